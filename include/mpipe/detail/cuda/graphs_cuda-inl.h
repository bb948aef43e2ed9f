#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/cuda/graphs.h"

#include <ATen/Functions.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <mutex>
#include <set>

namespace mpipe {
namespace detail {

// Note [CUDA graphs]
// ~~~~~~~~~~~~~~~~~~
// With ModelPipelineOptions::cuda_graphs, a no-grad forward, constant_forward
// or sequence_forward whose stages and input all sit on one CUDA device is
// captured once per (method, arguments, input shape and dtype) and replayed
// afterwards, which removes the host's per-op cost. The capture runs the call
// from the caller's thread (no worker threads) on a side stream; the runtime's
// fork and join (Note [One runtime]) bring every stage stream into the
// capture and back, so the graph keeps the stages' concurrency. A replay reads
// a static input (the call's input is copied in) and the caller gets a copy
// of the static output. Stateful modules start every graphed call from their
// reset state (a call is graphed only when no module holds state) and are
// reset after it: state does not carry from one graphed call to the next.
// Calls with gradients, several devices, or held state run eagerly, as does
// any call once 16 shapes have been captured. Before each replay the
// parameters' and buffers' storage is compared with the capture's: a graph
// whose tensors moved (to(), set_data) is captured again (holds_graph).
// Without the option, repeated inference calls are graphed where that is safe
// (Note [Automatic CUDA graphs], graph_policy-inl.h).
//
// Like torch.cuda.graphs, a replay repeats the captured device work only:
// host-side decisions taken during the capture (a module's branches on its
// own counters, say) are fixed in the graph. A capture that fails (a module
// that synchronises, such as .item()) is abandoned: the error reaches the
// caller, and later calls of that key run eagerly.
//
// Note [Graphed training steps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// train_step and constant_train_step capture forward *and* backward: the
// autograd engine issues each backward op on its forward op's stream, so the
// captured stage streams carry the backward too. Parameter gradients need a
// fixed address: at capture every parameter that requires grad gets a static
// .grad (its current one, or zeros), and the graph accumulates into it in
// place, as autograd does into a defined .grad. Before each replay a
// parameter's .grad is checked: the static tensor itself -> accumulate; none
// (zero_grad() set it to None) -> the static one is zeroed and put back, which
// equals eager's "first gradient becomes .grad"; another tensor -> its values
// are copied into the static one, which becomes .grad again. A static .grad
// that is no longer the parameter's but that the caller still holds (kept
// from an earlier step) would be zeroed or overwritten: the graph is dropped
// and the key runs eagerly from then on. A parameter whose
// storage was replaced since the capture (data_ptr changed), or whose
// requires_grad flipped, drops the graph, and the step is captured again;
// parameters the warm-up step gave no gradient get no static .grad. The first
// sight of a key runs the step eagerly on the caller's thread, as the capture
// will (the warm-up: that thread's cuBLAS handle and workspaces, the
// allocator), the second captures and replays. A step is captured only when
// no parameter's AccumulateGrad node is alive from an earlier autograd graph
// (that node keeps the stream it was made on, possibly the default stream,
// which a capture cannot wait on); until then steps run eagerly. The loss
// function is captured with the rest: the key knows its shapes, not what it
// computes. The step's activations live in the graph's private memory pool
// between replays: a graphed step keeps its peak memory reserved.

constexpr size_t kMaxGraphs = 16;

class GraphCache {
 public:
  struct Entry {
    std::unique_ptr<at::cuda::CUDAGraph> graph;
    at::Tensor input, output;
    std::vector<const void*> watched_ptrs;  // parameters' and buffers' storage at capture
  };
  struct StepEntry {
    std::unique_ptr<at::cuda::CUDAGraph> graph;
    std::vector<at::Tensor> inputs;
    at::Tensor loss;
    std::vector<at::Tensor> params, grads;
    std::vector<const void*> param_ptrs;
    std::vector<bool> param_requires_grad;
  };
  std::map<std::string, Entry> entries;
  std::map<std::string, StepEntry> steps;
  /// Keys whose warm-up step ran, with which parameters it gave a gradient.
  std::map<std::string, std::vector<bool>> warmed;
  std::set<std::string> failed;
  size_t size() const { return entries.size() + steps.size(); }
};

MPIPE_FUNC std::shared_ptr<GraphCache> make_graph_cache() { return std::make_shared<GraphCache>(); }

MPIPE_FUNC size_t graphs_held(const GraphCache& cache) { return cache.size(); }


// Note [A failed capture]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A capture that a stage invalidates (a synchronising call such as .item())
// makes CUDAGraph::capture_end throw before it ends two things capture_begin
// started: the allocator keeps routing to the graph's private pool (through a
// filter that refers to the graph, and while any such filter is listed the
// allocator holds back blocks freed with pending stream uses), and the
// default CUDA generator's state stays in capture mode, so every later random
// op outside a capture fails ("Offset increment outside graph capture"), in
// eager calls and in the replays of graphs captured before. undo_capture ends
// both, so the process stays usable: the capture uses a pool of its own
// (graph_pool_handle), whose routing it ends and which it releases (unless
// capture_end got that far), and it mends the generator's state itself, not a
// copy: a second capture, of one kernel, that succeeds runs the state's
// capture epilogue.
using PoolId = decltype(at::cuda::graph_pool_handle());

MPIPE_FUNC void undo_capture(c10::DeviceIndex device, PoolId pool) noexcept {
  bool routed = true;
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
  } catch (...) {  // capture_end had ended it; the graph releases its pool
    routed = false;
  }
  try {
    if (routed) c10::cuda::CUDACachingAllocator::releasePool(device, pool);
    at::Tensor one = at::zeros({1}, at::TensorOptions().device(c10::Device(c10::kCUDA, device)));
    at::cuda::CUDAGraph mend;
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool(false, device));
    mend.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    one.add_(1);
    mend.capture_end();
  } catch (...) {  // the caller reports the capture's own error
  }
}

