#pragma once

// Private: the definition of schedules::validate (declared and documented in
// mpipe/schedule.h, which includes this file at its end).

#include <mpipe/schedule.h>

#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace mpipe {
namespace schedules {

inline void validate(const std::vector<Program>& programs, int64_t n_stages, int64_t n_micro,
                     bool backward) {
  auto fail = [](const std::string& what) {
    TORCH_CHECK_VALUE(false, "mpipe::schedules::validate: " + what);
  };
  if (n_stages <= 0 || n_micro <= 0) {
    fail("sizes must be positive, got n_stages=" + std::to_string(n_stages) +
         ", n_micro=" + std::to_string(n_micro));
  }
  const auto n = static_cast<size_t>(n_stages), m = static_cast<size_t>(n_micro);
  std::vector<int64_t> rank(n, -1);
  // Per (stage, micro-batch): bit 1 F, 2 B, 4 I, 8 W seen.
  std::vector<std::vector<int>> seen(n, std::vector<int>(m, 0));
  for (size_t r = 0; r < programs.size(); ++r) {
    for (const Op& op : programs[r]) {
      // Formatted only on failure: validate runs before every executor run.
      auto where = [&] { return c10::str(op) + " on rank " + std::to_string(r); };
      if (op.stage < 0 || op.stage >= n_stages || op.micro_batch < 0 || op.micro_batch >= n_micro) {
        fail(where() + ": stage or micro-batch out of range (" + std::to_string(n_stages) +
             " stages, " + std::to_string(n_micro) + " micro-batches)");
      }
      auto& at = rank[static_cast<size_t>(op.stage)];
      if (at >= 0 && at != static_cast<int64_t>(r)) {
        fail(where() + ": stage " + std::to_string(op.stage) + " also runs on rank " +
             std::to_string(at));
      }
      at = static_cast<int64_t>(r);
      int& bits = seen[static_cast<size_t>(op.stage)][static_cast<size_t>(op.micro_batch)];
      const int bit = op.kind == OpKind::Forward ? 1 : op.kind == OpKind::Backward ? 2
                      : op.kind == OpKind::BackwardInput ? 4 : 8;
      if (bits & bit) fail(where() + ": repeated");
      if (bit != 1 && !backward) fail(where() + ": a backward in a forward-only call");
      if (bit != 1 && !(bits & 1)) fail(where() + ": before the forward");
      if ((bit == 2 && (bits & 12)) || (bit == 4 && (bits & 2))) {
        fail(where() + ": both a full and a split backward");
      }
      if (bit == 8 && !(bits & 4)) fail(where() + ": the weight gradient before the input gradient");
      bits |= bit;
    }
  }
  // Pairs (Op::with_next, Note [DualPipeV]): a forward and a backward of
  // other stages and micro-batches, neither of which waits for the other.
  for (size_t r = 0; r < programs.size(); ++r) {
    const Program& p = programs[r];
    for (size_t k = 0; k < p.size(); ++k) {
      if (!p[k].with_next) continue;
      const std::string where = c10::str(p[k]) + " on rank " + std::to_string(r);
      if (k + 1 == p.size()) fail(where + ": pairs with nothing (it ends its program)");
      const Op& a = p[k];
      const Op& b = p[k + 1];
      auto back = [](OpKind kind) {
        return kind == OpKind::Backward || kind == OpKind::BackwardInput;
      };
      if (!(a.kind == OpKind::Forward ? back(b.kind) : back(a.kind) && b.kind == OpKind::Forward)) {
        fail(where + " " + c10::str(b) + ": a pair is a forward and a backward (B or I)");
      }
      if (a.stage == b.stage || a.micro_batch == b.micro_batch) {
        fail(where + " " + c10::str(b) + ": a pair's operations work on two stages and two "
             "micro-batches");
      }
      if (b.with_next) fail(where + " " + c10::str(b) + ": pairs do not chain");
    }
  }
  for (size_t s = 0; s < n; ++s) {
    for (size_t i = 0; i < m; ++i) {
      const int bits = seen[s][i];
      if (!(bits & 1) || (backward && bits != 3 && bits != 13)) {
        fail("stage " + std::to_string(s) + " misses " +
             (!(bits & 1) ? "the forward" : (bits & 4) ? "the weight gradient" : "the backward") +
             " of micro-batch " + std::to_string(i));
      }
    }
  }
}

}  // namespace schedules
}  // namespace mpipe
