#pragma once

// The optimizer's state of one parameter, on LibTorch 1.13 (which keys it by
// the TensorImpl's address as text) and 2.x (by the address itself).

#include <c10/util/StringUtil.h>
#include <torch/optim/optimizer.h>

#include <stdexcept>
#include <string>

namespace mpipe_test {

/// Whether `key` of Optimizer::state() is `p`'s: its TensorImpl's address as
/// text (1.13) or the address (2.x); an overload each, so both compile.
inline bool is_state_key_of(const std::string& key, const torch::Tensor& p) {
  return key == c10::str(p.unsafeGetTensorImpl());
}
inline bool is_state_key_of(const void* key, const torch::Tensor& p) {
  return key == static_cast<const void*>(p.unsafeGetTensorImpl());
}

template <typename ParamState>
const ParamState& param_state(const torch::optim::Optimizer& opt, const torch::Tensor& p) {
  for (const auto& kv : opt.state()) {
    if (is_state_key_of(kv.first, p)) return static_cast<const ParamState&>(*kv.second);
  }
  throw std::runtime_error("the optimizer holds no state for this parameter");
}

}  // namespace mpipe_test
