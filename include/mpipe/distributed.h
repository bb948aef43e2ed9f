#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_DISTRIBUTED_H_
#define MPIPE_DISTRIBUTED_H_

// Pipelines across processes and machines, on c10d (PyTorch's distributed
// backend): the process group a ModelPipeline spans.
//
//   auto group = mpipe::distributed::init_from_env();   // torchrun / mpipe-launch
//   mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group));
//   auto [begin, end] = group.stage_range(4);            // this rank's stages of 4
//   for (int64_t s = begin; s < end; ++s) pipe->append(make_stage(s), device);
//   at::Tensor out = pipe->forward(x, 8);  // x read on the first rank; out on the last
//
// Every rank runs the same program and makes the same pipeline calls in the
// same order. Each rank appends a contiguous range of the stages (one or
// more, on its own devices; ModelPipelineOptions::stage_numbers places them
// otherwise, as in the V of v_stages); ranks are ordered along the pipeline by
// pipeline_rank(). The first rank's inputs are the call's inputs (other
// ranks' are ignored and may be undefined); the last rank's (the one holding
// the last stage) target is the step's target. It gets the outputs
// (forward-type calls) or the loss (training steps); every other rank gets an
// undefined tensor (an empty Tensors from the overloads taking
// std::vector<Input>). docs/distributed.md
// has the protocol, the failure rules and the launch commands.

#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {
struct GroupAccess;
}  // namespace detail
namespace distributed {

/// What carries CUDA tensors between ranks.
enum class Backend {
  /// NCCL for CUDA tensors where this LibTorch has it and CUDA is available,
  /// Gloo otherwise; the environment variable MPIPE_BACKEND=gloo|nccl overrides it.
  Auto,
  /// Gloo for every tensor (CUDA tensors through host memory).
  Gloo,
  /// NCCL for CUDA tensors (GPU to GPU); Gloo for CPU tensors.
  NCCL,
};

/// "Auto", "Gloo" or "NCCL".
const char* to_string(Backend backend);

/// Options of init_from_env() and init().
struct GroupOptions {
  /// What carries CUDA tensors (Gloo always carries the messages' headers and CPU tensors).
  TORCH_ARG(Backend, backend) = Backend::Auto;
  /// The longest any rank waits for another: at the rendezvous, at a
  /// pipeline's first call, and during a call for the next message from
  /// another rank. A rank that dies makes the others fail at once; one that
  /// stalls, within this timeout plus half a second per pipeline rank plus
  /// 2 s, every report naming the stalled rank (docs/distributed.md).
  /// Make it longer than the slowest stage's work in one call.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// Data-parallel replicas R of the pipeline: the world's W ranks form R
  /// pipelines of S = W / R ranks each. Rank r is pipeline rank r / R of
  /// replica r % R, so the R replicas of a stage are neighbours (on one node
  /// under torchrun's numbering) and pipeline neighbours are R ranks apart.
  TORCH_ARG(int64_t, replicas) = 1;
};

/// A handle to a process group (copies share it). Default-constructed: none,
/// the pipeline runs in this process only.
class ProcessGroup {
 public:
  /// No group: a pipeline given it runs in this process only.
  ProcessGroup() = default;
  /// Whether this is a group (not default-constructed); the other accessors
  /// throw c10::Error on an undefined one.
  bool defined() const noexcept { return impl_ != nullptr; }

  /// This rank in the world, 0 to world_size() - 1.
  int64_t rank() const;
  /// The number of ranks in the world.
  int64_t world_size() const;
  /// Data parallelism: the number of replicas of the pipeline.
  int64_t replicas() const;
  /// This rank's replica, rank() % replicas().
  int64_t replica() const;
  /// This rank's place along its pipeline, rank() / replicas().
  int64_t pipeline_rank() const;
  /// The number of ranks of each pipeline, world_size() / replicas().
  int64_t pipeline_size() const;
  /// Whether this rank holds the pipeline's first stages (it reads the inputs).
  bool is_first() const { return pipeline_rank() == 0; }
  /// Whether this is the last pipeline rank: it holds the pipeline's last
  /// stages and gets the outputs or the loss, unless stage_numbers placed the
  /// stages otherwise (in the V, rank 0 holds the last stage).
  bool is_last() const { return pipeline_rank() + 1 == pipeline_size(); }
  /// The backend for CUDA tensors (Gloo carries the messages' headers and CPU
  /// tensors in every case).
  Backend backend() const;
  /// GroupOptions::timeout, as the group was created with.
  std::chrono::milliseconds timeout() const;

  /// The stages [first, end) of `n_stages` this rank holds when they are
  /// split into pipeline_size() contiguous ranges, the first ranges one
  /// stage longer when they do not divide evenly.
  std::pair<int64_t, int64_t> stage_range(int64_t n_stages) const;
  /// The stages of `n_stages` = 2 * pipeline_size() this rank holds in the V
  /// placement of ZB-V and DualPipeV: pipeline rank r holds stages r and
  /// n_stages - 1 - r, so rank 0 holds the first and the last stage. Pass
  /// them to ModelPipelineOptions::stage_numbers and append those stages.
  std::vector<int64_t> v_stages(int64_t n_stages) const;
  /// `path` with ".rank<r>" before its extension ("model.pt" ->
  /// "model.rank1.pt"): where each rank saves and loads its stages.
  std::string rank_path(const std::string& path) const;
  /// Returns once every rank of the world has called it.
  void barrier() const;
  /// Whether `flag` is true on any rank of the world; every rank calls it
  /// (GradScaler uses it so that all ranks skip the same steps).
  bool any(bool flag) const;
  /// The sum of `value` over every rank of the world; every rank calls it
  /// (clip_grad_norm uses it for the gradients' norm across ranks).
  double sum(double value) const;
  /// The largest `value` of any rank of the world; every rank calls it.
  double max(double value) const;


 private:
  friend struct mpipe::detail::GroupAccess;  // the runtime's way in (detail/group.h)
  struct Impl;
  explicit ProcessGroup(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

/// Whether this build of mpipe has c10d (else init() and init_from_env() throw).
bool available();

/// Joins the world described by torchrun's variables: RANK, WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT (mpipe-launch sets them too). Rank 0 hosts the
/// rendezvous (a c10d TCPStore on MASTER_PORT).
ProcessGroup init_from_env(GroupOptions options = {});
/// Joins a world of `world_size` ranks as `rank`, meeting at master_addr:master_port.
ProcessGroup init(int64_t rank, int64_t world_size, const std::string& master_addr,
                  int master_port, GroupOptions options = {});

}  // namespace distributed
}  // namespace mpipe

#endif  // MPIPE_DISTRIBUTED_H_
