#pragma once

// The transformer_lm example's model: token and position embedding, N
// pre-norm blocks (causal self-attention, MLP), final LayerNorm and output
// head, as a list of layers to split into stages. bench/mpipe_bench.cpp and
// bench/mpipe_dist_bench.cpp time the same model (their "lm" workloads).

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/version.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace transformer_lm {

namespace nn = torch::nn;

struct EmbedImpl : nn::Module {
  EmbedImpl(int64_t vocab, int64_t dim, int64_t context) {
    tok = register_module("tok", nn::Embedding(vocab, dim));
    pos = register_module("pos", nn::Embedding(context, dim));
  }
  torch::Tensor forward(const torch::Tensor& idx) {  // [B, T] token ids -> [B, T, dim]
    return tok(idx) + pos(torch::arange(idx.size(1), idx.options()));
  }
  nn::Embedding tok{nullptr}, pos{nullptr};
};
TORCH_MODULE(Embed);

struct BlockImpl : nn::Module {
  BlockImpl(int64_t dim, int64_t heads) : heads(heads) {
    ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({dim})));
    qkv = register_module("qkv", nn::Linear(dim, 3 * dim));
    proj = register_module("proj", nn::Linear(dim, dim));
    ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({dim})));
    fc1 = register_module("fc1", nn::Linear(dim, 4 * dim));
    fc2 = register_module("fc2", nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(torch::Tensor x) {  // [B, T, dim]
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    auto parts = qkv(ln1(x)).view({B, T, 3, heads, C / heads}).permute({2, 0, 3, 1, 4});
    const auto q = parts[0], k = parts[1], v = parts[2];  // [B, heads, T, C / heads]
#if TORCH_VERSION_MAJOR >= 2
    auto y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
#else  // LibTorch 1.x has no fused attention
    auto att = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(C / heads));
    const auto future = torch::ones({T, T}, x.options().dtype(torch::kBool)).triu(1);
    auto y = att.masked_fill(future, -std::numeric_limits<float>::infinity()).softmax(-1).matmul(v);
#endif
    x = x + proj(y.transpose(1, 2).reshape({B, T, C}));
    return x + fc2(nn::functional::gelu(fc1(ln2(x))));
  }
  int64_t heads;
  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct HeadImpl : nn::Module {
  HeadImpl(int64_t dim, int64_t vocab) {
    ln = register_module("ln", nn::LayerNorm(nn::LayerNormOptions({dim})));
    out = register_module("out", nn::Linear(nn::LinearOptions(dim, vocab).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(ln(x)); }  // [B, T, vocab] logits
  nn::LayerNorm ln{nullptr};
  nn::Linear out{nullptr};
};
TORCH_MODULE(Head);

/// The layers in order: the embedding, the blocks, the head (GPT-2's
/// initialisation: normal(0, 0.02), residual projections scaled by depth).
struct Layers {
  Embed embed{nullptr};
  std::vector<Block> blocks;
  Head head{nullptr};

  Layers(int64_t vocab, int64_t layers, int64_t dim, int64_t heads, int64_t context) {
    embed = Embed(vocab, dim, context);
    for (int64_t l = 0; l < layers; ++l) blocks.emplace_back(dim, heads);
    head = Head(dim, vocab);
    torch::NoGradGuard no_grad;
    for (auto& p : all()->named_parameters()) {
      const auto& name = p.key();
      if (name.find("ln") != std::string::npos || name.find("bias") != std::string::npos) continue;
      const bool residual = name.find("proj") != std::string::npos || name.find("fc2") != std::string::npos;
      nn::init::normal_(p.value(), 0.0, residual ? 0.02 / std::sqrt(2.0 * static_cast<double>(layers)) : 0.02);
    }
    for (auto& p : all()->named_parameters()) {
      if (p.key().find("bias") != std::string::npos) p.value().zero_();
    }
  }
  int64_t size() const { return static_cast<int64_t>(blocks.size()) + 2; }
  /// Appends layer i to `seq`.
  void push(nn::Sequential& seq, int64_t i) const {
    if (i == 0) {
      seq->push_back(embed);
    } else if (i + 1 == size()) {
      seq->push_back(head);
    } else {
      seq->push_back(blocks[static_cast<size_t>(i - 1)]);
    }
  }
  /// Every layer in one module (the plain model).
  nn::Sequential all() const {
    nn::Sequential seq;
    for (int64_t i = 0; i < size(); ++i) push(seq, i);
    return seq;
  }
};

/// Mean cross-entropy of `logits` [B, T, vocab] (any float dtype) against
/// token ids `targets` [B, T], in float32.
inline torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat),
                                              targets.reshape({-1}));
}

}  // namespace transformer_lm
