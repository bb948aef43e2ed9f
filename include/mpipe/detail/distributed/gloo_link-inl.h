#pragma once

#include "mpipe/detail/config.h"

// GlooLink (gloo_link.h): a call's messages as Gloo sends and receives on the
// group's world (a header, then the message's parts; a CUDA tensor over NCCL
// with that backend), a receiving thread per peer, and the end of a call
// (Note [Ending a call]); open_link.

#include "mpipe/detail/distributed/gloo_link.h"
#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/runtime/streams.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

namespace mpipe {
namespace detail {

MPIPE_FUNC GlooLink::GlooLink(std::shared_ptr<GroupImpl> group, int64_t pipeline_id, int64_t seq,
                              LinkHandlers handlers)
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

MPIPE_FUNC GlooLink::~GlooLink() {
  if (!finished_) {
    try {
      finish("the call was left without ending it", true, -1);
    } catch (...) {
    }
  }
}

MPIPE_FUNC void GlooLink::post(int64_t peer, WireMessage m) {
  at::Tensor header = at::zeros({kHeader}, at::kLong);
  int64_t* h = header.data_ptr<int64_t>();
  h[kMagicSlot] = kMagic;
  h[kPipeline] = pipeline_;
  h[kSeq] = seq_;
  h[kType] = m.type;
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
// End or Abort. Both waits share one deadline: the longest receive's
// patience from here (the group's timeout plus half a second per other rank,
// Note [Cross-process calls] in remote-inl.h, plus a quarter second), or
// kAnswer once the call is failing (this rank's error, or a peer's Abort or
// loss arriving while it waits). A peer that misses it is stalled: its sends
// and receive are aborted, the group is broken, and the message names that
// peer. The patience matters: a peer still waiting for the stalled rank's
// inputs gives up, and names it, only after its own patience; a shorter
// deadline here named that innocent peer as stalled too (scripts/stress.sh
// with --fault). So a rank that stalls between calls costs the others the
// timeout once, not once per wait. A peer found late (a receive from it
// timed out here, or on the rank whose Abort names it) is not waited for
// at all, unless it ended the call: a stalled rank cannot answer, and
// waiting kAnswer for it only delayed every report.
MPIPE_FUNC std::string GlooLink::finish(const std::string& error, bool failing, int64_t late) {
  finished_ = true;
  std::string problems;
  auto add = [&](const std::string& s) {
    if (!s.empty() && problems.find(s) == std::string::npos) {
      problems += (problems.empty() ? "" : "; ") + s;
    }
  };
  const int64_t me = group_->pipeline_rank();
  if (late < 0 || late >= group_->pipeline_size() || late == me || error.empty()) late = -1;
  for (int64_t p = 0; p < group_->pipeline_size(); ++p) {
    if (p == me) continue;
    WireMessage end;
    end.type = error.empty() ? WireMessage::End : WireMessage::Abort;
    end.text = error;
    end.from = late;
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
  const auto patience = group_->timeout + std::chrono::milliseconds(
                                              500 * (group_->pipeline_size() - 1) + 250);
  const auto start = std::chrono::steady_clock::now();
  auto deadline = start + (failing ? answer : patience);
  bool cut = failing;
  {
    std::unique_lock<std::mutex> lock(state_);
    if (late >= 0) peers_[static_cast<size_t>(late)].late = true;
    auto done = [&] {  // a late peer that has not ended is not waited for
      for (int64_t p = 0; p < group_->pipeline_size(); ++p) {
        const Peer& peer = peers_[static_cast<size_t>(p)];
        if (p != me && !(peer.ended && peer.drained) && !(peer.late && !peer.ended)) return false;
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
      const std::string within =  // none for a late peer: it was not waited for
          peer.late && !peer.ended ? "" : c10::str(" within ", std::round(waited * 10) / 10, " s");
      const std::string why = c10::str("rank ", group_->world_rank(p), " did not ",
          peer.ended ? "take this rank's last messages" : "end the call", within, " (stalled?)");
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

MPIPE_FUNC void GlooLink::drain(int64_t peer) {
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
      const std::string what = message_of(std::current_exception());
      error = closed_after_timeout(what)
                  ? std::string(kClosedAfterTimeout)
                  : c10::str("rank ", group_->world_rank(peer), " did not take a message: ", what);
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

MPIPE_FUNC at::Tensor GlooLink::receive(int64_t peer, at::Tensor into) {
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

MPIPE_FUNC void GlooLink::ended(int64_t peer, bool failed) {
  std::lock_guard<std::mutex> lock(state_);
  peers_[static_cast<size_t>(peer)].ended = true;
  if (failed) peer_failed_ = true;
  changed_.notify_all();
}

MPIPE_FUNC void GlooLink::hand_over(int64_t peer, WireMessage m) {
  if (chaos_) {
    chaos_->push(peer, std::move(m));
  } else {
    handlers_.deliver(peer, std::move(m));
  }
}

MPIPE_FUNC void GlooLink::pump(int64_t peer) {
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
            if (m.from >= 0 && m.from < group_->pipeline_size() &&
                m.from != group_->pipeline_rank()) {
              peers_[static_cast<size_t>(m.from)].late = true;  // the peer found it stalled
            }
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
      const std::string what = message_of(std::current_exception());
      const std::string why = closed_after_timeout(what)
                                  ? std::string(kClosedAfterTimeout)
                                  : c10::str("rank ", from_rank, " cannot be reached (", what, ")");
      group_->break_group(why);
      handlers_.failed(peer, why);
    }
    ended(peer, true);
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

}  // namespace detail
}  // namespace mpipe
