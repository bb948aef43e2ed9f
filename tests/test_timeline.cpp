// Timelines (recording, Chrome trace, SVG, bubble fractions) and memory reports.

#include "common.h"

#include <nlohmann/json.hpp>

#ifdef MPIPE_TEST_WITH_EXPAT
#include <expat.h>
#endif

#include <cstdio>
#include <map>

using namespace mpipe_test;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::TaskKind;
using mpipe::Timeline;

namespace {

/// Tasks of `kind` by (stage, item).
std::map<std::pair<int64_t, int64_t>, mpipe::Timeline::Task> by_stage_item(const Timeline& t,
                                                                         TaskKind kind) {
  std::map<std::pair<int64_t, int64_t>, mpipe::Timeline::Task> out;
  for (const auto& task : t.tasks) {
    if (task.kind != kind) continue;
    EXPECT_TRUE(out.emplace(std::make_pair(task.stage, task.item), task).second)
        << "task recorded twice: stage " << task.stage << " item " << task.item;
  }
  return out;
}

#ifdef MPIPE_TEST_WITH_EXPAT
/// Parses `svg` as XML; returns element counts by name, or fails the test.
std::map<std::string, int> parse_xml(const std::string& svg) {
  std::map<std::string, int> counts;
  XML_Parser parser = XML_ParserCreate(nullptr);
  XML_SetUserData(parser, &counts);
  XML_SetStartElementHandler(parser, [](void* data, const XML_Char* name, const XML_Char**) {
    ++(*static_cast<std::map<std::string, int>*>(data))[name];
  });
  const bool ok = XML_Parse(parser, svg.data(), static_cast<int>(svg.size()), 1) == XML_STATUS_OK;
  EXPECT_TRUE(ok) << "SVG is not well-formed XML: " << XML_ErrorString(XML_GetErrorCode(parser))
                  << " at line " << XML_GetCurrentLineNumber(parser);
  XML_ParserFree(parser);
  return counts;
}
#endif

void check_exports(const Timeline& t) {
  const auto trace = nlohmann::json::parse(t.to_chrome_trace());  // throws if malformed
  size_t complete = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "X") {
      ++complete;
      EXPECT_GE(e.at("dur").get<double>(), 0.0);
      EXPECT_GE(e.at("ts").get<double>(), 0.0);
    }
  }
  EXPECT_EQ(complete, t.tasks.size());
  EXPECT_NEAR(trace.at("otherData").at("bubble_schedule").get<double>(), t.schedule_bubble, 1e-4);
  EXPECT_NEAR(trace.at("otherData").at("bubble_measured").get<double>(), t.bubble_fraction(), 1e-4);
#ifdef MPIPE_TEST_WITH_EXPAT
  auto counts = parse_xml(t.to_svg());
  EXPECT_EQ(counts.count("svg"), 1u);
  EXPECT_EQ(counts["title"], static_cast<int>(t.tasks.size())) << "one tooltip per task";
#endif
}

}  // namespace

TEST(Timeline, ForwardRecordsEveryTaskInDataFlowOrder) {
  for (bool threads : {true, false}) {
    auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads).record_timeline(true));
    for (int j = 0; j < 3; ++j) pipe->append(mlp_stage(8, 8), "cpu");
    EXPECT_TRUE(pipe->timeline().empty()) << "nothing recorded before a call";
    pipe->forward(torch::randn({10, 8}), 3);  // 4 micro-batches
    const Timeline t = pipe->timeline();
    EXPECT_EQ(t.method, "forward");
    EXPECT_EQ(t.n_stages, 3);
    EXPECT_EQ(t.n_items, 4);
    EXPECT_DOUBLE_EQ(t.schedule_bubble, 2.0 / 6.0);
    auto f = by_stage_item(t, TaskKind::Forward);
    ASSERT_EQ(f.size(), 12u);
    for (const auto& kv : f) {
      const auto& task = kv.second;
      EXPECT_LE(task.start_ms, task.end_ms);
      EXPECT_EQ(task.device, torch::Device(torch::kCPU));
      if (task.stage > 0) {  // needs the previous stage's output
        EXPECT_GE(task.start_ms, f.at({task.stage - 1, task.item}).end_ms);
      }
      if (task.item > 0) {  // a stage runs its items in order
        EXPECT_GE(task.start_ms, f.at({task.stage, task.item - 1}).end_ms);
      }
    }
    EXPECT_GT(t.makespan_ms(), 0.0);
    EXPECT_GE(t.bubble_fraction(), 0.0);
    EXPECT_LT(t.bubble_fraction(), 1.0);
    check_exports(t);
  }
}

