// A tour of mpipe: one short function per topic, each checked against the
// plain model where there is one. The README's and docs/' code blocks are
// excerpts of this file (tests/doc_blocks.py checks that they still are).
// Runs on cuda:0 when there is a GPU, else on the CPU; started by a launcher
// (mpipe-launch -n 2 -- ./tour), it runs the part across processes.
#include <mpipe/mpipe.h>
#include <mpipe/autocast.h>
#include <mpipe/snn.h>
#include <mpipe/distributed.h>
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <string>

using namespace torch::nn;

namespace {

bool close(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && torch::allclose(a.to(torch::kCPU), b.to(torch::kCPU), 1e-4, 1e-5);
}

// Stages with several tensors ------------------------------------------------

struct EncoderImpl : Module {                   // (hidden, mask) -> (hidden, mask)
  EncoderImpl() : linear(register_module("linear", Linear(16, 16))) {}
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor h, torch::Tensor mask) {
    return {torch::relu(linear(h)) * mask, mask};
  }
  Linear linear;
};
TORCH_MODULE(Encoder);

bool several_tensors(torch::Device device) {
  Encoder e0, e1;
  mpipe::ModelPipeline pipe;
  pipe->append(e0, device).append(e1, device);
  auto x = torch::randn({32, 16}, device);
  auto mask = (torch::rand({16}, device) > 0.2).to(torch::kFloat);  // one mask for every row
  mpipe::Tensors out = pipe->forward({x, mpipe::unbatched(mask)}, /*split_size=*/8);
  auto plain = std::get<0>(e1(std::get<0>(e0(x, mask)), mask));
  return close(out[0], plain);
}

// Skip connections ------------------------------------------------------------

struct DownImpl : Module {
  DownImpl() : linear(register_module("linear", Linear(8, 8))) {}
  torch::Tensor forward(torch::Tensor x) {
    mpipe::stash("enc1", x);                    // kept for the last stage
    return torch::tanh(linear(x));
  }
  Linear linear;
};
TORCH_MODULE(Down);

struct UpImpl : Module {
  UpImpl() : linear(register_module("linear", Linear(8, 8))) {}
  torch::Tensor forward(torch::Tensor x) {
    return linear(x) + mpipe::pop("enc1");      // the first stage's input, on this device
  }
  Linear linear;
};
TORCH_MODULE(Up);

bool skip_connections(torch::Device device) {
  Down down;
  Sequential middle(Linear(8, 8), Tanh());
  Up up;
  mpipe::ModelPipeline pipe;
  pipe->append(down, device).append(middle, device).append(up, device);
  auto x = torch::randn({12, 8}, device);
  auto y = pipe->forward(x, 4);
  auto plain = up(middle->forward(down(x)));    // outside a pipeline, too
  return close(y, plain);
}

// When something fails --------------------------------------------------------

bool when_something_fails(torch::Device device) {
  mpipe::ModelPipeline pipe;
  pipe->append(Sequential(Linear(8, 16)), device).append(Sequential(Linear(32, 2)), device);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
    return functional::mse_loss(out, y);
  };
  auto x = torch::randn({8, 8}, device), y = torch::randn({8, 2}, device);
  torch::Tensor loss;
  std::string message;
  try {
    loss = pipe->train_step(x, y, loss_fn, mpipe::TrainStepOptions(4));
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    message = e.what_without_backtrace();
  }
  // The message names the stage, the micro-batch and the shape it was given.
  return message.find("stage 1") != std::string::npos &&
         message.find("[4, 16]") != std::string::npos;
}

// Spiking networks -------------------------------------------------------------

