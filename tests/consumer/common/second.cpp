// The second file of the consumer program: other headers, the same runtime
// (header-only: mpipe.h first, which pulls the implementation).
#include <mpipe/mpipe.h>

#include <mpipe/distributed.h>
#include <mpipe/snn.h>
#include <mpipe/timeline.h>

#include <sstream>
#include <string>

// The user's own helpers, named like helpers of mpipe's implementation, and a
// using-directive: header-only mode must add no names to mpipe's namespaces,
// or these calls would be ambiguous.
using namespace mpipe;
namespace {
std::string pad(const std::string& s, size_t) { return s; }
std::string escape(const std::string& s) { return s; }
std::string human(int64_t bytes) { return std::to_string(bytes); }
bool recomputing() { return false; }
}  // namespace

std::string second_file_report() {
  if (pad("a", 2) != "a" || escape("b") != "b" || human(3) != "3" || recomputing()) return "helpers";
  mpipe::snn::LIFNode lif;
  auto spikes = lif->forward(torch::full({2, 3}, 3.0));
  std::ostringstream out;
  out << "second file: " << spikes.sum().item<double>() << " spikes; distributed "
      << (mpipe::distributed::available() ? "available" : "off");
  return out.str();
}
