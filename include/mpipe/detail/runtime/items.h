#pragma once

// Private: a call's items, the micro-batches or time steps (or time chunks)
// cut from its inputs, and the last stage's outputs of them joined back
// (gather, TimeStepOutputs, one_output).

#include "mpipe/detail/runtime/time_chunks.h"

#include "mpipe/split.h"
#include "mpipe/tensors.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace mpipe {
namespace detail {

/// What `split` was given as, for messages: "split_size" or "chunks".
inline const char* split_name(const Split& split) {
  return split.by_count() ? "chunks" : "split_size";
}

/// Rows per micro-batch of `split` for a batch of `batch` rows; refuses a
/// value below 1, naming `method` and what was given.
inline int64_t split_rows(const Split& split, const char* method, int64_t batch) {
  TORCH_CHECK(split.value() > 0, "mpipe::ModelPipeline::", method, ": ", split_name(split),
              " must be positive, got ", split.value());
  if (!split.by_count()) return split.value();
  return (batch - 1) / split.value() + 1;  // ceil(batch / n) for batch >= 1
}

/// The batched inputs' common size along `dim` (checked); -1 when none is.
inline int64_t batch_size(const char* method, const std::vector<Input>& inputs, int64_t dim) {
  TORCH_CHECK(!inputs.empty(), "mpipe::ModelPipeline::", method, ": no inputs given");
  int64_t size = -1, first = -1;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const at::Tensor& t = inputs[k].tensor;
    TORCH_CHECK(t.defined(), "mpipe::ModelPipeline::", method, ": input ", k,
                " is an undefined tensor");
    if (!inputs[k].batched) continue;
    TORCH_CHECK(t.dim() > dim, "mpipe::ModelPipeline::", method, ": input ", k,
                " needs a ", dim == 0 ? "batch dimension (dim 0)" : "time dimension and a batch "
                "dimension", ", got shape ", t.sizes(), "; mark inputs that every ",
                dim == 0 ? "micro-batch" : "time step", " gets whole with mpipe::unbatched");
    if (size < 0) {
      size = t.size(dim);
      first = static_cast<int64_t>(k);
    }
    TORCH_CHECK(t.size(dim) == size, "mpipe::ModelPipeline::", method, ": batched inputs ",
                first, " and ", k, " differ in size along dim ", dim, " (", size, " and ",
                t.size(dim), ")");
  }
  return size;
}

/// The batch `method` splits into micro-batches: the batched inputs' common
/// size along dim 0, checked to exist and to be non-empty.
inline int64_t split_batch(const char* method, const std::vector<Input>& inputs) {
  const int64_t batch = batch_size(method, inputs, 0);
  TORCH_CHECK(batch != -1, "mpipe::ModelPipeline::", method, ": no input is batched; ", method,
              " splits batched inputs into micro-batches");
  TORCH_CHECK(batch > 0, "mpipe::ModelPipeline::", method, ": the input's batch is empty (size 0 "
              "along dim 0)");
  return batch;
}

/// The one output of a call whose Tensor overload was used; undefined when
/// there is none (a rank before the last, across processes).
inline at::Tensor one_output(const char* method, Tensors out) {
  if (out.empty()) return {};
  TORCH_CHECK(out.size() == 1, "mpipe::ModelPipeline::", method, ": the last stage returned ",
              out.size(), " tensors; call the overload that takes std::vector<mpipe::Input> "
              "and returns mpipe::Tensors");
  return std::move(out[0]);
}

/// Rows [i * rows, i * rows + rows) of the batched inputs; unbatched whole.
inline Tensors micro_batch(const std::vector<Input>& inputs, int64_t i, int64_t rows,
                           int64_t batch) {
  Tensors out;
  for (const auto& in : inputs) {
    out.push_back(in.batched ? in.tensor.narrow(0, i * rows, std::min(rows, batch - i * rows))
                             : in.tensor);
  }
  return out;
}

/// Batched tensor `t`'s rows of micro-batch m (Note [Micro-batches over
/// time]), along `dim`: all of them when the call has one micro-batch.
inline at::Tensor micro_batch_rows(const at::Tensor& t, const TimeChunks& chunks, int64_t m,
                                   int64_t dim) {
  return chunks.split() ? t.narrow(dim, chunks.first_row(m), chunks.rows_of(m)) : t;
}

/// constant_forward's single-step item i: its micro-batch's rows of the
/// batched inputs; unbatched inputs whole.
inline Tensors constant_step(const std::vector<Input>& inputs, const TimeChunks& chunks,
                             int64_t i) {
  Tensors out;
  for (const auto& in : inputs) {
    out.push_back(in.batched ? micro_batch_rows(in.tensor, chunks, chunks.micro_batch(i), 0)
                             : in.tensor);
  }
  return out;
}

