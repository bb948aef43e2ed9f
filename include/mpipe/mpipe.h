#ifndef MPIPE_MPIPE_H_
#define MPIPE_MPIPE_H_

// Everything mpipe offers, in one include. In header-only mode
// (mpipe::mpipe_header_only) it also pulls the implementation, and a file
// includes it before any other mpipe header (Note [Header-only mode] in
// mpipe/detail/config.h).

#include <mpipe/autocast.h>
#include <mpipe/balance.h>
#include <mpipe/batchnorm.h>
#include <mpipe/checkpoint.h>
#include <mpipe/device.h>
#include <mpipe/grad_norm.h>
#include <mpipe/grad_scaler.h>
#include <mpipe/job_checkpoints.h>
#include <mpipe/linear.h>
#include <mpipe/memory.h>
#include <mpipe/model_pipeline.h>
#include <mpipe/pipeline_options.h>
#include <mpipe/schedule.h>
#include <mpipe/script.h>
#include <mpipe/simulate.h>
#include <mpipe/skip.h>
#include <mpipe/split.h>
#include <mpipe/state.h>
#include <mpipe/tensors.h>
#include <mpipe/timeline.h>
#include <mpipe/training.h>
#include <mpipe/version.h>

#ifdef MPIPE_HEADER_ONLY
#ifdef MPIPE_CUDA_KERNELS
#error "MPIPE_CUDA_KERNELS needs the compiled library (mpipe::mpipe): nvcc builds its kernels"
#endif
#include "mpipe/detail/implementation.h"
#endif

#endif  // MPIPE_MPIPE_H_
