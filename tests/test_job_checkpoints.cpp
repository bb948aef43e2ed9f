// mpipe::JobCheckpoints in one process: a resumed job ends bit for bit where
// the uninterrupted one does; torn, corrupted, incomplete and mismatched
// checkpoints are refused by name and the one before is used.

#include "common.h"
#include "optimizer_state.h"

#include <mpipe/job_checkpoints.h>

#include <torch/optim/adamw.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

using namespace mpipe_test;
using mpipe::JobCheckpoints;
using mpipe::ModelPipeline;

namespace {

/// A fresh folder for one test's checkpoints.
std::string fresh_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("mpipe_job_" + name + "_" + std::to_string(::getpid()));
  remove_tree(dir);
  return dir.string();
}

/// A job: 3 stages (one with dropout: every step draws random numbers), AdamW
/// and a GradScaler, the same every time it is made. Its data come from the
/// CPU generator too, as a data loader's shuffling would.
struct Job {
  ModelPipeline pipe{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt;
  mpipe::GradScaler scaler{mpipe::GradScalerOptions().init_scale(256.0).growth_interval(2)};

  torch::Device device;

  explicit Job(int64_t width = 16, torch::Device on = torch::kCPU) : device(on) {
    torch::manual_seed(5);
    if (device.is_cuda()) torch::cuda::manual_seed_all(5);
    pipe = ModelPipeline();
    pipe->append(mlp_stage(8, width), device)
        .append(torch::nn::Sequential(torch::nn::Linear(width, 16), torch::nn::Dropout(0.3)), device)
        .append(mlp_stage(16, 4), device);
    opt = std::make_unique<torch::optim::AdamW>(pipe->parameters(),
                                                torch::optim::AdamWOptions(1e-2));
  }
  JobCheckpoints checkpoints(const std::string& dir, int64_t keep = 2) {
    return JobCheckpoints(dir, *pipe, *opt, &scaler, keep);
  }
  /// One training step; returns its loss.
  double step() {
    // On a GPU, from its generator, which a checkpoint holds too.
    const auto x = torch::randn({12, 8}, device), y = torch::randn({12, 4}, device);
    opt->zero_grad();
    const auto loss =
        pipe->train_step(x, y, mse, mpipe::TrainStepOptions(4).loss_scale(scaler.get_scale()));
    scaler.step(*opt);
    scaler.update();
    return loss.item<double>();
  }
  /// Every parameter and optimizer state tensor, in order.
  std::vector<torch::Tensor> state() const {
    std::vector<torch::Tensor> out = pipe->parameters();
    for (const auto& p : pipe->parameters()) {
      const auto& s = mpipe_test::param_state<torch::optim::AdamWParamState>(*opt, p);
      out.push_back(s.exp_avg());
      out.push_back(s.exp_avg_sq());
    }
    return out;
  }
};

void expect_same_state(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(torch::equal(a[k], b[k])) << "tensor " << k;
}

/// Cuts `path` to `bytes` bytes.
void truncate_to(const std::string& path, size_t bytes) {
  std::filesystem::resize_file(path, bytes);
}

/// Flips one byte in the middle of `path`.
void corrupt(const std::string& path) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  const auto size = std::filesystem::file_size(path);
  f.seekg(static_cast<std::streamoff>(size / 2));
  char c = 0;
  f.read(&c, 1);
  f.seekp(static_cast<std::streamoff>(size / 2));
  c = static_cast<char>(c ^ 0x5a);
  f.write(&c, 1);
}

/// Saves after 3 of 6 steps, then a new job (a restarted process: the same
/// construction) resumes there: the same losses, then the same weights,
/// optimizer state and scale.
void expect_resumed_job_ends_where_uninterrupted_does(const std::string& name,
                                                     torch::Device device) {
  const std::string dir = fresh_dir(name);
  Job a(16, device);
  auto ck = a.checkpoints(dir);
  EXPECT_FALSE(ck.resume().has_value()) << "nothing saved yet";
  // The data position is any bytes: text, and every byte value (a pickle).
  std::string position = "epoch 0, batch 3";
  for (int c = 0; c < 256; ++c) position += static_cast<char>(c);
  std::vector<double> losses;
  for (int64_t k = 0; k < 6; ++k) {
    losses.push_back(a.step());
    if (k == 2) ck.save(3, position);
  }
  Job b(16, device);
  auto ckb = b.checkpoints(dir);
  const auto resumed = ckb.resume();
  ASSERT_TRUE(resumed.has_value());
  EXPECT_EQ(resumed->step, 3);
  EXPECT_EQ(resumed->data_position, position);
  EXPECT_TRUE(resumed->skipped.empty());
  for (int64_t k = resumed->step; k < 6; ++k) {
    EXPECT_EQ(b.step(), losses[static_cast<size_t>(k)]) << "step " << k;
  }
  expect_same_state(b.state(), a.state());
  EXPECT_EQ(b.scaler.get_scale(), a.scaler.get_scale());
  EXPECT_EQ(b.scaler.growth_tracker(), a.scaler.growth_tracker());
  remove_tree(dir);
}

}  // namespace

