// A first mpipe program: a three-stage MLP checked against the plain model,
// trained with Adam, saved and loaded. It runs on cuda:0 when there is a GPU,
// else on the CPU.
#include <mpipe/mpipe.h>
#include <torch/torch.h>

#include <iostream>

using namespace torch::nn;

int main() {
  torch::manual_seed(0);
  const torch::Device device = torch::cuda::is_available() ? torch::Device("cuda:0")
                                                           : torch::Device(torch::kCPU);

  // Three stages. Each could have a device of its own ("cuda:1", torch::kCPU, ...).
  Sequential s0(Linear(32, 64), ReLU()), s1(Linear(64, 64), ReLU()), s2(Linear(64, 4));
  mpipe::ModelPipeline pipe;
  pipe->append(s0, device).append(s1, device).append(s2, device);

  // forward: micro-batches of 16 rows (or mpipe::chunks(4): 4 micro-batches),
  // the same result as the stages run one after another on the whole batch.
  auto x = torch::randn({64, 32}, device);
  auto plain = s2->forward(s1->forward(s0->forward(x)));
  double diff = (pipe->forward(x, /*split_size=*/16) - plain).abs().max().item<double>();
  diff += (pipe->forward(x, mpipe::chunks(4)) - plain).abs().max().item<double>();
  std::cout << "forward: max difference from the plain model " << diff << "\n";

  // Train: learn a labelling of 256 points. train_step splits the batch into
  // micro-batches of 32 rows, runs forwards and backwards under the 1F1B
  // schedule and adds the gradient of the whole batch's loss into .grad.
  auto data = torch::randn({256, 32}, device);
  auto labels = data.slice(1, 0, 4).argmax(1);  // on the last stage's device
  auto loss_fn = [](const torch::Tensor& logits, const torch::Tensor& target) {
    return functional::cross_entropy(logits, target);  // the mean over its rows
  };
  const auto step = mpipe::TrainStepOptions(/*split_size=*/32).schedule(mpipe::Schedule::OneFOneB);
  torch::optim::Adam optimizer(pipe->parameters(), 1e-2);
  double first_loss = 0, loss = 0;
  pipe->train();
  for (int epoch = 0; epoch < 60; ++epoch) {
    optimizer.zero_grad();
    loss = pipe->train_step(data, labels, loss_fn, step).item<double>();
    optimizer.step();
    if (epoch == 0) first_loss = loss;
  }
  pipe->eval();
  torch::NoGradGuard no_grad;
  auto accuracy = pipe->forward(data, 64).argmax(1).eq(labels).to(torch::kFloat).mean();
  std::cout << "training: loss " << first_loss << " -> " << loss << ", accuracy "
            << accuracy.item<double>() << "\n";

  // Save and load: every stage's parameters and buffers; each stage goes
  // back to its device.
  torch::save(pipe, "first_program.pt");
  mpipe::ModelPipeline again;
  again->append(Sequential(Linear(32, 64), ReLU()), device)
      .append(Sequential(Linear(64, 64), ReLU()), device)
      .append(Sequential(Linear(64, 4)), device);
  torch::load(again, "first_program.pt");
  const bool same = torch::equal(again->forward(data, 64), pipe->forward(data, 64));
  std::cout << "loaded copy gives the same outputs: " << (same ? "yes" : "no") << "\n";

  const bool ok = diff < 1e-5 && loss < 0.5 * first_loss && same;
  std::cout << "first_program: " << (ok ? "OK" : "FAILED") << "\n";
  return ok ? 0 : 1;
}