/// Captures `body` into `graph` on a side stream forked from (and joined back
/// into) the caller's stream. A failed capture is ended before the error
/// propagates, so the stream and the allocator leave capture mode.
MPIPE_FUNC void capture(at::cuda::CUDAGraph& graph, const std::function<void()>& before,
                        const std::function<void()>& body) {
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream();
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  at::cuda::CUDAEvent ready;
  ready.record(caller);
  ready.block(side);
  {
    c10::cuda::CUDAStreamGuard stream_guard(side);
    // Casts made in the capture are cached for the capture's micro-batches and
    // dropped when it ends (Note [Autocast in the pipeline]).
    struct DropCasts {
      ~DropCasts() {
        if (AutocastState::current().any()) clear_autocast_cache();
      }
    } drop_casts;
    before();
    // Casts cached by the warm-up live outside the graph: the capture must
    // make its own, or its replays would read the warm-up's.
    if (AutocastState::current().any()) clear_autocast_cache();
    // Thread-local mode: only this thread is barred from unsafe CUDA calls
    // while capturing; the autograd engine's thread and others run freely.
    const c10::DeviceIndex device = caller.device_index();
    const PoolId pool = at::cuda::graph_pool_handle();  // Note [A failed capture]
    graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
    try {
      body();
      graph.capture_end();
    } catch (...) {
      try {
        graph.capture_end();
      } catch (...) {  // an invalidated capture: the first error is the one to report
      }
      undo_capture(device, pool);
      throw;
    }
  }
  at::cuda::CUDAEvent captured;
  captured.record(side);
  captured.block(caller);
}


MPIPE_FUNC std::vector<const void*> storage_of(const std::vector<at::Tensor>& tensors) {
  std::vector<const void*> ptrs;
  ptrs.reserve(tensors.size());
  for (const auto& t : tensors) ptrs.push_back(t.defined() ? t.data_ptr() : nullptr);
  return ptrs;
}

