#pragma once

#include "mpipe/detail/config.h"

// c10d's side of a process group (with c10d only, MPIPE_WITH_C10D): the
// rendezvous, the process groups (Comm, comm.h), the exchanges and
// collectives on them. A call's messages travel on GlooLink (gloo_link-inl.h;
// Note [Cross-process calls] in remote-inl.h says what travels when).

#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/distributed/comm.h"
#include "mpipe/detail/distributed/group.h"
#include "mpipe/detail/distributed/link.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/cuda.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <utility>

namespace mpipe {
namespace detail {

using distributed::Backend;
using distributed::ProcessGroup;
using Impl = GroupImpl;

MPIPE_FUNC bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

MPIPE_FUNC c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& prefix, int rank, int size,
    const std::string& master_addr, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (is_loopback(master_addr)) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, size, options);
}

MPIPE_FUNC Backend resolve_backend(Backend asked) {
  if (asked == Backend::Auto) {
    if (const char* env = std::getenv("MPIPE_BACKEND")) {
      const std::string v = env;
      if (v == "gloo" || v == "Gloo") {
        asked = Backend::Gloo;
      } else if (v == "nccl" || v == "NCCL") {
        asked = Backend::NCCL;
      } else {
        TORCH_CHECK(false, "mpipe::distributed: MPIPE_BACKEND must be gloo or nccl, got '", v,
                    "'");
      }
    }
  }
#ifdef USE_C10D_NCCL
  const bool nccl = true;
#else
  const bool nccl = false;
#endif
  if (asked == Backend::Auto) return nccl && torch::cuda::is_available() ? Backend::NCCL : Backend::Gloo;
  TORCH_CHECK(asked != Backend::NCCL || nccl, "mpipe::distributed: the NCCL backend was asked "
              "for, but this LibTorch has no NCCL (a CPU build?); use Backend::Gloo");
  return asked;
}

MPIPE_FUNC std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : (fallback ? std::string(fallback) : std::string());
}

MPIPE_FUNC int64_t env_int(const char* name) {
  const std::string v = env_or(name, nullptr);
  TORCH_CHECK(!v.empty(), "mpipe::distributed::init_from_env: ", name, " is not set; start the "
              "program with mpipe-launch -n N -- ./app or torchrun --no-python "
              "--nproc-per-node N ./app (or call mpipe::distributed::init)");
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    TORCH_CHECK(used == v.size(), "");
    return x;
  } catch (...) {
    TORCH_CHECK(false, "mpipe::distributed::init_from_env: ", name, " must be an integer, got '",
                v, "'");
  }
}


/// Sends `mine` to every other rank of the world and receives theirs, rank
/// r's holding `sizes[r]` longs (none sent or received where that is 0), each
/// wait bounded by the group's timeout. Returns them by world rank.
MPIPE_FUNC std::vector<at::Tensor> exchange_longs(Impl& g, int tag, const at::Tensor& mine,
                                                  const std::vector<int64_t>& sizes) {
  std::vector<at::Tensor> got(static_cast<size_t>(g.world));
  got[static_cast<size_t>(g.rank)] = mine;
  std::vector<c10::intrusive_ptr<c10d::Work>> sends, receives(static_cast<size_t>(g.world));
  for (int64_t r = 0; r < g.world; ++r) {
    if (r == g.rank) continue;
    if (mine.numel() > 0) {
      std::vector<at::Tensor> out{mine};
      sends.push_back(g.comm->world->send(out, static_cast<int>(r), tag));
    }
    got[static_cast<size_t>(r)] = at::empty({sizes[static_cast<size_t>(r)]}, at::kLong);
    if (sizes[static_cast<size_t>(r)] == 0) continue;
    std::vector<at::Tensor> in{got[static_cast<size_t>(r)]};
    receives[static_cast<size_t>(r)] = g.comm->world->recv(in, static_cast<int>(r), tag);
  }
  const auto deadline = std::chrono::steady_clock::now() + g.timeout;
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  std::string missing, why_first;
  for (int64_t r = 0; r < g.world; ++r) {
    if (r == g.rank || !receives[static_cast<size_t>(r)]) continue;
    try {
      receives[static_cast<size_t>(r)]->wait(left());
    } catch (...) {
      missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      if (why_first.empty()) why_first = message_of(std::current_exception());
    }
  }
  if (missing.empty()) {
    for (auto& w : sends) {
      try {
        w->wait(left());
      } catch (...) {
        if (why_first.empty()) why_first = message_of(std::current_exception());
      }
    }
  }
  if (!missing.empty() || !why_first.empty()) {
    std::lock_guard<std::mutex> keep(g.comm->abandoned_mutex);  // Gloo may still use them
    for (auto& w : receives) {
      if (w) g.comm->abandoned.push_back(w);
    }
    for (auto& w : sends) g.comm->abandoned.push_back(w);
  }
  if (!missing.empty()) {
    const std::string why =
        c10::str("rank", missing.find(',') == std::string::npos ? " " : "s ", missing,
                 " did not reach the pipeline's first call within ", g.timeout.count() / 1000.0,
                 " s (stalled or gone?)");
    g.break_group(why);
    TORCH_CHECK(false, why);
  }
  if (!why_first.empty()) {
    const std::string why = c10::str("the ranks could not exchange their stages: ", why_first);
    g.break_group(why);
    TORCH_CHECK(false, why);
  }
  return got;
}

