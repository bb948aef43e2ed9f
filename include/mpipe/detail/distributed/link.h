#pragma once

// Private: one pipeline call's messages to and from the other ranks of its
// pipeline (Note [Cross-process calls] in remote-inl.h). GlooLink
// (gloo_link-inl.h) implements Link and open_link, distributed-inl.h the
// other functions (with c10d; distributed_none-inl.h without it).

#include "mpipe/detail/runtime/transport.h"

#include "mpipe/distributed.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mpipe {
namespace detail {

struct WireMessage {
  enum Type : int64_t { Call = 1, Data = 2, End = 3, Abort = 4 };
  Type type = Data;
  // Data: tensor `index` of `count` sent under `key` to global stage `stage`;
  // `from` is the sending stage (the stasher, for a skip).
  Key key{Key::Activation, 0, {}};
  int64_t stage = 0;
  int64_t from = 0;
  int64_t index = 0;
  int64_t count = 1;
  at::Tensor tensor;  // may be undefined
  /// Received over NCCL: the tensor is ready once this event (on its device)
  /// fires; null when it is ready now (host transfers).
  std::shared_ptr<c10::Event> ready;
  // Call: the first rank's description of the call (CallInfo's fields).
  std::vector<int64_t> call;
  // Abort: what failed; `from` is then the rank found late (-1: none).
  std::string text;
};

class Link {
 public:
  virtual ~Link() = default;
  /// Sends `m` to pipeline rank `peer` without waiting; messages to one peer
  /// arrive in the order they were posted. A CUDA tensor goes over NCCL when
  /// the group's backend is NCCL (ordered after the current stream of its
  /// device), else through the host (a copy on the current stream).
  virtual void post(int64_t peer, WireMessage m) = 0;
  /// Ends the call on this rank: End (or, with `error`, Abort carrying it) to
  /// every peer, then waits until every peer ended too and every send went
  /// out, all within one deadline: the longest receive's patience (Note
  /// [Ending a call] in gloo_link-inl.h), cut to a few seconds
  /// once the call is `failing` or a peer's Abort or loss arrives (a healthy
  /// peer answers an Abort at once; one that does not is stalled, and the
  /// group is broken). `late`: the pipeline rank a receive here timed out
  /// on (-1: none); the Abort names it, and neither this rank nor one that
  /// gets the Abort waits for its End. Returns what went wrong on the way
  /// ("" if nothing).
  virtual std::string finish(const std::string& error, bool failing, int64_t late) = 0;
};

/// Called from the link's receiving threads: a Call or Data message from
/// `peer`, or (`failed`) the peer's Abort text or why it cannot be reached.
struct LinkHandlers {
  std::function<void(int64_t peer, WireMessage m)> deliver;
  std::function<void(int64_t peer, const std::string& why)> failed;
  /// The device of this rank's stage `stage` (where a CUDA tensor sent over
  /// NCCL for it is received).
  std::function<c10::Device(int64_t stage)> device_of;
};

/// The seed of the debug hook that delays and reorders the delivery of
/// received messages and delays each call's attach (Note [Message
/// addresses]); -1 when MPIPE_DEBUG_CHAOS is unset (the default: no delays).
int64_t debug_chaos_seed();

/// Opens call `seq` of pipeline `pipeline_id` with every other rank of this
/// rank's pipeline; a receiving thread per peer runs until the peer ends the
/// call. Throws if the group failed before (a peer died or stalled).
std::unique_ptr<Link> open_link(const distributed::ProcessGroup& group, int64_t pipeline_id,
                                int64_t seq, LinkHandlers handlers);

/// Every pipeline rank's stage numbers of pipeline `pipeline_id` (-1s where
/// the rank did not declare them), this rank's being `mine`: messages to and
/// from every rank of the world, each waited for with the timeout, so that
/// the error names the ranks that never came. Every rank calls it, in the
/// same order, at each pipeline's first call.
std::vector<std::vector<int64_t>> exchange_stages(const distributed::ProcessGroup& group,
                                                  int64_t pipeline_id,
                                                  const std::vector<int64_t>& mine);

/// A new pipeline's id on `group` (pipelines get them in construction order).
int64_t next_pipeline_id(const distributed::ProcessGroup& group);

/// Sums (or, `average`, averages) `tensors` across the replicas of this
/// rank's pipeline position, in place (one c10d allreduce per device and dtype).
void allreduce_replicas(const distributed::ProcessGroup& group, std::vector<at::Tensor> tensors,
                        bool average);

}  // namespace detail
}  // namespace mpipe
