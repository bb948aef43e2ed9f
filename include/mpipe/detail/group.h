#pragma once

// Private: what a distributed::ProcessGroup holds. The c10d objects are in
// Comm, defined by distributed-inl.h (the one file that includes c10d).

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
/// Every rank of the world waits for the others (distributed-inl.h).
void barrier(const distributed::ProcessGroup& group);
/// Whether `flag` is true on any rank of the world (every rank calls it).
bool any_rank(const distributed::ProcessGroup& group, bool flag);
}  // namespace detail
}  // namespace mpipe
