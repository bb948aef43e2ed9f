#pragma once

#include "mpipe/detail/config.h"

// A pipeline's part in a process group: the layout exchanged at the first
// call, and the description every rank agrees on.

#include "mpipe/detail/distributed/pipeline_group.h"

#include "mpipe/detail/distributed/group.h"

namespace mpipe {
namespace detail {

MPIPE_FUNC std::string PipelineGroup::connect(const char* method,
                                              const distributed::ProcessGroup& group,
                                              int64_t n_local, Executor& executor) {
  if (connected_stages_ == n_local) return {};
  if (connected_stages_ >= 0) {  // told to every rank through the call (across())
    return c10::str("mpipe::ModelPipeline::", method, ": rank ", group.rank(), " appended ",
                    n_local - connected_stages_, " stage(s) after the pipeline's first call across "
                    "processes (it held ", connected_stages_, ", now ", n_local,
                    "); append every stage before the first call");
  }
  // Every rank takes part, one with no stage too, so that all of them hear
  // which rank is wrong instead of waiting for it.
  if (pipeline_id_ < 0) pipeline_id_ = next_pipeline_id(group);
  const auto counts = exchange_stage_counts(group, pipeline_id_, n_local);
  Layout l;
  int64_t first = 0;
  std::string empty;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] <= 0) {
      empty += c10::str(empty.empty() ? "" : ", ", "rank ",
                        group_impl(group)->world_rank(static_cast<int64_t>(p)),
                        " (pipeline rank ", p, ")");
    }
    l.first.push_back(first);
    first += counts[p];
  }
  TORCH_CHECK(empty.empty(), "mpipe::ModelPipeline::", method, ": ", empty,
              " holds no stage; every rank appends its stages (ProcessGroup::stage_range) "
              "before the first call");
  l.n_stages = first;
  layout_ = l;
  executor.set_layout(l.first[static_cast<size_t>(group.pipeline_rank())], l.n_stages,
                      c10::str(", rank ", group.rank()));
  connected_stages_ = n_local;
  return {};
}

MPIPE_FUNC CallInfo PipelineGroup::agree(RemoteCall& call, const char* method,
                                         const std::function<CallInfo()>& make) {
  if (!call.first()) return call.await_call(method);
  CallInfo info = make();
  info.method = method_code(method);
  call.announce(info);
  return info;
}

}  // namespace detail
}  // namespace mpipe
