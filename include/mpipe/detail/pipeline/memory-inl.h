#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/memory.h"

#include <cstdio>
#include <sstream>

namespace mpipe {

namespace detail {

MPIPE_FUNC std::string human(int64_t bytes) {
  if (bytes < 0) return "n/a";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

MPIPE_FUNC std::string pad(const std::string& s, size_t width) {
  return s.size() >= width ? s + " " : s + std::string(width - s.size(), ' ');
}

}  // namespace detail

MPIPE_FUNC std::string MemoryReport::to_string() const {
  using namespace detail;
  std::ostringstream out;
  out << "mpipe memory report"
      << (last_call.empty() ? std::string() : " (allocator figures: last " + last_call + ")")
      << "\n";
  const size_t w = 14;
  out << pad("device", 10) << pad("stages", 7) << pad("parameters", w) << pad("gradients", w)
      << pad("buffers", w) << pad("before call", w) << pad("peak", w) << "call's peak\n";
  for (const auto& d : devices) {
    out << pad(d.device.str(), 10) << pad(std::to_string(d.stages), 7)
        << pad(human(d.parameter_bytes), w) << pad(human(d.gradient_bytes), w)
        << pad(human(d.buffer_bytes), w) << pad(human(d.allocated_before_bytes), w)
        << pad(human(d.peak_allocated_bytes), w) << human(d.call_peak_bytes()) << "\n";
  }
  out << "(call's peak = peak - before call: the activations and gradients in flight)\n";
  return out.str();
}

}  // namespace mpipe
