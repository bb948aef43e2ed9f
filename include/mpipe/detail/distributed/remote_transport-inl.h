#pragma once

// Private: RemoteTransport (remote.h), the executor's transport when stages
// live in other processes: local stages' messages stay in this process, the
// others go through the call's link (Note [Cross-process calls] in
// remote-inl.h).

#include "mpipe/detail/config.h"

#include "mpipe/detail/distributed/remote.h"

#include "mpipe/detail/distributed/group.h"
#include "mpipe/detail/runtime/skips.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

namespace mpipe {
namespace detail {

MPIPE_FUNC RemoteTransport::RemoteTransport(LocalTransport& local, RemoteCall& call,
                                            const StageMap& map, SkipTable* skips,
                                            std::function<void(std::exception_ptr)> fail)
    : local_(local), call_(call), map_(map), skips_(skips), fail_(std::move(fail)) {
  // Who a receive of `key` by stage `to` waits on: the stage before (inputs,
  // skips) or after (gradients); -1 when that is not known here.
  auto producer = [](int64_t to, const Key& key) -> int64_t {
    if (key.kind == Key::Activation) return to - 1;
    if (key.kind == Key::Gradient) return to + 1;
    return -1;
  };
  // The rank a receive waits on: the producer's, or for a skip (its
  // stasher is not known here) the rank of the nearest earlier stage that is
  // not this rank's; -1 when none.
  auto sender = [this, producer](int64_t to, const Key& key) -> int64_t {
    const Layout& l = call_.layout();
    const int64_t from = producer(to, key);
    int64_t rank = -1;
    if (from >= 0 && from < l.n_stages) {
      rank = l.rank_of(from);
    } else if (key.kind == Key::Skip) {
      for (int64_t s = std::min(to, l.n_stages) - 1; s >= 0 && rank < 0; --s) {
        if (!map_.holds(s)) rank = l.rank_of(s);
      }
    }
    return rank >= 0 && rank < call_.group().pipeline_size() ? rank : -1;
  };
  local_.sender_of = [this, producer, sender](int64_t to, const Key& key) -> std::string {
    const int64_t rank = sender(to, key);
    if (rank < 0) return "another rank";
    const std::string world = c10::str("rank ", detail::group_impl(call_.group())->world_rank(rank));
    const int64_t from = producer(to, key);
    return from >= 0 && from < call_.layout().n_stages ? c10::str(world, " (stage ", from, ")")
                                                        : world;
  };
  // A receive that gave up names its sender as late, when that is known (not
  // a skip's guessed stasher): Note [Ending a call] in gloo_link-inl.h.
  local_.timed_out = [this, producer, sender](int64_t to, const Key& key) {
    const int64_t from = producer(to, key);
    if (from >= 0 && from < call_.layout().n_stages) call_.late(sender(to, key));
  };
  // A stall upstream leaves every later rank waiting for inputs, one behind
  // the other; downstream, every earlier rank waiting for gradients. The rank
  // next to the stalled one should time out first and name it, so waits grow
  // with the hand-offs between ranks away from it: half a second per rank
  // over the whole chain (per hand-off with contiguous ranges, a quarter in
  // the V, which crosses each boundary twice), so the longest wait stays
  // within the documented bound (Note [Cross-process calls]). A
  // receive from a stage of this rank waits without a timeout: that stage
  // either delivers or fails the call (its own receive times out, or another
  // rank's Abort arrives), and it is not the one to name.
  local_.patience = [this, producer](int64_t to, const Key& key) {
    const int64_t from = producer(to, key);
    if (map_.holds(from)) return std::chrono::milliseconds(0);
    const Layout& l = call_.layout();
    const int64_t at = std::min(std::max<int64_t>(to, 0), l.n_stages - 1);
    const int64_t hops = key.kind == Key::Activation || key.kind == Key::Skip
                             ? l.hops_before(at)
                             : l.hops_before(l.n_stages - 1) - l.hops_before(at);
    const int64_t chain = l.hops_before(l.n_stages - 1);
    const int64_t others = call_.group().pipeline_size() - 1;
    return call_.group().timeout() +
           std::chrono::milliseconds(chain > 0 ? 500 * others * hops / chain : 0);
  };
}

MPIPE_FUNC void RemoteTransport::post(int64_t from, int64_t to, const Key& key,
                                      const Tensors& values) {
  const int64_t peer = call_.layout().rank_of(to);
  for (size_t k = 0; k < values.size(); ++k) {
    WireMessage m;
    m.type = WireMessage::Data;
    m.key = key;
    m.stage = to;
    m.from = from;
    m.index = static_cast<int64_t>(k);
    m.count = static_cast<int64_t>(values.size());
    m.tensor = values[k];
    call_.post(peer, std::move(m));
  }
  if (values.empty()) {  // still one message, so the receiver sees the parcel
    WireMessage m;
    m.type = WireMessage::Data;
    m.key = key;
    m.stage = to;
    m.from = from;
    m.count = 0;
    call_.post(peer, std::move(m));
  }
}

MPIPE_FUNC void RemoteTransport::send(int64_t from, int64_t to, const Key& key, Tensors values) {
  if (key.kind == Key::Skip) {  // held until its item's activations leave (or it is popped here)
    local_.send(from, -1, key, std::move(values));
    return;
  }
  if (local(to)) {
    local_.send(from, to, key, std::move(values));
    return;
  }
  // The sending stage's stream is current: the host copy in post() waits for it.
  if (key.kind == Key::Activation) {
    for (auto& held : local_.take_skips(key.item)) post(held.from, to, held.key, held.values);
  }
  post(from, to, key, values);
}

MPIPE_FUNC void RemoteTransport::deliver(int64_t peer, WireMessage m) {
  (void)peer;
  try {
    const auto where = std::make_pair(m.stage, m.key);
    Tensors values;
    std::shared_ptr<c10::Event> ready;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Partial& part = partial_[where];
      if (m.ready) part.ready = m.ready;
      if (m.count > 0) {
        if (part.values.empty()) part.values.resize(static_cast<size_t>(m.count));
        TORCH_CHECK(m.index >= 0 && m.index < m.count &&
                        static_cast<int64_t>(part.values.size()) == m.count,
                    "a malformed message (tensor ", m.index, " of ", m.count, ")");
        part.values[static_cast<size_t>(m.index)] = std::move(m.tensor);
      }
      if (++part.got < std::max<int64_t>(m.count, 1)) return;
      values = std::move(part.values);
      ready = std::move(part.ready);
      partial_.erase(where);
    }
    if (m.key.kind == Key::Skip) {
      TORCH_CHECK(values.size() == 1, "a skip parcel holds one tensor, got ", values.size());
      TORCH_CHECK(skips_ != nullptr, "skip '", m.key.name, "' arrived after the forward pass");
      skips_->stash(m.key.name, m.key.item, m.from);
      local_.deposit(m.from, -1, m.key, std::move(values), std::move(ready));
    } else {
      TORCH_CHECK(local(m.stage), "a message for stage ", m.stage, " reached the rank of ",
                  call_.layout().ranks_stages(call_.pipeline_rank()));
      local_.deposit(m.from, m.stage, m.key, std::move(values), std::move(ready));
    }
  } catch (...) {
    fail_(std::current_exception());
  }
}

}  // namespace detail
}  // namespace mpipe
