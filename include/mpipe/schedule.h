#ifndef MPIPE_SCHEDULE_H_
#define MPIPE_SCHEDULE_H_

// Schedules: `Schedule`, the names train_step takes, and the pure functions
// behind them: which worker runs which stage's operations on which item
// (micro-batch or time step), in what order (Note [Programs]). They hold no
// tensors and no threads, so they are tested exactly; the runtime follows
// them (docs/design.md, "One runtime"). Bad arguments throw c10::ValueError.
// Running programs in time (StageCost, simulate, makespan, bubble) is
// mpipe/simulate.h, which includes this header.

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace mpipe {

/// A training schedule: the order of each stage's forwards and backwards in
/// ModelPipelineImpl::train_step (TrainStepOptions::schedule).
enum class Schedule {
  /// Fill-drain: all forwards, then all backwards (schedules::gpipe).
  GPipe,
  /// One forward, one backward (schedules::one_f_one_b): the same time, with
  /// at most n_stages micro-batches' activations alive instead of all.
  OneFOneB,
  /// Megatron-LM's interleaved 1F1B over TrainStepOptions::virtual_stages
  /// chunks per worker (schedules::interleaved_one_f_one_b): stage s runs on
  /// worker s % (n_stages / virtual_stages). A smaller bubble for more
  /// hand-offs. Place stage s on the device of stage s % d when you append it.
  Interleaved1F1B,
  /// ZB-H1 zero-bubble (schedules::zero_bubble_h1): each backward split into
  /// the input gradient and the weight gradient, the latter deferred into the
  /// bubbles; 1F1B's peak memory.
  ZeroBubbleH1,
  /// ZB-V (schedules::zero_bubble_v): 2D stages on D workers in a V, worker w
  /// running stages w and 2D-1-w, backwards split as ZB-H1's; almost no
  /// bubble at 1F1B's peak memory. Place stage s on the device of worker
  /// schedules::stage_workers(programs)[s] when you append it.
  ZeroBubbleV,
  /// DualPipeV (DeepSeek's V-shaped DualPipe) on ZB-V's placement: in its
  /// steady state each worker runs a forward of one stage paired with a
  /// backward of its other stage (Op::with_next), issued together so that a
  /// GPU runs them at once on the two stages' streams (Note [DualPipeV] in
  /// mpipe/detail/schedules/dualpipe_v.h). Needs 2 * workers micro-batches
  /// or more; with fewer it runs ZB-V's programs.
  DualPipeV,
  /// Programs built for TrainStepOptions::stage_costs by list scheduling: the
  /// fastest that simulate predicts within the memory bound, never slower
  /// than a built-in schedule within it (choose_schedule, Note [Choosing a
  /// schedule] in mpipe/training.h); the timeline calls it "Tailored".
  Tailored,
  /// The schedule with the least predicted step time whose predicted
  /// activation memory fits TrainStepOptions::memory_limit (choose_schedule,
  /// Note [Choosing a schedule]); the timeline names the one that ran.
  Auto,
};

/// "GPipe", "1F1B", "Interleaved1F1B", "ZB-H1", "ZB-V", "DualPipeV", "Tailored" or "Auto".
inline const char* to_string(Schedule s) {
  switch (s) {
    case Schedule::GPipe: return "GPipe";
    case Schedule::OneFOneB: return "1F1B";
    case Schedule::Interleaved1F1B: return "Interleaved1F1B";
    case Schedule::ZeroBubbleH1: return "ZB-H1";
    case Schedule::ZeroBubbleV: return "ZB-V";
    case Schedule::DualPipeV: return "DualPipeV";
    case Schedule::Tailored: return "Tailored";
    case Schedule::Auto: return "Auto";
  }
  return "?";
}

namespace schedules {

// Note [Programs]
// ~~~~~~~~~~~~~~~
// Training schedules. A schedule is a program per worker ("rank"): the
// operations that worker runs, in order. The built-in schedules below make
// them, and a user may write them too (TrainStepOptions::programs): the
// runtime runs any programs that validate() accepts and simulate() can
// finish. An operation names its stage, so a rank may run several stages
// (interleaved 1F1B runs stages r, r + d, r + 2d, ... on rank r). An
// operation waits only for its data:
//   F(s, i)  forward of micro-batch i on stage s: after F(s - 1, i);
//   B(s, i)  full backward: after F(s, i) and the gradient from stage s + 1
//            (B or I of (s + 1, i)); the last stage's after its own F(s, i),
//            which computed the loss;
//   I(s, i)  the input half of a split backward (the gradient of the stage's
//            inputs, on the critical path): waits like B;
//   W(s, i)  the weight half: after I(s, i) on the same rank.
// Each (stage, micro-batch) runs F once and then either B, or I and later W.
// A micro-batch's activations on a stage stay alive from its F to its B or W.

/// What an operation of a program does (Note [Programs]).
enum class OpKind {
  /// F: the stage's forward of the micro-batch.
  Forward,
  /// B: its full backward (input and weight gradients).
  Backward,
  /// I: the input half of a split backward, the gradient of the stage's inputs.
  BackwardInput,
  /// W: the weight half of a split backward, after the I of the same stage and micro-batch.
  BackwardWeight,
};

/// One operation of a program: `kind` of micro-batch `micro_batch` on stage `stage`.
struct Op {
  /// Forward, full backward, or one half of a split backward.
  OpKind kind;
  /// The micro-batch it works on. (The programs a user writes are
  /// train_step's, whose items are micro-batches; the runtime's own programs
  /// for constant_train_step number time chunks here.)
  int64_t micro_batch;
  /// The stage it runs.
  int64_t stage;
  /// This operation and the next one of its program are one action: a forward
  /// and a backward (B or I) of other stages and micro-batches, whose work is
  /// issued one after the other and whose results are handed on after both
  /// (DualPipeV's overlapped F&B, Note [DualPipeV]).
  bool with_next = false;
  /// Same kind, micro-batch and stage (with_next aside).
  bool operator==(const Op& b) const {
    return kind == b.kind && micro_batch == b.micro_batch && stage == b.stage;
  }
  /// Not operator==.
  bool operator!=(const Op& b) const { return !(*this == b); }
};

/// The forward of `micro_batch` on `stage`.
inline Op F(int64_t micro_batch, int64_t stage) { return Op{OpKind::Forward, micro_batch, stage}; }
/// The full backward of `micro_batch` on `stage`.
inline Op B(int64_t micro_batch, int64_t stage) { return Op{OpKind::Backward, micro_batch, stage}; }
/// The input gradient (first half of a split backward) of `micro_batch` on `stage`.
inline Op I(int64_t micro_batch, int64_t stage) {
  return Op{OpKind::BackwardInput, micro_batch, stage};
}
/// The weight gradient (second half of a split backward) of `micro_batch` on `stage`.
inline Op W(int64_t micro_batch, int64_t stage) {
  return Op{OpKind::BackwardWeight, micro_batch, stage};
}

/// Writes e.g. "F(3, 1)", the forward of micro-batch 3 on stage 1 (B, I, W:
/// the full backward and the two halves of a split one; "&" after it: with_next).
inline std::ostream& operator<<(std::ostream& out, const Op& op) {
  return out << "FBIW"[static_cast<int>(op.kind)] << '(' << op.micro_batch << ", " << op.stage
             << ')' << (op.with_next ? "&" : "");
}

/// One rank's operations, in the order it runs them.
using Program = std::vector<Op>;

/// What a stage's operations cost, in any unit of time. A full backward costs
/// backward_input + backward_weight. `transfer` delays the next stage's
/// forward (and this stage's backward input from the next stage) by the time
/// to move an activation or gradient across the boundary after this stage
/// (nothing where both stages run on one worker).
struct StageCost {
  /// The time of F.
  double forward = 1;
  /// The time of I (the input gradient).
  double backward_input = 1;
  /// The time of W (the weight gradient).
  double backward_weight = 1;
  /// The time to hand an activation or gradient to or from the next stage.
  double transfer = 0;
};

/// Costs of every stage: empty for the unit costs above, one entry for all
/// stages alike, or one per stage.
using Costs = std::vector<StageCost>;

}  // namespace schedules

namespace detail {
inline void check_sizes(const char* who, int64_t n_micro, int64_t n_stages) {
  TORCH_CHECK_VALUE(n_micro > 0 && n_stages > 0, "mpipe::schedules::", who,
                    ": sizes must be positive, got n_micro=", n_micro, ", n_stages=", n_stages);
}
/// `warmup` forwards, then one forward and one backward in turn, then the
/// remaining backwards: the 1F1B order of a rank's forwards and backwards.
inline schedules::Program one_forward_one_backward(const schedules::Program& forwards,
                                                   const schedules::Program& backwards,
                                                   size_t warmup) {
  schedules::Program p;
  size_t f = 0, b = 0;
  while (f < std::min(warmup, forwards.size())) p.push_back(forwards[f++]);
  while (f < forwards.size()) {
    p.push_back(forwards[f++]);
    if (b < backwards.size()) p.push_back(backwards[b++]);
  }
  while (b < backwards.size()) p.push_back(backwards[b++]);
  return p;
}
}  // namespace detail

namespace schedules {

/// The program of a call with no backward (forward, constant_forward,
/// sequence_forward): rank s runs F(0, s), ..., F(n_items - 1, s). simulate
/// runs it as a fill-drain wavefront: with equal stages F(i, s) starts at
/// tick i + s, n_items + n_stages - 1 ticks in all.
inline std::vector<Program> forward_only(int64_t n_items, int64_t n_stages) {
  detail::check_sizes("forward_only", n_items, n_stages);
  std::vector<Program> programs(static_cast<size_t>(n_stages));
  for (int64_t s = 0; s < n_stages; ++s) {
    for (int64_t i = 0; i < n_items; ++i) programs[static_cast<size_t>(s)].push_back(F(i, s));
  }
  return programs;
}

/// GPipe (fill-drain): rank s runs stage s, all forwards, then all backwards.
/// Each stage keeps the activations of all n_micro micro-batches alive.
inline std::vector<Program> gpipe(int64_t n_micro, int64_t n_stages) {
  detail::check_sizes("gpipe", n_micro, n_stages);
  std::vector<Program> programs(static_cast<size_t>(n_stages));
  for (int64_t s = 0; s < n_stages; ++s) {
    Program& p = programs[static_cast<size_t>(s)];
    for (int64_t i = 0; i < n_micro; ++i) p.push_back(F(i, s));
    for (int64_t i = 0; i < n_micro; ++i) p.push_back(B(i, s));
  }
  return programs;
}

/// 1F1B (PipeDream-flush): rank s runs stage s, min(n_stages - s - 1,
/// n_micro) warm-up forwards, then one forward and one backward in turn, then
/// the remaining backwards. Stage s keeps at most n_stages - s micro-batches'
/// activations alive; the run takes as long as GPipe's.
inline std::vector<Program> one_f_one_b(int64_t n_micro, int64_t n_stages) {
  detail::check_sizes("one_f_one_b", n_micro, n_stages);
  std::vector<Program> programs(static_cast<size_t>(n_stages));
  for (int64_t s = 0; s < n_stages; ++s) {
    Program fwd, bwd;
    for (int64_t i = 0; i < n_micro; ++i) {
      fwd.push_back(F(i, s));
      bwd.push_back(B(i, s));
    }
    programs[static_cast<size_t>(s)] =
        detail::one_forward_one_backward(fwd, bwd, static_cast<size_t>(n_stages - s - 1));
  }
  return programs;
}

/// Interleaved 1F1B (Megatron-LM): n_stages = d * virtual_stages stages on
/// d ranks, stage s on rank s % d, so rank r holds the non-adjacent chunks r,
/// r + d, r + 2d and so on. Micro-batches move in groups of d: a rank runs a group's
/// forwards chunk by chunk (backwards chunk by chunk in reverse), after
/// 2 (d - r - 1) + (virtual_stages - 1) d warm-up forwards then one forward and
/// one backward in turn. The bubble is about virtual_stages times smaller
/// than 1F1B's over the same d ranks; every micro-batch crosses ranks
/// virtual_stages times as often. virtual_stages = 1 is one_f_one_b.
inline std::vector<Program> interleaved_one_f_one_b(int64_t n_micro, int64_t n_stages,
                                                    int64_t virtual_stages) {
  detail::check_sizes("interleaved_one_f_one_b", n_micro, n_stages);
  TORCH_CHECK_VALUE(virtual_stages > 0 && n_stages % virtual_stages == 0,
                    "mpipe::schedules::interleaved_one_f_one_b: virtual_stages must be positive "
                    "and divide the stage count ", n_stages, ", got ", virtual_stages);
  if (virtual_stages == 1) return one_f_one_b(n_micro, n_stages);
  // Built for n_micro rounded up to whole groups; the padding's operations are
  // then dropped. Dropping operations keeps a schedule deadlock-free (no real
  // operation depends on a dropped one), whereas building the last, partial
  // group directly can deadlock.
  const int64_t v = virtual_stages, d = n_stages / v;
  const int64_t padded = (n_micro + d - 1) / d * d, total = padded * v;
  std::vector<Program> programs(static_cast<size_t>(d));
  for (int64_t r = 0; r < d; ++r) {
    Program fwd, bwd;
    for (int64_t g0 = 0; g0 < padded; g0 += d) {
      for (int64_t c = 0; c < v; ++c) {
        for (int64_t k = 0; k < d; ++k) {
          fwd.push_back(F(g0 + k, c * d + r));
          bwd.push_back(B(g0 + k, (v - 1 - c) * d + r));
        }
      }
    }
    const auto warmup = static_cast<size_t>(std::min(total, 2 * (d - r - 1) + (v - 1) * d));
    for (const Op& op : detail::one_forward_one_backward(fwd, bwd, warmup)) {
      if (op.micro_batch < n_micro) programs[static_cast<size_t>(r)].push_back(op);
    }
  }
  return programs;
}

/// ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): rank s runs
/// stage s with its backward split into I (the gradient of the stage's
/// inputs, which the previous stage waits for) and W (the gradient of its
/// weights, which nobody waits for). Stage s runs min(n_stages - s, n_micro)
/// forwards, then for each micro-batch k: I(k), W(k - s) (stage s defers its
/// weight gradients by s micro-batches, into what would be idle time), the
/// next forward; then the deferred W's. Every stage holds at most
/// min(n_stages, n_micro) micro-batches, 1F1B's peak (which 1F1B reaches on
/// stage 0). With F = I = W the run takes 3 n_micro + n_stages - 1 time units
/// for n_micro >= n_stages: the bubble is a third of 1F1B's.
inline std::vector<Program> zero_bubble_h1(int64_t n_micro, int64_t n_stages) {
  detail::check_sizes("zero_bubble_h1", n_micro, n_stages);
  std::vector<Program> programs(static_cast<size_t>(n_stages));
  for (int64_t s = 0; s < n_stages; ++s) {
    Program& p = programs[static_cast<size_t>(s)];
    int64_t next_f = 0, next_w = 0;
    while (next_f < std::min(n_stages - s, n_micro)) p.push_back(F(next_f++, s));
    for (int64_t k = 0; k < n_micro; ++k) {
      p.push_back(I(k, s));
      if (k >= s) p.push_back(W(next_w++, s));
      if (next_f < n_micro) p.push_back(F(next_f++, s));
    }
    while (next_w < n_micro) p.push_back(W(next_w++, s));
  }
  return programs;
}

/// ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6):
/// 2 * n_workers stages in a V, worker w running stages w and
/// 2 * n_workers - 1 - w (the first and the last stage share worker 0), each
/// backward split into I and W, the W's deferred into what would be idle
/// time, within 1F1B's peak memory (2 * n_workers activations of these
/// half-size stages per worker). With F = I = W and n_micro a multiple of
/// n_workers the run takes 6 n_micro + n_workers - 1 time units, the least
/// possible; with fewer micro-batches than workers, ZB-H1 over n_workers
/// stages is faster. Built by list scheduling (Note [Greedy schedules] in
/// mpipe/detail/schedules/greedy.h).
inline std::vector<Program> zero_bubble_v(int64_t n_micro, int64_t n_workers);

/// Throws c10::ValueError (a c10::Error) unless the programs run, for every
/// stage s < n_stages and micro-batch i < n_micro, F(i, s) exactly once and then either
/// B(i, s) once or I(i, s) once and later W(i, s) once, all of a stage's
/// operations on one rank (with `backward` = false: F only).
inline void validate(const std::vector<Program>& programs, int64_t n_stages, int64_t n_micro,
                     bool backward = true);

/// The most activation memory a rank holds at once while running `program`:
/// a (stage, micro-batch) holds `per_stage[stage]` (1 when per_stage is empty)
/// from its F to its B or W.
inline double peak_activations(const Program& program, const std::vector<double>& per_stage = {}) {
  double live = 0, peak = 0;
  for (const Op& op : program) {
    const double size = per_stage.empty() ? 1.0 : per_stage.at(static_cast<size_t>(op.stage));
    if (op.kind == OpKind::Forward) live += size;
    if (op.kind == OpKind::Backward || op.kind == OpKind::BackwardWeight) live -= size;
    peak = std::max(peak, live);
  }
  return peak;
}

/// The worker that runs each stage in `programs`: stage s on worker
/// stage_workers(programs)[s] (-1 for a stage none runs).
inline std::vector<int64_t> stage_workers(const std::vector<Program>& programs) {
  std::vector<int64_t> out;
  for (size_t r = 0; r < programs.size(); ++r) {
    for (const Op& op : programs[r]) {
      if (static_cast<int64_t>(out.size()) <= op.stage) out.resize(static_cast<size_t>(op.stage) + 1, -1);
      out[static_cast<size_t>(op.stage)] = static_cast<int64_t>(r);
    }
  }
  return out;
}

}  // namespace schedules

namespace detail {  // DualPipeV's programs on n_workers (mpipe/detail/schedules/dualpipe_v.h)
inline std::vector<schedules::Program> dualpipe_v(int64_t n_micro, int64_t n_workers);
}  // namespace detail

/// The programs `s` gives n_stages stages (not Auto or Tailored, which depend
/// on the costs: see choose_schedule), one per worker: a
/// starting point for hand-written TrainStepOptions::programs. ZeroBubbleV
/// and DualPipeV need an even n_stages (n_stages / 2 workers).
inline std::vector<schedules::Program> programs_for(Schedule s, int64_t n_micro, int64_t n_stages,
                                                    int64_t virtual_stages = 1) {
  switch (s) {
    case Schedule::GPipe: return schedules::gpipe(n_micro, n_stages);
    case Schedule::OneFOneB: return schedules::one_f_one_b(n_micro, n_stages);
    case Schedule::Interleaved1F1B:
      return schedules::interleaved_one_f_one_b(n_micro, n_stages, virtual_stages);
    case Schedule::ZeroBubbleH1: return schedules::zero_bubble_h1(n_micro, n_stages);
    case Schedule::ZeroBubbleV:
      TORCH_CHECK_VALUE(n_stages % 2 == 0, "mpipe: ZB-V needs an even number of stages (two per "
                        "worker, in a V), got ", n_stages);
      return schedules::zero_bubble_v(n_micro, n_stages / 2);
    case Schedule::DualPipeV:
      TORCH_CHECK_VALUE(n_stages % 2 == 0, "mpipe: DualPipeV needs an even number of stages (two "
                        "per worker, in a V), got ", n_stages);
      return detail::dualpipe_v(n_micro, n_stages / 2);
    case Schedule::Auto:
    case Schedule::Tailored: break;
  }
  TORCH_CHECK_VALUE(false, "mpipe::programs_for: ", to_string(s), " depends on the stage costs; "
                    "use choose_schedule(...).programs");
}

}  // namespace mpipe

#include <mpipe/detail/schedules/dualpipe_v.h>  // DualPipeV's programs
#include <mpipe/detail/schedules/greedy.h>    // zero_bubble_v's definition
#include <mpipe/detail/schedules/validate.h>  // validate's

#endif  // MPIPE_SCHEDULE_H_
