#pragma once

// Private: a call's T time steps as items of k steps each (Note [Time
// chunks]), for each of its micro-batches (Note [Micro-batches over time] in
// pipeline/time_step_calls-inl.h).

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace mpipe {
namespace detail {

// Note [Time chunks]
// ~~~~~~~~~~~~~~~~~~
// With multi-step stages (ModelPipelineOptions::step_mode(Multi), or a
// time_chunk given to the call) the items that flow through the stages are
// chunks of k consecutive time steps, time-major [k, N, ...], not single
// steps: each stage call runs k steps at once (stateless layers on [k*N, ...]
// through SeqToANN, neurons as one fused multi-step kernel), so a stage makes
// T/k calls instead of T, while chunks still overlap across stages as steps
// do. k = 1 pipelines every step (most overlap, most calls); k >= T is one
// chunk (no overlap over time). The last chunk may be shorter. State carries
// from chunk to chunk as it does from step to step, and the outputs are cut
// back into steps (and summed step by step when reducing), so results do not
// depend on k, except where a layer's result depends on how many rows it
// sees at once: batch statistics (SpikingConvBlock normalises step by step
// in training for this reason), a BLAS that rounds a product over k*N rows
// differently from one over N rows (MKL, cuBLAS: the last bit), and the
// summation order of weight gradients. With ModelPipelineOptions::time_chunk
// 0 the pipeline picks k (resolve_time_chunk): T on one device, where one chunk
// measured fastest (bench/RESULTS.md, runs H and I).


/// A call's time chunk chosen by the pipeline (ModelPipelineOptions::time_chunk 0).
constexpr int64_t kAutoChunk = -1;

/// T steps as items of k steps each (the last may be shorter; k = 0 means
/// single-step items), for each micro-batch of `rows` rows of a batch of
/// `batch` (rows = 0: the whole batch). Item i is chunk chunk(i) of
/// micro-batch micro_batch(i): a micro-batch's items are consecutive.
struct TimeChunks {
  int64_t T = 0;
  int64_t k = 0;
  int64_t rows = 0;
  int64_t batch = 0;
  bool multi() const { return k > 0; }
  /// Items per micro-batch.
  int64_t per_micro_batch() const { return multi() ? (T + k - 1) / k : T; }
  int64_t micro_batches() const { return rows > 0 && batch > rows ? (batch - 1) / rows + 1 : 1; }
  bool split() const { return micro_batches() > 1; }
  int64_t count() const { return micro_batches() * per_micro_batch(); }
  int64_t micro_batch(int64_t i) const { return split() ? i / per_micro_batch() : 0; }
  /// The chunk (or step) of its micro-batch that item i is.
  int64_t chunk(int64_t i) const { return split() ? i % per_micro_batch() : i; }
  int64_t first(int64_t i) const { return multi() ? chunk(i) * k : chunk(i); }
  int64_t size(int64_t i) const { return multi() ? std::min(k, T - chunk(i) * k) : 1; }
  /// Micro-batch m's first row and its row count.
  int64_t first_row(int64_t m) const { return split() ? m * rows : 0; }
  int64_t rows_of(int64_t m) const { return split() ? std::min(rows, batch - m * rows) : batch; }
  /// For messages: `item` with micro-batches, else `chunk` for time chunks,
  /// else `step`.
  const char* pick(const char* item, const char* chunk, const char* step) const {
    return split() ? item : multi() ? chunk : step;
  }
  /// What item i is beyond its number, for messages: " (time steps a to b
  /// of T)" for a chunk, " (micro-batch m of M, time step t of T)" with
  /// micro-batches; empty for single steps of one batch.
  std::string steps_of(int64_t i) const {
    const std::string mb =
        split() ? c10::str("micro-batch ", micro_batch(i), " of ", micro_batches(), ", ") : "";
    if (multi()) {
      return c10::str(" (", mb, "time steps ", first(i), " to ", first(i) + size(i) - 1, " of ", T,
                      ")");
    }
    return split() ? c10::str(" (", mb, "time step ", first(i), " of ", T, ")") : std::string();
  }
};

}  // namespace detail
}  // namespace mpipe
