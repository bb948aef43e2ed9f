#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/streams.h"

#include <map>
#include <mutex>
#include <string>
#include <tuple>

namespace mpipe {
namespace detail {

MPIPE_FUNC c10::Stream shared_stream(c10::Device device, StreamRole role, size_t slot) {
  static std::mutex mutex;
  // Never destroyed: streams outlive every pipeline (and static destruction).
  static auto* streams = new std::map<std::tuple<std::string, int, size_t>, c10::Stream>();
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device.str(), static_cast<int>(role), slot);
  auto it = streams->find(key);
  if (it == streams->end()) it = streams->emplace(key, pool_stream(device)).first;
  return it->second;
}

}  // namespace detail
}  // namespace mpipe
