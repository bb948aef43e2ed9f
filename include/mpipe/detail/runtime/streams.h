#pragma once

// Private: backend-generic stream and event helpers (c10's virtual guard
// interface, so no CUDA header is needed and CPU-only builds compile).

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

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

// Note [Pooled events]
// ~~~~~~~~~~~~~~~~~~~~
// Every hand-off records an event on the producer's stream, and a CUDA event
// made and destroyed per hand-off costs a driver call each way. Events are
// reused instead: one whose last holder lets go goes back to its device's
// free list, and the next hand-off records it again. That is safe because a
// stream that waited on it kept the state of the record it waited for (CUDA's
// cudaStreamWaitEvent semantics); nothing reads an event after its holders
// drop it. The pool keeps at most 1024 free events per device and lives as
// long as the process (events may be released during static destruction).
class EventPool {
 public:
  static EventPool& get() {
    static auto* pool = new EventPool();  // never destroyed
    return *pool;
  }
  std::shared_ptr<c10::Event> take(c10::Device device) {
    c10::Event* event = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = free_[key(device)];
      if (!free.empty()) {
        event = free.back().release();
        free.pop_back();
      }
    }
    if (!event) event = new c10::Event(device.type());
    return std::shared_ptr<c10::Event>(event, [this, device](c10::Event* e) { give(device, e); });
  }

 private:
  void give(c10::Device device, c10::Event* event) {
    std::unique_ptr<c10::Event> owned(event);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& free = free_[key(device)];
    if (free.size() < 1024) free.push_back(std::move(owned));
  }
  static std::pair<int, int> key(c10::Device d) { return {static_cast<int>(d.type()), d.index()}; }
  std::mutex mutex_;
  std::map<std::pair<int, int>, std::vector<std::unique_ptr<c10::Event>>> free_;
};

/// An event recorded on `stream` now (Note [Pooled events]).
inline std::shared_ptr<c10::Event> record_event(const c10::Stream& stream) {
  auto event = EventPool::get().take(stream.device());
  event->record(stream);
  return event;
}

}  // namespace detail
}  // namespace mpipe
