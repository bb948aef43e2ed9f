#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_AUTOCAST_H_
#define MPIPE_AUTOCAST_H_

// Mixed precision for a scope, as Python's `with torch.autocast(...)`
// (LibTorch has the thread-local state but no guard for it):
//
//   {
//     mpipe::AutocastGuard bf16(torch::kCUDA, torch::kBFloat16);
//     loss = pipe->train_step(x, y, loss_fn, mpipe::TrainStepOptions(64));
//   }
//
// Every pipeline call made inside runs each stage under the caller's autocast
// state (device types, dtypes, cache flag), on its worker thread too; the
// backward pass runs with autocast off, as PyTorch recommends (Note [Autocast
// in the pipeline]). Across processes every rank must enter the same state.
// Leaving the outermost guard drops the thread's cached casts, as Python does.

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace mpipe {

/// Autocast on for a scope on this thread, as Python's `with torch.autocast(...)`;
/// the destructor puts the previous state back.
class AutocastGuard {
 public:
  /// Autocast on `device` (kCPU or kCUDA) to `dtype` (kBFloat16 or kHalf),
  /// or off (`enabled` false); `cache` keeps casts of weights for the scope.
  explicit AutocastGuard(c10::DeviceType device,
                         c10::ScalarType dtype = c10::ScalarType::BFloat16, bool enabled = true,
                         bool cache = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool was_enabled_;
  c10::ScalarType previous_dtype_;
  bool previous_cache_;
};

}  // namespace mpipe

#endif  // MPIPE_AUTOCAST_H_
