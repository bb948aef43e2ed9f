#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/job_checkpoints.h"

#include "mpipe/model_pipeline.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cerrno>
#include <fcntl.h>
#include <ftw.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

namespace mpipe {
namespace detail {

// Note [Job checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint is a folder `step-<step>` with one file per rank,
// `rank-<r>.ckpt`, and a marker `complete`. A rank's file is a
// torch::serialize archive (its stages, the optimizer, the GradScaler, the
// CPU generator's state and each CUDA device's, the step, the data position,
// and what the job looked like: world size, rank, the stages' parameter and
// buffer names, shapes and dtypes) followed by a trailer: the magic
// "MPIPECK1", the archive's length and its FNV-1a 64-bit hash. It is written
// to `rank-<r>.ckpt.tmp`, flushed to disk, then renamed: a file that exists
// is whole. The marker is written the same way by rank 0 after a barrier, so
// a checkpoint counts only once every rank has finished its file; a rank
// killed mid-save leaves a folder without a marker, which resume ignores.
// resume() tries the folders with a marker, newest first: each rank checks
// its own file (present, trailer, length, hash, the job's shape) and the
// ranks agree (ProcessGroup::any) before anyone loads, so they all load the
// same step or all skip it. What the random generators hold is restored
// last: the per-(stage, item) draws of every later call come from the CPU
// generator's seed (Note [Random draws]), so the continuation draws what the
// uninterrupted run drew.

constexpr char kCheckpointMagic[9] = "MPIPECK1";

/// FNV-1a, 64 bits: enough to tell a torn or flipped file from a whole one.
MPIPE_FUNC uint64_t fnv1a(const std::string& bytes) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

/// Writes `bytes` to `path` whole or not at all: a temporary file, flushed
/// to disk, then renamed over `path`.
MPIPE_FUNC void write_whole(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TORCH_CHECK(fd >= 0, "mpipe::JobCheckpoints: cannot create ", tmp, ": ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      TORCH_CHECK(false, "mpipe::JobCheckpoints: cannot write ", tmp, ": ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  TORCH_CHECK(synced, "mpipe::JobCheckpoints: cannot flush ", tmp, " to disk");
  TORCH_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "mpipe::JobCheckpoints: cannot rename ",
              tmp, " to ", path, ": ", std::strerror(errno));
}

/// The job's shape as a checkpoint records it: rank, world size, the stage
/// numbers the rank declared (ModelPipelineOptions::stage_numbers, when it
/// did), and every parameter's and buffer's name, shape and dtype.
MPIPE_FUNC std::string job_shape(const ModelPipelineImpl& pipe, int64_t rank, int64_t world) {
  std::ostringstream out;
  out << "rank " << rank << " of " << world << ";";
  if (!pipe.options.stage_numbers().empty()) {
    out << " stages " << c10::ArrayRef<int64_t>(pipe.options.stage_numbers()) << ";";
  }
  for (const auto& p : pipe.named_parameters()) {
    out << " " << p.key() << p.value().sizes() << p.value().scalar_type();
  }
  for (const auto& b : pipe.named_buffers()) {
    out << " " << b.key() << b.value().sizes() << b.value().scalar_type();
  }
  return out.str();
}

/// Where two job shapes first differ: "'<saved>' where this job has
/// '<current>'", a few tokens of each.
MPIPE_FUNC std::string first_difference(const std::string& saved, const std::string& current) {
  size_t at = 0;
  while (at < saved.size() && at < current.size() && saved[at] == current[at]) ++at;
  at = saved.rfind(' ', at) == std::string::npos ? 0 : saved.rfind(' ', at);  // a token's start
  return "'" + saved.substr(at, 60) + "' where this job has '" + current.substr(at, 60) + "'";
}

/// The CUDA devices of `pipe`'s parameters and buffers, whose generators a
/// checkpoint holds.
MPIPE_FUNC std::vector<c10::Device> cuda_devices_of(const ModelPipelineImpl& pipe) {
  std::set<c10::DeviceIndex> seen;
  for (const auto& p : pipe.parameters()) {
    if (p.is_cuda()) seen.insert(p.device().index());
  }
  for (const auto& b : pipe.buffers()) {
    if (b.is_cuda()) seen.insert(b.device().index());
  }
  std::vector<c10::Device> out;
  for (auto i : seen) out.emplace_back(c10::kCUDA, i);
  return out;
}

/// This rank's file of checkpoint `dir`, checked: its archive's bytes, or
/// the reason it is refused.
MPIPE_FUNC bool read_whole(const std::string& path, std::string& payload, std::string& why) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    why = "it is missing";
    return false;
  }
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  constexpr size_t trailer = 8 + 8 + 8;
  if (bytes.size() < trailer || bytes.compare(bytes.size() - trailer, 8, kCheckpointMagic) != 0) {
    why = "it is truncated (no trailer; " + std::to_string(bytes.size()) + " bytes)";
    return false;
  }
  uint64_t length = 0, hash = 0;
  std::memcpy(&length, bytes.data() + bytes.size() - 16, 8);
  std::memcpy(&hash, bytes.data() + bytes.size() - 8, 8);
  if (length != bytes.size() - trailer) {
    why = "it is truncated (" + std::to_string(bytes.size() - trailer) + " of " +
          std::to_string(length) + " bytes)";
    return false;
  }
  payload = bytes.substr(0, length);
  if (fnv1a(payload) != hash) {
    why = "its checksum does not match (the file is corrupted)";
    return false;
  }
  return true;
}