TEST(Timeline, TrainStepRecordsForwardsBackwardsAndRecomputes) {
  for (auto checkpoint : {mpipe::Checkpoint::Never, mpipe::Checkpoint::Always}) {
    auto pipe = ModelPipeline(
        ModelPipelineOptions().record_timeline(true).checkpoint(checkpoint));
    pipe->append(mlp_stage(4, 4), "cpu").append(mlp_stage(4, 4), "cpu");
    auto loss_fn = [](const torch::Tensor& y, const torch::Tensor& t) {
      return torch::mse_loss(y, t);
    };
    pipe->train_step(torch::randn({6, 4}), torch::randn({6, 4}), loss_fn,
                     mpipe::TrainStepOptions(2).schedule(mpipe::Schedule::OneFOneB));
    const Timeline t = pipe->timeline();
    EXPECT_EQ(t.method, "train_step");
    EXPECT_DOUBLE_EQ(t.schedule_bubble, 1.0 / 4.0);  // (n - 1) / (m + n - 1)
    auto f = by_stage_item(t, TaskKind::Forward);
    auto b = by_stage_item(t, TaskKind::Backward);
    auto r = by_stage_item(t, TaskKind::Recompute);
    EXPECT_EQ(f.size(), 6u);
    EXPECT_EQ(b.size(), 6u);
    EXPECT_EQ(r.size(), checkpoint == mpipe::Checkpoint::Always ? 6u : 0u);
    for (const auto& kv : b) {
      EXPECT_GE(kv.second.start_ms, f.at(kv.first).end_ms) << "backward after its forward";
      if (kv.first.first == 0) {  // needs stage 1's input gradient
        EXPECT_GE(kv.second.start_ms, b.at({1, kv.first.second}).end_ms);
      }
    }
    check_exports(t);
  }
}

TEST(Timeline, ConstantTrainStepRunsABackwardPerStageAndTimeStep) {
  for (bool threads : {true, false}) {
    auto pipe = ModelPipeline(ModelPipelineOptions().record_timeline(true).worker_threads(threads));
    pipe->append(Leaky(4), "cpu").append(Leaky(4), "cpu").append(Leaky(4), "cpu");
    auto loss_fn = [](const torch::Tensor& y, const torch::Tensor&) { return y.pow(2).mean(); };
    pipe->constant_train_step(torch::randn({2, 4}), 5, torch::Tensor(), loss_fn);
    const Timeline t = pipe->timeline();
    EXPECT_EQ(t.method, "constant_train_step");
    auto f = by_stage_item(t, TaskKind::Forward);
    auto b = by_stage_item(t, TaskKind::Backward);
    EXPECT_EQ(f.size(), 15u);
    EXPECT_EQ(b.size(), 15u) << "one backward task per (stage, time step)";
    for (const auto& kv : b) {
      const int64_t stage = kv.first.first, step = kv.first.second;
      EXPECT_GE(kv.second.start_ms, f.at({stage, 4}).end_ms) << "after the stage's forwards";
      if (stage < 2) EXPECT_GE(kv.second.start_ms, b.at({stage + 1, step}).end_ms);
      if (step < 4) EXPECT_GE(kv.second.start_ms, b.at({stage, step + 1}).end_ms);
    }
    check_exports(t);
  }
}

TEST(Timeline, OffByDefaultAndExportErrorsAreClear) {
  auto pipe = ModelPipeline();
  pipe->append(mlp_stage(4, 4), "cpu");
  pipe->forward(torch::randn({4, 4}), 2);
  EXPECT_TRUE(pipe->timeline().empty());
  Timeline t;
  EXPECT_EQ(t.bubble_fraction(), 0.0);
  check_exports(t);  // an empty timeline still exports valid files
  MPIPE_EXPECT_ERROR(t.save_svg("/nonexistent-dir/x.svg"), "save_svg", "/nonexistent-dir/x.svg");
  const std::string path = testing::TempDir() + "mpipe_timeline_test.json";
  t.save_chrome_trace(path);
  EXPECT_EQ(std::remove(path.c_str()), 0);
}

