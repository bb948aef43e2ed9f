// The precision subsystem of libmpipe: its -inl.h files compiled once
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/precision/autocast-inl.h"
#include "mpipe/detail/precision/cast_grads-inl.h"
