#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/rng.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

namespace mpipe {
namespace detail {

// Note [Random draws]
// ~~~~~~~~~~~~~~~~~~~
// A stage's Dropout, PoissonEncoder or own noise draws from its device's one
// default generator. With a worker thread per stage, the stages that share a
// device (every CPU stage shares the CPU's) would draw in whatever order the
// threads happen to run, so the same seed would give other masks on every
// call. Enforcing an order between threads would make stages wait for each
// other; instead each (stage, item) forward draws from its own generators:
//
//  - When a call starts, on the caller's thread, it draws one 64-bit number
//    from the CPU's default generator and mixes in the state of every stage
//    device's default generator (read, not advanced): the call's seed. So the
//    default generators end the call in a state that depends only on the seed
//    and the call, and a next call draws other masks unless it is reseeded.
//  - Stage j's forward of item i (a micro-batch or a time step) runs in an
//    RngScope: its random ops draw from private generators, one per device
//    they draw on, seeded with mix(call seed, j, i, device): a CPU generator, or
//    a clone of the device's default generator (Philox on CUDA) reseeded.
//    Nothing is shared between threads, so no stage waits for another, and
//    threaded and inline runs draw the same numbers. A checkpointed stage's
//    recompute runs in the scope of the same (j, i), so it draws the same mask
//    without saving or restoring any generator.
//
// The routing goes through the dispatcher. Every ATen operator that draws
// (one with a `Generator? generator` argument) gets a kernel here at the
// BackendSelect key, which every call passes and which otherwise falls
// through for these operators. Outside a scope (other threads, the backward
// pass) the kernel passes the call on unchanged; inside one it fills a
// missing generator with the scope's. Composite operators (dropout,
// rand_like) and factories (randn, rand: they have a BackendSelect kernel of
// their own) draw through an in-place operator that is caught; randperm
// without a generator is the one factory that draws directly, so it is not
// reproducible across threads. The few operators that draw without a
// generator argument (the fused CUDA dropout, attention with dropout) cannot
// be handed one: their kernel moves the scope's state into the device's
// default generator, runs the operator and moves it back, under one lock, so
// only those launches wait for each other.
//
// Consequences: masks differ from those of a plain whole-batch loop (each
// micro-batch and time step has its own stream), and from those of a call
// captured as a CUDA graph: a graphed call runs its stages inline in a fixed
// order and draws from the default generator (PlainDraws), which is what a
// replay must do to match its capture (Philox offsets advance per replay, so
// each replay still draws new masks). Operators registered after the first
// pipeline call, or outside ATen, draw from the default generator.


MPIPE_INLINE_VAR thread_local RngScope* t_rng_scope = nullptr;
MPIPE_INLINE_VAR thread_local bool t_plain = false;
// Inside a swap: draws go to the default generator.
MPIPE_INLINE_VAR thread_local bool t_swapped = false;

MPIPE_FUNC uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

MPIPE_FUNC uint64_t mix_bytes(uint64_t h, const at::Tensor& bytes) {
  const auto* p = static_cast<const unsigned char*>(bytes.data_ptr());
  const size_t n = static_cast<size_t>(bytes.numel() * bytes.element_size());
  for (size_t k = 0; k < n; k += 8) {
    uint64_t word = 0;
    std::memcpy(&word, p + k, std::min<size_t>(8, n - k));
    h = mix(h ^ word);
  }
  return h;
}

MPIPE_FUNC bool draws_without_generator(const c10::OperatorName& name) {
  static const char* const ops[] = {
      "aten::native_dropout",
      "aten::_scaled_dot_product_flash_attention",
      "aten::_scaled_dot_product_efficient_attention",
      "aten::_scaled_dot_product_cudnn_attention",
      "aten::_flash_attention_forward",
      "aten::_efficient_attention_forward",
  };
  for (const char* op : ops) {
    if (name.name == op) return true;
  }
  return false;
}

MPIPE_FUNC bool is_generator_argument(const c10::Argument& arg) {
  const auto optional = arg.type()->cast<c10::OptionalType>();
  return optional && optional->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

/// The device an operator draws on: its first tensor's, its device argument,
/// or the backend the dispatcher chose.
MPIPE_FUNC c10::optional<c10::Device> device_of(c10::DispatchKeySet ks,
                                                const torch::jit::Stack& stack, size_t first,
                                                size_t n) {
  for (size_t k = first; k < first + n; ++k) {
    const c10::IValue& v = stack[k];
    if (v.isTensor() && v.toTensor().defined()) return v.toTensor().device();
  }
  for (size_t k = first; k < first + n; ++k) {
    if (stack[k].isDevice()) return stack[k].toDevice();
  }
  const c10::BackendComponent backend = ks.highestBackendKey();
  if (backend == c10::BackendComponent::CPUBit) return c10::Device(c10::kCPU);
  if (backend == c10::BackendComponent::CUDABit) return c10::Device(c10::kCUDA);
  return c10::nullopt;
}

/// Drawing operators run in a stage's forward so far, in any pipeline: a call
/// that draws is never captured automatically (Note [Automatic CUDA graphs]).
MPIPE_FUNC std::atomic<uint64_t>& draw_counter() {
  static std::atomic<uint64_t> n{0};
  return n;
}

MPIPE_FUNC uint64_t draws_seen() { return draw_counter().load(std::memory_order_relaxed); }

MPIPE_FUNC std::mutex& swap_mutex() {
  static std::mutex m;
  return m;
}

MPIPE_FUNC void draw_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                            torch::jit::Stack* stack) {
  const c10::DispatchKeySet below =
      ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);
  RngScope* scope = t_rng_scope;
  if (scope == nullptr || t_swapped) return op.redispatchBoxed(below, stack);
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  for (size_t k = 0; k < args.size(); ++k) {
    if (!is_generator_argument(args[k])) continue;
    draw_counter().fetch_add(1, std::memory_order_relaxed);
    c10::IValue& generator = (*stack)[first + k];
    if (generator.isNone()) {
      if (const auto device = device_of(ks, *stack, first, args.size())) {
        generator = c10::IValue(scope->generator(*device));
      }
    }
    return op.redispatchBoxed(below, stack);
  }
  // Draws from the device's default generator itself (Note [Random draws]).
  const auto device = device_of(ks, *stack, first, args.size());
  bool draws = device.has_value() && !device->is_cpu();  // CPU kernels draw through ops above
  for (size_t k = 0; k < args.size() && draws; ++k) {
    const c10::IValue& v = (*stack)[first + k];
    if (args[k].name() == "dropout_p" && v.isDouble() && v.toDouble() == 0.0) draws = false;
    if (args[k].name() == "train" && v.isBool() && !v.toBool()) draws = false;
  }
  if (!draws) return op.redispatchBoxed(below, stack);
  draw_counter().fetch_add(1, std::memory_order_relaxed);
  at::Generator own = scope->generator(*device);
  at::Generator shared = at::globalContext().defaultGenerator(*device);
  std::lock_guard<std::mutex> swap_lock(swap_mutex());
  at::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(shared.mutex());
    saved = shared.get_state();
    shared.set_state(own.get_state());
  }
  struct SwapBack {
    at::Generator& own;
    at::Generator& shared;
    const at::Tensor& saved;
    ~SwapBack() {
      t_swapped = false;
      std::lock_guard<std::mutex> lock(shared.mutex());
      own.set_state(shared.get_state());
      shared.set_state(saved);
    }
  } swap_back{own, shared, saved};
  t_swapped = true;
  op.redispatchBoxed(below, stack);
}

