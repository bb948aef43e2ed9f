#pragma once

// Private: how an item's tensors move between stages (Note [Transport]).

#include "mpipe/tensors.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/Optional.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

class Recorder;
class SkipTable;

/// Where a stage runs: its device and, on an accelerator, the stream all its
/// kernels are launched on (none for CPU stages).
struct StagePlace {
  c10::Device device;
  c10::optional<c10::Stream> compute;
  /// Copies from the previous stage's device, when that is another accelerator.
  c10::optional<c10::Stream> copy_in;
  /// The lanes of the stage's device, which its stages share (Note [Lanes]).
  std::vector<c10::Stream> lanes;
};

/// Which of the pipeline's stages this process holds: all of them in one
/// process; across processes, those the ranks agreed on at the first call
/// (Note [Cross-process calls]), local index j being global stage global[j].
struct StageMap {
  std::vector<int64_t> global;  // by local index, ascending
  std::vector<int64_t> local;   // by global stage: its local index, or -1 (another rank's)
  /// Local stages `global` (ascending) of `n_total`.
  static StageMap of(const std::vector<int64_t>& global, int64_t n_total) {
    StageMap m;
    m.global = global;
    m.local.assign(static_cast<size_t>(n_total), -1);
    for (size_t j = 0; j < global.size(); ++j) {
      m.local[static_cast<size_t>(global[j])] = static_cast<int64_t>(j);
    }
    return m;
  }
  int64_t n_total() const { return static_cast<int64_t>(local.size()); }
  bool holds(int64_t stage) const {
    return stage >= 0 && stage < n_total() && local[static_cast<size_t>(stage)] >= 0;
  }
  size_t at(int64_t stage) const { return static_cast<size_t>(local[static_cast<size_t>(stage)]); }
};

/// What is being moved: an item's activations (to the next stage), the
/// gradients of a stage's inputs (to the previous stage), a stashed skip tensor
/// (to the stage that pops it) or a skip's gradient (back to the stasher).
struct Key {
  enum Kind { Activation, Gradient, Skip, SkipGradient };
  Kind kind;
  int64_t item;
  std::string name;  // skips only
  friend bool operator<(const Key& a, const Key& b) {
    return std::tie(a.kind, a.item, a.name) < std::tie(b.kind, b.item, b.name);
  }
};

/// Thrown by receive() once the call failed elsewhere: stop quietly.
struct Aborted {};

// Note [Transport]
// ~~~~~~~~~~~~~~~~
// The executor never moves a tensor itself: stage `from` send()s what it
// produced (on its compute stream, or on the host) under a Key, and stage `to`
// receive()s it, usable on its own stream. Stage -1 is the caller: the call's
// inputs enter through accept(). A transport decides how values travel and how
// the consumer is ordered after the producer; schedules and the executor do
// not know. LocalTransport is the in-process one (Note [Hand-offs] in transport-inl.h); a
// transport between processes (c10d) implements the same three calls.
class Transport {
 public:
  virtual ~Transport() = default;
  /// Stage `from` hands `values`, computed on its stream, to stage `to` (-1:
  /// whichever stage receives `key`, as for skips).
  virtual void send(int64_t from, int64_t to, const Key& key, Tensors values) = 0;
  /// What was sent under `key`, on stage `to`'s device and usable on its
  /// stream. Blocks until it arrives when the call runs threaded; throws
  /// Aborted once abort() was called.
  virtual Tensors receive(int64_t to, const Key& key) = 0;
  /// The call failed: every receive, waiting or not, throws Aborted.
  virtual void abort() = 0;
};

/// Stages in one process: per-stage streams, events and record_stream.
class LocalTransport : public Transport {
 public:
  /// `stages` are the global stages `map` names (all of them in one process).
  /// `blocking`: receive waits for a send
  /// (threaded calls, and calls across processes); otherwise the schedule's
  /// order guarantees that it came first. A blocking receive gives up after
  /// `timeout` (0: never). Copies are recorded on `recorder` when it is set.
  LocalTransport(const std::vector<StagePlace>& stages, const StageMap& map, bool blocking,
                 Recorder* recorder, std::chrono::milliseconds timeout = {});

