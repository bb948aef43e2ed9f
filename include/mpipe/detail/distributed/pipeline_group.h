#pragma once

// Private: a pipeline's part in a process group (Note [Cross-process calls]
// in remote-inl.h): where every rank's stages are, and how one call runs on
// every rank. One of ModelPipelineImpl::Parts (pipeline/session.h).

#include "mpipe/detail/distributed/remote.h"
#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/runtime/executor.h"

#include "mpipe/distributed.h"

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

class PipelineGroup {
 public:
  /// The ranks the pipeline spans, once connected (0 before).
  int64_t ranks() const { return static_cast<int64_t>(layout_.first.size()); }

  /// Runs `body(call)` as one call across processes on every rank of
  /// `group` (Note [Cross-process calls]): its error ends the call on every
  /// rank. `devices` are this rank's stages', whose global numbers start at
  /// `executor`'s first stage once connected.
  template <typename F>
  auto across(const char* method, const distributed::ProcessGroup& group,
              const std::vector<c10::Device>& devices, Executor& executor, F&& body)
      -> decltype(body(std::declval<RemoteCall&>()));

  /// The first rank's `make()`, told to every rank.
  static CallInfo agree(RemoteCall& call, const char* method,
                        const std::function<CallInfo()>& make);

 private:
  /// The stage ranges of every rank, exchanged at the first call (every
  /// rank gets the error when one holds no stage). Returns the error of a
  /// rank that appended stages since, which across() tells every rank.
  std::string connect(const char* method, const distributed::ProcessGroup& group,
                      int64_t n_local, Executor& executor);

  int64_t pipeline_id_ = -1;  // on the group, in construction (or first-call) order
  int64_t call_seq_ = 0;
  int64_t connected_stages_ = -1;  // the local stage count the layout was made for
  Layout layout_;
};

template <typename F>
auto PipelineGroup::across(const char* method, const distributed::ProcessGroup& group,
                           const std::vector<c10::Device>& devices, Executor& executor, F&& body)
    -> decltype(body(std::declval<RemoteCall&>())) {
  const std::string late = connect(method, group, static_cast<int64_t>(devices.size()), executor);
  RemoteCall call(group, layout_, pipeline_id_, call_seq_++, [&devices, &executor](int64_t stage) {
    return devices[static_cast<size_t>(stage - executor.first_stage())];
  });
  decltype(body(call)) result;
  std::exception_ptr error;
  try {
    TORCH_CHECK(late.empty(), late);
    result = body(call);
  } catch (...) {
    error = std::current_exception();
  }
  if (error) {
    const std::string what = message_of(error);
    const std::string others = call.finish(what, method);
    if (others.empty()) std::rethrow_exception(error);
    // What the other ranks reported may name the root cause (the rank that
    // stalled behind the one this rank waited for).
    TORCH_CHECK(false, what, "; other ranks: ", others);
  }
  call.finish("", method);  // throws another rank's failure
  return result;
}

}  // namespace detail
}  // namespace mpipe
