#pragma once

// The optimizer's state of one parameter, on LibTorch 1.13 (which keys it by
// the TensorImpl's address as text) and 2.x (by the address itself).

#include <c10/util/StringUtil.h>
#include <torch/optim/optimizer.h>

#include <stdexcept>
#include <string>
#include <type_traits>

namespace mpipe_test {

template <typename ParamState>
const ParamState& param_state(const torch::optim::Optimizer& opt, const torch::Tensor& p) {
  for (const auto& kv : opt.state()) {
    using Key = std::decay_t<decltype(kv.first)>;
    bool mine = false;
    if constexpr (std::is_same_v<Key, std::string>) {
      mine = kv.first == c10::str(p.unsafeGetTensorImpl());
    } else {
      mine = kv.first == static_cast<Key>(p.unsafeGetTensorImpl());
    }
    if (mine) return static_cast<const ParamState&>(*kv.second);
  }
  throw std::runtime_error("the optimizer holds no state for this parameter");
}

}  // namespace mpipe_test
