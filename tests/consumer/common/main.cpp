// A user's program: builds a two-stage pipeline and checks it against the
// plain model. Built by the consumer tests through find_package (against
// mpipe::mpipe_header_only) and through add_subdirectory (mpipe::mpipe).
// Header-only through find_package, two files include mpipe (this one and
// second.cpp), so that header-only mode must define everything once (inline)
// or fail to link (common/consumer.cmake).
#include <mpipe/mpipe.h>

#include <torch/nn/modules/linear.h>

#include <cstring>
#include <iostream>
#include <string>

#ifdef MPIPE_HEADER_ONLY
#include <link.h>
#endif

#ifdef MPIPE_CONSUMER_SECOND_FILE
std::string second_file_report();  // second.cpp
#endif

int main() {
  auto a = torch::nn::Linear(4, 3), b = torch::nn::Linear(3, 2);
  mpipe::ModelPipeline pipe;
  pipe->append(a, "cpu").append(b, "cpu");
  auto x = torch::randn({6, 4});
  auto diff = (pipe->forward(x, 4) - b(a(x))).abs().max().item<double>();
  std::cout << "mpipe " << MPIPE_VERSION_STRING << " consumer: max diff " << diff << "\n";
#ifdef MPIPE_CONSUMER_SECOND_FILE
  const std::string second = second_file_report();
  std::cout << second << "\n";
  if (second.rfind("second file: ", 0) != 0) return 1;
#endif
#ifdef MPIPE_HEADER_ONLY
  // Header-only: the program must not load libmpipe.
  bool loaded = false;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* flag) {
        if (info->dlpi_name && std::strstr(info->dlpi_name, "libmpipe")) *static_cast<bool*>(flag) = true;
        return 0;
      },
      &loaded);
  std::cout << "header-only; libmpipe loaded: " << (loaded ? "yes" : "no") << "\n";
  if (loaded) return 1;
  const char* mode = "header-only";
#else
  const char* mode = "compiled";
#endif
  if (!(diff < 1e-6)) return 1;
  std::cout << "consumer: OK (" << mode << ")\n";
  return 0;
}
