// No include guard: every public mpipe header that has an implementation
// includes this file first. In header-only mode the first of them pulls every
// declaration (mpipe/mpipe.h), then the whole implementation, once per
// translation unit (Note [Header-only mode] in mpipe/detail/config.h). In the
// default mode it is empty.

#if defined(MPIPE_HEADER_ONLY) && !defined(MPIPE_DETAIL_IMPLEMENTATION)
#define MPIPE_DETAIL_IMPLEMENTATION
#ifdef MPIPE_CUDA_KERNELS
#error "MPIPE_CUDA_KERNELS needs the compiled library (mpipe::mpipe): nvcc builds its kernels"
#endif

#include "mpipe/mpipe.h"

#include "mpipe/detail/implementation.h"
#endif
