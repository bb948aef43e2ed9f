// The distributed subsystem of libmpipe: its -inl.h files compiled once
// (Note [Header-only mode] in mpipe/detail/config.h). CMake gives this file
// c10d's and Gloo's headers and MPIPE_WITH_C10D when it found them.
#include "mpipe/detail/distributed/group-inl.h"
#include "mpipe/detail/distributed/pipeline_group-inl.h"
#include "mpipe/detail/distributed/remote-inl.h"
#include "mpipe/detail/distributed/remote_transport-inl.h"
#ifdef MPIPE_WITH_C10D
#include "mpipe/detail/distributed/distributed-inl.h"
#include "mpipe/detail/distributed/gloo_link-inl.h"
#else
#include "mpipe/detail/distributed/distributed_none-inl.h"
#endif
