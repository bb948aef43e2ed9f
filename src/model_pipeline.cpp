// Compiles mpipe/detail/model_pipeline-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/model_pipeline-inl.h"
