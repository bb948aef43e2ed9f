#pragma once

// Private: backend-generic stream and event helpers (c10's virtual guard
// interface, so no CUDA header is needed and CPU-only builds compile).

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <memory>

namespace mpipe {
namespace detail {

inline c10::Stream pool_stream(c10::Device device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
}

/// What a process-wide stream is for (Note [Shared streams and workers]).
enum class StreamRole { Compute, Copy };

/// The process's stream for (`device`, `role`, `slot`), taken from the device's
/// pool at first use and the same for every pipeline afterwards.
c10::Stream shared_stream(c10::Device device, StreamRole role, size_t slot);

inline c10::Stream current_stream(c10::Device device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

/// record_stream: `t`'s memory is in use on `stream` (Note [Hand-offs] in transport-inl.h).
inline void record_on(const at::Tensor& t, const c10::Stream& stream) {
  if (!t.defined() || !t.has_storage() || t.device().is_cpu()) return;
  c10::impl::VirtualGuardImpl(t.device().type()).recordDataPtrOnStream(t.storage().data_ptr(),
                                                                       stream);
}

/// `t` is used on its device's current stream now (the caller's: a call's
/// results handed to it).
inline void record_on_current(const at::Tensor& t) {
  if (t.defined() && !t.device().is_cpu()) record_on(t, current_stream(t.device()));
}

inline std::shared_ptr<c10::Event> record_event(const c10::Stream& stream) {
  auto event = std::make_shared<c10::Event>(stream.device_type());
  event->record(stream);
  return event;
}

}  // namespace detail
}  // namespace mpipe
