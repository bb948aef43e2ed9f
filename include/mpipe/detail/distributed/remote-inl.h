#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/distributed/remote.h"

#include "mpipe/detail/distributed/group.h"
#include "mpipe/detail/runtime/skips.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

namespace mpipe {
namespace detail {

// Note [Cross-process calls]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A pipeline on a process group holds, on each rank, a contiguous range of
// the global stages; the ranges are exchanged with every rank of the world
// at the first call (Layout). Every call then runs in four steps on every rank:
//  1. open: a link to every other rank of the pipeline (gloo_link-inl.h): a
//     receiving thread per peer reads that peer's messages in the order they
//     were sent (one Gloo tag per pipeline, so order is all that matches
//     them, as it would be on NCCL) until the peer's End or Abort.
//  2. agree: the first rank checks its inputs and sends a Call message (the
//     method, the micro-batch count and sizes, the schedule); the others wait
//     for it and refuse a different method. So shapes and micro-batch counts
//     may change from call to call, and only the first rank needs the input.
//  3. run: the executor runs, on each rank, the global programs restricted to
//     its stages, with a RemoteTransport: hand-offs between local stages stay
//     local; one whose other end is remote is posted without waiting (so no
//     schedule can deadlock on a send: 1F1B's forward-send and backward-
//     receive cannot block each other), one tensor per message, each behind a
//     header of kind, item, stage, dtype and shape. A skip's stasher does not
//     know who pops it: skips still unpopped when an item's activations leave
//     a rank go along, just before them, to the next rank, and so on; a skip's
//     gradient goes straight back to the rank of its stasher.
//  4. end: every rank sends End (or Abort with its error) to every other rank
//     and waits for theirs. Every message of the call is read before the
//     peer's End, so the next call starts on clean channels even after an
//     error, and a rank that finished its own work still fails when another
//     rank failed ("rank 2 failed: ..."), naming the stage and item.
// Every rank takes part in that exchange, also one that appended no stage:
// then every rank fails naming it. A rank that appends a stage after the
// first call fails its next calls through the call itself (step 4 carries its
// error to every rank).
// A peer that dies breaks its connection (the receiving thread fails at once).
// One that stalls leaves the ranks after it waiting for inputs and those
// before it for gradients, each behind the next: a receive from another rank
// waits the group's timeout plus a grace that grows with the hand-offs
// between ranks from the pipeline's end it waits on (half a second per rank
// over the whole chain, so a quarter per hand-off in the V, which crosses
// each boundary twice), so the stalled rank's neighbour gives up first
// and its Abort, naming the stalled rank, reaches the others before they give
// up; a receive from a stage of the same rank waits without a timeout (that
// stage delivers or the call fails), so no rank ever names itself. The call
// then ends without waiting for the stalled rank's End: the Abort carries
// its rank (Note [Ending a call] in gloo_link-inl.h). A rank stalled before
// the pipeline's first call is named by the exchange of the stage ranges (one
// message to and from every rank, each waited for with the timeout). A stall, a death or a broken
// protocol marks the group broken: later calls fail at once (restart every
// rank). Errors in a stage or in a call's arguments leave the group usable.
//
// Note [Message addresses]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A peer may start the call's run, and send its first messages, before this
// rank attached its transport. So every Data message is addressed: its call
// (the header's pipeline and sequence number, checked by the receiving
// thread) and its item, stage and kind (the transport's key). RemoteCall
// keeps what comes before the one attach of the call in early_ and hands it
// over at attach; after detach, the call is over on this rank (it ended or
// failed) and what still comes is dropped. The debug hook
// MPIPE_DEBUG_CHAOS=<seed> stretches these windows: it delays every received
// message by up to 3 ms at random (so messages overtake one another) and
// pauses before a third of the attaches, 20-60 ms. The stress test runs
// under it (docs/RELIABILITY.md). (Calls once ran in phases, each attaching
// its own transport, and messages carried their phase: constant_train_step's
// backward was a second phase. Every call kind is one executor run now.)

MPIPE_FUNC int64_t debug_chaos_seed() {
  static const int64_t seed = [] {
    const char* v = std::getenv("MPIPE_DEBUG_CHAOS");
    if (!v || !*v) return int64_t{-1};
    try {
      return static_cast<int64_t>(std::stoull(v) & 0x7fffffffffffffffULL);
    } catch (...) {
      TORCH_CHECK(false, "mpipe: MPIPE_DEBUG_CHAOS must be a non-negative integer (a seed), got '",
                  v, "'");
    }
  }();
  return seed;
}

constexpr int64_t kWithNext = 16;  // in a Tailored op's kind field: Op::with_next

const char* const kMethods[] = {"forward", "constant_forward", "sequence_forward", "train_step",
                                "constant_train_step"};

MPIPE_FUNC int64_t method_code(const char* method) {
  for (int64_t k = 0; k < 5; ++k) {
    if (std::strcmp(kMethods[k], method) == 0) return k;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown method ", method);
}

MPIPE_FUNC std::vector<int64_t> CallInfo::fields() const {
  std::vector<int64_t> f = {method,         n_items,   rows,       batch,   reduce, schedule,
                            virtual_stages, reduction, time_chunk, programs};
  // Then Tailored's programs: a length and its ops each, a pair's first op
  // (Op::with_next: DualPipeV's programs may win) marked by kWithNext.
  for (const auto& p : tailored) {
    f.push_back(static_cast<int64_t>(p.size()));
    for (const auto& op : p) {
      f.insert(f.end(), {static_cast<int64_t>(op.kind) + (op.with_next ? kWithNext : 0),
                         op.micro_batch, op.stage});
    }
  }
  return f;
}

MPIPE_FUNC CallInfo CallInfo::from(const std::vector<int64_t>& f) {
  TORCH_CHECK(f.size() >= 10, "a malformed call message (", f.size(), " fields)");
  CallInfo c;
  c.method = f[0];
  c.n_items = f[1];
  c.rows = f[2];
  c.batch = f[3];
  c.reduce = f[4];
  c.schedule = f[5];
  c.virtual_stages = f[6];
  c.reduction = f[7];
  c.time_chunk = f[8];
  c.programs = f[9];
  for (size_t k = 10; k < f.size();) {
    TORCH_CHECK(f[k] >= 0 && static_cast<size_t>(f[k]) <= (f.size() - k - 1) / 3,
                "a malformed call message (a program of ", f[k], " operations in ", f.size(),
                " fields)");
    const auto len = static_cast<size_t>(f[k++]);
    c.tailored.emplace_back();
    for (size_t j = 0; j < len; ++j, k += 3) {
      const int64_t kind = f[k] & ~kWithNext;
      TORCH_CHECK(f[k] >= 0 && kind <= static_cast<int64_t>(schedules::OpKind::BackwardWeight),
                  "a malformed call message (operation kind ", f[k], ")");
      c.tailored.back().push_back(
          schedules::Op{static_cast<schedules::OpKind>(kind), f[k + 1], f[k + 2]});
      c.tailored.back().back().with_next = (f[k] & kWithNext) != 0;
    }
  }
  return c;
}

MPIPE_FUNC std::string Layout::ranks_stages(int64_t p) const {
  const auto& mine = stages[static_cast<size_t>(p)];
  if (mine.size() == 1) return c10::str("stage ", mine[0]);
  if (mine.back() - mine.front() + 1 == static_cast<int64_t>(mine.size())) {
    return c10::str("stages ", mine.front(), "-", mine.back());
  }
  std::string list;
  for (int64_t s : mine) list += c10::str(list.empty() ? "" : ", ", s);
  return "stages " + list;
}

MPIPE_FUNC int64_t Layout::hops_before(int64_t stage) const {
  int64_t hops = 0;
  for (int64_t s = 1; s <= stage && s < n_stages; ++s) hops += rank_of(s) != rank_of(s - 1);
  return hops;
}

MPIPE_FUNC RemoteCall::RemoteCall(const distributed::ProcessGroup& group, const Layout& layout,
                                  int64_t pipeline_id, int64_t seq,
                                  std::function<c10::Device(int64_t)> device_of)
    : group_(group), layout_(layout) {
  LinkHandlers handlers;
  handlers.device_of = std::move(device_of);
  handlers.deliver = [this](int64_t peer, WireMessage m) { deliver(peer, std::move(m)); };
  handlers.failed = [this](int64_t peer, const std::string& why) { failed(peer, why); };
  const int64_t seed = debug_chaos_seed();
  if (seed >= 0) {
    chaos_on_ = true;
    chaos_.seed(static_cast<uint64_t>(seed) * 31u + static_cast<uint64_t>(group.rank()) * 131u +
                static_cast<uint64_t>(seq));
  }
  link_ = open_link(group, pipeline_id, seq, std::move(handlers));
}

MPIPE_FUNC RemoteCall::~RemoteCall() {
  if (link_) {
    try {
      link_->finish("the call ended without finishing", true, -1);
    } catch (...) {
    }
  }
}

MPIPE_FUNC void RemoteCall::announce(const CallInfo& info) {
  for (int64_t p = 1; p < group_.pipeline_size(); ++p) {
    WireMessage m;
    m.type = WireMessage::Call;
    m.call = info.fields();
    link_->post(p, std::move(m));
  }
}

MPIPE_FUNC CallInfo RemoteCall::await_call(const char* method) {
  std::unique_lock<std::mutex> lock(mutex_);
  const bool done = changed_.wait_for(lock, group_.timeout(),
                                      [&] { return has_call_ || !failure_.empty(); });
  if (!done && late_ < 0) late_ = 0;  // the first pipeline rank (late(), locked here)
  TORCH_CHECK(done, "mpipe::ModelPipeline::", method, ": nothing arrived from rank ",
              detail::group_impl(group_)->world_rank(0), " (the first rank) within ",
              group_.timeout().count() / 1000.0, " s: it did not start the call (stalled?)");
  TORCH_CHECK(failure_.empty(), "mpipe::ModelPipeline::", method, ": ", failure_);
  const int64_t mine = method_code(method);
  TORCH_CHECK(call_.method == mine, "mpipe::ModelPipeline::", method, ": rank ", group_.rank(),
              " calls ", method, " but the first rank (rank ",
              detail::group_impl(group_)->world_rank(0), ") calls ", kMethods[call_.method],
              "; every rank must make the same calls");
  return call_;
}

MPIPE_FUNC void RemoteCall::deliver(int64_t peer, WireMessage m) {
  RemoteTransport* to = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (m.type == WireMessage::Call) {
      call_ = CallInfo::from(m.call);
      call_from_ = peer;
      has_call_ = true;
      changed_.notify_all();
      return;
    }
    if (attached_ != Attached::Now) {
      // Before the attach: kept for it. After the detach, the call is over
      // here (it ended, or failed): dropped.
      if (attached_ == Attached::Not) early_.emplace_back(peer, std::move(m));
      return;
    }
    to = transport_;
    ++busy_;
  }
  to->deliver(peer, std::move(m));  // outside the lock: it may fail the call
  std::lock_guard<std::mutex> lock(mutex_);
  if (--busy_ == 0) changed_.notify_all();
}

MPIPE_FUNC void RemoteCall::late(int64_t peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (late_ < 0) late_ = peer;
}

MPIPE_FUNC void RemoteCall::failed(int64_t peer, const std::string& why) {
  (void)peer;
  RemoteTransport* to = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) failure_ = why;
    failures_.push_back(why);
    changed_.notify_all();
    if (attached_ != Attached::Now) return;  // attach() hands it over
    to = transport_;
    ++busy_;
  }
  to->peer_failed(why);
  std::lock_guard<std::mutex> lock(mutex_);
  if (--busy_ == 0) changed_.notify_all();
}

