#pragma once

// Every -inl.h file, by layer: what header-only mode compiles into the
// user's file (Note [Header-only mode] in mpipe/detail/config.h). The files
// in src/ compile the same files into libmpipe, one subsystem each.

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

#include "mpipe/detail/pipeline/balance-inl.h"
#include "mpipe/detail/pipeline/batchnorm-inl.h"
#include "mpipe/detail/pipeline/session-inl.h"
#include "mpipe/detail/cuda/graph_policy-inl.h"
#include "mpipe/detail/pipeline/device-inl.h"
#include "mpipe/detail/pipeline/grad_norm-inl.h"
#include "mpipe/detail/pipeline/job_checkpoints-inl.h"
#include "mpipe/detail/pipeline/memory-inl.h"
#include "mpipe/detail/pipeline/micro_batch_calls-inl.h"
#include "mpipe/detail/pipeline/model_pipeline-inl.h"
#include "mpipe/detail/pipeline/script-inl.h"
#include "mpipe/detail/pipeline/timeline-inl.h"
#include "mpipe/detail/pipeline/time_step_calls-inl.h"

#include "mpipe/detail/precision/autocast-inl.h"
#include "mpipe/detail/precision/cast_grads-inl.h"

#include "mpipe/detail/snn/encoding-inl.h"
#include "mpipe/detail/snn/fused_neuron-inl.h"
#include "mpipe/detail/snn/monitor-inl.h"
#include "mpipe/detail/snn/neuron-inl.h"
#include "mpipe/detail/snn/surrogate-inl.h"

// What the build found (CMake defines these as it chose the compiled
// library's files): CUDA graphs and the allocator probe need a CUDA
// LibTorch; pipelines across processes need c10d's and Gloo's headers.
#include "mpipe/detail/cuda/cuda.h"
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