MPIPE_FUNC Held holds_graph(GraphCache& cache, const std::string& key,
                            const std::vector<at::Tensor>& watched) {
  auto it = cache.entries.find(key);
  if (it == cache.entries.end()) return Held::None;
  if (storage_of(watched) == it->second.watched_ptrs) return Held::Held;
  cache.entries.erase(it);  // replaced parameters (to(), set_data, load into new tensors)
  return Held::Moved;
}

MPIPE_FUNC at::Tensor run_graphed(GraphCache& cache, const std::string& key, const at::Tensor& x,
                                  const std::vector<at::Tensor>& watched,
                                  const std::function<at::Tensor(const at::Tensor&)>& eager,
                                  const std::function<void()>& reset) {
  c10::cuda::CUDAGuard device_guard(x.device());
  holds_graph(cache, key, watched);
  auto it = cache.entries.find(key);
  if (it == cache.entries.end()) {
    if (cache.size() >= kMaxGraphs || cache.failed.count(key)) return at::Tensor();
    GraphCache::Entry entry;
    entry.watched_ptrs = storage_of(watched);
    entry.input = x.clone();
    entry.graph = std::make_unique<at::cuda::CUDAGraph>();
    try {
      capture(
          *entry.graph,
          [&] {
            // Warm-up: library handles, workspaces, the allocator. Its random
            // draws are undone, so this call's replay draws what later calls
            // draw from the same generator state (Note [Random draws]).
            at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator(x.device().index());
            at::Tensor rng_state;
            {
              std::lock_guard<std::mutex> lock(gen.mutex());
              rng_state = gen.get_state();
            }
            eager(entry.input);
            {
              std::lock_guard<std::mutex> lock(gen.mutex());
              gen.set_state(rng_state);
            }
            reset();
          },
          [&] { entry.output = eager(entry.input); });
    } catch (...) {
      cache.failed.insert(key);
      throw;
    }
    it = cache.entries.emplace(key, std::move(entry)).first;
  }
  GraphCache::Entry& entry = it->second;
  entry.input.copy_(x);
  entry.graph->replay();
  return entry.output.clone();
}

MPIPE_FUNC Held holds_step(GraphCache& cache, const std::string& key,
                           const std::vector<at::Tensor>& params) {
  auto it = cache.steps.find(key);
  if (it == cache.steps.end()) return Held::None;
  const auto& e = it->second;
  bool moved = e.param_ptrs.size() != params.size();
  for (size_t k = 0; !moved && k < params.size(); ++k) {
    moved = params[k].data_ptr() != e.param_ptrs[k] ||
            params[k].requires_grad() != e.param_requires_grad[k];
  }
  if (!moved) return Held::Held;
  cache.steps.erase(it);  // new storage, or a parameter frozen or unfrozen: capture again
  return Held::Moved;
}

MPIPE_FUNC bool room_for_capture(c10::Device device) {
  const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const int64_t reserved =
      stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  const size_t total = at::cuda::getDeviceProperties(index)->totalGlobalMem;
  return 2 * static_cast<uint64_t>(reserved) <= total;
}