MPIPE_FUNC std::unique_ptr<Transport> RemoteCall::attach(
    LocalTransport& local, const StageMap& map, SkipTable* skips,
    std::function<void(std::exception_ptr)> fail) {
  auto owned = std::make_unique<RemoteTransport>(local, *this, map, skips, std::move(fail));
  RemoteTransport* transport = owned.get();
  if (chaos_on_) {  // the debug hook: a late attach (Note [Message addresses])
    std::unique_lock<std::mutex> lock(mutex_);
    const auto pause = chaos_() % 3 == 0 ? 20000 + chaos_() % 40000 : chaos_() % 2000;
    lock.unlock();  // messages keep arriving meanwhile
    std::this_thread::sleep_for(std::chrono::microseconds(pause));
  }
  std::vector<std::pair<int64_t, WireMessage>> early;
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(attached_ == Attached::Not, "a call's transport attaches once");
    transport_ = transport;
    attached_ = Attached::Now;
    early.swap(early_);
    failure = failure_;
    ++busy_;  // detach() waits for these hand-offs too
  }
  for (auto& e : early) transport->deliver(e.first, std::move(e.second));
  if (!failure.empty()) transport->peer_failed(failure);
  std::lock_guard<std::mutex> lock(mutex_);
  if (--busy_ == 0) changed_.notify_all();
  return owned;
}

MPIPE_FUNC void RemoteCall::detach() {
  std::unique_lock<std::mutex> lock(mutex_);
  // The transport dies with the executor's call: wait out the hand-offs in
  // flight on the receiving threads.
  attached_ = Attached::Over;
  transport_ = nullptr;
  early_.clear();
  changed_.wait(lock, [&] { return busy_ == 0; });
}

MPIPE_FUNC std::string RemoteCall::finish(const std::string& error, const char* method) {
  detach();
  bool failing = !error.empty();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failing |= !failure_.empty();
  }
  int64_t late;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    late = late_;
  }
  const std::string problems = link_->finish(error, failing, late);
  link_.reset();
  std::string others;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& f : failures_) {
      if (error.find(f) == std::string::npos && others.find(f) == std::string::npos) {
        others += (others.empty() ? "" : "; ") + f;
      }
    }
  }
  if (!problems.empty()) others += (others.empty() ? "" : "; ") + problems;
  if (!error.empty()) return others;  // the caller adds them to its own error
  TORCH_CHECK(others.empty(), "mpipe::ModelPipeline::", method, ": ", others);
  return {};
}

}  // namespace detail
}  // namespace mpipe
