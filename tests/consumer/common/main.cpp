// A user's program: builds a two-stage pipeline and checks it against the
// plain model. Built by the consumer tests through find_package and through
// add_subdirectory.
#include <mpipe/mpipe.h>

#include <torch/nn/modules/linear.h>

#include <iostream>

int main() {
  auto a = torch::nn::Linear(4, 3), b = torch::nn::Linear(3, 2);
  mpipe::ModelPipeline pipe;
  pipe->append(a, "cpu").append(b, "cpu");
  auto x = torch::randn({6, 4});
  auto diff = (pipe->forward(x, 4) - b(a(x))).abs().max().item<double>();
  std::cout << "mpipe " << MPIPE_VERSION_STRING << " consumer: max diff " << diff << "\n";
  return diff < 1e-6 ? 0 : 1;
}
