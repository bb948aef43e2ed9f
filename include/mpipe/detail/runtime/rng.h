#pragma once

// Private: reproducible random draws in stage forwards (Note [Random draws]).

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

/// One call's random seed, taken on the caller's thread when the call starts.
struct CallRng {
  bool active = false;
  uint64_t seed = 0;

  /// Draws the call's seed from the default generators of the CPU and of
  /// `devices` (Note [Random draws]); inactive under PlainDraws.
  static CallRng begin(const std::vector<c10::Device>& devices);
};

/// While alive on the caller's thread, calls draw from the default generators
/// in their (fixed) run order instead: the CUDA-graph path, whose replays must
/// draw what the first, eager run drew.
class PlainDraws {
 public:
  PlainDraws();
  ~PlainDraws();
  PlainDraws(const PlainDraws&) = delete;
  PlainDraws& operator=(const PlainDraws&) = delete;

 private:
  bool previous_;
};

/// How many drawing operators have run in stages' forwards (in a pipeline's
/// RngScope), process-wide: compare two readings to see whether a call drew.
uint64_t draws_seen();

/// Routes the random draws of one (stage, item) forward on this thread to
/// private generators seeded from (call seed, stage, item, device). Nothing
/// when `rng` is inactive.
class RngScope {
 public:
  RngScope(const CallRng& rng, int64_t stage, int64_t item);
  ~RngScope();
  RngScope(const RngScope&) = delete;
  RngScope& operator=(const RngScope&) = delete;

  /// The generator this scope uses for `device`, made on first use.
  at::Generator generator(c10::Device device);

 private:
  uint64_t seed_ = 0;
  std::vector<std::pair<c10::Device, at::Generator>> generators_;
  RngScope* previous_ = nullptr;
  bool active_ = false;
};

}  // namespace detail
}  // namespace mpipe
