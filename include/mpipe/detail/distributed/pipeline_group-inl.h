#pragma once

#include "mpipe/detail/config.h"

// A pipeline's part in a process group: the layout exchanged at the first
// call, and each call opened on every rank.

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

MPIPE_FUNC std::unique_ptr<RemoteCall> PipelineGroup::open(
    const char* method, const distributed::ProcessGroup& group,
    const std::vector<c10::Device>& devices, Executor& executor, std::string& late) {
  late = connect(method, group, static_cast<int64_t>(devices.size()), executor);
  return std::make_unique<RemoteCall>(
      group, layout_, pipeline_id_, call_seq_++, [&devices, &executor](int64_t stage) {
        return devices[static_cast<size_t>(stage - executor.first_stage())];
      });
}

}  // namespace detail
}  // namespace mpipe