bool spiking(torch::Device device) {
  namespace snn = mpipe::snn;
  auto train_x = torch::rand({64, 784}, device);
  auto train_labels = torch::randint(0, 10, {64}, torch::TensorOptions(device).dtype(torch::kLong));
  std::vector<std::pair<torch::Tensor, torch::Tensor>> train_batches = {
      {train_x.slice(0, 0, 32), train_labels.slice(0, 0, 32)},
      {train_x.slice(0, 32), train_labels.slice(0, 32)}};
  auto x_test = train_x, labels_test = train_labels;

  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().reset_state_each_call(true));
  pipe->append(Sequential(Linear(784, 512), snn::LIFNode()), device)
      .append(Sequential(Linear(512, 10), snn::LIFNode()), device);
  torch::optim::Adam optimizer(pipe->parameters(), 1e-3);
  const int64_t T = 8;
  // constant_train_step hands the loss the SUM of the T outputs: turn it into a
  // rate first, or the loss trains at T times the scale.
  auto loss_fn = [T](const torch::Tensor& summed, const torch::Tensor& labels) {
    return snn::rate_mse_loss(snn::rate_from_sum(summed, T), labels);
  };
  for (auto& [x, labels] : train_batches) {
    optimizer.zero_grad();
    pipe->constant_train_step(x, T, labels, loss_fn);   // resets the neurons before and after
    optimizer.step();
  }
  torch::NoGradGuard no_grad;                            // evaluation
  auto rate = snn::rate_from_sum(pipe->constant_forward(x_test, T), T);
  auto accuracy = snn::predict(rate).eq(labels_test).to(torch::kFloat).mean();

  // reset_state_each_call: every call starts from rest, so two calls agree.
  const bool repeats = torch::equal(pipe->constant_forward(x_test, T), pipe->constant_forward(x_test, T));
  return repeats && accuracy.item<double>() >= 0;
}

bool time_chunks(torch::Device device) {
  namespace snn = mpipe::snn;
  const int64_t T = 8;
  auto x = torch::rand({16, 784}, device);
  auto labels = torch::randint(0, 10, {16}, torch::TensorOptions(device).dtype(torch::kLong));
  auto loss_fn = [T](const torch::Tensor& summed, const torch::Tensor& labels) {
    return snn::rate_mse_loss(snn::rate_from_sum(summed, T), labels);
  };
  auto options = mpipe::ModelPipelineOptions().step_mode(snn::StepMode::Multi).time_chunk(4);
  mpipe::ModelPipeline pipe(options);
  auto multi = snn::LIFNodeOptions().step_mode(snn::StepMode::Multi);
  pipe->append(Sequential(snn::SeqToANN(Linear(784, 512)), snn::LIFNode(multi)), device)
      .append(Sequential(snn::SeqToANN(Linear(512, 10)), snn::LIFNode(multi)), device);
  pipe->constant_train_step(x, T, labels, loss_fn);      // chunks of 4 steps
  // 4 micro-batches x chunks of 8 steps: 4 * T / 8 items, each micro-batch with its own state
  pipe->constant_train_step(x, T, labels, loss_fn, /*time_chunk=*/8, mpipe::chunks(4));
  torch::NoGradGuard no_grad;
  auto chunked = pipe->constant_forward(x, T);
  mpipe::reset_states(*pipe);
  auto whole = pipe->constant_forward(x, T, true, /*time_chunk=*/T);  // one chunk: no overlap over time
  mpipe::reset_states(*pipe);
  auto split = pipe->constant_forward(x, T, true, std::nullopt, /*split=*/4);  // 4 rows each
  mpipe::reset_states(*pipe);
  return close(chunked, whole) && close(chunked, split);
}

// Schedules ----------------------------------------------------------------------

