#pragma once

// Private: one call's skip connections (Note [Skip connections]).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace mpipe {
namespace detail {

/// Who stashed and who popped each (name, item) of one call.
class SkipTable {
 public:
  /// Stage `stage` stashes `name` for `item`: refused when a stage already did.
  void stash(const std::string& name, int64_t item, int64_t stage);
  /// Stage `stage` pops `name` for `item`: the stage that stashed it; refused
  /// when none did or it was popped already.
  int64_t pop(const std::string& name, int64_t item, int64_t stage);
  /// One of the item's stashes that no stage popped, as (name, stasher), or
  /// a stasher of -1 when every stash was popped (ask once its last stage ran).
  std::pair<std::string, int64_t> unpopped(int64_t item) const;

 private:
  struct Entry {
    int64_t stasher = -1;
    int64_t popper = -1;
  };
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int64_t>, Entry> entries_;
};

/// While alive on this thread, mpipe::stash and mpipe::pop call these (a
/// stage call of a pipeline); otherwise they use the thread's own store.
class SkipScope {
 public:
  using Stash = std::function<void(const std::string&, at::Tensor)>;
  using Pop = std::function<at::Tensor(const std::string&)>;
  SkipScope(Stash stash, Pop pop);
  ~SkipScope();
  SkipScope(const SkipScope&) = delete;
  SkipScope& operator=(const SkipScope&) = delete;

  Stash stash;
  Pop pop;

 private:
  SkipScope* previous_;
};

}  // namespace detail
}  // namespace mpipe
