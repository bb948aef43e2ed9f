#pragma once

#include "mpipe/detail/config.h"

// The one file that includes c10d: the rendezvous, the process groups, and
// the link a call's messages travel on (Note [Cross-process calls] in
// remote-inl.h says what travels when).

#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/distributed/group.h"
#include "mpipe/detail/distributed/link.h"
#include "mpipe/detail/runtime/streams.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

namespace mpipe {
namespace detail {

struct Comm {
  c10::intrusive_ptr<c10d::Store> store;
  /// The world, for the pipeline's messages (point to point) and barriers.
  c10::intrusive_ptr<c10d::ProcessGroupGloo> world;
  /// The replicas of this rank's pipeline position (data parallelism); null
  /// with one replica.
  c10::intrusive_ptr<c10d::ProcessGroupGloo> replicas;
#ifdef USE_C10D_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> replicas_nccl;  // CUDA gradients, NCCL backend
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> world_nccl;     // CUDA activations and gradients
#endif
  /// Sends aborted when a peer stalled: kept alive with the group, since
  /// Gloo may still touch their buffers (the group is broken by then).
  std::mutex abandoned_mutex;
  std::vector<c10::intrusive_ptr<c10d::Work>> abandoned;
};


using distributed::Backend;
using distributed::ProcessGroup;
using Impl = GroupImpl;

constexpr int64_t kMagic = 0x6d70697065;  // "mpipe"
constexpr int64_t kHeader = 32;
constexpr int64_t kMaxDims = 12;
enum Slot : int64_t {
  kMagicSlot, kPipeline, kSeq, kType, kPhase, kKind, kItem, kStage, kFrom, kIndex, kCount, kDtype,
  kTextBytes, kCallFields, kDims, kShape  // kShape .. kShape + kMaxDims - 1
};
constexpr int64_t kOverNccl = kShape + kMaxDims;  // 1: the payload follows on NCCL
static_assert(kOverNccl < kHeader, "the header holds the shape and the NCCL flag");

MPIPE_FUNC bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

MPIPE_FUNC c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank, int size,
    const std::string& master_addr, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (is_loopback(master_addr)) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options);
}

MPIPE_FUNC Backend resolve_backend(Backend asked) {
  if (asked == Backend::Auto) {
    if (const char* env = std::getenv("MPIPE_BACKEND")) {
      const std::string v = env;
      if (v == "gloo" || v == "Gloo") {
        asked = Backend::Gloo;
      } else if (v == "nccl" || v == "NCCL") {
        asked = Backend::NCCL;
      } else {
        TORCH_CHECK(false, "mpipe::distributed: MPIPE_BACKEND must be gloo or nccl, got '", v,
                    "'");
      }
    }
  }
#ifdef USE_C10D_NCCL
  const bool nccl = true;
#else
  const bool nccl = false;
#endif
  if (asked == Backend::Auto) return nccl && torch::cuda::is_available() ? Backend::NCCL : Backend::Gloo;
  TORCH_CHECK(asked != Backend::NCCL || nccl, "mpipe::distributed: the NCCL backend was asked "
              "for, but this LibTorch has no NCCL (a CPU build?); use Backend::Gloo");
  return asked;
}

// One call's link: a receiving thread ("pump") per peer reads that peer's
// messages in order until its End or Abort; sends are posted without
// waiting and waited for in finish(), on a thread per peer, so that one
// deadline bounds the whole end of the call.
class GlooLink final : public Link {
 public:
  GlooLink(std::shared_ptr<Impl> group, int64_t pipeline_id, int64_t seq, LinkHandlers handlers)
      : group_(std::move(group)),
        comm_(*group_->comm),
        pipeline_(pipeline_id),
        seq_(seq),
        handlers_(std::move(handlers)),
        peers_(static_cast<size_t>(group_->pipeline_size())) {
    tag_ = static_cast<int>(pipeline_id);
    const int64_t seed = debug_chaos_seed();
    if (seed >= 0) {
      chaos_ = std::make_unique<Chaos>(
          static_cast<uint64_t>(seed) * 1000003u + static_cast<uint64_t>(group_->rank) * 7919u +
              static_cast<uint64_t>(seq),
          peers_.size(), handlers_.deliver);
    }
    for (int64_t p = 0; p < group_->pipeline_size(); ++p) {
      if (p == group_->pipeline_rank()) continue;
      peers_[static_cast<size_t>(p)].thread = std::thread([this, p] { pump(p); });
    }
  }

