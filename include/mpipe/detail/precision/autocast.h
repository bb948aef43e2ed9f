#pragma once

// Private: the caller's autocast state, carried to the stage workers.
//
// Note [Autocast in the pipeline]
// Autocast is thread-local. LibTorch's ThreadLocalState, which the workers
// take from the caller, carries whether autocast is on (dispatch keys) but,
// in LibTorch 1.13, not its lower-precision dtypes nor whether casts are
// cached, so a worker could cast to fp16 while its caller asked for bf16.
// Each call therefore captures the whole state (AutocastState::current) and
// every worker runs its program under it (AutocastScope). Forward, the
// recompute of a checkpointed stage and the loss run under it; autograd's
// backward runs with autocast off, as PyTorch recommends (backward ops run in
// the dtypes their forward ops chose). The cast cache keys on the weights,
// which an optimizer step changes in place, and lives as long as the caller's
// autocast scope, which may span several steps: each call starts by dropping
// the cached casts (start_with_fresh_casts). LibTorch 2 keeps one cache for
// all threads, cleared when any thread leaves its outermost autocast scope
// (the caller's AutocastGuard): workers then share the casts of a call and
// leave the cache alone. LibTorch 1.13 keeps one per thread, which nothing
// would ever clear on a worker, so there each worker clears its own at the end
// of each call (autocast_cache_per_thread). A CUDA graph is captured with the
// cache on, so that a weight is cast once for all micro-batches in the graph
// too, and the cache is cleared as soon as the capture ends: no cast made in
// the graph's memory outlives the capture in the cache (the reason
// torch.cuda.make_graphed_callables asks for the cache off, where the autocast
// scope may outlast the capture). The state is part of the graph's key.
// A checkpointed stage's first forward runs without grad and with the cache
// off: a cast cached there has no autograd history, and the recompute would
// take it from the cache and send no gradient to the weight.

#include <c10/core/ScalarType.h>

#include <string>

namespace mpipe {
namespace detail {

struct AutocastState {
  bool cpu = false;
  bool cuda = false;
  c10::ScalarType cpu_dtype = c10::ScalarType::BFloat16;
  c10::ScalarType cuda_dtype = c10::ScalarType::Half;
  bool cache = true;

  /// This thread's state.
  static AutocastState current();
  /// Autocast off on every device (the dtypes and the cache flag kept).
  AutocastState off() const {
    AutocastState s = *this;
    s.cpu = s.cuda = false;
    return s;
  }
  bool any() const { return cpu || cuda; }
  bool operator==(const AutocastState& o) const {
    return cpu == o.cpu && cuda == o.cuda && cpu_dtype == o.cpu_dtype &&
           cuda_dtype == o.cuda_dtype && cache == o.cache;
  }
  /// Makes this thread's state equal to this one.
  void apply() const;
  /// For cache keys: "" when autocast is off.
  std::string str() const;
};

/// Runs a scope under `state`, then puts the thread's previous state back
/// (nothing to do in the common case: the thread already has that state).
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& state)
      : previous_(AutocastState::current()), changed_(!(previous_ == state)) {
    if (changed_) state.apply();
  }
  ~AutocastScope() {
    if (changed_) previous_.apply();
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastState previous_;
  bool changed_;
};

/// Autocast off for a scope (autograd's backward).
class NoAutocast {
 public:
  NoAutocast() : previous_(AutocastState::current()) {
    if (previous_.any()) previous_.off().apply();
  }
  ~NoAutocast() {
    if (previous_.any()) previous_.apply();
  }
  NoAutocast(const NoAutocast&) = delete;
  NoAutocast& operator=(const NoAutocast&) = delete;

 private:
  AutocastState previous_;
};

/// Drops this thread's cached casts (every thread's, with LibTorch 2).
void clear_autocast_cache();

/// At the start of a pipeline call: drops the cached casts if autocast is on,
/// so that no stage uses a cast of weights an optimizer has changed since
/// (the caller's autocast scope may span several steps).
void start_with_fresh_casts();

/// Whether each thread has a cast cache of its own (LibTorch 1.x).
bool autocast_cache_per_thread();

}  // namespace detail
}  // namespace mpipe
