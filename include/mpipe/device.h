#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_DEVICE_H_
#define MPIPE_DEVICE_H_

// Where a stage runs: the accepted spellings of a device and their checks.

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace mpipe {

/// The device argument of `ModelPipelineImpl::append`. Accepts
///  - a `torch::Device`;
///  - a string: "cpu", "cuda", "cuda:2", or a bare index "2" as the reference
///    Python class takes it (meaning "cuda:2");
///  - an integer GPU index (2 means "cuda:2").
/// It is resolved and checked by `resolve_device`, which the pipeline calls
/// when the stage is appended so that errors can name the stage.
class DeviceArg {
 public:
  /// A device as it is, such as torch::Device(torch::kCUDA, 1).
  /* implicit */ DeviceArg(c10::Device device) : device_(device), has_device_(true) {}
  /// A device type without an index: torch::kCPU, or torch::kCUDA (the current CUDA device).
  /* implicit */ DeviceArg(c10::DeviceType type) : device_(type), has_device_(true) {}
  /// A spelling: "cpu", "cuda", "cuda:2", or a bare index "2" (cuda:2).
  /* implicit */ DeviceArg(std::string spec) : device_(c10::kCPU), spec_(std::move(spec)) {}
  /// A spelling, as the std::string overload.
  /* implicit */ DeviceArg(const char* spec) : DeviceArg(std::string(spec)) {}
  /// A GPU index: 2 means cuda:2.
  /* implicit */ DeviceArg(int index) : DeviceArg(static_cast<int64_t>(index)) {}
  /// A GPU index: 2 means cuda:2.
  /* implicit */ DeviceArg(int64_t index)
      : device_(c10::kCPU), index_(index), has_index_(true) {}

  /// How the user wrote it, for error messages.
  std::string describe() const;

 private:
  friend c10::Device resolve_device(const DeviceArg& arg);
  c10::Device device_;
  std::string spec_;
  int64_t index_ = -1;
  bool has_device_ = false;
  bool has_index_ = false;
};

/// Resolves `arg` to a concrete device with an index and checks that this
/// process can use it: CPU always; CUDA only when LibTorch was built with CUDA
/// and the index is below the visible device count. "cuda" without an index
/// means the current CUDA device. Throws c10::Error with a message that says
/// what was wrong and how to fix it.
c10::Device resolve_device(const DeviceArg& arg);

}  // namespace mpipe

#endif  // MPIPE_DEVICE_H_