/// sequence_forward's single-step item i: step t of the batched inputs ([T,
/// N, ...]), its micro-batch's rows; unbatched whole.
inline Tensors time_step(const std::vector<Input>& inputs, const TimeChunks& chunks, int64_t i) {
  Tensors out;
  for (const auto& in : inputs) {
    out.push_back(in.batched ? micro_batch_rows(in.tensor.select(0, chunks.first(i)), chunks,
                                                chunks.micro_batch(i), 0)
                             : in.tensor);
  }
  return out;
}

/// Chunk i of constant_forward's inputs: each batched input (its micro-batch's
/// rows) repeated as [k_i, N, ...] (a broadcast view); unbatched inputs whole.
inline Tensors repeated_chunk(const std::vector<Input>& inputs, const TimeChunks& chunks,
                              int64_t i) {
  Tensors out;
  for (const auto& in : inputs) {
    if (!in.batched) {
      out.push_back(in.tensor);
      continue;
    }
    const at::Tensor t = micro_batch_rows(in.tensor, chunks, chunks.micro_batch(i), 0);
    std::vector<int64_t> shape{chunks.size(i)};
    shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
    out.push_back(t.unsqueeze(0).expand(shape));
  }
  return out;
}

/// Chunk i of sequence_forward's batched inputs ([T, N, ...] -> [k_i, N_m,
/// ...]); unbatched whole.
inline Tensors sequence_chunk(const std::vector<Input>& inputs, const TimeChunks& chunks,
                              int64_t i) {
  Tensors out;
  for (const auto& in : inputs) {
    out.push_back(in.batched ? micro_batch_rows(in.tensor.narrow(0, chunks.first(i), chunks.size(i)),
                                                chunks, chunks.micro_batch(i), 1)
                             : in.tensor);
  }
  return out;
}

inline Tensors tensors_of(const std::vector<Input>& inputs) {
  Tensors out;
  for (const auto& in : inputs) out.push_back(in.tensor);
  return out;
}

/// `acc` (undefined: none yet) plus the steps of `chunk` [k, ...], added one
/// at a time; differentiable, with a cheap backward (time_chunks-inl.h).
at::Tensor step_sum(const at::Tensor& acc, const at::Tensor& chunk);

/// The last stage's outputs of T time steps, as they arrive in step order:
/// summed output by output (reduce), or kept per step (per chunk for time
/// chunks) for results(); one such record per micro-batch.
class TimeStepOutputs {
 public:
  TimeStepOutputs(bool reduce, TimeChunks chunks)
      : reduce_(reduce),
        chunks_(chunks),
        parts_(static_cast<size_t>(chunks.micro_batches()),
               std::vector<Tensors>(reduce ? 1 : static_cast<size_t>(chunks.per_micro_batch()))) {}
  /// Item i's outputs: a chunk's (add_chunk) with multi-step chunks, else
  /// one step's (add).
  void add_item(int64_t i, Tensors out) {
    if (chunks_.multi()) {
      add_chunk(i, std::move(out));
    } else {
      add(i, std::move(out));
    }
  }
  /// Chunk i's outputs, each [k_i, ...] (checked). Summed step by step, in
  /// the order single steps make them, so every k gives the same result.
  /// Runs in the last stage's action, whose error already names the call,
  /// the stage and the chunk with its steps (Executor::describe_failure), so
  /// the messages here do not repeat them.
  void add_chunk(int64_t i, Tensors out) {
    const int64_t k = chunks_.size(i);
    for (size_t o = 0; o < out.size(); ++o) {
      const at::Tensor& y = out[o];
      TORCH_CHECK(y.defined() && y.dim() >= 1 && y.size(0) == k, "the stage returned ",
                  y.defined() ? c10::str("shape ", y.sizes()) : std::string("an undefined tensor"),
                  out.size() > 1 ? c10::str(" (output ", o, ")") : std::string(),
                  "; a multi-step stage returns [k, N, ...] with k = ", k,
                  " steps along dim 0");
    }
    std::vector<Tensors>& mine = parts_[static_cast<size_t>(chunks_.micro_batch(i))];
    const int64_t c = chunks_.chunk(i);
    if (!reduce_) {
      mine[static_cast<size_t>(c)] = std::move(out);
      return;
    }
    if (c > 0) {
      TORCH_CHECK(out.size() == mine[0].size(), "the stage returned ", out.size(),
                  " tensors, but ", mine[0].size(), " at its first time chunk");
    } else {
      mine[0].resize(out.size());
    }
    for (size_t o = 0; o < out.size(); ++o) mine[0][o] = step_sum(mine[0][o], out[o]);
  }
  void add(int64_t i, Tensors out) {
    std::vector<Tensors>& mine = parts_[static_cast<size_t>(chunks_.micro_batch(i))];
    const int64_t t = chunks_.chunk(i);
    if (!reduce_) {
      mine[static_cast<size_t>(t)] = std::move(out);
    } else if (t == 0) {
      mine[0] = std::move(out);
    } else {
      TORCH_CHECK(out.size() == mine[0].size(), "the stage returned ", out.size(),
                  " tensors, but ", mine[0].size(), " at time step 0");
      for (size_t k = 0; k < out.size(); ++k) mine[0][k] = mine[0][k] + out[k];
    }
  }
  bool reduced() const { return reduce_; }
  /// The call's outputs: the sums, or the steps stacked [T, N, ...] (`stack`)
  /// or concatenated time-major [T*N, ...]; micro-batches joined along the
  /// batch dimension.
  Tensors results(const char* method, int64_t last_stage, bool stack) const;