  void send(int64_t from, int64_t to, const Key& key, Tensors values) override;
  Tensors receive(int64_t to, const Key& key) override;
  void abort() override;

  /// Values for stage `to` (or, for a skip, any stage) from another process,
  /// on the host or, when `ready` is set, on a device once it fires; `from` is
  /// the stage that sent them (the stasher, for a skip).
  void deposit(int64_t from, int64_t to, const Key& key, Tensors values,
               std::shared_ptr<c10::Event> ready = nullptr);
  /// Another process failed: every receive, waiting or not, throws a
  /// c10::Error saying `why`.
  void fail(const std::string& why);
  /// A skip parcel still here: the one an item's boundary hand-off takes
  /// along to the next process.
  struct Held {
    Key key;
    int64_t from;
    Tensors values;  // on the host or ready on their device
  };
  std::vector<Held> take_skips(int64_t item);
  /// Across processes: who should have sent `key` to stage `to` ("rank 2
  /// (stage 4)"), for the message of a receive that timed out.
  std::function<std::string(int64_t to, const Key& key)> sender_of;
  /// Across processes: a receive of `key` by stage `to` gave up waiting
  /// (called before it throws), so the call can name the late rank.
  std::function<void(int64_t to, const Key& key)> timed_out;
  /// Across processes: how long a receive of `key` waits (else the timeout;
  /// 0: without a timeout).
  std::function<std::chrono::milliseconds(int64_t to, const Key& key)> patience;

  /// The caller's `values`, ready once `ready` (recorded on the caller's
  /// stream; null for host values) fires, made usable by stage `to`.
  Tensors accept(int64_t to, int64_t item, Tensors values,
                 const std::shared_ptr<c10::Event>& ready) const;
  /// The stream stage `to` computes item `item` on, when lanes are in use
  /// (Note [Lanes]); unset: the stage's compute stream.
  std::function<c10::optional<c10::Stream>(int64_t to, int64_t item)> stream_of;

 private:
  struct Parcel {
    Tensors values;
    std::shared_ptr<c10::Event> ready;  // null: ready on the host
    int64_t from = -1;                  // the sending stage
  };
  const StagePlace& place(int64_t stage) const {
    return stages_[map_.at(stage)];
  }
  size_t slot(int64_t to) const { return map_.at(to); }
  /// The stream local stage `j` computes item `item` on (stream_of, else its compute stream).
  c10::optional<c10::Stream> compute_of(int64_t j, int64_t item) const {
    return stream_of ? stream_of(j, item) : place(j).compute;
  }
  at::Tensor move(const at::Tensor& value, const std::shared_ptr<c10::Event>& ready, int64_t to,
                  int64_t item) const;

  const std::vector<StagePlace>& stages_;
  const StageMap& map_;
  const bool blocking_;
  Recorder* const recorder_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  /// One per receiving stage, so a send wakes only the stage it is for (the
  /// last one is for skips, which any later stage may pop).
  std::vector<std::condition_variable> arrived_;
  /// By receiving stage (-1 for skips: whichever stage pops them) and key.
  std::map<std::pair<int64_t, Key>, Parcel> parcels_;
  bool aborted_ = false;
  std::string failure_;  // another process failed (fail())
};

/// A call across processes as the executor sees it (Note [Cross-process
/// calls] in distributed/remote-inl.h, where RemoteCall implements it): the
/// runtime knows no more of the other ranks than this, so it includes
/// nothing of distributed/.
class CallLink {
 public:
  virtual ~CallLink() = default;
  /// How long a stage waits for another rank's message (0: no limit).
  virtual std::chrono::milliseconds timeout() const = 0;
  /// The call's transport, around `local` (this process's stages, `map`),
  /// attached once per call: messages that came before it are handed to it
  /// now. `fail` ends the executor's run.
  virtual std::unique_ptr<Transport> attach(LocalTransport& local, const StageMap& map,
                                            SkipTable* skips,
                                            std::function<void(std::exception_ptr)> fail) = 0;
  /// The transport stops receiving; what still comes is dropped. Waits out
  /// the hand-offs in flight, so the transport may be destroyed after.
  virtual void detach() = 0;
};

}  // namespace detail
}  // namespace mpipe
