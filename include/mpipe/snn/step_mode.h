#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SNN_STEP_MODE_H_
#define MPIPE_SNN_STEP_MODE_H_

// How an SNN layer takes time: one step per call, or a [T, N, ...] sequence
// per call (SpikingJelly's step_mode 's' and 'm').

#include <cstdint>
#include <ostream>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace mpipe {
namespace snn {

/// How an SNN layer takes time: one step or a [T, N, ...] sequence per call.
enum class StepMode {
  /// Each call is one time step: input [N, ...], output [N, ...].
  Single,
  /// Each call is T consecutive time steps, time-major: input [T, N, ...],
  /// output [T, N, ...]; state carries from one call to the next.
  Multi,
};

/// Writes "single" or "multi".
inline std::ostream& operator<<(std::ostream& os, StepMode mode) {
  return os << (mode == StepMode::Single ? "single" : "multi");
}

/// Sets the step mode of every mpipe::snn neuron and snn::Dropout in
/// `module` (itself included) and returns how many it set. Stateless layers still need
/// SeqToANN (mpipe/snn/containers.h) to take [T, N, ...] input.
int64_t set_step_mode(torch::nn::Module& module, StepMode mode);

}  // namespace snn
}  // namespace mpipe

#endif  // MPIPE_SNN_STEP_MODE_H_