  ~GlooLink() override {
    if (!finished_) {
      try {
        finish("the call was left without ending it", true);
      } catch (...) {
      }
    }
  }

  void post(int64_t peer, WireMessage m) override {
    at::Tensor header = at::zeros({kHeader}, at::kLong);
    int64_t* h = header.data_ptr<int64_t>();
    h[kMagicSlot] = kMagic;
    h[kPipeline] = pipeline_;
    h[kSeq] = seq_;
    h[kType] = m.type;
    h[kPhase] = m.phase;
    h[kKind] = m.key.kind;
    h[kItem] = m.key.item;
    h[kStage] = m.stage;
    h[kFrom] = m.from;
    h[kIndex] = m.index;
    h[kCount] = m.count;
    h[kDtype] = -1;
    std::vector<at::Tensor> payload;
    const std::string& text = m.type == WireMessage::Abort ? m.text : m.key.name;
    h[kTextBytes] = static_cast<int64_t>(text.size());
    if (!text.empty()) {
      at::Tensor bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
      std::memcpy(bytes.data_ptr(), text.data(), text.size());
      payload.push_back(bytes);
    }
    h[kCallFields] = static_cast<int64_t>(m.call.size());
    if (!m.call.empty()) {
      payload.push_back(at::tensor(m.call, at::kLong));
    }
    at::Tensor nccl_payload;
    if (m.tensor.defined()) {
      TORCH_CHECK(m.tensor.dim() <= kMaxDims, "mpipe: a tensor sent to another rank has ",
                  m.tensor.dim(), " dimensions; at most ", kMaxDims, " are supported");
      h[kDtype] = static_cast<int64_t>(m.tensor.scalar_type());
      h[kDims] = m.tensor.dim();
      for (int64_t d = 0; d < m.tensor.dim(); ++d) h[kShape + d] = m.tensor.size(d);
      if (m.tensor.numel() > 0) {
#ifdef USE_C10D_NCCL
        if (m.tensor.is_cuda() && comm_.world_nccl) {
          nccl_payload = m.tensor.detach().contiguous();
          h[kOverNccl] = 1;
        }
#endif
        if (!nccl_payload.defined()) payload.push_back(m.tensor.detach().to(at::kCPU).contiguous());
      }
    }
    Peer& to = peers_[static_cast<size_t>(peer)];
    const int dst = static_cast<int>(group_->world_rank(peer));
    std::lock_guard<std::mutex> lock(to.send_mutex);  // a message's parts stay together
    std::vector<at::Tensor> one{header};
    to.sends.push_back(comm_.world->send(one, dst, tag_));
    for (auto& t : payload) {
      std::vector<at::Tensor> part{t};
      to.sends.push_back(comm_.world->send(part, dst, tag_));
    }
#ifdef USE_C10D_NCCL
    // NCCL matches by order only: the peer's receiving thread posts its
    // receives in the order of these headers, one peer at a time.
    if (nccl_payload.defined()) {
      std::vector<at::Tensor> part{nccl_payload};
      to.sends.push_back(comm_.world_nccl->send(part, dst, 0));
    }
#endif
  }