MPIPE_FUNC std::vector<std::vector<int64_t>> exchange_stages(const distributed::ProcessGroup& group,
                                                             int64_t pipeline_id,
                                                             const std::vector<int64_t>& mine) {
  // Every rank sends its stage count, then its stages' numbers, to every
  // other rank of the world and waits for theirs, each with the group's
  // timeout: unlike one collective, that names the ranks that never came
  // (stalled before the pipeline's first call). Every rank connects its
  // pipelines in the same order; the tags are the pipeline's, offset past the
  // calls' tags. (The store would do too, but its locks are taken inside
  // LibTorch, where ThreadSanitizer cannot see them.)
  Impl& g = *group_impl(group);
  const std::string broken = g.broken_reason();
  TORCH_CHECK(broken.empty(), "the process group failed in an earlier call (", broken, "); "
              "restart every rank");
  const int tag = static_cast<int>((int64_t{1} << 24) + pipeline_id);
  const auto n = static_cast<int64_t>(mine.size());
  const auto counts = exchange_longs(g, tag, at::full({1}, n, at::kLong),
                                     std::vector<int64_t>(static_cast<size_t>(g.world), 1));
  std::vector<int64_t> sizes;
  for (const auto& c : counts) sizes.push_back(c.item<int64_t>());
  const at::Tensor numbers = at::tensor(c10::ArrayRef<int64_t>(mine), at::kLong);
  const auto lists = exchange_longs(g, tag + (1 << 23), numbers, sizes);
  std::vector<std::vector<int64_t>> out;
  for (int64_t p = 0; p < g.pipeline_size(); ++p) {
    const at::Tensor t = lists[static_cast<size_t>(g.world_rank(p))].contiguous();
    out.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  }
  return out;
}

MPIPE_FUNC int64_t next_pipeline_id(const distributed::ProcessGroup& group) {
  return group_impl(group)->next_pipeline++;
}

MPIPE_FUNC void barrier(const distributed::ProcessGroup& group) {
  group_impl(group)->comm->world->barrier()->wait();
}

MPIPE_FUNC bool any_rank(const distributed::ProcessGroup& group, bool flag) {
  std::vector<at::Tensor> one{at::full({1}, flag ? 1 : 0, at::kLong)};
  group_impl(group)->comm->world->allreduce(one)->wait();
  return one[0].item<int64_t>() > 0;
}

MPIPE_FUNC double reduce_ranks(const distributed::ProcessGroup& group, double value, bool max) {
  std::vector<at::Tensor> one{at::full({1}, value, at::kDouble)};
  c10d::AllreduceOptions options;
  options.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  group_impl(group)->comm->world->allreduce(one, options)->wait();
  return one[0].item<double>();
}

