#include "transport.h"

#include "recorder.h"
#include "streams.h"

#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

namespace mpipe {
namespace detail {

LocalTransport::LocalTransport(const std::vector<StagePlace>& stages, bool blocking,
                               Recorder* recorder)
    : stages_(stages), blocking_(blocking), recorder_(recorder), arrived_(stages.size() + 1) {}

void LocalTransport::send(int64_t from, int64_t to, const Key& key, Tensors values) {
  Parcel parcel{std::move(values), nullptr};
  if (from >= 0) {
    const StagePlace& producer = stages_[static_cast<size_t>(from)];
    if (producer.compute) parcel.ready = record_event(*producer.compute);
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
    arrived_[static_cast<size_t>(to)].notify_all();
  }
}

Tensors LocalTransport::receive(int64_t to, const Key& key) {
  Parcel parcel;
  const auto where = std::make_pair(key.kind == Key::Skip ? int64_t{-1} : to, key);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (blocking_) {
      arrived_[static_cast<size_t>(to)].wait(
          lock, [&] { return aborted_ || parcels_.count(where) > 0; });
    }
    if (aborted_) throw Aborted{};
    auto it = parcels_.find(where);
    TORCH_INTERNAL_ASSERT(it != parcels_.end(), "mpipe: the schedule delivered no input");
    parcel = std::move(it->second);
    parcels_.erase(it);
  }
  return accept(to, key.item, std::move(parcel.values), parcel.ready);
}

void LocalTransport::abort() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
  }
  for (auto& cv : arrived_) cv.notify_all();
}

Tensors LocalTransport::accept(int64_t to, int64_t item, Tensors values,
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
// stage `to` after the event recorded on the producer's stream (`ready`):
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
at::Tensor LocalTransport::move(const at::Tensor& value, const std::shared_ptr<c10::Event>& ready,
                                int64_t to, int64_t item) const {
  const StagePlace& stage = stages_[static_cast<size_t>(to)];
  const c10::Device src = value.device();
  if (src == stage.device) {
    if (stage.compute) {
      if (ready) ready->block(*stage.compute);
      record_on(value, *stage.compute);
    }
    return value;
  }
  if (src.is_cpu()) {
    c10::StreamGuard guard(*stage.compute);
    TaskSpan span(recorder_, to, item, TaskKind::Copy, stage.device, stage.compute);
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
  const c10::Stream streams[] = {copy, *stage.compute};
  c10::MultiStreamGuard guard(streams);
  TaskSpan span(recorder_, to, item, TaskKind::Copy, stage.device, copy);
  at::Tensor out = value.to(stage.device, /*non_blocking=*/true);
  record_on(value, copy);
  return out;
}

}  // namespace detail
}  // namespace mpipe
