#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/precision/autocast.h"

#include "mpipe/autocast.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/version.h>

// LibTorch 2.4 made the autocast state per device type and deprecated the
// per-backend functions.
#if defined(TORCH_VERSION_MAJOR) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))
#define MPIPE_AUTOCAST_BY_DEVICE_TYPE 1
#endif

namespace mpipe {

namespace detail {

// Autocast's state on `d` (kCPU or kCUDA), on any LibTorch.
MPIPE_FUNC bool enabled_on(c10::DeviceType d) {
#ifdef MPIPE_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::is_autocast_enabled(d);
#else
  return d == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

MPIPE_FUNC c10::ScalarType dtype_on(c10::DeviceType d) {
#ifdef MPIPE_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::get_autocast_dtype(d);
#else
  return d == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                   : at::autocast::get_autocast_gpu_dtype();
#endif
}

MPIPE_FUNC void set_on(c10::DeviceType d, bool enabled, c10::ScalarType dtype) {
#ifdef MPIPE_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_enabled(d, enabled);
  at::autocast::set_autocast_dtype(d, dtype);
#else
  if (d == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_enabled(enabled);
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
#endif
}

}  // namespace detail

namespace detail {

MPIPE_FUNC AutocastState AutocastState::current() {
  AutocastState s;
  s.cpu = detail::enabled_on(c10::DeviceType::CPU);
  s.cuda = detail::enabled_on(c10::DeviceType::CUDA);
  s.cpu_dtype = detail::dtype_on(c10::DeviceType::CPU);
  s.cuda_dtype = detail::dtype_on(c10::DeviceType::CUDA);
  s.cache = at::autocast::is_autocast_cache_enabled();
  return s;
}

MPIPE_FUNC void AutocastState::apply() const {
  detail::set_on(c10::DeviceType::CPU, cpu, cpu_dtype);
  detail::set_on(c10::DeviceType::CUDA, cuda, cuda_dtype);
  at::autocast::set_autocast_cache_enabled(cache);
}

MPIPE_FUNC std::string AutocastState::str() const {
  if (!any()) return "";
  return c10::str(cpu ? c10::str("cpu:", cpu_dtype) : std::string(), cuda ? "/cuda:" : "",
                  cuda ? c10::str(cuda_dtype) : std::string());
}

MPIPE_FUNC void clear_autocast_cache() { at::autocast::clear_cache(); }

MPIPE_FUNC void start_with_fresh_casts() {
  if (detail::enabled_on(c10::DeviceType::CPU) ||
      detail::enabled_on(c10::DeviceType::CUDA)) {
    at::autocast::clear_cache();
  }
}

MPIPE_FUNC bool autocast_cache_per_thread() {
#if defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR < 2
  return true;
#else
  return false;
#endif
}

}  // namespace detail

MPIPE_FUNC AutocastGuard::AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled,
                                        bool cache)
    : device_(device) {
  TORCH_CHECK(device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA,
              "mpipe::AutocastGuard: autocast is for CPU or CUDA, got ", device);
  TORCH_CHECK(dtype == c10::ScalarType::BFloat16 || dtype == c10::ScalarType::Half,
              "mpipe::AutocastGuard: the lower precision is BFloat16 or Half, got ", dtype);
  was_enabled_ = detail::enabled_on(device);
  previous_dtype_ = detail::dtype_on(device);
  previous_cache_ = at::autocast::is_autocast_cache_enabled();
  detail::set_on(device, enabled, dtype);
  at::autocast::set_autocast_cache_enabled(cache);
  at::autocast::increment_nesting();
}

MPIPE_FUNC AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  detail::set_on(device_, was_enabled_, previous_dtype_);
  at::autocast::set_autocast_cache_enabled(previous_cache_);
}

}  // namespace mpipe
