#pragma once

// Private: a call's T time steps as items of k steps each (Note [Time
// chunks]), for each of its micro-batches (Note [Micro-batches over time] in
// pipeline/time_step_calls-inl.h), and the backward of one (stage, time
// chunk) of constant_train_step (Note [Chained backward]).

#include <ATen/SequenceNumber.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

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


// Note [Chained backward]
// ~~~~~~~~~~~~~~~~~~~~~~~
// constant_train_step runs like train_step: F(t, s) for every time chunk t,
// then B(t, s) from the last chunk down (detail::chained, runtime/programs.h),
// with the graph cut at stage boundaries by leaves. Inside a stage, though, the chunks stay
// linked: a stateful module's chunk t + 1 reads the state chunk t left, and
// that state is the module's own (Stateful's is opaque), so no leaf can cut
// it. B(t, s) therefore runs autograd's engine on chunk t's own nodes only:
// the nodes created while F(t, s) ran, which the sequence numbers of the
// stage's thread delimit ([lo, hi), recorded around the forward). Every edge
// that leaves them (to an earlier chunk's node, a parameter, the caller's
// graph) is redirected, before the run, to a Catch node that keeps the
// gradient (the engine's own capture would not do: it runs every node on a
// path to a captured edge, earlier chunks included), and the gradient is
// carried to the stage's next backward, where it enters as a root beside
// that chunk's own. A carried edge whose node is not in that chunk is caught
// again, with the chunk's contributions added. The last backward of the
// stage (chunk 0) runs everything left, accumulating into .grad, except the
// caller's graph: on stage 0 it catches the gradients of the caller's
// inputs, whole, and the step hands them to the caller's graph on the
// caller's thread after the call, as train_step does (backward_through_caller
// in pipeline/session-inl.h).
//
// This computes what one backward of the whole graph computes, in the same
// order of additions: the engine runs a thread's nodes newest first, so in
// one backward every later chunk's contribution to a node (or to a
// parameter's gradient) arrives before the node's own chunk's, which is where
// the carried root puts it. Results equal the plain model's and do not depend
// on the chunk size (tests/test_multistep.cpp checks that bit for bit).
//
// A limit: a node made on another thread, which a stage reaches through a
// tensor it kept from outside the call, may carry a sequence number inside
// [lo, hi); the caller's inputs' nodes are excluded by name, nothing else.

/// The nodes one stage made for one chunk: sequence numbers [lo, hi) of its
/// thread.
struct ChunkNodes {
  uint64_t lo = 0, hi = 0;
  static uint64_t now() { return at::sequence_number::peek(); }
};

/// Where a chunk's backward stops: takes the gradient of one edge that
/// leaves the chunk, in place of the node the edge led to.
struct Catch final : torch::autograd::Node {
  explicit Catch(const torch::autograd::InputMetadata& meta)
      : Node(/*sequence_nr=*/UINT64_MAX) {
    input_metadata_.push_back(meta);
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    grad = std::move(grads[0]);
    return {};
  }
  at::Tensor grad;
};

