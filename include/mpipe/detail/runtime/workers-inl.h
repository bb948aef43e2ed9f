#pragma once

// Private: the worker threads every pipeline of the process shares.

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/executor.h"

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace mpipe {
namespace detail {

// Note [Shared streams and workers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Stage streams and worker threads belong to the process, not to a pipeline:
// the k-th stage on a device computes on that device's k-th shared compute
// stream, copies use shared copy streams, and stage k's program runs on shared
// worker k. Per-pipeline streams and threads leaked GPU memory: LibTorch keeps
// a cuBLAS workspace per (handle, stream) pair for the life of the process,
// and handles are per thread, so every pipeline with fresh streams and fresh
// threads added workspaces (about 260 MiB per 4-stage pipeline on an H200)
// until the 32 pool streams per device were used up. With shared streams and
// workers the pairs repeat and memory stays flat however many pipelines a
// program builds.
//
// Pipelines called at the same time from different threads share the
// workers. A call queues all its stage programs under one process-wide lock,
// so every worker sees calls in the same order and a call's programs never
// wait behind a later call's (which could deadlock: A's stage 0 waiting for
// A's stage 1, queued behind B's stage 1, waiting for B's stage 0, queued
// behind A's). Such calls therefore run one after the other on the workers,
// as their GPU work would on shared streams. A call made from inside a stage
// (on a worker thread) runs inline, so it never waits for its own worker.

MPIPE_INLINE_VAR thread_local bool t_on_worker = false;

MPIPE_FUNC bool on_shared_worker() { return t_on_worker; }

MPIPE_FUNC std::mutex& queue_mutex() {
  static std::mutex m;
  return m;
}

/// Shared worker k, started at first use and never destroyed.
MPIPE_FUNC Worker& shared_worker(size_t k) {
  static std::mutex mutex;
  static auto* workers = new std::vector<std::unique_ptr<Worker>>();
  std::lock_guard<std::mutex> lock(mutex);
  while (workers->size() <= k) workers->push_back(std::make_unique<Worker>());
  return *(*workers)[k];
}

MPIPE_FUNC Worker::Worker() : thread_([this] { loop(); }) {}

MPIPE_FUNC Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

MPIPE_FUNC void Worker::push(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

MPIPE_FUNC void Worker::loop() {
  t_on_worker = true;
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      auto ready = [this] { return stop_ || !queue_.empty(); };
      cv_.wait(lock, ready);
      if (queue_.empty()) return;
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();          // tasks catch their own errors (Executor::run_program)
    fn = nullptr;  // release what the task captured (tensors) before waiting
  }
}

}  // namespace detail
}  // namespace mpipe
