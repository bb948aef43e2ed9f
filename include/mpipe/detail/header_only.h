#pragma once

// Included at the end of the outermost public mpipe header of a file (Note
// [Header-only mode] in mpipe/detail/config.h): in header-only mode, the
// whole implementation; otherwise nothing.

#ifdef MPIPE_HEADER_ONLY
#ifdef MPIPE_CUDA_KERNELS
#error "MPIPE_CUDA_KERNELS needs the compiled library (mpipe::mpipe): nvcc builds its kernels"
#endif

#include "mpipe/detail/autocast-inl.h"
#include "mpipe/detail/balance-inl.h"
#include "mpipe/detail/batchnorm-inl.h"
#include "mpipe/detail/calls-inl.h"
#include "mpipe/detail/cast_grads-inl.h"
#include "mpipe/detail/device-inl.h"
#include "mpipe/detail/executor-inl.h"
#include "mpipe/detail/group-inl.h"
#include "mpipe/detail/memory-inl.h"
#include "mpipe/detail/model_pipeline-inl.h"
#include "mpipe/detail/recorder-inl.h"
#include "mpipe/detail/remote-inl.h"
#include "mpipe/detail/rng-inl.h"
#include "mpipe/detail/skips-inl.h"
#include "mpipe/detail/split_backward-inl.h"
#include "mpipe/detail/state-inl.h"
#include "mpipe/detail/streams-inl.h"
#include "mpipe/detail/time_chunks-inl.h"
#include "mpipe/detail/timeline-inl.h"
#include "mpipe/detail/train_steps-inl.h"
#include "mpipe/detail/transport-inl.h"
#include "mpipe/detail/snn/encoding-inl.h"
#include "mpipe/detail/snn/fused_neuron-inl.h"
#include "mpipe/detail/snn/neuron-inl.h"
#include "mpipe/detail/snn/surrogate-inl.h"

// What the build found (mpipe::mpipe_header_only defines these as the
// compiled library's CMake chose its files): CUDA graphs and the allocator
// probe need a CUDA LibTorch; pipelines across processes need c10d's and
// Gloo's headers.
#ifdef MPIPE_TORCH_CUDA
#include "mpipe/detail/device_probe_cuda-inl.h"
#include "mpipe/detail/graphs_cuda-inl.h"
#else
#include "mpipe/detail/device_probe_none-inl.h"
#include "mpipe/detail/graphs_none-inl.h"
#endif
#ifdef MPIPE_WITH_C10D
#include "mpipe/detail/distributed-inl.h"
#else
#include "mpipe/detail/distributed_none-inl.h"
#endif
#endif  // MPIPE_HEADER_ONLY
