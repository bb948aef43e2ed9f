#pragma once

// Private: the c10d objects a distributed::ProcessGroup holds (group.h
// declares Comm). distributed-inl.h makes them; GlooLink (gloo_link.h) carries
// a call's messages on them. With c10d only (MPIPE_WITH_C10D).

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <mutex>
#include <vector>

namespace mpipe {
namespace detail {

struct Comm {
  c10::intrusive_ptr<c10d::Store> store;
  /// The world, for the pipeline's messages (point to point) and barriers.
  c10::intrusive_ptr<c10d::ProcessGroupGloo> world;
  /// The replicas of this rank's pipeline position (data parallelism); null
  /// with one replica.
  c10::intrusive_ptr<c10d::ProcessGroupGloo> replicas;
#ifdef USE_C10D_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> replicas_nccl;  // CUDA gradients, NCCL backend
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> world_nccl;     // CUDA activations and gradients
#endif
  /// Sends aborted when a peer stalled: kept alive with the group, since
  /// Gloo may still touch their buffers (the group is broken by then).
  std::mutex abandoned_mutex;
  std::vector<c10::intrusive_ptr<c10d::Work>> abandoned;
};

}  // namespace detail
}  // namespace mpipe