/// Registers draw_kernel for every drawing ATen operator, once per process.
MPIPE_FUNC void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& dispatcher = c10::Dispatcher::singleton();
    // The registrations live as long as the process: never destroyed (the
    // dispatcher may be gone at exit), and held by a static, so LeakSanitizer
    // sees them reachable.
    static auto* handles = new std::vector<c10::RegistrationHandleRAII>();
    const auto kernel = c10::KernelFunction::makeFromBoxedFunction<&draw_kernel>();
    for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) continue;
      const auto op = dispatcher.findOp(name);
      if (!op || !op->hasSchema()) continue;
      // Composite operators draw through the operators they call; factory
      // operators (which have a BackendSelect kernel of their own) too, apart
      // from randperm (Note [Random draws]).
      if (op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::BackendSelect)) {
        continue;
      }
      const auto& args = op->schema().arguments();
      if (draws_without_generator(name) ||
          std::any_of(args.begin(), args.end(), is_generator_argument)) {
        handles->push_back(dispatcher.registerImpl(name, c10::DispatchKey::BackendSelect, kernel,
                                                   c10::nullopt, nullptr,
                                                   "mpipe: Note [Random draws]"));
      }
    }
  });
}


MPIPE_FUNC CallRng CallRng::begin(const std::vector<c10::Device>& devices) {
  CallRng rng;
  if (t_plain) return rng;
  install();
  {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    rng.seed = mix(at::check_generator<at::CPUGeneratorImpl>(cpu)->random64());
  }
  std::vector<c10::Device> seen;
  for (const c10::Device& d : devices) {
    if (d.is_cpu() || std::find(seen.begin(), seen.end(), d) != seen.end()) continue;
    seen.push_back(d);
    at::Generator gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng.seed = mix_bytes(rng.seed, gen.get_state());
  }
  rng.active = true;
  return rng;
}

MPIPE_FUNC PlainDraws::PlainDraws() : previous_(t_plain) { t_plain = true; }
MPIPE_FUNC PlainDraws::~PlainDraws() { t_plain = previous_; }

MPIPE_FUNC RngScope::RngScope(const CallRng& rng, int64_t stage, int64_t item) {
  if (!rng.active) return;
  seed_ = mix(mix(rng.seed ^ static_cast<uint64_t>(stage)) ^ static_cast<uint64_t>(item));
  previous_ = t_rng_scope;
  t_rng_scope = this;
  active_ = true;
}

MPIPE_FUNC RngScope::~RngScope() {
  if (active_) t_rng_scope = previous_;
}

MPIPE_FUNC at::Generator RngScope::generator(c10::Device device) {
  if (!device.is_cpu() && !device.has_index()) {
    device = c10::Device(device.type(),
                         c10::impl::getDeviceGuardImpl(device.type())->getDevice().index());
  }
  for (auto& g : generators_) {
    if (g.first == device) return g.second;
  }
  const uint64_t seed = mix(seed_ ^ (static_cast<uint64_t>(device.type()) << 8 |
                                     static_cast<uint8_t>(device.index() + 1)));
  at::Generator gen;
  if (device.is_cpu()) {
    gen = at::detail::createCPUGenerator(seed);
  } else {
    at::Generator shared = at::globalContext().defaultGenerator(device);
    {
      std::lock_guard<std::mutex> lock(shared.mutex());
      gen = shared.clone();
    }
    gen.set_current_seed(seed);
  }
  generators_.emplace_back(device, gen);
  return gen;
}

}  // namespace detail
}  // namespace mpipe
