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
                                              const std::vector<int64_t>& declared,
                                              int64_t n_local, Executor& executor) {
  if (connected_stages_ == n_local) return {};
  if (connected_stages_ >= 0) {  // told to every rank through the call (across())
    return c10::str("mpipe::ModelPipeline::", method, ": rank ", group.rank(), " appended ",
                    n_local - connected_stages_, " stage(s) after the pipeline's first call across "
                    "processes (it held ", connected_stages_, ", now ", n_local,
                    "); append every stage before the first call");
  }
  // Every rank takes part, one with no stage or wrong stage numbers too, so
  // that all of them hear which rank is wrong instead of waiting for it.
  // Each sends its stage numbers: -1s where it declares none, -2s where
  // their count is not its stages'.
  if (pipeline_id_ < 0) pipeline_id_ = next_pipeline_id(group);
  const auto size = static_cast<size_t>(n_local);
  std::vector<int64_t> mine = declared.empty()          ? std::vector<int64_t>(size, -1)
                              : declared.size() != size ? std::vector<int64_t>(size, -2)
                                                        : declared;
  auto lists = exchange_stages(group, pipeline_id_, mine);
  const std::string where = c10::str("mpipe::ModelPipeline::", method, ": ");
  auto name = [&](size_t p) {
    return c10::str("rank ", group_impl(group)->world_rank(static_cast<int64_t>(p)),
                    " (pipeline rank ", p, ")");
  };
  std::string empty, miscounted, undeclared;
  int64_t n_stages = 0, n_declared = 0;
  for (size_t p = 0; p < lists.size(); ++p) {
    const auto& l = lists[p];
    n_stages += static_cast<int64_t>(l.size());
    if (l.empty()) empty += (empty.empty() ? "" : ", ") + name(p);
    if (!l.empty() && l[0] == -2) miscounted += (miscounted.empty() ? "" : ", ") + name(p);
    if (!l.empty() && l[0] == -1) undeclared += (undeclared.empty() ? "" : ", ") + name(p);
    n_declared += !l.empty() && l[0] >= 0;
  }
  TORCH_CHECK(empty.empty(), where, empty, " holds no stage; every rank appends its stages "
              "(ProcessGroup::stage_range) before the first call");
  TORCH_CHECK(miscounted.empty(), where, "the stage numbers of ", miscounted, " (",
              "ModelPipelineOptions::stage_numbers) are not as many as the stages it appended",
              declared.size() != size ? c10::str(" (here ", declared.size(), " numbers, ", n_local,
                                                 " stages)")
                                      : std::string());
  TORCH_CHECK(n_declared == 0 || undeclared.empty(), where, undeclared, " set no "
              "ModelPipelineOptions::stage_numbers but other ranks do; every rank sets them or "
              "none does");
  Layout l;
  l.n_stages = n_stages;
  l.owner.assign(static_cast<size_t>(n_stages), -1);
  int64_t next = 0;
  for (size_t p = 0; p < lists.size(); ++p) {
    if (n_declared == 0) {  // contiguous ranges in pipeline-rank order
      for (auto& s : lists[p]) s = next++;
    }
    for (size_t k = 0; k < lists[p].size(); ++k) {
      const int64_t s = lists[p][k];
      TORCH_CHECK(s >= 0 && s < n_stages && (k == 0 || s > lists[p][k - 1]), where, name(p),
                  " numbers its stages ", c10::ArrayRef<int64_t>(lists[p]),
                  " (ModelPipelineOptions::stage_numbers); they must ascend, within 0 to ",
                  n_stages - 1, " (the ranks hold ", n_stages, " stages)");
      const int64_t other = l.owner[static_cast<size_t>(s)];
      TORCH_CHECK(other < 0, where, "stage ", s, " is numbered by both ", name(other), " and ",
                  name(p), " (ModelPipelineOptions::stage_numbers); each stage number is one "
                  "rank's");
      l.owner[static_cast<size_t>(s)] = static_cast<int64_t>(p);
    }
  }
  TORCH_CHECK(l.owner[0] == 0, where, "stage 0 is held by ", name(l.owner[0]), "; pipeline "
              "rank 0 holds it, since it reads the inputs (ModelPipelineOptions::stage_numbers)");
  l.stages = std::move(lists);
  layout_ = l;
  executor.set_layout(l.stages[static_cast<size_t>(group.pipeline_rank())], l.n_stages,
                      c10::str(", rank ", group.rank()));
  connected_stages_ = n_local;
  return {};
}

MPIPE_FUNC std::unique_ptr<RemoteCall> PipelineGroup::open(
    const char* method, const distributed::ProcessGroup& group,
    const std::vector<int64_t>& stage_numbers, const std::vector<c10::Device>& devices,
    Executor& executor, std::string& late) {
  late = connect(method, group, stage_numbers, static_cast<int64_t>(devices.size()), executor);
  return std::make_unique<RemoteCall>(
      group, layout_, pipeline_id_, call_seq_++, [&devices, &executor](int64_t stage) {
        const StageMap& map = executor.stage_map();
        TORCH_CHECK(map.holds(stage), "a message for stage ", stage, ", which this rank does not "
                    "hold");
        return devices[map.at(stage)];
      });
}

}  // namespace detail
}  // namespace mpipe
