#pragma once

// CUDA graphs and the allocator probe: their CUDA implementation with a CUDA
// LibTorch (MPIPE_TORCH_CUDA), else the stand-ins that say CUDA is absent.
#ifdef MPIPE_TORCH_CUDA
#include "mpipe/detail/cuda/device_probe_cuda-inl.h"
#include "mpipe/detail/cuda/graphs_cuda-inl.h"
#else
#include "mpipe/detail/cuda/device_probe_none-inl.h"
#include "mpipe/detail/cuda/graphs_none-inl.h"
#endif
