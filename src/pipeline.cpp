// The pipeline (ModelPipeline and its calls) subsystem of libmpipe: its -inl.h files compiled once
// (Note [Header-only mode] in mpipe/detail/config.h).
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
#include "mpipe/detail/pipeline/timeline-inl.h"
#include "mpipe/detail/pipeline/time_step_calls-inl.h"
