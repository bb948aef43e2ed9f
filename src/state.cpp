#include "mpipe/checkpoint.h"
#include "mpipe/state.h"

namespace mpipe {

namespace {
thread_local MicroBatch current;
thread_local bool recomputing = false;
}  // namespace

bool is_recomputing() noexcept { return recomputing; }
RecomputeGuard::RecomputeGuard() noexcept : previous_(recomputing) { recomputing = true; }
RecomputeGuard::~RecomputeGuard() { recomputing = previous_; }

MicroBatch current_micro_batch() noexcept { return current; }

MicroBatchGuard::MicroBatchGuard(MicroBatch micro_batch) noexcept : previous_(current) {
  current = micro_batch;
}

MicroBatchGuard::~MicroBatchGuard() { current = previous_; }

int64_t reset_states(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* stateful = dynamic_cast<Stateful*>(m.get())) {
      stateful->reset_state();
      ++n;
    }
  }
  return n;
}

}  // namespace mpipe
