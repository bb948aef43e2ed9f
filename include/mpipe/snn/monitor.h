#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SNN_MONITOR_H_
#define MPIPE_SNN_MONITOR_H_

// The firing rate of every spiking layer during training or evaluation, as
// SpikingJelly's monitor.OutputMonitor with cal_firing_rate gives:
//
//   mpipe::snn::FiringRateMonitor monitor(*pipe);    // every neuron of the model
//   pipe->constant_train_step(x, T, y, loss_fn);     // ... any calls
//   std::cout << monitor.to_string();                // "stages.0.2  0.1342" per layer
//   monitor.reset();                                 // start counting afresh
//
// Counting adds one reduction per neuron step on the spikes' device; reading
// the rates synchronises with it. Steps replayed from a CUDA graph
// (cuda_graphs(true)) are not counted, nor recomputations (checkpointing).
// A model with neurons is never replayed from a graph automatically.

#include <mpipe/snn/neuron.h>

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace mpipe {
namespace snn {

/// Counts the spikes of every neuron (IFNode, LIFNode, ParametricLIFNode) of
/// a model while it lives: firing rates per layer since it started or since
/// reset(). A neuron keeps one count, for one monitor at a time: the last
/// one made takes it over (the count starts afresh), and an older monitor's
/// end leaves it counting. An overtaken monitor still reads that one count:
/// its rates() are the newer monitor's, and its reset() clears them.
class FiringRateMonitor {
 public:
  /// One spiking layer's firing rate.
  struct LayerRate {
    /// The neuron's name in the model, as named_modules() gives it.
    std::string name;
    /// Spikes over elements (neurons x steps x samples); 0 before any step.
    double rate = 0;
    /// The spikes counted.
    double spikes = 0;
    /// The elements they were fired from.
    int64_t elements = 0;
  };

  /// Starts counting in every neuron of `model` (the model itself included).
  explicit FiringRateMonitor(torch::nn::Module& model);
  /// Stops counting.
  ~FiringRateMonitor();
  FiringRateMonitor(const FiringRateMonitor&) = delete;
  FiringRateMonitor& operator=(const FiringRateMonitor&) = delete;

  /// Each neuron's firing rate, in the model's order (reads the counts: synchronises).
  std::vector<LayerRate> rates() const;
  /// Clears every count.
  void reset();
  /// One line per layer: its name and rate.
  std::string to_string() const;

 private:
  std::vector<std::pair<std::string, std::shared_ptr<NeuronBase>>> neurons_;
};

}  // namespace snn
}  // namespace mpipe

#endif  // MPIPE_SNN_MONITOR_H_
