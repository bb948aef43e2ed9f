// CPU-only LibTorch: no device timing, no allocator counters (device_probe.h).
#include "device_probe.h"

namespace mpipe {
namespace detail {

class TimingEvent {};

std::shared_ptr<TimingEvent> record_timing_event(const c10::Stream&) { return nullptr; }
double elapsed_ms(const TimingEvent&, const TimingEvent&) { return 0.0; }
AllocatorCounters allocator_counters(c10::Device) { return {}; }
void reset_allocator_peak(c10::Device) {}

}  // namespace detail
}  // namespace mpipe