// Note [Removing a checkpoint]: LibTorch 2.x's libtorch.so exports its own
// copy of std::filesystem::remove_all, which the dynamic linker binds a
// program's calls to, and that copy jumps to address 0 (the GPU machine's
// torch 2.11: a SIGSEGV in every call). So folders are removed with POSIX's
// nftw, children first, without following symbolic links.
MPIPE_FUNC int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  return ::remove(path) == 0 || errno == ENOENT ? 0 : errno;  // gone already: fine
}

/// Removes checkpoint folder `path` and everything under it, its `complete`
/// marker first (a half-removed folder never looks complete); best effort,
/// never throws: an old checkpoint left behind costs only disk.
MPIPE_FUNC void remove_tree(const std::string& path) {
  ::unlink((path + "/complete").c_str());
  ::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/// The checkpoint folders of `directory` that carry the complete marker,
/// newest step first.
MPIPE_FUNC std::vector<std::pair<int64_t, std::string>> complete_checkpoints(
    const std::string& directory) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(directory, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind("step-", 0) != 0) continue;
    if (!std::filesystem::exists(entry.path() / "complete")) continue;
    try {
      out.emplace_back(std::stoll(name.substr(5)), entry.path().string());
    } catch (const std::exception&) {  // not one of ours
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

}  // namespace detail

MPIPE_FUNC JobCheckpoints::JobCheckpoints(std::string directory, ModelPipelineImpl& pipe,
                                          torch::optim::Optimizer& optimizer, GradScaler* scaler,
                                          int64_t keep)
    : directory_(std::move(directory)), pipe_(pipe), optimizer_(optimizer), scaler_(scaler),
      keep_(keep) {
  TORCH_CHECK(keep_ >= 1, "mpipe::JobCheckpoints: keep must be at least 1, got ", keep_);
  std::error_code ec;
  std::filesystem::create_directories(directory_, ec);
  TORCH_CHECK(!ec, "mpipe::JobCheckpoints: cannot create ", directory_, ": ", ec.message());
}

MPIPE_FUNC std::string JobCheckpoints::save(int64_t step, const std::string& data_position) {
  TORCH_CHECK(step >= 0, "mpipe::JobCheckpoints::save: the step must be >= 0, got ", step);
  const distributed::ProcessGroup& group = pipe_.options.process_group();
  const int64_t rank = group.defined() ? group.rank() : 0;
  const int64_t world = group.defined() ? group.world_size() : 1;
  const std::string dir = directory_ + "/step-" + std::to_string(step);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec, "mpipe::JobCheckpoints::save: cannot create ", dir, ": ", ec.message());

  torch::serialize::OutputArchive archive;
  archive.write("job_shape", c10::IValue(detail::job_shape(pipe_, rank, world)));
  archive.write("step", c10::IValue(step));
  archive.write("data_position", c10::IValue(data_position));
  torch::serialize::OutputArchive model, optim;
  pipe_.save(model);
  optimizer_.save(optim);
  archive.write("model", model);
  archive.write("optimizer", optim);
  if (scaler_) {
    torch::serialize::OutputArchive scaler;
    scaler_->save(scaler);
    archive.write("scaler", scaler);
  }
  archive.write("rng_cpu", at::detail::getDefaultCPUGenerator().get_state(), /*is_buffer=*/true);
  for (const auto& d : detail::cuda_devices_of(pipe_)) {
    archive.write("rng_cuda_" + std::to_string(d.index()),
                  at::globalContext().defaultGenerator(d).get_state(), /*is_buffer=*/true);
  }
  std::ostringstream bytes;
  archive.save_to(bytes);
  std::string file = bytes.str();
  const uint64_t length = file.size(), hash = detail::fnv1a(file);
  file.append(detail::kCheckpointMagic, 8);
  file.append(reinterpret_cast<const char*>(&length), 8);
  file.append(reinterpret_cast<const char*>(&hash), 8);
  detail::write_whole(dir + "/rank-" + std::to_string(rank) + ".ckpt", file);

  // Complete once every rank's file is whole: then the older ones may go.
  if (group.defined()) group.barrier();
  if (rank == 0) {
    detail::write_whole(dir + "/complete", "world " + std::to_string(world) + "\n");
    const auto all = detail::complete_checkpoints(directory_);
    for (size_t k = static_cast<size_t>(keep_); k < all.size(); ++k) {
      detail::remove_tree(all[k].second);
    }
  }
  if (group.defined()) group.barrier();  // nobody resumes from a folder being removed
  return dir;
}

