#pragma once

// Private: the scope every backward of the pipeline runs in.
//
// Note [Backward on the worker's thread]
// LibTorch's autograd engine runs every CUDA node on one thread per device,
// whichever thread called backward. With all stages on one GPU, the backward
// of every stage and micro-batch then queues on that one thread while the
// workers wait: on narrow-mlp (4 stages of 8 Linear(1024), 8 micro-batches)
// that thread was busy 38 of a step's 58 ms, 256 AddmmBackward nodes at about
// 100 µs of host time each (bench/RESULTS.md, the profile of issue 15).
// LibTorch 2 can run a backward on the calling thread instead (the
// multithreading flag of the thread's AutogradState; Python's
// torch.autograd.set_multithreading_enabled): each worker then runs its own
// stage's backward, and the stages' host work proceeds in parallel, as their
// forwards do. Each node still runs on the stream of its forward, so the GPU
// sees the same work. LibTorch 1.x lacks the flag and keeps the engine's
// threads (its CPU nodes already run on the calling thread). One backward
// through stages on several devices (constant_train_step's) keeps the
// engine's threads, one per device, which run those devices' nodes in
// parallel; so does the caller's own graph upstream of the pipeline. Backward
// always runs with autocast off (Note [Autocast in the pipeline]).

#include "mpipe/detail/precision/autocast.h"

#include <c10/core/AutogradState.h>
#include <torch/version.h>

#if defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR >= 2
#define MPIPE_BACKWARD_ON_CALLER 1
#endif

namespace mpipe {
namespace detail {

class BackwardScope {
 public:
  /// `on_this_thread`: run the backward on this thread (LibTorch 2); else on
  /// the engine's threads.
  explicit BackwardScope(bool on_this_thread = true) {
#ifdef MPIPE_BACKWARD_ON_CALLER
    auto& state = c10::AutogradState::get_tls_state();
    previous_ = state.get_multithreading_enabled();
    if (on_this_thread) state.set_multithreading_enabled(false);
#else
    (void)on_this_thread;
#endif
  }
  ~BackwardScope() {
#ifdef MPIPE_BACKWARD_ON_CALLER
    c10::AutogradState::get_tls_state().set_multithreading_enabled(previous_);
#endif
  }
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;

 private:
  NoAutocast no_autocast_;
#ifdef MPIPE_BACKWARD_ON_CALLER
  bool previous_ = true;
#endif
};

}  // namespace detail
}  // namespace mpipe
