#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/split_backward.h"

#include <ATen/Functions.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace mpipe {
namespace detail {

// Note [Split backward]
// ~~~~~~~~~~~~~~~~~~~~~
// Zero-bubble schedules split a stage's backward B(j, i) into I(j, i), the
// gradients of its inputs (the previous stage waits for them), and W(j, i),
// the gradients of its weights (nobody waits for them). I is
// autograd::grad(roots, inputs, grads, retain_graph): autograd computes only
// what leads to the inputs, so no weight gradient.
//
// W must not compute the activation gradients again. Call A the nodes of the
// stage's graph from which an input can be reached (I runs exactly those).
// Every path from a root to a weight leaves A at most once and never comes
// back (a node that reaches an A node is in A). So the weight gradients are
// the sum, over the A nodes N with an edge out of A that leads to weights, of
// what N sends down those edges: N's incoming gradients, which I computed,
// pushed through N's non-A edges only. Before I, a pre-hook on each such N
// records its incoming gradients; W runs the engine from N with them, once
// per N, with `outputs` = the weights below N's non-A edges (so autograd
// computes only those: e.g. a matmul's weight gradient, not its input
// gradient again). Roots outside A (a stage whose inputs need no gradient)
// run from the roots as usual, all in one run.
//
// By linearity the separate runs add up to backward's gradients, but not
// to its bits: where backward sums two gradients at a node and then runs it
// (or sums them at a weight's AccumulateGrad before adding to .grad), two
// runs run the node twice, or add to .grad twice, which rounds differently.
// So the roots outside A are one run (stage 0's stash and output both reach
// its Linear), and the split is taken only when no node below the parts is
// reached from two of them (one Linear applied twice side by side:
// fc(x) + fc(2 x) sends two gradients to fc's weight).
//
// Two cases do not split so: the one above, and a weight below N's non-A
// edges that N's A edges also reach (a weight used both before and after
// the input path joins it, fc(fc(x)); the engine would then also run N's A
// edges and count part of the gradient twice). There, and for any other
// leaf the analysis cannot place, W falls back to backward(roots, grads,
// inputs = every leaf but the stage's inputs) from the graph I kept,
// computing the activation gradients again: right, only slower.

using torch::autograd::Edge;
using torch::autograd::Node;


/// Records a node's incoming gradients when it runs.
struct Capture : torch::autograd::FunctionPreHook {
  explicit Capture(std::shared_ptr<std::vector<at::Tensor>> into) : into_(std::move(into)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    *into_ = grads;
    return grads;
  }
  std::shared_ptr<std::vector<at::Tensor>> into_;
};

MPIPE_FUNC bool is_leaf_node(const Node* n) {
  return dynamic_cast<const torch::autograd::AccumulateGrad*>(n) != nullptr;
}


struct WeightPass::Plan {
  struct Part {
    torch::autograd::edge_list roots;
    std::vector<at::Tensor> grads;                       // fixed grads (roots outside A)...
    std::shared_ptr<std::vector<at::Tensor>> captured;   // ...or captured by I (A nodes)
    torch::autograd::edge_list outputs;                  // the weights to accumulate into
  };
  std::vector<at::Tensor> roots, grads;  // kept for the fallback, and to keep the graph alive
  std::vector<at::Tensor> inputs;
  std::vector<Part> parts;
  bool split = false;
  bool done = false;
};


MPIPE_FUNC WeightPass::WeightPass(std::vector<at::Tensor> roots, std::vector<at::Tensor> grads,
                                  const std::vector<at::Tensor>& inputs)
    : plan_(std::make_shared<Plan>()) {
  Plan& p = *plan_;
  p.roots = std::move(roots);
  p.grads = std::move(grads);
  p.inputs = inputs;

  std::unordered_set<const Node*> input_nodes;
  for (const auto& x : inputs) {
    input_nodes.insert(torch::autograd::impl::gradient_edge(x).function.get());
  }
  // Every node of the graph, children before parents (iterative DFS).
  std::vector<Node*> order;
  std::unordered_set<Node*> seen;
  {
    std::vector<std::pair<Node*, size_t>> stack;
    for (const auto& r : p.roots) {
      Node* g = r.grad_fn().get();
      if (g && seen.insert(g).second) stack.emplace_back(g, 0);
      while (!stack.empty()) {
        auto& top = stack.back();
        const auto& edges = top.first->next_edges();
        if (top.second < edges.size()) {
          Node* c = edges[top.second++].function.get();
          if (c && seen.insert(c).second) stack.emplace_back(c, 0);
        } else {
          order.push_back(top.first);
          stack.pop_back();
        }
      }
    }
  }
  // In A: reaches an input. reaches_weight: reaches a leaf that is not an input.
  std::unordered_map<const Node*, bool> in_a, reaches_weight;
  for (Node* n : order) {
    bool a = input_nodes.count(n) > 0, w = is_leaf_node(n) && !a;
    for (const auto& e : n->next_edges()) {
      if (!e.function) continue;
      a = a || in_a[e.function.get()];
      w = w || reaches_weight[e.function.get()];
    }
    in_a[n] = a;
    reaches_weight[n] = w;
  }
  /// Visits every node reachable from `from` through nodes that reach a
  /// weight, until `visit` returns true (then returns true).
  auto walk = [&](const std::vector<Node*>& from, const std::function<bool(Node*)>& visit) {
    std::unordered_set<Node*> visited;
    std::vector<Node*> todo(from);
    while (!todo.empty()) {
      Node* n = todo.back();
      todo.pop_back();
      if (!visited.insert(n).second) continue;
      if (visit(n)) return true;
      for (const auto& e : n->next_edges()) {
        if (e.function && reaches_weight[e.function.get()]) todo.push_back(e.function.get());
      }
    }
    return false;
  };
  /// The weight leaves reachable from `from` (all outside A), as output edges.
  auto weights_below = [&](const std::vector<Node*>& from) {
    torch::autograd::edge_list out;
    walk(from, [&](Node* n) {
      if (is_leaf_node(n)) out.emplace_back(n->shared_from_this(), 0);
      return false;
    });
    return out;
  };
  /// Whether any node reachable from `from` is one of `targets`.
  auto reaches_any = [&](const std::vector<Node*>& from, const std::set<const Node*>& targets) {
    return walk(from, [&](Node* n) { return targets.count(n) > 0; });
  };

  // Every node below a part, so that no node is below two (the note above).
  std::unordered_set<const Node*> below_parts;
  auto claim = [&](const std::vector<Node*>& from) {
    return !walk(from, [&](Node* n) { return !below_parts.insert(n).second; });
  };
  // Roots outside A run from the roots, in one run; roots that are leaves accumulate.
  Plan::Part outside;
  std::vector<Node*> outside_nodes;
  for (size_t k = 0; k < p.roots.size(); ++k) {
    const at::Tensor& r = p.roots[k];
    const Edge edge = torch::autograd::impl::gradient_edge(r);
    if (!edge.function || in_a[edge.function.get()] || input_nodes.count(edge.function.get())) {
      continue;
    }
    if (!reaches_weight[edge.function.get()]) continue;
    outside.roots.push_back(edge);
    outside.grads.push_back(p.grads[k].defined() ? p.grads[k] : at::ones_like(r));
    outside_nodes.push_back(edge.function.get());
  }
  if (!outside.roots.empty()) {
    outside.outputs = weights_below(outside_nodes);
    claim(outside_nodes);  // the first part: claims cannot clash yet
    p.parts.push_back(std::move(outside));
  }
  // A nodes with edges out of A that lead to weights.
  std::vector<std::pair<Node*, Plan::Part>> hooked;
  for (Node* n : order) {
    if (!in_a[n] || is_leaf_node(n)) continue;
    std::vector<Node*> out_of_a, within_a;
    for (const auto& e : n->next_edges()) {
      if (!e.function) continue;
      Node* c = e.function.get();
      if (in_a[c]) {
        within_a.push_back(c);
      } else if (reaches_weight[c]) {
        out_of_a.push_back(c);
      }
    }
    if (out_of_a.empty()) continue;
    Plan::Part part;
    part.outputs = weights_below(out_of_a);
    std::set<const Node*> targets;
    for (const auto& o : part.outputs) targets.insert(o.function.get());
    if (reaches_any(within_a, targets)) return;  // does not split: fall back
    if (!claim(out_of_a)) return;                 // a node below two parts: fall back
    for (uint32_t k = 0; k < n->num_inputs(); ++k) part.roots.emplace_back(n->shared_from_this(), k);
    part.captured = std::make_shared<std::vector<at::Tensor>>();
    hooked.emplace_back(n, std::move(part));
  }
  for (auto& h : hooked) {
    h.first->add_pre_hook(std::make_unique<Capture>(h.second.captured));
    p.parts.push_back(std::move(h.second));
  }
  p.split = true;
}

MPIPE_FUNC bool WeightPass::reuses_input_pass() const { return plan_ && plan_->split; }

MPIPE_FUNC void WeightPass::run() {
  if (!plan_ || plan_->done) return;
  Plan& p = *plan_;
  p.done = true;
  if (p.split) {
    auto& engine = torch::autograd::Engine::get_default_engine();
    for (auto& part : p.parts) {
      std::vector<at::Tensor> grads = part.captured ? *part.captured : part.grads;
      bool any = false;
      for (const auto& g : grads) any = any || g.defined();
      if (!any || part.outputs.empty() || grads.size() != part.roots.size()) continue;
      engine.execute(part.roots, grads, /*keep_graph=*/true, /*create_graph=*/false,
                     /*accumulate_grad=*/true, part.outputs);
    }
  } else if (!p.roots.empty()) {
    // Every leaf backward would reach, but the inputs.
    std::set<const c10::TensorImpl*> skip;
    for (const auto& x : p.inputs) skip.insert(x.unsafeGetTensorImpl());
    std::vector<at::Tensor> leaves;
    std::unordered_set<Node*> visited;
    std::vector<Node*> todo;
    for (const auto& r : p.roots) {
      if (r.grad_fn()) {
        todo.push_back(r.grad_fn().get());
      } else if (r.requires_grad() && skip.insert(r.unsafeGetTensorImpl()).second) {
        leaves.push_back(r);
      }
    }
    while (!todo.empty()) {
      Node* n = todo.back();
      todo.pop_back();
      if (!visited.insert(n).second) continue;
      if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(n)) {
        const at::Tensor& v = acc->variable;
        if (v.defined() && skip.insert(v.unsafeGetTensorImpl()).second) leaves.push_back(v);
        continue;
      }
      for (const auto& e : n->next_edges()) {
        if (e.function) todo.push_back(e.function.get());
      }
    }
    if (!leaves.empty()) {
      torch::autograd::backward(p.roots, p.grads, /*retain_graph=*/false, /*create_graph=*/false,
                                leaves);
    }
  }
  plan_.reset();  // the graph, the captured gradients
}

}  // namespace detail
}  // namespace mpipe
