#pragma once

#include "mpipe/detail/config.h"

// distributed::ProcessGroup's accessors (no c10d here: see comm.h).

#include "mpipe/detail/distributed/group.h"

#include <c10/util/Exception.h>

namespace mpipe {
namespace distributed {

MPIPE_FUNC const char* to_string(Backend backend) {
  switch (backend) {
    case Backend::Auto: return "Auto";
    case Backend::Gloo: return "Gloo";
    case Backend::NCCL: return "NCCL";
  }
  return "?";
}

}  // namespace distributed
namespace detail {
MPIPE_FUNC const GroupImpl& group_of(const std::shared_ptr<GroupImpl>& impl) {
  TORCH_CHECK(impl != nullptr, "mpipe::distributed::ProcessGroup: this group is undefined "
              "(default-constructed); create one with mpipe::distributed::init_from_env()");
  return *impl;
}
}  // namespace detail
namespace distributed {

MPIPE_FUNC int64_t ProcessGroup::rank() const { return detail::group_of(impl_).rank; }
MPIPE_FUNC int64_t ProcessGroup::world_size() const { return detail::group_of(impl_).world; }
MPIPE_FUNC int64_t ProcessGroup::replicas() const { return detail::group_of(impl_).replicas; }
MPIPE_FUNC int64_t ProcessGroup::replica() const { return detail::group_of(impl_).replica(); }
MPIPE_FUNC int64_t ProcessGroup::pipeline_rank() const {
  return detail::group_of(impl_).pipeline_rank();
}
MPIPE_FUNC int64_t ProcessGroup::pipeline_size() const {
  return detail::group_of(impl_).pipeline_size();
}
MPIPE_FUNC Backend ProcessGroup::backend() const { return detail::group_of(impl_).backend; }
MPIPE_FUNC std::chrono::milliseconds ProcessGroup::timeout() const {
  return detail::group_of(impl_).timeout;
}

MPIPE_FUNC std::pair<int64_t, int64_t> ProcessGroup::stage_range(int64_t n_stages) const {
  const int64_t s = pipeline_size(), p = pipeline_rank();
  TORCH_CHECK(n_stages >= s, "mpipe::distributed::ProcessGroup::stage_range: ", n_stages,
              " stages cannot be spread over ", s, " pipeline ranks (each needs one or more)");
  const int64_t base = n_stages / s, extra = n_stages % s;
  const int64_t first = p * base + std::min(p, extra);
  return {first, first + base + (p < extra ? 1 : 0)};
}

MPIPE_FUNC std::vector<int64_t> ProcessGroup::v_stages(int64_t n_stages) const {
  const int64_t s = pipeline_size(), p = pipeline_rank();
  TORCH_CHECK(n_stages == 2 * s, "mpipe::distributed::ProcessGroup::v_stages: the V places 2 "
              "stages on each of the ", s, " pipeline ranks (", 2 * s, " stages), got ", n_stages);
  return {p, n_stages - 1 - p};
}

MPIPE_FUNC std::string ProcessGroup::rank_path(const std::string& path) const {
  const std::string tag = ".rank" + std::to_string(rank());
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash) ||
      dot == (slash == std::string::npos ? 0 : slash + 1)) {
    return path + tag;
  }
  return path.substr(0, dot) + tag + path.substr(dot);
}

MPIPE_FUNC void ProcessGroup::barrier() const {
  detail::group_of(impl_);
  detail::barrier(*this);
}

MPIPE_FUNC bool ProcessGroup::any(bool flag) const {
  detail::group_of(impl_);
  return detail::any_rank(*this, flag);
}

MPIPE_FUNC double ProcessGroup::sum(double value) const {
  detail::group_of(impl_);
  return detail::reduce_ranks(*this, value, /*max=*/false);
}

MPIPE_FUNC double ProcessGroup::max(double value) const {
  detail::group_of(impl_);
  return detail::reduce_ranks(*this, value, /*max=*/true);
}

}  // namespace distributed
}  // namespace mpipe
