#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SCRIPT_H_
#define MPIPE_SCRIPT_H_

// Models written in Python, as pipeline stages: a TorchScript module (scripted
// or traced in Python, loaded with torch::jit::load) is appended as a torch::nn
// module is, and its top-level children become layers for mpipe::balance.
//
//   torch::jit::Module model = torch::jit::load("model.pt");  // an nn.Sequential
//   auto pipe = mpipe::balance::from_sequential(mpipe::script_layers(model),
//                                               {"cuda:0", "cuda:1"}, {3, 2});
//   // or one stage per module: pipe->append(model, "cuda:0");
//
// Note [TorchScript stages] in mpipe/detail/pipeline/script-inl.h has what
// such a stage does and does not do.

#include <mpipe/model_pipeline.h>  // also declares torch::jit::Module

#include <torch/nn/modules/container/sequential.h>

namespace mpipe {

/// The top-level children of `module` (an nn.Sequential saved from Python,
/// or any module whose forward calls its children one after another, each on
/// the previous one's outputs), in order, each as a torch::nn module named as
/// the child: the layers that mpipe::balance's profile_time, balanced and
/// from_sequential take (from_sequential also cuts before named layers). The
/// layers share `module`'s parameters and buffers: training the pipeline
/// trains `module`, and `module.save(path)` then writes what Python's
/// torch.jit.load reads. Throws c10::Error when `module` has no children.
torch::nn::Sequential script_layers(const torch::jit::Module& module);

}  // namespace mpipe

#endif  // MPIPE_SCRIPT_H_
