#pragma once

// Private: saving and loading the state of a stage's Stateful modules (Note
// [State snapshots] in mpipe/state.h).

#include "mpipe/state.h"

#include <torch/nn/module.h>

#include <any>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

/// A Stateful module inside a stage, found when the stage was appended.
struct StatefulModule {
  std::shared_ptr<torch::nn::Module> module;  // keeps `state` alive
  Stateful* state = nullptr;
  std::string name;  // its path in the stage ("" for the stage itself) and type
};

/// The Stateful modules in `stage`'s tree, itself included.
inline std::vector<StatefulModule> find_stateful(const std::shared_ptr<torch::nn::Module>& stage) {
  std::vector<StatefulModule> out;
  for (const auto& item : stage->named_modules("", /*include_self=*/true)) {
    if (auto* s = dynamic_cast<Stateful*>(item.value().get())) {
      out.push_back({item.value(), s,
                     (item.key().empty() ? std::string("the stage itself") : item.key()) + " (" +
                         item.value()->name() + ")"});
    }
  }
  return out;
}

/// The states of some modules at one moment (those without snapshots are
/// skipped).
class StateSnapshot {
 public:
  StateSnapshot() = default;
  explicit StateSnapshot(const std::vector<StatefulModule>& modules) { add(modules); }
  /// Every stage's modules.
  explicit StateSnapshot(const std::vector<std::vector<StatefulModule>>& stages) {
    for (const auto& modules : stages) add(modules);
  }
  void load() const {
    for (const auto& s : saved_) s.first->load_state(s.second);
  }
  bool empty() const { return saved_.empty(); }

 private:
  void add(const std::vector<StatefulModule>& modules) {
    for (const auto& m : modules) {
      if (m.state->supports_state_snapshots()) saved_.emplace_back(m.state, m.state->save_state());
    }
  }
  std::vector<std::pair<Stateful*, std::any>> saved_;
};

/// Loads the states of its construction back if the scope is left by an
/// exception (a failed call leaves state as it was before the call).
class RollbackOnFailure {
 public:
  explicit RollbackOnFailure(const std::vector<std::vector<StatefulModule>>& stages)
      : snapshot_(stages), uncaught_(std::uncaught_exceptions()) {}
  ~RollbackOnFailure() {
    if (std::uncaught_exceptions() <= uncaught_) return;
    try {
      snapshot_.load();
    } catch (...) {  // the call's own error is the one to report
    }
  }
  RollbackOnFailure(const RollbackOnFailure&) = delete;
  RollbackOnFailure& operator=(const RollbackOnFailure&) = delete;

 private:
  StateSnapshot snapshot_;
  int uncaught_;
};

}  // namespace detail
}  // namespace mpipe
