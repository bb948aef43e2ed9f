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
  int64_t ranks() const { return static_cast<int64_t>(layout_.stages.size()); }
  /// Where the stages are, once connected.
  const Layout& layout() const { return layout_; }

  /// Opens call `method` on every rank of `group`: at the first call the
  /// ranks exchange their stage numbers (Note [Cross-process calls]).
  /// `devices` are this rank's stages', numbered `stage_numbers`
  /// (ModelPipelineOptions; empty: after the earlier ranks' stages), which
  /// `executor`'s stage map holds once connected. `late` gets the error of a
  /// rank that appended stages since, for the call to tell every rank.
  std::unique_ptr<RemoteCall> open(const char* method, const distributed::ProcessGroup& group,
                                   const std::vector<int64_t>& stage_numbers,
                                   const std::vector<c10::Device>& devices, Executor& executor,
                                   std::string& late);

 private:
  /// The stages of every rank, exchanged at the first call (every rank gets
  /// the error when one holds no stage or numbers them wrong). Returns the
  /// error of a rank that appended stages since, which the call tells every
  /// rank.
  std::string connect(const char* method, const distributed::ProcessGroup& group,
                      const std::vector<int64_t>& declared, int64_t n_local, Executor& executor);

  int64_t pipeline_id_ = -1;  // on the group, in construction (or first-call) order
  int64_t call_seq_ = 0;
  int64_t connected_stages_ = -1;  // the local stage count the layout was made for
  Layout layout_;
};

}  // namespace detail
}  // namespace mpipe
