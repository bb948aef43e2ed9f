// The second file of the consumer program: other headers, the same runtime.
#include <mpipe/distributed.h>
#include <mpipe/snn.h>
#include <mpipe/timeline.h>

#include <sstream>
#include <string>

std::string second_file_report() {
  mpipe::snn::LIFNode lif;
  auto spikes = lif->forward(torch::full({2, 3}, 3.0));
  std::ostringstream out;
  out << "second file: " << spikes.sum().item<double>() << " spikes; distributed "
      << (mpipe::distributed::available() ? "available" : "off");
  return out.str();
}
