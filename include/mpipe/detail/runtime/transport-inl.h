#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/transport.h"

#include "mpipe/detail/runtime/recorder.h"
#include "mpipe/detail/runtime/streams.h"

#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

namespace mpipe {
namespace detail {

MPIPE_FUNC LocalTransport::LocalTransport(const std::vector<StagePlace>& stages,
                                          const StageMap& map, bool blocking, Recorder* recorder,
                                          std::chrono::milliseconds timeout)
    : stages_(stages),
      map_(map),
      blocking_(blocking),
      recorder_(recorder),
      timeout_(timeout),
      arrived_(stages.size() + 1) {}

MPIPE_FUNC void LocalTransport::send(int64_t from, int64_t to, const Key& key, Tensors values) {
  Parcel parcel{std::move(values), nullptr, from};
  if (from >= 0) {
    const c10::optional<c10::Stream> on = compute_of(from, key.item);
    // A consumer on the producer's stream (a lane) launches after this send,
    // so its kernels follow the producer's without an event (Note [Lanes]).
    const bool same_stream =
        key.kind != Key::Skip && map_.holds(to) && compute_of(to, key.item) == on;
    if (on && !same_stream) parcel.ready = record_event(*on);
  }
  const auto where = std::make_pair(key.kind == Key::Skip ? int64_t{-1} : to, key);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool fresh = parcels_.emplace(where, std::move(parcel)).second;
    TORCH_INTERNAL_ASSERT(fresh, "mpipe: a transport key was sent twice");
  }
  if (!blocking_) return;
  if (key.kind == Key::Skip) {
    for (auto& cv : arrived_) cv.notify_all();
  } else {
    arrived_[slot(to)].notify_all();
  }
}

MPIPE_FUNC void LocalTransport::deposit(int64_t from, int64_t to, const Key& key, Tensors values,
                                        std::shared_ptr<c10::Event> ready) {
  const auto where = std::make_pair(key.kind == Key::Skip ? int64_t{-1} : to, key);
  std::lock_guard<std::mutex> lock(mutex_);
  const bool fresh =
      parcels_.emplace(where, Parcel{std::move(values), std::move(ready), from}).second;
  TORCH_CHECK(fresh, "mpipe: ", key.kind == Key::Skip ? "skip '" + key.name + "'" : "a message",
              " of item ", key.item, " arrived twice from stage ", from);
  for (auto& cv : arrived_) cv.notify_all();
}

MPIPE_FUNC std::vector<LocalTransport::Held> LocalTransport::take_skips(int64_t item) {
  std::vector<Held> out;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = parcels_.begin(); it != parcels_.end();) {
    if (it->first.first == -1 && it->first.second.kind == Key::Skip &&
        it->first.second.item == item) {
      if (it->second.ready) {  // the host copy that sends it runs on this thread's current stream
        const auto& e = *it->second.ready;
        e.block(current_stream(c10::Device(e.device_type(), e.device_index())));
      }
      out.push_back({it->first.second, it->second.from, std::move(it->second.values)});
      it = parcels_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

MPIPE_FUNC Tensors LocalTransport::receive(int64_t to, const Key& key) {
  Parcel parcel;
  const auto where = std::make_pair(key.kind == Key::Skip ? int64_t{-1} : to, key);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    auto ready = [&] { return aborted_ || !failure_.empty() || parcels_.count(where) > 0; };
    const auto wait = patience ? patience(to, key) : timeout_;
    if (blocking_ && timeout_.count() > 0 && wait.count() > 0) {
      const bool arrived = arrived_[slot(to)].wait_for(lock, wait, ready);
      if (!arrived && timed_out) timed_out(to, key);
      TORCH_CHECK(arrived, "nothing arrived from ",
                  sender_of ? sender_of(to, key) : std::string("another rank"),
                  " within ", wait.count() / 1000.0,
                  " s (the group's timeout, plus grace by pipeline position): stage ", to,
                  " waited for ",
                  key.kind == Key::Activation  ? "its inputs"
                  : key.kind == Key::Gradient  ? "the gradients of its outputs"
                  : key.kind == Key::Skip      ? "skip '" + key.name + "'"
                                               : "the gradient of skip '" + key.name + "'",
                  " of item ", key.item);
    } else if (blocking_) {
      arrived_[slot(to)].wait(lock, ready);
    }
    if (aborted_) throw Aborted{};
    TORCH_CHECK(failure_.empty(), failure_);
    auto it = parcels_.find(where);
    TORCH_INTERNAL_ASSERT(it != parcels_.end(), "mpipe: the schedule delivered no input");
    parcel = std::move(it->second);
    parcels_.erase(it);
  }
  return accept(to, key.item, std::move(parcel.values), parcel.ready);
}

MPIPE_FUNC void LocalTransport::abort() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
  }
  for (auto& cv : arrived_) cv.notify_all();
}