bool schedules(torch::Device device) {
  Sequential model(Linear(32, 64), ReLU(), Linear(64, 64), ReLU(), Linear(64, 64), ReLU(),
                   Linear(64, 10));
  model->to(device);
  auto x = torch::randn({64, 32}, device);
  auto y = torch::randint(0, 10, {64}, torch::TensorOptions(device).dtype(torch::kLong));
  auto loss_fn = [](const torch::Tensor& logits, const torch::Tensor& y) {
    return functional::cross_entropy(logits, y);
  };
  const std::vector<int64_t> sizes = {2, 2, 2, 1};
  auto pipe = mpipe::balance::from_sequential(model, {device, device, device, device}, sizes);

  auto layer_times = mpipe::balance::profile_time(model, x.slice(0, 0, 16));
  auto costs = mpipe::balance::stage_costs(layer_times, sizes);
  auto step = mpipe::TrainStepOptions(16)
                  .schedule(mpipe::Schedule::Auto)
                  .stage_costs(costs)                 // schedules::Costs, one per stage
                  .activation_bytes({2e8, 2e8, 2e8, 2e8})
                  .memory_limit(8e9);                 // bytes of activations per device
  auto auto_loss = pipe->train_step(x, y, loss_fn, step);
  auto choice = mpipe::choose_schedule(/*n_micro=*/4, /*n_stages=*/4, step, {0, 0, 0, 0});
  std::cout << "  Auto chose " << mpipe::to_string(choice.schedule) << "\n";
  

  using mpipe::schedules::F, mpipe::schedules::B;
  auto two = mpipe::balance::from_sequential(model, {device, device}, {4, 3});
  auto mine = mpipe::TrainStepOptions(32).programs({   // 2 stages; 64 rows: 2 micro-batches
      {F(0, 0), F(1, 0), B(1, 0), B(0, 0)},            // worker of stage 0
      {F(0, 1), B(0, 1), F(1, 1), B(1, 1)}});          // worker of stage 1
  auto given_loss = two->train_step(x, y, loss_fn, mine);
  return close(auto_loss, given_loss);                  // the same model, the same loss
}

// Mixed precision ----------------------------------------------------------------

bool precision(torch::Device device) {
  mpipe::ModelPipeline pipe;
  pipe->append(Sequential(mpipe::Linear(32, 64), ReLU()), device)
      .append(Sequential(mpipe::Linear(64, 10)), device);
  torch::optim::SGD optimizer(pipe->parameters(), 0.1);
  auto x = torch::randn({64, 32}, device), y = torch::randn({64, 10}, device);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
    return functional::mse_loss(out.to(torch::kFloat), y);
  };
  torch::Tensor loss;
  {
    mpipe::AutocastGuard bf16(device.type(), torch::kBFloat16);  // torch.autocast, in C++
    loss = pipe->train_step(x, y, loss_fn, mpipe::TrainStepOptions(16));
  }
  optimizer.step();
  return std::isfinite(loss.item<double>());
}

// Balancing ----------------------------------------------------------------------

bool balancing(torch::Device device) {
  Sequential model(Linear(32, 256), ReLU(), Linear(256, 256), ReLU(), Linear(256, 32), ReLU(),
                   Linear(32, 10));
  model->to(device);
  auto sample_batch = torch::randn({64, 32}, device);
  auto costs = mpipe::balance::profile_time(model, sample_batch);   // or profile_memory
  auto pipe = mpipe::balance::balanced(model, {device, device}, costs);
  auto manual = mpipe::balance::from_sequential(model, {device, device}, {4, 3});
  torch::NoGradGuard no_grad;
  auto plain = model->forward(sample_batch);
  return pipe->size() == 2 && close(pipe->forward(sample_batch, 16), plain) &&
         close(manual->forward(sample_batch, 16), plain);
}

// Timelines and memory reports ---------------------------------------------------

bool timelines(torch::Device device) {
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().record_timeline(true).track_memory(true));
  pipe->append(Sequential(Linear(32, 64), ReLU()), device).append(Sequential(Linear(64, 10)), device);
  auto x = torch::randn({64, 32}, device), y = torch::randn({64, 10}, device);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
    return functional::mse_loss(out, y);
  };
  pipe->train_step(x, y, loss_fn, mpipe::TrainStepOptions(16).schedule(mpipe::Schedule::OneFOneB));
  mpipe::Timeline t = pipe->timeline();
  t.save_chrome_trace("step.json");   // Perfetto or chrome://tracing
  t.save_svg("step.svg");             // a self-contained Gantt chart
  std::printf("  bubble %.1f %% (schedule: %.1f %%)\n", 100 * t.bubble_fraction(),
              100 * t.schedule_bubble);
  std::cout << pipe->memory_report().to_string();
  return t.tasks.size() == 2 * 2 * 4;  // a forward and a backward per stage and micro-batch
}