  // Note [Ending a call]
  // ~~~~~~~~~~~~~~~~~~~~
  // A rank ends a call by posting End (or Abort) to every peer and then
  // waiting for two things per peer: its own sends to go out (a Gloo send
  // completes only once the peer posts the matching receive) and the peer's
  // End or Abort. Both waits share one deadline: the group's timeout from
  // here, or kAnswer once the call is failing (this rank's error, or a peer's
  // Abort or loss arriving while it waits). A peer that misses it is stalled:
  // its sends and receive are aborted, the group is broken, and the message
  // names that peer. So a rank that stalls between calls costs the others the
  // timeout once, not once per wait.
  std::string finish(const std::string& error, bool failing) override {
    finished_ = true;
    std::string problems;
    auto add = [&](const std::string& s) {
      if (!s.empty()) problems += (problems.empty() ? "" : "; ") + s;
    };
    const int64_t me = group_->pipeline_rank();
    for (int64_t p = 0; p < group_->pipeline_size(); ++p) {
      if (p == me) continue;
      WireMessage end;
      end.type = error.empty() ? WireMessage::End : WireMessage::Abort;
      end.text = error;
      try {
        post(p, std::move(end));
      } catch (const std::exception& e) {
        add(c10::str("sending to rank ", group_->world_rank(p), " failed: ", e.what()));
        failing = true;
      }
    }
    for (int64_t p = 0; p < group_->pipeline_size(); ++p) {
      if (p == me) continue;
      peers_[static_cast<size_t>(p)].drain = std::thread([this, p] { drain(p); });
    }
    const auto answer = std::min<std::chrono::milliseconds>(group_->timeout, kAnswer);
    const auto start = std::chrono::steady_clock::now();
    auto deadline = start + (failing ? answer : group_->timeout);
    bool cut = failing;
    {
      std::unique_lock<std::mutex> lock(state_);
      auto done = [&] {
        for (int64_t p = 0; p < group_->pipeline_size(); ++p) {
          const Peer& peer = peers_[static_cast<size_t>(p)];
          if (p != me && !(peer.ended && peer.drained)) return false;
        }
        return true;
      };
      while (!done()) {
        if (!cut && peer_failed_) {  // a peer's Abort or loss: the call is failing now
          cut = true;
          deadline = std::min(deadline, std::chrono::steady_clock::now() + answer);
        }
        if (changed_.wait_until(lock, deadline) == std::cv_status::timeout &&
            std::chrono::steady_clock::now() >= deadline) {
          break;
        }
      }
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      for (int64_t p = 0; p < group_->pipeline_size(); ++p) {
        Peer& peer = peers_[static_cast<size_t>(p)];
        if (p == me || (peer.ended && peer.drained)) continue;
        peer.abandoned = true;
        if (peer.current) peer.current->abort();
        const std::string why = c10::str(
            "rank ", group_->world_rank(p), " did not ",
            peer.ended ? "take this rank's last messages" : "end the call", " within ",
            std::round(waited * 10) / 10, " s (stalled?)");
        group_->break_group(why);
        add(why);
      }
    }
    for (int64_t p = 0; p < group_->pipeline_size(); ++p) {
      if (p == me) continue;
      Peer& peer = peers_[static_cast<size_t>(p)];
      {
        std::lock_guard<std::mutex> lock(peer.send_mutex);
        if (peer.abandoned) {
          for (auto& w : peer.sends) w->abort();  // wakes the drain
          std::lock_guard<std::mutex> keep(comm_.abandoned_mutex);
          comm_.abandoned.insert(comm_.abandoned.end(), peer.sends.begin(), peer.sends.end());
        }
      }
      peer.drain.join();
      peer.thread.join();
      if (!peer.send_error.empty()) {
        group_->break_group(peer.send_error);
        add(peer.send_error);
      }
    }
    if (chaos_) chaos_->stop();
    return problems;
  }

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
  void drain(int64_t peer) {
    Peer& p = peers_[static_cast<size_t>(peer)];
    std::vector<c10::intrusive_ptr<c10d::Work>> sends;
    {
      std::lock_guard<std::mutex> lock(p.send_mutex);
      sends = p.sends;
    }
    std::string error;
    for (auto& w : sends) {
      try {
        if (!w->wait()) break;  // aborted
      } catch (...) {
        error = c10::str("rank ", group_->world_rank(peer), " did not take a message: ",
                         message_of(std::current_exception()));
        break;
      }
    }
    {
      std::lock_guard<std::mutex> lock(p.send_mutex);
      p.sends.clear();
    }
    std::lock_guard<std::mutex> lock(state_);
    p.send_error = error;
    p.drained = true;
    if (!error.empty()) peer_failed_ = true;
    changed_.notify_all();
  }

