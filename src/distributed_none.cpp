// Builds without c10d: mpipe::distributed says so when it is used.

#include "group.h"
#include "link.h"

#include <c10/util/Exception.h>

namespace mpipe {
namespace detail {
namespace {
[[noreturn]] void unavailable() {
  TORCH_CHECK(false, "mpipe::distributed: this build of mpipe has no c10d (LibTorch without "
              "torch/csrc/distributed, or the Gloo headers were missing when mpipe was built: "
              "apt-get install libgloo-dev); pipelines across processes are off");
}
}  // namespace

std::unique_ptr<Link> open_link(const distributed::ProcessGroup&, int64_t, int64_t, LinkHandlers) {
  unavailable();
}
std::vector<int64_t> exchange_stage_counts(const distributed::ProcessGroup&, int64_t, int64_t) {
  unavailable();
}
int64_t next_pipeline_id(const distributed::ProcessGroup&) { unavailable(); }
void barrier(const distributed::ProcessGroup&) { unavailable(); }
bool any_rank(const distributed::ProcessGroup&, bool) { unavailable(); }
void allreduce_replicas(const distributed::ProcessGroup&, std::vector<at::Tensor>, bool) {
  unavailable();
}
}  // namespace detail

namespace distributed {
bool available() { return false; }
ProcessGroup init(int64_t, int64_t, const std::string&, int, GroupOptions) {
  detail::unavailable();
}
ProcessGroup init_from_env(GroupOptions) { detail::unavailable(); }
}  // namespace distributed
}  // namespace mpipe
