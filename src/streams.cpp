// Compiles mpipe/detail/streams-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/streams-inl.h"
