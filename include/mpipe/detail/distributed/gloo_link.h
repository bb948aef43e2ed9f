#pragma once

// Private: the Gloo wire protocol of a pipeline call's messages (Note
// [Cross-process calls] in remote-inl.h says what travels when): the layout
// of a message's header, and GlooLink, the Link that posts and receives
// messages in it (gloo_link-inl.h). With c10d only (MPIPE_WITH_C10D).

#include "mpipe/detail/distributed/comm.h"
#include "mpipe/detail/distributed/group.h"
#include "mpipe/detail/distributed/link.h"

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

constexpr int64_t kMagic = 0x6d70697065;  // "mpipe"
constexpr int64_t kHeader = 32;
constexpr int64_t kMaxDims = 12;
enum Slot : int64_t {
  kMagicSlot, kPipeline, kSeq, kType, kKind, kItem, kStage, kFrom, kIndex, kCount, kDtype,
  kTextBytes, kCallFields, kDims, kShape  // kShape .. kShape + kMaxDims - 1
};
constexpr int64_t kOverNccl = kShape + kMaxDims;  // 1: the payload follows on NCCL
static_assert(kOverNccl < kHeader, "the header holds the shape and the NCCL flag");

// When one send times out, Gloo closes every connection of the context, and
// the other transfers fail with "Application timeout caused pair closure":
// not their peers' fault, so they name no rank (the send that timed out
// names its own).
constexpr const char* kClosedAfterTimeout =
    "Gloo closed this rank's connections after a send timed out";
inline bool closed_after_timeout(const std::string& what) {
  return what.find("Application timeout caused pair closure") != std::string::npos;
}

// One call's link: a receiving thread ("pump") per peer reads that peer's
// messages in order until its End or Abort; sends are posted without
// waiting and waited for in finish(), on a thread per peer, so that one
// deadline bounds the whole end of the call.
class GlooLink final : public Link {
 public:
  GlooLink(std::shared_ptr<GroupImpl> group, int64_t pipeline_id, int64_t seq,
           LinkHandlers handlers);
  ~GlooLink() override;

  void post(int64_t peer, WireMessage m) override;
  /// Note [Ending a call] in gloo_link-inl.h.
  std::string finish(const std::string& error, bool failing, int64_t late) override;

 private:
  /// How long a failing call waits for its peers' answers (Note [Ending a call]).
  static constexpr std::chrono::milliseconds kAnswer{2000};

  struct Peer {
    std::mutex send_mutex;  // guards sends
    std::vector<c10::intrusive_ptr<c10d::Work>> sends;
    std::thread thread;  // the pump
    std::thread drain;   // waits for `sends` in finish()
    std::string send_error;  // written by the drain before it sets drained
    // Guarded by GlooLink::state_:
    c10::intrusive_ptr<c10d::Work> current;  // the receive in progress
    bool ended = false;      // the pump is done
    bool drained = false;    // every send went out (or failed)
    bool abandoned = false;  // finish() gave up on the peer
    bool late = false;       // a receive from it timed out, here or on a rank that said so
  };

  // The receiving half of the debug hook (Note [Message addresses] in
  // remote-inl.h): with MPIPE_DEBUG_CHAOS=<seed>, every received message is
  // handed over after a random delay of up to kDelayUs, so that messages
  // from different peers and of different items overtake one another; a
  // peer's End or Abort waits until its earlier messages were handed over.
  class Chaos {
   public:
    Chaos(uint64_t seed, size_t n_peers,
          std::function<void(int64_t peer, WireMessage m)> deliver)
        : random_(seed), pending_(n_peers, 0), deliver_(std::move(deliver)) {
      thread_ = std::thread([this] { run(); });
    }
    ~Chaos() { stop(); }
    void push(int64_t peer, WireMessage m) {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto at = std::chrono::steady_clock::now() +
                      std::chrono::microseconds(random_() % kDelayUs);
      queue_.emplace(at, std::make_pair(peer, std::move(m)));
      ++pending_[static_cast<size_t>(peer)];
      changed_.notify_all();
    }
    /// Returns once every message of `peer` was handed over.
    void drain(int64_t peer) {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return pending_[static_cast<size_t>(peer)] == 0; });
    }
    void stop() {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
        changed_.notify_all();
      }
      if (thread_.joinable()) thread_.join();
    }

   private:
    static constexpr uint64_t kDelayUs = 3000;
    void run() {
      std::unique_lock<std::mutex> lock(mutex_);
      for (;;) {
        if (queue_.empty()) {
          if (stopping_) return;
          changed_.wait(lock);
          continue;
        }
        auto first = queue_.begin();
        if (std::chrono::steady_clock::now() < first->first) {
          changed_.wait_until(lock, first->first);
          continue;
        }
        auto item = std::move(first->second);
        queue_.erase(first);
        lock.unlock();
        try {
          deliver_(item.first, std::move(item.second));
        } catch (...) {  // deliver reports its own failures
        }
        lock.lock();
        --pending_[static_cast<size_t>(item.first)];
        changed_.notify_all();
      }
    }
    std::mutex mutex_;
    std::condition_variable changed_;
    std::mt19937_64 random_;
    std::multimap<std::chrono::steady_clock::time_point, std::pair<int64_t, WireMessage>> queue_;
    std::vector<int64_t> pending_;
    bool stopping_ = false;
    std::function<void(int64_t, WireMessage)> deliver_;
    std::thread thread_;
  };

  // The sends to `peer`, in order; an aborted one (finish() gave up) ends it.
  void drain(int64_t peer);
  // No timeout of its own: a peer may be idle as long as its work takes
  // (finish() bounds the wait for its End; the executor's receives time out).
  // A peer that is gone fails the wait at once.
  at::Tensor receive(int64_t peer, at::Tensor into);
  void ended(int64_t peer, bool failed);
  void hand_over(int64_t peer, WireMessage m);
  void pump(int64_t peer);

  std::shared_ptr<GroupImpl> group_;
  Comm& comm_;
  const int64_t pipeline_;
  const int64_t seq_;
  int tag_ = 0;
  LinkHandlers handlers_;
  std::vector<Peer> peers_;
  std::unique_ptr<Chaos> chaos_;
  std::mutex state_;  // guards the Peer fields so marked, and peer_failed_
  std::condition_variable changed_;
  bool peer_failed_ = false;
  bool finished_ = false;
};

}  // namespace detail
}  // namespace mpipe
