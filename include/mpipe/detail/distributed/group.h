#pragma once

// Private: what a distributed::ProcessGroup holds. The c10d objects are in
// Comm, defined by comm.h (c10d is included only by comm.h, distributed-inl.h
// and gloo_link{.h,-inl.h}).

#include "mpipe/distributed.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace mpipe {
namespace detail {
struct Comm;
}  // namespace detail

namespace distributed {

// What a group holds (private to ProcessGroup; the runtime reaches it through
// detail::GroupAccess).
struct ProcessGroup::Impl {
  int64_t rank = 0;
  int64_t world = 1;
  int64_t replicas = 1;
  Backend backend = Backend::Gloo;  // resolved: Gloo or NCCL
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<detail::Comm> comm;
  std::atomic<int64_t> next_pipeline{0};

  int64_t replica() const { return rank % replicas; }
  int64_t pipeline_rank() const { return rank / replicas; }
  int64_t pipeline_size() const { return world / replicas; }
  /// The world rank of pipeline rank `p` in this rank's replica.
  int64_t world_rank(int64_t p) const { return p * replicas + replica(); }

  /// Marks the group unusable (a peer died, stalled or broke the protocol):
  /// later calls fail at once with `why`.
  void break_group(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex);
    if (broken.empty()) broken = why;
  }
  std::string broken_reason() const {
    std::lock_guard<std::mutex> lock(mutex);
    return broken;
  }

 private:
  mutable std::mutex mutex;
  std::string broken;
};

}  // namespace distributed

namespace detail {
/// The runtime's access to a ProcessGroup's state.
struct GroupAccess {
  using Impl = distributed::ProcessGroup::Impl;
  static const std::shared_ptr<Impl>& impl(const distributed::ProcessGroup& g) noexcept {
    return g.impl_;
  }
  static distributed::ProcessGroup make(std::shared_ptr<Impl> impl) {
    return distributed::ProcessGroup(std::move(impl));
  }
};
using GroupImpl = GroupAccess::Impl;
/// What `g` holds (null for an undefined group).
inline const std::shared_ptr<GroupImpl>& group_impl(const distributed::ProcessGroup& g) noexcept {
  return GroupAccess::impl(g);
}

/// Every rank of the world waits for the others (distributed-inl.h).
void barrier(const distributed::ProcessGroup& group);
/// Whether `flag` is true on any rank of the world (every rank calls it).
bool any_rank(const distributed::ProcessGroup& group, bool flag);
/// `value` summed (or, `max`, its largest) over every rank of the world.
double reduce_ranks(const distributed::ProcessGroup& group, double value, bool max);
}  // namespace detail
}  // namespace mpipe
