#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_MEMORY_H_
#define MPIPE_MEMORY_H_

// A per-device memory summary of a pipeline (ModelPipelineImpl::memory_report).

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

namespace mpipe {

/// A pipeline's memory per device (ModelPipelineImpl::memory_report()).
struct MemoryReport {
  /// One device's row.
  struct DeviceRow {
    c10::Device device = c10::kCPU;  ///< the device
    int64_t stages = 0;  ///< how many stages run on this device
    int64_t parameter_bytes = 0;  ///< the bytes of those stages' parameters
    int64_t gradient_bytes = 0;  ///< parameters' .grad tensors now
    int64_t buffer_bytes = 0;    ///< running statistics and other buffers
    /// CUDA devices with ModelPipelineOptions::track_memory: the caching
    /// allocator's allocated bytes when the last call began (all of the
    /// process's tensors on that device). -1 otherwise.
    int64_t allocated_before_bytes = -1;
    /// CUDA devices with ModelPipelineOptions::track_memory: the caching
    /// allocator's peak allocated bytes during the last call. -1 otherwise.
    int64_t peak_allocated_bytes = -1;
    /// What the last call added at its peak: its activations and the gradients
    /// in flight (peak - before); -1 when unknown.
    int64_t call_peak_bytes() const {
      return peak_allocated_bytes < 0 ? -1 : peak_allocated_bytes - allocated_before_bytes;
    }
  };

  std::string last_call;  ///< the method the allocator figures belong to, or ""
  std::vector<DeviceRow> devices;  ///< a row per device that runs a stage, in stage order
  /// A table with a row per device, sizes in KiB/MiB/GiB, "n/a" where a
  /// figure cannot be counted (on the CPU, the activations' peak).
  std::string to_string() const;
};

}  // namespace mpipe

#endif  // MPIPE_MEMORY_H_