TEST(JobCheckpoints, AResumedJobEndsBitForBitWhereTheUninterruptedOneDoes) {
  expect_resumed_job_ends_where_uninterrupted_does("resume", torch::kCPU);
}

// On a GPU: the data and dropout's masks come from the CUDA generator,
// whose state the checkpoint holds.
TEST(JobCheckpoints, AResumedJobOnTheGpuEndsBitForBitWhereTheUninterruptedOneDoes_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  expect_resumed_job_ends_where_uninterrupted_does("resume_cuda", torch::Device("cuda:0"));
}

TEST(JobCheckpoints, TornCorruptedAndIncompleteCheckpointsAreRefusedByName) {
  const std::string dir = fresh_dir("torn");
  Job a;
  auto ck = a.checkpoints(dir, /*keep=*/3);
  a.step();
  ck.save(1);
  a.step();
  const std::string newest = ck.save(2);
  const std::string file = newest + "/rank-0.ckpt";
  std::filesystem::copy_file(file, file + ".good");
  // A later step whose ranks never all finished: no marker, never tried.
  std::filesystem::create_directories(dir + "/step-9");
  std::filesystem::copy_file(file, dir + "/step-9/rank-0.ckpt");

  auto resume_expecting = [&](const std::string& why) {
    Job b;
    auto ckb = b.checkpoints(dir, 3);
    const auto resumed = ckb.resume();
    ASSERT_TRUE(resumed.has_value());
    EXPECT_EQ(resumed->step, 1) << "the checkpoint before the refused one";
    ASSERT_EQ(resumed->skipped.size(), 1u);
    EXPECT_NE(resumed->skipped[0].find("rank 0's file " + file), std::string::npos)
        << resumed->skipped[0];
    EXPECT_NE(resumed->skipped[0].find(why), std::string::npos) << resumed->skipped[0];
  };
  truncate_to(file, std::filesystem::file_size(file) / 2);
  resume_expecting("truncated");
  std::filesystem::copy_file(file + ".good", file, std::filesystem::copy_options::overwrite_existing);
  corrupt(file);
  resume_expecting("checksum");
  std::filesystem::remove(file);
  resume_expecting("missing");
  // Every complete checkpoint refused: an error that lists them.
  truncate_to(dir + "/step-1/rank-0.ckpt", 100);
  Job c;
  auto ckc = c.checkpoints(dir, 3);
  MPIPE_EXPECT_ERROR(ckc.resume(), "none of the 2 complete checkpoints", "step-2", "missing",
                     "step-1", "truncated");
  remove_tree(dir);
}

TEST(JobCheckpoints, AnotherJobsCheckpointIsRefusedAndOldOnesAreRemoved) {
  const std::string dir = fresh_dir("other");
  Job a;
  auto ck = a.checkpoints(dir, /*keep=*/2);
  for (int64_t k = 1; k <= 4; ++k) {
    a.step();
    ck.save(k);
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-1"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-2"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/step-3/complete"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/step-4/complete"));
  Job wider(32);  // other stages: other parameter shapes
  auto ckw = wider.checkpoints(dir);
  MPIPE_EXPECT_ERROR(ckw.resume(), "step-4", "saved by another job", "step-3");
  MPIPE_EXPECT_ERROR(JobCheckpoints(dir, *a.pipe, *a.opt, nullptr, 0), "keep must be at least 1");
  MPIPE_EXPECT_ERROR(ck.save(-1), "the step must be >= 0", "-1");
  remove_tree(dir);
}