MPIPE_FUNC std::optional<JobCheckpoints::Resumed> JobCheckpoints::resume() {
  const distributed::ProcessGroup& group = pipe_.options.process_group();
  const int64_t rank = group.defined() ? group.rank() : 0;
  const int64_t world = group.defined() ? group.world_size() : 1;
  const std::string shape = detail::job_shape(pipe_, rank, world);
  // Every rank sees the same folders (one file system): rank 0's list is the
  // one tried, in order, by all.
  auto candidates = detail::complete_checkpoints(directory_);
  const int64_t n = static_cast<int64_t>(candidates.size());
  if (group.defined()) {
    TORCH_CHECK(static_cast<int64_t>(group.max(static_cast<double>(n))) == n &&
                    -static_cast<int64_t>(group.max(-static_cast<double>(n))) == n,
                "mpipe::JobCheckpoints::resume: the ranks see different checkpoints in ",
                directory_, " (rank ", rank, " sees ", n, ")");
  }
  std::string refused;
  std::vector<std::string> skipped;
  for (const auto& candidate : candidates) {
    const std::string path = candidate.second + "/rank-" + std::to_string(rank) + ".ckpt";
    std::string payload, why;
    bool ok = detail::read_whole(path, payload, why);
    torch::serialize::InputArchive archive;
    if (ok) {
      try {
        std::istringstream in(payload);
        archive.load_from(in);
        c10::IValue recorded;
        archive.read("job_shape", recorded);
        if (recorded.toStringRef() != shape) {
          ok = false;
          why = "it was saved by another job: " +
                detail::first_difference(recorded.toStringRef(), shape);
        }
      } catch (const std::exception& e) {
        ok = false;
        why = std::string("it cannot be read: ") + e.what();
      }
    }
    const bool refused_anywhere = group.defined() ? group.any(!ok) : !ok;
    if (refused_anywhere) {
      const std::string line = ok ? candidate.second + ": refused by another rank"
                                  : "rank " + std::to_string(rank) + "'s file " + path + ": " + why;
      TORCH_WARN("mpipe::JobCheckpoints::resume: skipping ", candidate.second, " (", line, ")");
      refused += "\n  " + line;
      skipped.push_back(line);
      continue;
    }
    c10::IValue step, position;
    archive.read("step", step);
    archive.read("data_position", position);
    torch::serialize::InputArchive model, optim;
    archive.read("model", model);
    archive.read("optimizer", optim);
    pipe_.load(model);
    optimizer_.load(optim);
    if (scaler_) {
      torch::serialize::InputArchive scaler;
      archive.read("scaler", scaler);
      scaler_->load(scaler);
    }
    at::Tensor state;
    archive.read("rng_cpu", state, /*is_buffer=*/true);
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    cpu.set_state(state);
    for (const auto& d : detail::cuda_devices_of(pipe_)) {
      archive.read("rng_cuda_" + std::to_string(d.index()), state, /*is_buffer=*/true);
      at::Generator gen = at::globalContext().defaultGenerator(d);
      gen.set_state(state);
    }
    return Resumed{step.toInt(), position.toStringRef(), candidate.second, skipped};
  }
  TORCH_CHECK(candidates.empty(), "mpipe::JobCheckpoints::resume: none of the ", n,
              " complete checkpoints in ", directory_, " can be loaded:", refused);
  return std::nullopt;
}

}  // namespace mpipe
