#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/cuda/device_probe.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace mpipe {
namespace detail {

class TimingEvent {
 public:
  at::cuda::CUDAEvent event{cudaEventDefault};  // timing on
};

MPIPE_FUNC std::shared_ptr<TimingEvent> record_timing_event(const c10::Stream& stream) {
  if (stream.device_type() != c10::DeviceType::CUDA) return nullptr;
  auto e = std::make_shared<TimingEvent>();
  e->event.record(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream));
  return e;
}

MPIPE_FUNC double elapsed_ms(const TimingEvent& from, const TimingEvent& to) {
  from.event.synchronize();
  to.event.synchronize();
  return static_cast<double>(from.event.elapsed_time(to.event));
}

MPIPE_FUNC AllocatorCounters allocator_counters(c10::Device device) {
  if (!device.is_cuda()) return {};
  const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const auto& bytes =
      stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return {bytes.current, bytes.peak};
}

MPIPE_FUNC void reset_allocator_peak(c10::Device device) {
  if (!device.is_cuda()) return;
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.has_index() ? device.index()
                                                                     : c10::cuda::current_device());
}

MPIPE_FUNC bool capturing_graph(c10::Device device) {
  if (!device.is_cuda()) return false;
  const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(index).stream(), &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace detail
}  // namespace mpipe