  // No timeout of its own: a peer may be idle as long as its work takes
  // (finish() bounds the wait for its End; the executor's receives time out).
  // A peer that is gone fails the wait at once.
  at::Tensor receive(int64_t peer, at::Tensor into) {
    Peer& from = peers_[static_cast<size_t>(peer)];
    std::vector<at::Tensor> one{into};
    auto work = comm_.world->recv(one, static_cast<int>(group_->world_rank(peer)), tag_);
    {
      std::lock_guard<std::mutex> lock(state_);
      TORCH_CHECK(!from.abandoned, "abandoned");
      from.current = work;
    }
    const bool done = work->wait(std::chrono::hours(24 * 365));
    {
      std::lock_guard<std::mutex> lock(state_);
      from.current.reset();
      if (!done || from.abandoned) {
        std::lock_guard<std::mutex> keep(comm_.abandoned_mutex);
        comm_.abandoned.push_back(work);
      }
      TORCH_CHECK(done && !from.abandoned, "abandoned");
    }
    return into;
  }

  void ended(int64_t peer, bool failed) {
    std::lock_guard<std::mutex> lock(state_);
    peers_[static_cast<size_t>(peer)].ended = true;
    if (failed) peer_failed_ = true;
    changed_.notify_all();
  }

  void hand_over(int64_t peer, WireMessage m) {
    if (chaos_) {
      chaos_->push(peer, std::move(m));
    } else {
      handlers_.deliver(peer, std::move(m));
    }
  }

  void pump(int64_t peer) {
    const int64_t from_rank = group_->world_rank(peer);
    try {
      for (;;) {
        at::Tensor header = receive(peer, at::empty({kHeader}, at::kLong));
        const int64_t* h = header.data_ptr<int64_t>();
        TORCH_CHECK(h[kMagicSlot] == kMagic && h[kPipeline] == pipeline_,
                    "a message that is not this pipeline's arrived (pipeline ", h[kPipeline],
                    " of ", pipeline_, "): build the same pipelines in the same order on every "
                    "rank");
        TORCH_CHECK(h[kSeq] == seq_, "it is at call ", h[kSeq], " of this pipeline and this rank "
                    "at call ", seq_, ": every rank must make the same pipeline calls in the "
                    "same order");
        WireMessage m;
        m.type = static_cast<WireMessage::Type>(h[kType]);
        m.phase = h[kPhase];
        m.key.kind = static_cast<Key::Kind>(h[kKind]);
        m.key.item = h[kItem];
        m.stage = h[kStage];
        m.from = h[kFrom];
        m.index = h[kIndex];
        m.count = h[kCount];
        std::string text;
        if (h[kTextBytes] > 0) {
          at::Tensor bytes = receive(peer, at::empty({h[kTextBytes]}, at::kByte));
          text.assign(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(h[kTextBytes]));
        }
        if (h[kCallFields] > 0) {
          at::Tensor call = receive(peer, at::empty({h[kCallFields]}, at::kLong));
          m.call.assign(call.data_ptr<int64_t>(), call.data_ptr<int64_t>() + h[kCallFields]);
        }
        if (h[kDtype] >= 0) {
          std::vector<int64_t> shape(h + kShape, h + kShape + h[kDims]);
          auto options = at::TensorOptions().dtype(static_cast<at::ScalarType>(h[kDtype]));
          if (h[kOverNccl] == 1) {
#ifdef USE_C10D_NCCL
            TORCH_CHECK(comm_.world_nccl, "a tensor came over NCCL, but this rank's group has "
                        "no NCCL (every rank must choose the same backend)");
            const c10::Device device = handlers_.device_of(m.stage);
            TORCH_CHECK(device.is_cuda(), "rank ", from_rank, " sent a CUDA tensor over NCCL "
                        "for stage ", m.stage, ", which runs on ", device, " here; with the NCCL "
                        "backend a boundary between ranks joins CUDA stages (use Backend::Gloo "
                        "for CPU stages)");
            m.tensor = at::empty(shape, options.device(device));
            std::vector<at::Tensor> part{m.tensor};
            comm_.world_nccl->recv(part, static_cast<int>(from_rank), 0)->wait();
            // wait() ordered this thread's current stream after the receive.
            m.ready = record_event(current_stream(device));
#else
            TORCH_CHECK(false, "a tensor came over NCCL, but this build has no NCCL");
#endif
          } else {
            m.tensor = at::empty(shape, options);
            if (m.tensor.numel() > 0) receive(peer, m.tensor);
          }
        }
        if (m.type == WireMessage::End || m.type == WireMessage::Abort) {
          if (chaos_) chaos_->drain(peer);  // what came before is handed over first
          if (m.type == WireMessage::Abort) {
            {
              std::lock_guard<std::mutex> lock(state_);
              peer_failed_ = true;
            }
            handlers_.failed(peer, c10::str("rank ", from_rank, " failed: ", text));
          }
          return ended(peer, m.type == WireMessage::Abort);
        }
        m.key.name = std::move(text);
        hand_over(peer, std::move(m));
      }
    } catch (...) {
      if (chaos_) chaos_->drain(peer);
      bool abandoned;
      {
        std::lock_guard<std::mutex> lock(state_);
        abandoned = peers_[static_cast<size_t>(peer)].abandoned;
      }
      if (!abandoned) {  // else finish() names the peer
        const std::string why = c10::str("rank ", from_rank, " cannot be reached (",
                                         message_of(std::current_exception()), ")");
        group_->break_group(why);
        handlers_.failed(peer, why);
      }
      ended(peer, true);
    }
  }