/// One stage's chain of chunk backwards (Note [Chained backward]).
class ChunkChain {
 public:
  /// Backpropagates `grads` (undefined: ones, for a loss) from `roots`
  /// through chunk `nodes`' own graph, plus what later chunks carried here.
  /// Returns the gradients of `leaves` (undefined where none reached them).
  /// `final`: the stage's last backward, which runs everything left.
  /// `stops`: nodes never counted in a chunk (the caller's inputs').
  /// The first `caller_leaves` leaves are the caller's inputs, which every
  /// chunk reads: their gradients are carried like any other edge's, and the
  /// final backward catches them whole, so that the caller's own graph runs
  /// on the caller's thread after the call (Note [Chained backward]).
  std::vector<at::Tensor> backward(const std::vector<at::Tensor>& roots,
                                   const std::vector<at::Tensor>& grads, ChunkNodes nodes,
                                   const std::vector<at::Tensor>& leaves, bool final,
                                   const std::set<const torch::autograd::Node*>& stops,
                                   size_t caller_leaves = 0) {
    using torch::autograd::Edge;
    torch::autograd::edge_list root_edges;
    torch::autograd::variable_list root_grads;
    for (auto& c : carry_) {  // later chunks' contributions arrive first
      root_edges.push_back(std::move(c.first));
      root_grads.push_back(std::move(c.second));
    }
    carry_.clear();
    for (size_t k = 0; k < roots.size(); ++k) {
      root_edges.push_back(torch::autograd::impl::gradient_edge(roots[k]));
      root_grads.push_back(grads[k].defined() ? grads[k] : at::ones_like(roots[k]));
    }
    std::vector<at::Tensor> out(leaves.size());
    if (root_edges.empty()) return out;
    auto& engine = torch::autograd::Engine::get_default_engine();
    if (final && caller_leaves == 0) {
      engine.execute(root_edges, root_grads, /*keep_graph=*/false, /*create_graph=*/false,
                     /*accumulate_grad=*/true);
      for (size_t k = 0; k < leaves.size(); ++k) {
        if (leaves[k].defined() && leaves[k].requires_grad()) out[k] = leaves[k].grad();
      }
      return out;
    }
    // Every edge that leaves the chunk's nodes now ends in a Catch (in the
    // final backward, only those into the caller's inputs). The nodes run
    // once, in this backward, so nothing needs them as they were.
    std::set<const torch::autograd::Node*> callers;
    for (size_t k = 0; k < caller_leaves; ++k) {
      callers.insert(torch::autograd::impl::gradient_edge(leaves[k]).function.get());
    }
    auto inside = [&](const torch::autograd::Node* n) {
      if (final) return callers.count(n) == 0;
      const uint64_t s = n->sequence_nr();
      return s >= nodes.lo && s < nodes.hi && stops.count(n) == 0;
    };
    std::map<std::pair<const torch::autograd::Node*, uint32_t>, size_t> index;
    std::vector<std::pair<Edge, std::shared_ptr<Catch>>> caught;  // original edge, its Catch
    auto catch_of = [&](const Edge& e) {
      const auto it = index.emplace(std::make_pair(e.function.get(), e.input_nr), caught.size());
      if (it.second) {
        caught.emplace_back(e, std::make_shared<Catch>(e.function->input_metadata(e.input_nr)));
      }
      return Edge(caught[it.first->second].second, 0);
    };
    std::set<const torch::autograd::Node*> seen;
    std::vector<torch::autograd::Node*> stack;
    auto follow = [&](Edge& e) {
      if (!e.function) return;
      if (!inside(e.function.get())) {
        e = catch_of(e);
      } else if (seen.insert(e.function.get()).second) {
        stack.push_back(e.function.get());
      }
    };
    for (auto& e : root_edges) follow(e);
    while (!stack.empty()) {
      torch::autograd::Node* n = stack.back();
      stack.pop_back();
      for (auto& e : n->next_edges()) follow(e);
    }
    engine.execute(root_edges, root_grads, /*keep_graph=*/false, /*create_graph=*/false,
                   /*accumulate_grad=*/true);
    std::vector<bool> taken(caught.size(), false);
    for (size_t k = 0; k < leaves.size(); ++k) {
      if (!leaves[k].defined() || !leaves[k].requires_grad()) continue;
      if (final && k >= caller_leaves) {  // accumulated into .grad
        out[k] = leaves[k].grad();
        continue;
      }
      if (!final && k < caller_leaves) continue;  // carried with the rest
      const Edge e = torch::autograd::impl::gradient_edge(leaves[k]);
      const auto it = index.find(std::make_pair(e.function.get(), e.input_nr));
      if (it == index.end()) continue;
      out[k] = caught[it->second].second->grad;
      taken[it->second] = true;
    }
    for (size_t k = 0; k < caught.size(); ++k) {
      if (!taken[k] && caught[k].second->grad.defined()) {
        carry_.emplace_back(caught[k].first, caught[k].second->grad);
      }
    }
    return out;
  }

 private:
  std::vector<std::pair<torch::autograd::Edge, at::Tensor>> carry_;
};

}  // namespace detail
}  // namespace mpipe