TEST(Timeline, BubbleOfHandMadeTasks) {
  Timeline t;
  t.n_stages = 2;
  // Stage 0 busy 0-2 ms, stage 1 busy 1-3 ms: 4 of 2 x 3 stage-ms busy.
  t.tasks.push_back({0, 0, TaskKind::Forward, torch::kCPU, 0.0, 2.0});
  t.tasks.push_back({1, 0, TaskKind::Forward, torch::kCPU, 1.0, 3.0});
  t.tasks.push_back({1, 0, TaskKind::Copy, torch::kCPU, 0.5, 1.0});  // copies are not work
  EXPECT_DOUBLE_EQ(t.makespan_ms(), 3.0);
  EXPECT_NEAR(t.bubble_fraction(), 1.0 - 4.0 / 6.0, 1e-12);
  EXPECT_NEAR(mpipe::schedules::bubble(mpipe::schedules::gpipe(8, 4)), 3.0 / 11.0, 1e-12);
  EXPECT_NEAR(mpipe::schedules::bubble(mpipe::schedules::one_f_one_b(8, 4)), 3.0 / 11.0, 1e-12);
  check_exports(t);
}

TEST(MemoryReport, CountsParametersGradientsAndBuffersPerDevice) {
  auto pipe = ModelPipeline(ModelPipelineOptions().track_memory(true));
  pipe->append(torch::nn::Linear(4, 8), "cpu")
      .append(torch::nn::Sequential(torch::nn::Linear(8, 2), torch::nn::BatchNorm1d(2)), "cpu");
  auto before = pipe->memory_report();
  ASSERT_EQ(before.devices.size(), 1u);
  const auto& cpu = before.devices[0];
  EXPECT_EQ(cpu.stages, 2);
  const int64_t params = (4 * 8 + 8 + 8 * 2 + 2 + 2 + 2) * 4;  // float32
  EXPECT_EQ(cpu.parameter_bytes, params);
  EXPECT_EQ(cpu.gradient_bytes, 0);
  EXPECT_EQ(cpu.buffer_bytes, (2 + 2) * 4 + 8);  // running mean, var; num_batches_tracked
  EXPECT_EQ(cpu.peak_allocated_bytes, -1) << "no allocator counters on the CPU";
  auto loss_fn = [](const torch::Tensor& y, const torch::Tensor&) { return y.pow(2).mean(); };
  pipe->train_step(torch::randn({4, 4}), torch::zeros({4, 1}), loss_fn, 2);
  auto after = pipe->memory_report();
  EXPECT_EQ(after.devices[0].gradient_bytes, params);
  const std::string text = after.to_string();
  EXPECT_NE(text.find("cpu"), std::string::npos) << text;
  EXPECT_NE(text.find("n/a"), std::string::npos) << text;
  EXPECT_NE(text.find("parameters"), std::string::npos) << text;
}

TEST(Timeline, AndMemoryReportOnTheGpu_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  auto pipe = ModelPipeline(ModelPipelineOptions().record_timeline(true).track_memory(true));
  for (int j = 0; j < 4; ++j) pipe->append(mlp_stage(256, 256, 4), g);
  auto loss_fn = [](const torch::Tensor& y, const torch::Tensor&) { return y.pow(2).mean(); };
  auto x = torch::randn({512, 256}, g);
  pipe->train_step(x, torch::zeros({512, 1}, g), loss_fn, 64);
  const mpipe::Timeline t = pipe->timeline();
  ASSERT_EQ(t.tasks.size(), 64u);  // 8 micro-batches x 4 stages x (F, B)
  std::map<std::pair<int64_t, int64_t>, mpipe::Timeline::Task> f;
  for (const auto& task : t.tasks) {
    EXPECT_EQ(task.device, g);
    EXPECT_GE(task.start_ms, 0.0);
    EXPECT_LE(task.start_ms, task.end_ms);
    if (task.kind == mpipe::TaskKind::Forward) f[{task.stage, task.item}] = task;
  }
  for (const auto& kv : f) {  // device times follow the data flow
    if (kv.first.first > 0) {
      EXPECT_GE(kv.second.start_ms, f.at({kv.first.first - 1, kv.first.second}).end_ms);
    }
  }
  EXPECT_GT(t.bubble_fraction(), 0.0);
  EXPECT_LT(t.bubble_fraction(), 1.0);
  const auto report = pipe->memory_report();
  ASSERT_EQ(report.devices.size(), 1u);
  const auto& d = report.devices[0];
  EXPECT_EQ(d.stages, 4);
  EXPECT_GT(d.allocated_before_bytes, 0);
  EXPECT_GT(d.call_peak_bytes(), 0) << "activations were allocated during the step";
  std::cout << report.to_string();
}