  std::shared_ptr<Impl> group_;
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

MPIPE_FUNC std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : (fallback ? std::string(fallback) : std::string());
}

MPIPE_FUNC int64_t env_int(const char* name) {
  const std::string v = env_or(name, nullptr);
  TORCH_CHECK(!v.empty(), "mpipe::distributed::init_from_env: ", name, " is not set; start the "
              "program with mpipe-launch -n N -- ./app or torchrun --no-python "
              "--nproc-per-node N ./app (or call mpipe::distributed::init)");
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    TORCH_CHECK(used == v.size(), "");
    return x;
  } catch (...) {
    TORCH_CHECK(false, "mpipe::distributed::init_from_env: ", name, " must be an integer, got '",
                v, "'");
  }
}


MPIPE_FUNC std::unique_ptr<Link> open_link(const distributed::ProcessGroup& group,
                                           int64_t pipeline_id, int64_t seq,
                                           LinkHandlers handlers) {
  const std::string broken = group_impl(group)->broken_reason();
  TORCH_CHECK(broken.empty(), "the process group failed in an earlier call (", broken, "); "
              "restart every rank");
  return std::make_unique<GlooLink>(group_impl(group), pipeline_id, seq, std::move(handlers));
}

MPIPE_FUNC std::vector<int64_t> exchange_stage_counts(const distributed::ProcessGroup& group,
                                                      int64_t pipeline_id, int64_t mine) {
  // Every rank sends its count to every other rank of the world and waits
  // for theirs, each with the group's timeout: unlike one collective, that
  // names the ranks that never came (stalled before the pipeline's first
  // call). Every rank connects its pipelines in the same order; the tag is
  // the pipeline's, offset past the calls' tags. (The store would do too,
  // but its locks are taken inside LibTorch, where ThreadSanitizer cannot
  // see them.)
  Impl& g = *group_impl(group);
  const std::string broken = g.broken_reason();
  TORCH_CHECK(broken.empty(), "the process group failed in an earlier call (", broken, "); "
              "restart every rank");
  const int tag = static_cast<int>((int64_t{1} << 24) + pipeline_id);
  std::vector<at::Tensor> got(static_cast<size_t>(g.world));
  std::vector<c10::intrusive_ptr<c10d::Work>> sends, receives(static_cast<size_t>(g.world));
  const at::Tensor count = at::full({1}, mine, at::kLong);
  for (int64_t r = 0; r < g.world; ++r) {
    if (r == g.rank) continue;
    std::vector<at::Tensor> out{count};
    sends.push_back(g.comm->world->send(out, static_cast<int>(r), tag));
    got[static_cast<size_t>(r)] = at::empty({1}, at::kLong);
    std::vector<at::Tensor> in{got[static_cast<size_t>(r)]};
    receives[static_cast<size_t>(r)] = g.comm->world->recv(in, static_cast<int>(r), tag);
  }
  const auto deadline = std::chrono::steady_clock::now() + g.timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  std::string missing, why_first;
  for (int64_t r = 0; r < g.world; ++r) {
    if (r == g.rank) continue;
    try {
      receives[static_cast<size_t>(r)]->wait(left());
    } catch (...) {
      missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      if (why_first.empty()) why_first = message_of(std::current_exception());
    }
  }
  if (missing.empty()) {
    for (auto& w : sends) {
      try {
        w->wait(left());
      } catch (...) {
        if (why_first.empty()) why_first = message_of(std::current_exception());
      }
    }
  }
  if (!missing.empty() || !why_first.empty()) {
    std::lock_guard<std::mutex> keep(g.comm->abandoned_mutex);  // Gloo may still use them
    for (auto& w : receives) {
      if (w) g.comm->abandoned.push_back(w);
    }
    for (auto& w : sends) g.comm->abandoned.push_back(w);
  }
  if (!missing.empty()) {
    const std::string why =
        c10::str("rank", missing.find(',') == std::string::npos ? " " : "s ", missing,
                 " did not reach the pipeline's first call within ", g.timeout.count() / 1000.0,
                 " s (stalled or gone?)");
    g.break_group(why);
    TORCH_CHECK(false, why);
  }
  if (!why_first.empty()) {
    const std::string why = c10::str("the ranks could not exchange their stages: ", why_first);
    g.break_group(why);
    TORCH_CHECK(false, why);
  }
  std::vector<int64_t> counts;
  for (int64_t p = 0; p < g.pipeline_size(); ++p) {
    const int64_t r = g.world_rank(p);
    counts.push_back(r == g.rank ? mine : got[static_cast<size_t>(r)].item<int64_t>());
  }
  return counts;
}