MPIPE_FUNC void allreduce_replicas(const distributed::ProcessGroup& group,
                                   std::vector<at::Tensor> tensors, bool average) {
  const Impl& g = *group_impl(group);
  if (g.replicas == 1) return;
  // One flat buffer per (device, dtype): one allreduce each.
  std::map<std::pair<std::string, int>, std::vector<at::Tensor>> buckets;
  for (auto& t : tensors) {
    if (!t.defined()) continue;
    buckets[{t.device().str(), static_cast<int>(t.scalar_type())}].push_back(t);
  }
  for (auto& b : buckets) {
    std::vector<at::Tensor> flat_parts;
    for (auto& t : b.second) flat_parts.push_back(t.reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    const c10::Device device = flat.device();
    std::vector<at::Tensor> one;
#ifdef USE_C10D_NCCL
    if (device.is_cuda() && g.comm->replicas_nccl) {
      one = {flat};
      g.comm->replicas_nccl->allreduce(one)->wait();
    } else
#endif
    {
      one = {flat.to(at::kCPU)};
      g.comm->replicas->allreduce(one)->wait();
    }
    at::Tensor sum = one[0].to(device);
    if (average) sum.div_(static_cast<double>(g.replicas));
    int64_t at = 0;
    for (auto& t : b.second) {
      t.copy_(sum.narrow(0, at, t.numel()).view_as(t));
      at += t.numel();
    }
  }
}

}  // namespace detail

namespace distributed {

MPIPE_FUNC bool available() { return true; }

MPIPE_FUNC ProcessGroup init(int64_t rank, int64_t world_size, const std::string& master_addr,
                             int master_port, GroupOptions options) {
  TORCH_CHECK(world_size >= 1, "mpipe::distributed::init: the world size must be >= 1, got ",
              world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "mpipe::distributed::init: rank ", rank,
              " is outside the world of ", world_size);
  TORCH_CHECK(master_port > 0 && master_port < 65536, "mpipe::distributed::init: the master "
              "port must be in 1..65535, got ", master_port);
  TORCH_CHECK(options.replicas() >= 1 && world_size % options.replicas() == 0,
              "mpipe::distributed::init: replicas=", options.replicas(), " must divide the "
              "world size ", world_size, " (world = replicas x pipeline ranks)");
  TORCH_CHECK(options.timeout().count() > 0, "mpipe::distributed::init: the timeout must be "
              "positive, got ", options.timeout().count(), " ms");
  auto impl = std::make_shared<detail::GroupImpl>();
  impl->rank = rank;
  impl->world = world_size;
  impl->replicas = options.replicas();
  impl->backend = detail::resolve_backend(options.backend());
  impl->timeout = options.timeout();
  impl->comm = std::make_shared<detail::Comm>();
  auto& comm = *impl->comm;
  try {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(master_port);
    store_options.isServer = rank == 0;
    store_options.numWorkers = static_cast<size_t>(world_size);
    store_options.timeout = options.timeout();
    comm.store = c10::make_intrusive<c10d::TCPStore>(master_addr, store_options);
    comm.world = detail::make_gloo(comm.store, "mpipe/world", static_cast<int>(rank),
                                   static_cast<int>(world_size), master_addr, options.timeout());
#ifdef USE_C10D_NCCL
    if (impl->backend == Backend::NCCL && world_size > 1) {
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = options.timeout();
      comm.world_nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("mpipe/world/nccl", comm.store),
          static_cast<int>(rank), static_cast<int>(world_size), nccl_options);
    }
#endif
    if (impl->replicas > 1) {
      const std::string prefix = c10::str("mpipe/replicas", impl->pipeline_rank());
      comm.replicas = detail::make_gloo(comm.store, prefix, static_cast<int>(impl->replica()),
                                        static_cast<int>(impl->replicas), master_addr,
                                        options.timeout());
#ifdef USE_C10D_NCCL
      if (impl->backend == Backend::NCCL) {
        auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
        nccl_options->timeout = options.timeout();
        comm.replicas_nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
            c10::make_intrusive<c10d::PrefixStore>(prefix + "/nccl", comm.store),
            static_cast<int>(impl->replica()), static_cast<int>(impl->replicas), nccl_options);
      }
#endif
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "mpipe::distributed::init: rank ", rank, " of ", world_size,
                " could not join at ", master_addr, ":", master_port, ": ",
                e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "mpipe::distributed::init: rank ", rank, " of ", world_size,
                " could not join at ", master_addr, ":", master_port, ": ", e.what());
  }
  return detail::GroupAccess::make(std::move(impl));
}

MPIPE_FUNC ProcessGroup init_from_env(GroupOptions options) {
  const int64_t rank = detail::env_int("RANK");
  const int64_t world = detail::env_int("WORLD_SIZE");
  const std::string addr = detail::env_or("MASTER_ADDR", "127.0.0.1");
  const int64_t port = detail::env_int("MASTER_PORT");
  return init(rank, world, addr, static_cast<int>(port), options);
}

}  // namespace distributed
}  // namespace mpipe
