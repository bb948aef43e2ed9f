// The runtime subsystem of libmpipe: its -inl.h files compiled once
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/runtime/recorder-inl.h"
#include "mpipe/detail/runtime/rng-inl.h"
#include "mpipe/detail/runtime/skips-inl.h"
#include "mpipe/detail/runtime/split_backward-inl.h"
#include "mpipe/detail/runtime/state-inl.h"
#include "mpipe/detail/runtime/streams-inl.h"
#include "mpipe/detail/runtime/time_chunks-inl.h"
#include "mpipe/detail/runtime/transport-inl.h"
#include "mpipe/detail/runtime/workers-inl.h"
#include "mpipe/detail/runtime/actions-inl.h"
#include "mpipe/detail/runtime/backward_actions-inl.h"
#include "mpipe/detail/runtime/executor-inl.h"
