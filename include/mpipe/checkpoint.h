#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_CHECKPOINT_H_
#define MPIPE_CHECKPOINT_H_

// Activation checkpointing: which micro-batches a training step recomputes in
// backward instead of keeping their activations, and how a module can tell
// that it is being recomputed (e.g. to not count batch statistics twice).

#include <cstdint>

namespace mpipe {

/// Which micro-batches a training step checkpoints (ModelPipelineOptions::checkpoint).
enum class Checkpoint {
  /// Keep every activation (fastest, most memory).
  Never,
  /// Checkpoint every micro-batch but the last, whose backward follows at once
  /// in GPipe (torchgpipe's default).
  ExceptLast,
  /// Checkpoint every micro-batch.
  Always,
};

/// True while a checkpointed stage's forward is being run again in backward
/// (on this thread).
bool is_recomputing() noexcept;

}  // namespace mpipe

#endif  // MPIPE_CHECKPOINT_H_