MPIPE_FUNC int64_t next_pipeline_id(const distributed::ProcessGroup& group) {
  return group_impl(group)->next_pipeline++;
}

MPIPE_FUNC void barrier(const distributed::ProcessGroup& group) {
  group_impl(group)->comm->world->barrier()->wait();
}

MPIPE_FUNC bool any_rank(const distributed::ProcessGroup& group, bool flag) {
  std::vector<at::Tensor> one{at::full({1}, flag ? 1 : 0, at::kLong)};
  group_impl(group)->comm->world->allreduce(one)->wait();
  return one[0].item<int64_t>() > 0;
}

MPIPE_FUNC void allreduce_replicas(const distributed::ProcessGroup& group,
                                   std::vector<at::Tensor> tensors, bool average) {
  const Impl& g = *group_impl(group);
  if (g.replicas == 1) return;
  // One flat buffer per (device, dtype): one allreduce each.
  std::map<std::pair<std::string, int>, std::vector<at::Tensor>> buckets;
  for (auto& t : tensors) {
    if (!t.defined()) continue;
    buckets[{t.device().str(), static_cast<int>(t.scalar_type())}].push_back(t);
  }
  for (auto& b : buckets) {
    std::vector<at::Tensor> flat_parts;
    for (auto& t : b.second) flat_parts.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    const c10::Device device = flat.device();
    std::vector<at::Tensor> one;
#ifdef USE_C10D_NCCL
    if (device.is_cuda() && g.comm->replicas_nccl) {
      one = {flat};
      g.comm->replicas_nccl->allreduce(one)->wait();
    } else
#endif
    {
      one = {flat.to(at::kCPU)};
      g.comm->replicas->allreduce(one)->wait();
    }
    at::Tensor sum = one[0].to(device);
    if (average) sum.div_(static_cast<double>(g.replicas));
    int64_t at = 0;
    for (auto& t : b.second) {
      t.copy_(sum.narrow(0, at, t.numel()).view_as(t));
      at += t.numel();
    }
  }
}

}  // namespace detail