MPIPE_FUNC at::Tensor run_graphed_step(
    GraphCache& cache, const std::string& key, const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& params,
    const std::function<at::Tensor(const std::vector<at::Tensor>&)>& step,
    const std::function<void()>& reset, bool failure_throws) {
  TORCH_INTERNAL_ASSERT(!inputs.empty() && inputs[0].is_cuda());
  c10::cuda::CUDAGuard device_guard(inputs[0].device());
  holds_step(cache, key, params);
  auto it = cache.steps.find(key);
  if (it == cache.steps.end()) {
    if (cache.failed.count(key) || cache.size() >= kMaxGraphs) return at::Tensor();
    auto warm = cache.warmed.find(key);
    if (warm == cache.warmed.end()) {
      // First sight: the real step, run eagerly on this thread as the capture
      // will be, so that this thread's library handles (cuBLAS) and
      // workspaces exist before the capture, which must not create them.
      at::Tensor loss = step(inputs);
      std::vector<bool> got;
      for (const auto& p : params) got.push_back(p.requires_grad() && p.grad().defined());
      cache.warmed[key] = std::move(got);
      return loss;
    }
    const std::vector<bool>& got = warm->second;
    // Casts that autocast cached for eager calls hold their weights' AccumulateGrad
    // nodes alive (below): drop them; later casts are made again (Note [Autocast
    // in the pipeline]).
    if (AutocastState::current().any()) clear_autocast_cache();
    for (const auto& p : params) {
      // A live AccumulateGrad node (an autograd graph of an earlier call still
      // referenced, e.g. by a neuron's state) keeps the stream it was made on,
      // maybe the default stream, which a capture cannot wait on: run this
      // step eagerly and capture a later one.
      if (p.requires_grad() && torch::autograd::impl::try_get_grad_accumulator(p)) {
        return at::Tensor();
      }
    }
    GraphCache::StepEntry entry;
    for (const auto& t : inputs) entry.inputs.push_back(t.defined() ? t.clone() : t);
    std::vector<at::Tensor> created;  // .grad tensors made here, undone if the capture fails
    for (size_t k = 0; k < params.size(); ++k) {
      const at::Tensor& p = params[k];
      entry.param_ptrs.push_back(p.data_ptr());
      entry.param_requires_grad.push_back(p.requires_grad());
      // Parameters the warm-up gave no gradient (unused by the step) keep
      // theirs untouched, as eager steps do.
      if (!p.requires_grad() || (k < got.size() && !got[k])) continue;
      at::Tensor g = p.grad();
      if (!g.defined()) {
        g = at::zeros_like(p);
        p.mutable_grad() = g;
        created.push_back(p);
      }
      entry.params.push_back(p);
      entry.grads.push_back(g);
    }
    // Capturing records the step's work without running it; the replay below
    // runs it.
    entry.graph = std::make_unique<at::cuda::CUDAGraph>();
    try {
      capture(*entry.graph, reset, [&] { entry.loss = step(entry.inputs); });
    } catch (...) {
      cache.failed.insert(key);
      for (auto& p : created) p.mutable_grad() = at::Tensor();
      if (failure_throws) throw;
      reset();  // what the capture left in stateful modules: the caller runs the step eagerly
      return at::Tensor();
    }
    it = cache.steps.emplace(key, std::move(entry)).first;
  }
  GraphCache::StepEntry& entry = it->second;
  for (size_t k = 0; k < entry.params.size(); ++k) {
    // A static .grad that is no longer the parameter's but is still held
    // (the caller kept an earlier step's gradient, then zero_grad set it to
    // None): the replay would zero and overwrite the caller's tensor. Drop
    // the graph; this key runs eagerly from now on (clear_cuda_graphs()
    // forgets that).
    if (!entry.params[k].grad().is_same(entry.grads[k]) && entry.grads[k].use_count() > 1) {
      cache.steps.erase(it);
      cache.failed.insert(key);
      return at::Tensor();
    }
  }
  std::vector<at::Tensor> to_zero;
  for (size_t k = 0; k < entry.params.size(); ++k) {
    const at::Tensor current = entry.params[k].grad();
    if (current.is_same(entry.grads[k])) continue;
    if (current.defined()) {
      entry.grads[k].copy_(current);
    } else {
      to_zero.push_back(entry.grads[k]);
    }
    entry.params[k].mutable_grad() = entry.grads[k];
  }
  if (!to_zero.empty()) at::_foreach_zero_(to_zero);
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (inputs[k].defined()) entry.inputs[k].copy_(inputs[k]);
  }
  entry.graph->replay();
  return entry.loss.clone();
}

}  // namespace detail
}  // namespace mpipe
