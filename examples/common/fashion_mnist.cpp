#include "fashion_mnist.h"

#include <zlib.h>

#include <array>
#include <fstream>
#include <stdexcept>
#include <vector>

namespace examples {

namespace {

const char* const kHowToGet =
    "; install Debian's package (apt-get install dataset-fashion-mnist), or pass --data DIR "
    "pointing at a folder with the four IDX files of Fashion-MNIST";

std::string find_file(const std::string& dir, const std::string& name) {
  for (const std::string& candidate : {dir + "/" + name + ".gz", dir + "/" + name}) {
    if (std::ifstream(candidate).good()) return candidate;
  }
  throw std::runtime_error("Fashion-MNIST file " + dir + "/" + name + ".gz is missing" +
                           kHowToGet);
}

/// The whole file, decompressed if gzipped (zlib reads plain files as they are).
std::vector<uint8_t> read_all(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open " + path + kHowToGet);
  std::vector<uint8_t> data;
  std::array<uint8_t, 1 << 16> buffer;
  int n = 0;
  while ((n = gzread(f, buffer.data(), buffer.size())) > 0) {
    data.insert(data.end(), buffer.begin(), buffer.begin() + n);
  }
  int err = Z_OK;
  const std::string message = n < 0 ? gzerror(f, &err) : "";
  gzclose(f);
  if (n < 0) throw std::runtime_error(path + " is corrupt (" + message + ")" + kHowToGet);
  return data;
}

uint32_t be32(const std::vector<uint8_t>& d, size_t at) {
  return (uint32_t(d[at]) << 24) | (uint32_t(d[at + 1]) << 16) | (uint32_t(d[at + 2]) << 8) |
         uint32_t(d[at + 3]);
}

/// Checks the IDX header (magic, dimensions, length) and returns the item count.
int64_t check_idx(const std::vector<uint8_t>& d, const std::string& path, uint32_t magic,
                  size_t header, size_t item_bytes) {
  if (d.size() < header || be32(d, 0) != magic) {
    throw std::runtime_error(path + " is not an IDX file of the expected kind (bad header)" +
                             kHowToGet);
  }
  const int64_t count = be32(d, 4);
  if (magic == 0x00000803 && (be32(d, 8) != 28 || be32(d, 12) != 28)) {
    throw std::runtime_error(path + ": expected 28x28 images" + kHowToGet);
  }
  if (d.size() != header + static_cast<size_t>(count) * item_bytes) {
    throw std::runtime_error(path + " is truncated or has trailing bytes: " +
                             std::to_string(d.size()) + " bytes for " + std::to_string(count) +
                             " items" + kHowToGet);
  }
  return count;
}

}  // namespace

Dataset load_fashion_mnist(const std::string& dir, bool train, int64_t limit) {
  const std::string prefix = train ? "train" : "t10k";
  const std::string image_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const std::string label_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  const auto images = read_all(image_path);
  const auto labels = read_all(label_path);
  const int64_t n_images = check_idx(images, image_path, 0x00000803, 16, 28 * 28);
  const int64_t n_labels = check_idx(labels, label_path, 0x00000801, 8, 1);
  if (n_images != n_labels) {
    throw std::runtime_error(image_path + " and " + label_path + " disagree on the count (" +
                             std::to_string(n_images) + " vs " + std::to_string(n_labels) + ")");
  }
  const int64_t n = limit > 0 && limit < n_images ? limit : n_images;
  Dataset ds;
  ds.images = torch::from_blob(const_cast<uint8_t*>(images.data()) + 16, {n, 1, 28, 28},
                               torch::kUInt8)
                  .to(torch::kFloat)
                  .div_(255);
  ds.labels =
      torch::from_blob(const_cast<uint8_t*>(labels.data()) + 8, {n}, torch::kUInt8).to(torch::kLong);
  if (ds.labels.max().item<int64_t>() > 9) {
    throw std::runtime_error(label_path + " has labels above 9" + kHowToGet);
  }
  return ds;
}

bool fashion_mnist_present(const std::string& dir) {
  try {
    for (const char* name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
      find_file(dir, name);
    }
    return true;
  } catch (const std::runtime_error&) {
    return false;
  }
}

const char* fashion_mnist_class(int64_t label) {
  static const char* const names[] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                      "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  return label >= 0 && label < 10 ? names[label] : "?";
}

}  // namespace examples