// Across processes ---------------------------------------------------------------

Sequential make_stage(int64_t s) {
  torch::manual_seed(s);  // every rank builds stage s alike
  return Sequential(Linear(16, 16), Tanh());
}

bool across_processes(torch::Device) {
  // A GPU of its own per rank of this machine, else the CPU: two ranks
  // cannot share one GPU over NCCL.
  auto env = [](const char* name) { return std::atoll(std::getenv(name) ? std::getenv(name) : "0"); };
  const bool gpus = torch::cuda::device_count() >= env("LOCAL_WORLD_SIZE");
  const torch::Device device = gpus ? torch::Device(torch::kCUDA, env("LOCAL_RANK"))
                                    : torch::Device(torch::kCPU);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
    return functional::mse_loss(out, y);
  };
  torch::manual_seed(7);
  auto x = torch::randn({64, 16}).to(device), y = torch::randn({64, 16}).to(device);

  auto group = mpipe::distributed::init_from_env();   // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group));
  auto [first, end] = group.stage_range(4);          // rank 0 of 2: stages 0-1
  for (int64_t s = first; s < end; ++s) pipe->append(make_stage(s), device);
  auto loss = pipe->train_step(x, y, loss_fn, mpipe::TrainStepOptions(32));  // x read on the first rank, y on the last
  if (group.is_last()) std::cout << loss.item<double>() << "\n";            // other ranks: undefined
  torch::save(pipe, group.rank_path("model.pt"));    // each rank its stages: model.rank0.pt, ...

  // The V of ZB-V and DualPipeV: rank r holds stages r and 2S - 1 - r of 2S,
  // so rank 0 reads the inputs and also gets the loss.
  const auto mine = group.v_stages(2 * group.pipeline_size());  // rank 1 of 2: {1, 2}
  mpipe::ModelPipeline vee(mpipe::ModelPipelineOptions().process_group(group).stage_numbers(mine));
  for (int64_t s : mine) vee->append(make_stage(s), device);
  auto step = mpipe::TrainStepOptions(8).schedule(mpipe::Schedule::DualPipeV);
  auto v_loss = vee->train_step(x, y, loss_fn, step);
  if (v_loss.defined()) std::cout << v_loss.item<double>() << "\n";  // rank 0

  auto plain = [&](int64_t n) {  // the plain model of n stages, on one rank
    torch::Tensor h = x;
    for (int64_t s = 0; s < n; ++s) {
      auto stage = make_stage(s);
      stage->to(device);
      h = stage->forward(h);
    }
    return loss_fn(h, y);
  };
  const bool v_ok = group.pipeline_rank() == 0
                        ? close(v_loss, plain(2 * group.pipeline_size()))
                        : !v_loss.defined();
  return v_ok && (group.is_last() ? close(loss, plain(4)) : !loss.defined());
}

}  // namespace

int main() {
  const torch::Device device = torch::cuda::is_available() ? torch::Device("cuda:0")
                                                           : torch::Device(torch::kCPU);
  bool ok = true;
  auto run = [&](const char* name, bool (*f)(torch::Device)) {
    torch::manual_seed(0);
    const bool passed = f(device);
    std::cout << name << ": " << (passed ? "OK" : "FAILED") << "\n";
    ok = ok && passed;
  };
  if (std::getenv("WORLD_SIZE")) {  // started by a launcher: only the part across processes
    run("across processes", across_processes);
  } else {
    run("several tensors", several_tensors);
    run("skip connections", skip_connections);
    run("when something fails", when_something_fails);
    run("spiking", spiking);
    run("time chunks", time_chunks);
    run("schedules", schedules);
    run("precision", precision);
    run("balancing", balancing);
    run("timelines", timelines);
  }
  std::cout << "tour: " << (ok ? "OK" : "FAILED") << "\n";
  return ok ? 0 : 1;
}
