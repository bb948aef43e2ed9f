#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_MPIPE_H_
#define MPIPE_MPIPE_H_

// Everything mpipe offers, in one include.

#include <mpipe/autocast.h>
#include <mpipe/balance.h>
#include <mpipe/batchnorm.h>
#include <mpipe/checkpoint.h>
#include <mpipe/device.h>
#include <mpipe/grad_norm.h>
#include <mpipe/grad_scaler.h>
#include <mpipe/linear.h>
#include <mpipe/memory.h>
#include <mpipe/model_pipeline.h>
#include <mpipe/pipeline_options.h>
#include <mpipe/schedule.h>
#include <mpipe/simulate.h>
#include <mpipe/skip.h>
#include <mpipe/split.h>
#include <mpipe/state.h>
#include <mpipe/tensors.h>
#include <mpipe/timeline.h>
#include <mpipe/training.h>
#include <mpipe/version.h>

#endif  // MPIPE_MPIPE_H_
