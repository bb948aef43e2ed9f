#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/skips.h"

#include "mpipe/skip.h"

#include <c10/util/Exception.h>

namespace mpipe {
namespace detail {

// Note [Skip connections]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A stage's forward calls mpipe::stash(name, t) and a later stage's calls
// mpipe::pop(name), as with torchgpipe's skippable modules. The executor runs
// every stage call in a SkipScope that knows the call, the stage and the item:
//  - stash sends t through the transport under Key{Skip, item, name} to no
//    stage in particular, and the call's SkipTable notes the stasher;
//  - pop receives that key on the popping stage, so the tensor moves from the
//    stasher's device straight to the popper's (the stages between never see
//    it), ordered after the stasher's stream like any hand-off.
// In forward-type calls the autograd graph spans the call, so the gradient of
// a popped tensor flows back through the copy by itself. Training steps cut the
// graph at stage boundaries (Note [Training runtime]): the popper receives a
// detached tensor that requires grad; its backward sends that tensor's
// gradient back under Key{SkipGradient, item, name}, and the stasher's
// backward adds the stashed tensor to its roots with that gradient. In every
// schedule B(k, i) runs before B(j, i) for j < k, so the gradient is there. A
// checkpointed stage's recompute pops what its forward popped (kept) and its
// stashes become backward roots without being sent again.
//
// Routes are not declared: the table learns them as the call runs, and the
// checks follow from that: a pop that finds no stash, a second stash of a name
// for one item, and (once an item's last stage ran) a stash nobody popped are
// errors naming the stages. The last is found at the item's last stage but
// is the stasher's doing: its error names the stasher, the name and the item
// (Executor::forward_action), not the stage or phase where it was found.
// Across processes the routes are not declared either: a skip still unpopped
// travels with its item's activations to the next rank (Note [Cross-process
// calls] in remote-inl.h).

MPIPE_FUNC void SkipTable::stash(const std::string& name, int64_t item, int64_t stage) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto inserted = entries_.emplace(std::make_pair(name, item), Entry{stage, -1});
  TORCH_CHECK(inserted.second, "stash('", name, "'): stage ",
              inserted.first->second.stasher,
              " already stashed a tensor under this name for this item; each name is "
              "stashed once per micro-batch or time step");
}

MPIPE_FUNC int64_t SkipTable::pop(const std::string& name, int64_t item, int64_t stage) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find({name, item});
  TORCH_CHECK(it != entries_.end(), "pop('", name, "'): no earlier stage stashed a tensor "
              "under this name for this item (stash it in this stage or an earlier one)");
  TORCH_CHECK(it->second.popper < 0, "pop('", name, "'): stage ", it->second.popper,
              " already popped what stage ", it->second.stasher,
              " stashed under this name; each stash is popped once");
  it->second.popper = stage;
  return it->second.stasher;
}

MPIPE_FUNC std::pair<std::string, int64_t> SkipTable::unpopped(int64_t item) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& e : entries_) {
    if (e.first.second == item && e.second.popper < 0) return {e.first.first, e.second.stasher};
  }
  return {std::string(), -1};
}

MPIPE_INLINE_VAR thread_local SkipScope* t_skip_scope = nullptr;
// Outside pipeline calls.
MPIPE_INLINE_VAR thread_local std::map<std::string, at::Tensor>* t_store = nullptr;

MPIPE_FUNC std::map<std::string, at::Tensor>& store() {
  if (!t_store) t_store = new std::map<std::string, at::Tensor>();  // per thread, small
  return *t_store;
}

MPIPE_FUNC SkipScope::SkipScope(Stash s, Pop p)
    : stash(std::move(s)), pop(std::move(p)), previous_(t_skip_scope) {
  t_skip_scope = this;
}

MPIPE_FUNC SkipScope::~SkipScope() { t_skip_scope = previous_; }

}  // namespace detail

MPIPE_FUNC void stash(const std::string& name, at::Tensor tensor) {
  TORCH_CHECK(tensor.defined(), "mpipe::stash('", name, "'): the tensor is undefined");
  if (detail::t_skip_scope) return detail::t_skip_scope->stash(name, std::move(tensor));
  auto& s = detail::store();
  TORCH_CHECK(s.count(name) == 0, "mpipe::stash('", name, "'): a tensor is already stashed "
              "under this name and was not popped (outside a pipeline call; clear_stashed() "
              "drops it)");
  s.emplace(name, std::move(tensor));
}

MPIPE_FUNC at::Tensor pop(const std::string& name) {
  if (detail::t_skip_scope) return detail::t_skip_scope->pop(name);
  auto& s = detail::store();
  auto it = s.find(name);
  TORCH_CHECK(it != s.end(), "mpipe::pop('", name, "'): nothing was stashed under this name");
  at::Tensor t = std::move(it->second);
  s.erase(it);
  return t;
}

MPIPE_FUNC void clear_stashed() {
  if (detail::t_store) detail::t_store->clear();
}

}  // namespace mpipe
