#pragma once

#include "mpipe/detail/config.h"

// Builds without c10d: mpipe::distributed says so when it is used.

#include "mpipe/detail/distributed/group.h"
#include "mpipe/detail/distributed/link.h"

#include <c10/util/Exception.h>

namespace mpipe {
namespace detail {
[[noreturn]] MPIPE_FUNC void unavailable() {
  TORCH_CHECK(false, "mpipe::distributed: this build of mpipe has no c10d (LibTorch without "
              "torch/csrc/distributed, or the Gloo headers were missing when mpipe was built: "
              "apt-get install libgloo-dev); pipelines across processes are off");
}

MPIPE_FUNC std::unique_ptr<Link> open_link(const distributed::ProcessGroup&, int64_t, int64_t,
                                           LinkHandlers) {
  unavailable();
}
MPIPE_FUNC std::vector<std::vector<int64_t>> exchange_stages(const distributed::ProcessGroup&,
                                                             int64_t, const std::vector<int64_t>&) {
  unavailable();
}
MPIPE_FUNC int64_t next_pipeline_id(const distributed::ProcessGroup&) { unavailable(); }
MPIPE_FUNC void barrier(const distributed::ProcessGroup&) { unavailable(); }
MPIPE_FUNC bool any_rank(const distributed::ProcessGroup&, bool) { unavailable(); }
MPIPE_FUNC double reduce_ranks(const distributed::ProcessGroup&, double, bool) { unavailable(); }
MPIPE_FUNC void allreduce_replicas(const distributed::ProcessGroup&, std::vector<at::Tensor>,
                                   bool) {
  unavailable();
}
}  // namespace detail

namespace distributed {
MPIPE_FUNC bool available() { return false; }
MPIPE_FUNC ProcessGroup init(int64_t, int64_t, const std::string&, int, GroupOptions) {
  detail::unavailable();
}
MPIPE_FUNC ProcessGroup init_from_env(GroupOptions) { detail::unavailable(); }
}  // namespace distributed
}  // namespace mpipe
