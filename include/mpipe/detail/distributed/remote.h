#pragma once

// Private: a pipeline call that spans processes (Note [Cross-process calls]
// in remote-inl.h): the call's agreement, its transport, its end.

#include "mpipe/detail/distributed/link.h"
#include "mpipe/detail/runtime/transport.h"

#include "mpipe/distributed.h"
#include "mpipe/schedule.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace mpipe {
namespace detail {

class SkipTable;

/// What the first rank tells the others about a call.
struct CallInfo {
  int64_t method = 0;  // index into call_methods()
  int64_t n_items = 0;
  int64_t rows = 0;    // micro-batch rows (train_step, forward)
  int64_t batch = 0;   // the batch's rows
  int64_t reduce = 0;
  int64_t schedule = 0;
  int64_t virtual_stages = 1;
  int64_t reduction = 0;
  int64_t time_chunk = 0;  // steps per stage call (constant_forward, sequence_forward, constant_train_step)
  int64_t programs = 0;  // train_step with TrainStepOptions::programs or Tailored: their fingerprint
  std::vector<schedules::Program> tailored;  // train_step under Tailored: the first rank's programs

  std::vector<int64_t> fields() const;
  static CallInfo from(const std::vector<int64_t>& fields);
};

/// The call kinds' names, by CallInfo::method.
int64_t method_code(const char* method);

/// Where a pipeline's stages live across its ranks.
struct Layout {
  std::vector<std::vector<int64_t>> stages;  // per pipeline rank: its global stages, ascending
  std::vector<int64_t> owner;                // per global stage: its pipeline rank
  int64_t n_stages = 0;                      // in the whole pipeline
  int64_t rank_of(int64_t stage) const { return owner[static_cast<size_t>(stage)]; }
  /// "stage 3" / "stages 3-5" / "stages 0, 7"
  std::string ranks_stages(int64_t pipeline_rank) const;
  /// The hand-offs between ranks on the way from stage 0 to `stage`.
  int64_t hops_before(int64_t stage) const;
};

class RemoteTransport;

/// One call of a pipeline across processes, on every one of its ranks.
class RemoteCall : public CallLink {
 public:
  /// `device_of(stage)`: the device of this rank's stage `stage`.
  RemoteCall(const distributed::ProcessGroup& group, const Layout& layout, int64_t pipeline_id,
             int64_t seq, std::function<c10::Device(int64_t)> device_of);
  ~RemoteCall() override;

  const distributed::ProcessGroup& group() const { return group_; }
  const Layout& layout() const { return layout_; }
  int64_t pipeline_rank() const { return group_.pipeline_rank(); }
  bool first() const { return group_.is_first(); }  // holds stage 0, reads the inputs
  /// Holds the last stage: gets the outputs or the loss.
  bool last() const { return layout_.rank_of(layout_.n_stages - 1) == pipeline_rank(); }

  /// The first rank: tells every other rank what the call is.
  void announce(const CallInfo& info);
  /// Another rank: the first rank's call, which must be `method` too.
  CallInfo await_call(const char* method);

  std::chrono::milliseconds timeout() const override { return group_.timeout(); }
  /// The call's transport (a RemoteTransport), once per call, while the
  /// executor runs it. A peer's messages that arrive before attach are kept
  /// and handed to it then; after detach, what still comes is dropped (Note
  /// [Message addresses]).
  std::unique_ptr<Transport> attach(LocalTransport& local, const StageMap& map, SkipTable* skips,
                                    std::function<void(std::exception_ptr)> fail) override;
  void detach() override;

  /// Sends `m` (a Data message) to `peer`.
  void post(int64_t peer, WireMessage m) { link_->post(peer, std::move(m)); }

  /// Ends the call with every other rank (an Abort carrying `error` when this
  /// rank failed). Without a local error, throws what other ranks reported;
  /// with one, returns it ("" if nothing) for the caller's message.
  std::string finish(const std::string& error, const char* method);
  /// A receive from pipeline rank `peer` timed out here: finish() tells the
  /// others, and none waits for that rank's End (Note [Ending a call]).
  void late(int64_t peer);

 private:
  void deliver(int64_t peer, WireMessage m);
  void failed(int64_t peer, const std::string& why);

  distributed::ProcessGroup group_;
  Layout layout_;
  std::unique_ptr<Link> link_;

  std::mutex mutex_;
  std::condition_variable changed_;
  // Where Data goes: before attach, into early_; while attached, to
  // transport_; after detach (or finish), nowhere.
  enum class Attached { Not, Now, Over } attached_ = Attached::Not;
  RemoteTransport* transport_ = nullptr;
  int64_t busy_ = 0;  // deliveries into transport_ in progress
  std::vector<std::pair<int64_t, WireMessage>> early_;  // Data before attach
  std::mt19937_64 chaos_;  // the debug hook's pauses (seeded when it is on)
  bool chaos_on_ = false;
  bool has_call_ = false;
  int64_t call_from_ = -1;
  CallInfo call_;
  std::string failure_;                // the first peer failure
  int64_t late_ = -1;                  // late(): the first rank a receive timed out on
  std::vector<std::string> failures_;  // every one
};

/// The stages `map` names are this process's; the others are remote (Note
/// [Cross-process calls]).
class RemoteTransport : public Transport {
 public:
  RemoteTransport(LocalTransport& local, RemoteCall& call, const StageMap& map, SkipTable* skips,
                  std::function<void(std::exception_ptr)> fail);

  void send(int64_t from, int64_t to, const Key& key, Tensors values) override;
  Tensors receive(int64_t to, const Key& key) override { return local_.receive(to, key); }
  void abort() override { local_.abort(); }

  /// A message from another rank (RemoteCall's receiving threads).
  void deliver(int64_t peer, WireMessage m);
  void peer_failed(const std::string& why) { local_.fail(why); }

 private:
  bool local(int64_t stage) const { return map_.holds(stage); }
  void post(int64_t from, int64_t to, const Key& key, const Tensors& values);

  LocalTransport& local_;
  RemoteCall& call_;
  const StageMap& map_;
  SkipTable* skips_;  // null: the call has no skips
  std::function<void(std::exception_ptr)> fail_;
  std::mutex mutex_;  // guards partial_
  struct Partial {
    Tensors values;
    int64_t got = 0;
    std::shared_ptr<c10::Event> ready;  // the last NCCL receive's (one stream: covers all)
  };
  std::map<std::pair<int64_t, Key>, Partial> partial_;  // by (stage, key)
};

}  // namespace detail
}  // namespace mpipe
