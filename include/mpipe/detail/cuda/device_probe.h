#pragma once

// Private: what the timeline, the memory report and snn::poisson_encode read
// from devices. CUDA builds implement it in device_probe_cuda-inl.h; CPU-only
// builds get the answers "no device timing", "no allocator counters" and
// "not capturing".

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <memory>

namespace mpipe {
namespace detail {

class TimingEvent;

/// A timing event recorded on a CUDA `stream` now; null for other streams or
/// without CUDA.
std::shared_ptr<TimingEvent> record_timing_event(const c10::Stream& stream);

/// Milliseconds from `from` to `to`, once both have happened (waits for them).
double elapsed_ms(const TimingEvent& from, const TimingEvent& to);

/// The caching allocator's allocated bytes on `device` now, and their peak
/// since the last reset_allocator_peak; -1 each for non-CUDA devices.
struct AllocatorCounters {
  int64_t allocated = -1;
  int64_t peak = -1;
};
AllocatorCounters allocator_counters(c10::Device device);
void reset_allocator_peak(c10::Device device);

/// Whether `device`'s current stream is capturing a CUDA graph (nothing may be
/// read back to the host then); false for other devices and without CUDA.
bool capturing_graph(c10::Device device);

}  // namespace detail
}  // namespace mpipe
