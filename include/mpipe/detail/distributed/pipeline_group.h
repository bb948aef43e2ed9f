#pragma once

// Private: a pipeline's part in a process group (Note [Cross-process calls]
// in remote-inl.h): where every rank's stages are, and each call's number.
// One of the PipelineParts (pipeline/session.h).

#include "mpipe/detail/distributed/remote.h"
#include "mpipe/detail/runtime/executor.h"

#include "mpipe/distributed.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

class PipelineGroup {
 public:
  /// The ranks the pipeline spans, once connected (0 before).
  int64_t ranks() const { return static_cast<int64_t>(layout_.first.size()); }

  /// Opens call `method` on every rank of `group`: at the first call the
  /// ranks exchange their stage counts (Note [Cross-process calls]).
  /// `devices` are this rank's stages', whose global numbers start at
  /// `executor`'s first stage once connected. `late` gets the error of a rank
  /// that appended stages since, for the call to tell every rank.
  std::unique_ptr<RemoteCall> open(const char* method, const distributed::ProcessGroup& group,
                                   const std::vector<c10::Device>& devices, Executor& executor,
                                   std::string& late);

 private:
  /// The stage ranges of every rank, exchanged at the first call (every
  /// rank gets the error when one holds no stage). Returns the error of a
  /// rank that appended stages since, which the call tells every rank.
  std::string connect(const char* method, const distributed::ProcessGroup& group,
                      int64_t n_local, Executor& executor);

  int64_t pipeline_id_ = -1;  // on the group, in construction (or first-call) order
  int64_t call_seq_ = 0;
  int64_t connected_stages_ = -1;  // the local stage count the layout was made for
  Layout layout_;
};

}  // namespace detail
}  // namespace mpipe
