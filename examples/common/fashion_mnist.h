#pragma once

// Fashion-MNIST from the IDX files (gzipped or not), as the examples use it.

#include <torch/types.h>

#include <cstdint>
#include <string>

namespace examples {

/// Where Debian's dataset-fashion-mnist package puts the files.
inline const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct Dataset {
  torch::Tensor images;  // [N, 1, 28, 28] float in [0, 1]
  torch::Tensor labels;  // [N] int64 in 0..9
  int64_t size() const { return labels.size(0); }
};

/// Reads the training or test split from `dir` (train-images-idx3-ubyte.gz and
/// so on; uncompressed files are read too). `limit` > 0 keeps the first
/// `limit` examples. Throws std::runtime_error naming the file and saying how
/// to get the data when a file is missing, truncated or not IDX.
Dataset load_fashion_mnist(const std::string& dir, bool train, int64_t limit = 0);

/// True if every file of both splits is present in `dir`.
bool fashion_mnist_present(const std::string& dir);

/// The class names, in label order.
const char* fashion_mnist_class(int64_t label);

}  // namespace examples