 private:
  /// Micro-batch m's outputs, as results() gives a call's.
  Tensors results_of(size_t m, const char* method, int64_t last_stage, bool stack) const;

  bool reduce_;
  TimeChunks chunks_;
  std::vector<std::vector<Tensors>> parts_;  // per micro-batch: one entry (the sums) when reducing
};

/// The outputs of every item as one Tensors: output k of each item
/// concatenated along dim 0 (or stacked into [n_items, ...]).
inline Tensors gather(const char* method, const char* item_name, int64_t last_stage,
                      const std::vector<Tensors>& items, bool stack, bool micro_batched) {
  TORCH_INTERNAL_ASSERT(!items.empty());
  const size_t n_out = items[0].size();
  Tensors out;
  for (size_t k = 0; k < n_out; ++k) {
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < items.size(); ++i) {
      TORCH_CHECK(items[i].size() == n_out, "mpipe::ModelPipeline::", method, ": stage ",
                  last_stage, " returned ", items[i].size(), " tensors at ", item_name, " ", i,
                  " but ", n_out, " at ", item_name, " 0");
      const at::Tensor& t = items[i][k];
      TORCH_CHECK(stack || t.dim() >= 1, "mpipe::ModelPipeline::", method, ": stage ",
                  last_stage, " returned a 0-dim tensor", n_out > 1 ? c10::str(" (output ", k, ")") : "",
                  " at ", item_name, " ", i, "; outputs are concatenated along dim 0, so each "
                  "needs one", micro_batched ? "" : " (or use reduce = true)");
      parts.push_back(t);
    }
    if (stack) {
      out.push_back(at::stack(parts, 0));
    } else {
      out.push_back(parts.size() == 1 ? parts[0] : at::cat(parts, 0));
    }
  }
  return out;
}

inline Tensors TimeStepOutputs::results_of(size_t m, const char* method, int64_t last_stage,
                                           bool stack) const {
  const std::vector<Tensors>& steps = parts_[m];
  if (reduce_) return steps[0];
  if (!chunks_.multi()) return gather(method, "time step", last_stage, steps, stack, false);
  // Chunks [k, N, ...] concatenated along dim 0 are the steps stacked.
  Tensors out = gather(method, "time chunk", last_stage, steps, false, false);
  if (stack) return out;
  for (size_t o = 0; o < out.size(); ++o) {
    TORCH_CHECK(out[o].dim() >= 2, "mpipe::ModelPipeline::", method, ": stage ", last_stage,
                " returned a 0-dim tensor per time step", out.size() > 1 ? c10::str(" (output ", o, ")") : std::string(),
                "; outputs are concatenated along dim 0, so each needs one (or use reduce = true)");
    out[o] = out[o].flatten(0, 1);
  }
  return out;
}

inline Tensors TimeStepOutputs::results(const char* method, int64_t last_stage, bool stack) const {
  if (!chunks_.split()) return results_of(0, method, last_stage, stack);
  // Note [Micro-batches over time]: each micro-batch's sums, or its steps
  // stacked [T, N_m, ...], joined along the batch dimension.
  std::vector<Tensors> per;
  for (size_t m = 0; m < parts_.size(); ++m) {
    per.push_back(results_of(m, method, last_stage, reduce_ ? false : true));
  }
  const int64_t dim = reduce_ ? 0 : 1;
  Tensors out;
  for (size_t o = 0; o < per[0].size(); ++o) {
    std::vector<at::Tensor> parts;
    for (size_t m = 0; m < per.size(); ++m) {
      TORCH_CHECK(per[m].size() == per[0].size(), "mpipe::ModelPipeline::", method, ": stage ",
                  last_stage, " returned ", per[m].size(), " tensors in micro-batch ", m,
                  " but ", per[0].size(), " in micro-batch 0");
      TORCH_CHECK(per[m][o].dim() > dim, "mpipe::ModelPipeline::", method, ": stage ", last_stage,
                  " returned a 0-dim tensor per time step",
                  per[0].size() > 1 ? c10::str(" (output ", o, ")") : std::string(),
                  "; with micro-batches, outputs are joined along the batch dimension (dim 0 of "
                  "each step's output), so each needs one");
      parts.push_back(per[m][o]);
    }
    at::Tensor joined = at::cat(parts, dim);
    out.push_back(reduce_ || stack ? joined : joined.flatten(0, 1));
  }
  return out;
}

}  // namespace detail
}  // namespace mpipe