namespace distributed {

MPIPE_FUNC bool available() { return true; }

MPIPE_FUNC ProcessGroup init(int64_t rank, int64_t world_size, const std::string& master_addr,
                             int master_port, GroupOptions options) {
  TORCH_CHECK(world_size >= 1, "mpipe::distributed::init: the world size must be >= 1, got ",
              world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "mpipe::distributed::init: rank ", rank,
              " is outside the world of ", world_size);
  TORCH_CHECK(master_port > 0 && master_port < 65536, "mpipe::distributed::init: the master "
              "port must be in 1..65535, got ", master_port);
  TORCH_CHECK(options.replicas() >= 1 && world_size % options.replicas() == 0,
              "mpipe::distributed::init: replicas=", options.replicas(), " must divide the "
              "world size ", world_size, " (world = replicas x pipeline ranks)");
  TORCH_CHECK(options.timeout().count() > 0, "mpipe::distributed::init: the timeout must be "
              "positive, got ", options.timeout().count(), " ms");
  auto impl = std::make_shared<detail::GroupImpl>();
  impl->rank = rank;
  impl->world = world_size;
  impl->replicas = options.replicas();
  impl->backend = detail::resolve_backend(options.backend());
  impl->timeout = options.timeout();
  impl->comm = std::make_shared<detail::Comm>();
  auto& comm = *impl->comm;
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(master_port);
    store_options.isServer = rank == 0;
    store_options.numWorkers = static_cast<size_t>(world_size);
    store_options.timeout = options.timeout();
    comm.store = c10::make_intrusive<c10d::TCPStore>(master_addr, store_options);
    comm.world = detail::make_gloo(comm.store, "mpipe/world", static_cast<int>(rank),
                                   static_cast<int>(world_size), master_addr, options.timeout());
#ifdef USE_C10D_NCCL
    if (impl->backend == Backend::NCCL && world_size > 1) {
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = options.timeout();
      comm.world_nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("mpipe/world/nccl", comm.store),
          static_cast<int>(rank), static_cast<int>(world_size), nccl_options);
    }
#endif
    if (impl->replicas > 1) {
      const std::string prefix = c10::str("mpipe/replicas", impl->pipeline_rank());
      comm.replicas = detail::make_gloo(comm.store, prefix, static_cast<int>(impl->replica()),
                                        static_cast<int>(impl->replicas), master_addr,
                                        options.timeout());
#ifdef USE_C10D_NCCL
      if (impl->backend == Backend::NCCL) {
        auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
        nccl_options->timeout = options.timeout();
        comm.replicas_nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
            c10::make_intrusive<c10d::PrefixStore>(prefix + "/nccl", comm.store),
            static_cast<int>(impl->replica()), static_cast<int>(impl->replicas), nccl_options);
      }
#endif
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "mpipe::distributed::init: rank ", rank, " of ", world_size,
                " could not join at ", master_addr, ":", master_port, ": ",
                e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "mpipe::distributed::init: rank ", rank, " of ", world_size,
                " could not join at ", master_addr, ":", master_port, ": ", e.what());
  }
  return detail::GroupAccess::make(std::move(impl));
}

MPIPE_FUNC ProcessGroup init_from_env(GroupOptions options) {
  const int64_t rank = detail::env_int("RANK");
  const int64_t world = detail::env_int("WORLD_SIZE");
  const std::string addr = detail::env_or("MASTER_ADDR", "127.0.0.1");
  const int64_t port = detail::env_int("MASTER_PORT");
  return init(rank, world, addr, static_cast<int>(port), options);
}

}  // namespace distributed
}  // namespace mpipe
