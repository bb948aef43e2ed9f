#pragma once

#include "mpipe/detail/config.h"

// CPU-only LibTorch: no device timing, no allocator counters, no graph
// capture (device_probe.h).
#include "mpipe/detail/cuda/device_probe.h"

namespace mpipe {
namespace detail {

class TimingEvent {};

MPIPE_FUNC std::shared_ptr<TimingEvent> record_timing_event(const c10::Stream&) { return nullptr; }
MPIPE_FUNC double elapsed_ms(const TimingEvent&, const TimingEvent&) { return 0.0; }
MPIPE_FUNC AllocatorCounters allocator_counters(c10::Device) { return {}; }
MPIPE_FUNC void reset_allocator_peak(c10::Device) {}
MPIPE_FUNC bool capturing_graph(c10::Device) { return false; }

}  // namespace detail
}  // namespace mpipe