MPIPE_FUNC void LocalTransport::fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_.empty()) failure_ = why;
  for (auto& cv : arrived_) cv.notify_all();
}

MPIPE_FUNC Tensors LocalTransport::accept(int64_t to, int64_t item, Tensors values,
                                          const std::shared_ptr<c10::Event>& ready) const {
  for (auto& v : values) {
    if (v.defined()) v = move(v, ready, to, item);
  }
  return values;
}

// Note [Hand-offs]
// ~~~~~~~~~~~~~~~~
// Every CUDA stage launches its kernels on a compute stream of its own, so
// stages that share a GPU still overlap. A value crosses from its producer to
// stage `to` after the event recorded on the producer's stream (`ready`;
// none where the consumer computes on that same stream, a lane: Note [Lanes]):
//  - same CUDA device: the consumer's stream waits for the event, and the value
//    is record_stream'ed on it (the allocator must not reuse its memory while
//    the consumer may still read it);
//  - CPU -> CUDA: a non-blocking copy on the consumer's stream;
//  - CUDA -> CPU: the source device's copy stream waits for the event, then a
//    blocking copy (the CPU stage needs the values);
//  - CUDA -> other CUDA: the copy stream of the boundary waits for the event
//    and copies with the consumer's stream current on the destination, so
//    ATen orders the consumer after the copy; the source is record_stream'ed
//    on the copy stream.
// No host sync happens on an all-GPU pipeline. Copies are timeline tasks.
MPIPE_FUNC at::Tensor LocalTransport::move(const at::Tensor& value,
                                           const std::shared_ptr<c10::Event>& ready, int64_t to,
                                           int64_t item) const {
  const StagePlace& stage = place(to);
  const c10::optional<c10::Stream> compute = compute_of(to, item);
  const c10::Device src = value.device();
  if (src == stage.device) {
    if (compute) {
      if (ready) ready->block(*compute);
      record_on(value, *compute);
    }
    return value;
  }
  if (src.is_cpu()) {
    c10::StreamGuard guard(*compute);
    TaskSpan span(recorder_, to, item, TaskKind::Copy, stage.device, compute);
    return value.to(stage.device, /*non_blocking=*/true);
  }
  const c10::Stream copy =
      stage.copy_in && stage.copy_in->device() == src
          ? *stage.copy_in
          : shared_stream(src, StreamRole::Copy, 0);  // a skip from a stage further back
  if (ready) ready->block(copy);
  if (stage.device.is_cpu()) {
    c10::StreamGuard guard(copy);
    TaskSpan span(recorder_, to, item, TaskKind::Copy, stage.device, c10::nullopt);
    return value.to(stage.device, /*non_blocking=*/false);
  }
  const c10::Stream streams[] = {copy, *compute};
  c10::MultiStreamGuard guard(streams);
  TaskSpan span(recorder_, to, item, TaskKind::Copy, stage.device, copy);
  at::Tensor out = value.to(stage.device, /*non_blocking=*/true);
  record_on(value, copy);
  return out;
}

}  // namespace detail
}  // namespace mpipe
