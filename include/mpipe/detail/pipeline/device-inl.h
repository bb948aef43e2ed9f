#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <optional>

namespace mpipe {

MPIPE_FUNC std::string DeviceArg::describe() const {
  if (has_device_) return device_.str();
  if (has_index_) return std::to_string(index_);
  return "\"" + spec_ + "\"";
}

namespace detail {

/// The CUDA devices this process sees (0 with a CPU-only LibTorch).
MPIPE_FUNC int64_t cuda_device_count() {
  if (!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) return 0;
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount();
}

MPIPE_FUNC bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

MPIPE_FUNC c10::Device check_usable(c10::Device device, const DeviceArg& arg) {
  if (device.is_cpu()) return c10::Device(c10::kCPU);
  TORCH_CHECK(device.is_cuda(), "mpipe: device ", arg.describe(),
              " is not supported; stages run on \"cpu\" or \"cuda:<index>\"");
  TORCH_CHECK(c10::impl::hasDeviceGuardImpl(c10::kCUDA), "mpipe: device ", arg.describe(),
              " asks for CUDA, but this LibTorch was built without CUDA support; "
              "use \"cpu\" or link a CUDA build of LibTorch");
  const int64_t count = detail::cuda_device_count();
  TORCH_CHECK(count > 0, "mpipe: device ", arg.describe(),
              " asks for CUDA, but no CUDA device is visible to this process "
              "(check CUDA_VISIBLE_DEVICES and the driver), so use \"cpu\"");
  if (!device.has_index()) {
    device = c10::impl::getDeviceGuardImpl(c10::kCUDA)->getDevice();
  }
  TORCH_CHECK(device.index() < count, "mpipe: device ", arg.describe(),
              " is beyond the CUDA device count: index ", static_cast<int>(device.index()),
              " but only ", count, " device(s) are visible (valid: 0..", count - 1, ")");
  return device;
}

}  // namespace detail

MPIPE_FUNC c10::Device resolve_device(const DeviceArg& arg) {
  if (arg.has_device_) return detail::check_usable(arg.device_, arg);
  if (arg.has_index_) {
    TORCH_CHECK(arg.index_ >= 0, "mpipe: GPU index must be >= 0, got ", arg.index_);
    TORCH_CHECK(arg.index_ < 128, "mpipe: GPU index ", arg.index_, " is out of range");
    return detail::check_usable(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(arg.index_)), arg);
  }
  // The reference class takes a bare GPU number as a string ("2").
  if (detail::all_digits(arg.spec_)) {
    TORCH_CHECK(arg.spec_.size() <= 3, "mpipe: GPU index ", arg.describe(), " is out of range");
    return detail::check_usable(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(arg.spec_))), arg);
  }
  std::optional<c10::Device> parsed;
  try {
    parsed = c10::Device(arg.spec_);
  } catch (const c10::Error&) {
  }
  TORCH_CHECK(parsed.has_value(), "mpipe: unknown device string ", arg.describe(),
              "; expected \"cpu\", \"cuda\", \"cuda:<index>\" or a GPU index such as \"0\"");
  return detail::check_usable(*parsed, arg);
}

}  // namespace mpipe
