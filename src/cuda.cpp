// The CUDA subsystem of libmpipe: its -inl.h files compiled once
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/cuda/cuda.h"  // CMake defines MPIPE_TORCH_CUDA with a CUDA LibTorch
