// A decoder-only, character-level transformer language model trained on
// Debian's fortunes (about 2 MB of English quotations) through
// mpipe::ModelPipeline::train_step. See README.md.
//
//   token + position embedding -> N pre-norm blocks (causal self-attention,
//   MLP) -> final LayerNorm -> output head
//
// The layers are split into 4 stages (8 with --schedule interleaved), by a
// profile of each layer's time in one process, by their FLOPs across
// processes, or as --balance gives them. --plain trains the same layers as
// one module with the same recipe (the same micro-batches, their gradients
// accumulated), for comparison.

#include "model.h"
#include "plot.h"
#include "training.h"

#include <mpipe/autocast.h>
#include <mpipe/mpipe.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace nn = torch::nn;

namespace transformer_lm {
namespace {

constexpr const char* kDefaultData = "/usr/share/games/fortunes";

struct Config {
  examples::CommonFlags common;
  int64_t layers = 0, dim = 0, heads = 0, context = 0, batch = 0;  // 0: by device, below
  int64_t micro_batches = 8;
  int64_t steps = 0;
  int64_t warmup = -1;  // -1: a tenth of the steps, at most 100
  int64_t eval_every = 0;  // 0: once per epoch (a pass over the training text)
  int64_t val_chars = 0;   // 0: the whole validation text
  int64_t log_every = 0;
  double lr = 1e-3, weight_decay = 0.1, clip = 1.0;
  std::string schedule = "1f1b";
  std::string checkpoint = "never";
  std::string graphs = "auto";
  std::string balance = "auto";
  std::string precision;  // "": bf16 on a GPU, fp32 on the CPU
  bool plain = false;
  int64_t generate = -1;  // characters to sample at the end (-1: 400, 200 with --quick)
  std::string prompt = "The ";
  double temperature = 0.8;
  double max_val_loss = -1;
  bool below_unigram = false;
  mpipe::distributed::ProcessGroup group;
};

// The data -------------------------------------------------------------------

/// The text: every plain file of `dir` (not the .dat indexes, nor the .u8
/// links), by name, one after the other.
std::string load_text(const std::string& dir) {
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const auto name = e.path().filename().string();
    if (e.is_regular_file() && !e.is_symlink() && name.find('.') == std::string::npos) {
      files.push_back(e.path());
    }
  }
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return text;
}

bool text_present(const std::string& dir) { return load_text(dir).size() > 10000; }

struct Corpus {
  std::vector<unsigned char> chars;  // id -> byte
  torch::Tensor train, val;          // token ids (int64, CPU): the first 90 %, the last 10 %
  double unigram = 0;                // cross-entropy of val under train's character frequencies (nats)
};

/// `val_chars` > 0: validate on the first that many characters of the
/// validation text only (the baseline too).
Corpus make_corpus(const std::string& text, int64_t val_chars) {
  Corpus c;
  std::array<int64_t, 256> id{};
  id.fill(-1);
  for (unsigned char ch : text) {
    if (id[ch] < 0) id[ch] = 0;
  }
  for (int b = 0; b < 256; ++b) {
    if (id[b] >= 0) {
      id[b] = static_cast<int64_t>(c.chars.size());
      c.chars.push_back(static_cast<unsigned char>(b));
    }
  }
  std::vector<int64_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = id[static_cast<unsigned char>(text[i])];
  const auto all = torch::tensor(tokens, torch::kLong);
  const int64_t n_train = all.size(0) * 9 / 10;
  c.train = all.narrow(0, 0, n_train);
  c.val = all.narrow(0, n_train, all.size(0) - n_train);
  if (val_chars > 0 && val_chars < c.val.size(0)) c.val = c.val.narrow(0, 0, val_chars);
  // The unigram baseline, with add-one smoothing.
  const auto vocab = static_cast<int64_t>(c.chars.size());
  const auto counts = torch::bincount(c.train, {}, vocab).to(torch::kDouble) + 1;
  const auto logp = (counts / counts.sum()).log();
  c.unigram = -logp.index_select(0, c.val).mean().item<double>();
  return c;
}

std::string decode(const Corpus& c, const std::vector<int64_t>& ids) {
  std::string s;
  for (int64_t i : ids) s.push_back(static_cast<char>(c.chars[static_cast<size_t>(i)]));
  return s;
}

// Training pieces ------------------------------------------------------------

mpipe::Schedule schedule_of(const std::string& name) {
  if (name == "gpipe") return mpipe::Schedule::GPipe;
  if (name == "1f1b") return mpipe::Schedule::OneFOneB;
  if (name == "zbh1") return mpipe::Schedule::ZeroBubbleH1;
  if (name == "interleaved") return mpipe::Schedule::Interleaved1F1B;
  if (name == "auto") return mpipe::Schedule::Auto;
  throw std::runtime_error("--schedule must be gpipe, 1f1b, zbh1, interleaved or auto, got " + name);
}

mpipe::Checkpoint checkpoint_of(const std::string& name) {
  if (name == "never") return mpipe::Checkpoint::Never;
  if (name == "except-last") return mpipe::Checkpoint::ExceptLast;
  if (name == "always") return mpipe::Checkpoint::Always;
  throw std::runtime_error("--checkpoint must be never, except-last or always, got " + name);
}

/// Training FLOPs per token: 6 per matmul weight, and attention's two
/// products counted as if not causal (as PaLM's and nanoGPT's estimates do).
double flops_per_token(const Config& c, int64_t vocab) {
  const double d = static_cast<double>(c.dim), L = static_cast<double>(c.layers);
  return 6 * (L * 12 * d * d + d * static_cast<double>(vocab)) +
         12 * L * static_cast<double>(c.context) * d;
}

/// Layers per stage: given (--balance 1,2,2,1), or the split that minimises
/// the slowest stage, of each layer's measured time in one process and of
/// its FLOPs across processes (every rank must get the same split).
std::vector<int64_t> stage_sizes(const Config& c, Layers& layers, int64_t n_stages, int64_t vocab,
                                 const torch::Tensor& sample) {
  if (c.balance != "auto") {
    std::vector<int64_t> sizes;
    std::stringstream in(c.balance);
    for (std::string item; std::getline(in, item, ',');) sizes.push_back(std::stoll(item));
    int64_t sum = 0;
    for (int64_t s : sizes) sum += s;
    if (static_cast<int64_t>(sizes.size()) != n_stages || sum != layers.size() ||
        *std::min_element(sizes.begin(), sizes.end()) < 1) {
      throw std::runtime_error("--balance must give " + std::to_string(n_stages) +
                               " positive layer counts summing to " +
                               std::to_string(layers.size()) + ", got " + c.balance);
    }
    return sizes;
  }
  std::vector<double> costs;
  if (c.group.defined()) {
    const double d = static_cast<double>(c.dim);
    costs.push_back(d);  // the embedding: a lookup
    for (int64_t l = 0; l < c.layers; ++l) costs.push_back(24 * d * d + 4 * c.context * d);
    costs.push_back(2 * d * static_cast<double>(vocab));
  } else {
    auto all = layers.all();
    all->to(sample.device());
    costs = mpipe::balance::profile_time(all, sample, 3);
  }
  return mpipe::balance::partition(costs, n_stages);
}

/// Autocast to bf16 on the GPU when --precision bf16; nothing otherwise.
std::unique_ptr<mpipe::AutocastGuard> precision_scope(const Config& c, const torch::Device& d) {
  if (c.precision != "bf16") return nullptr;
  return std::make_unique<mpipe::AutocastGuard>(d.type(), torch::kBFloat16);
}

/// Warm-up, then cosine decay to a tenth of the peak.
double lr_at(const Config& c, int64_t step) {
  if (step < c.warmup) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup);
  const double t = static_cast<double>(step - c.warmup) /
                   static_cast<double>(std::max<int64_t>(1, c.steps - c.warmup));
  return c.lr * (0.1 + 0.45 * (1 + std::cos(M_PI * std::min(1.0, t))));
}

/// An SVG of the training loss (per logged interval), the validation loss
/// and the unigram baseline, per step; losses above 1.05 times the baseline
/// are drawn at the top.
void write_loss_svg(const std::string& path, const std::vector<std::pair<int64_t, double>>& train,
                    const std::vector<std::pair<int64_t, double>>& val, double unigram,
                    const std::string& title, int64_t steps) {
  auto line = [](const char* name, const char* colour, const std::vector<std::pair<int64_t, double>>& v) {
    examples::PlotLine l{name, colour, {}};
    for (const auto& [step, loss] : v) {
      l.x.push_back(static_cast<double>(step));
      l.values.push_back(loss);
    }
    return l;
  };
  const examples::PlotLine baseline{"unigram baseline", "#999", {unigram, unigram},
                                    {0.0, static_cast<double>(steps)}, /*dashed=*/true};
  examples::write_line_plot(path, title,
                            {line("training loss", "#d62728", train),
                             line("validation loss", "#1f77b4", val), baseline},
                            "step (of " + std::to_string(steps) + "); loss in nats per character",
                            /*percent=*/false, std::nullopt, unigram * 1.05);
}

/// How the example runs a model: through the pipeline, or plain.
struct Model {
  mpipe::ModelPipeline pipe{nullptr};
  nn::Sequential plain{nullptr};
  torch::Device in_device = torch::kCPU, out_device = torch::kCPU;

  std::vector<torch::Tensor> parameters() const {
    return plain ? plain->parameters() : pipe->parameters();
  }
  void train(bool on) {
    if (plain) {
      plain->train(on);
    } else {
      pipe->train(on);
    }
  }
  /// Logits (on the last rank across processes; undefined elsewhere).
  torch::Tensor forward(const torch::Tensor& x, int64_t micro_batches) {
    if (plain) return plain->forward(x);
    return pipe->forward(x, mpipe::chunks(std::min(micro_batches, x.size(0))));
  }
};

/// Mean loss per character over every whole window of the validation text.
double validate(Model& m, const Config& c, const Corpus& corpus) {
  torch::NoGradGuard no_grad;
  m.train(false);
  const int64_t windows = (corpus.val.size(0) - 1) / c.context;
  double sum = 0;
  int64_t n = 0;
  for (int64_t w = 0; w < windows; w += c.batch) {
    const int64_t b = std::min(c.batch, windows - w);
    const auto span = corpus.val.narrow(0, w * c.context, b * c.context + 1);
    const auto x = span.narrow(0, 0, b * c.context).view({b, c.context}).to(m.in_device);
    const auto y = span.narrow(0, 1, b * c.context).view({b, c.context}).to(m.out_device);
    torch::Tensor logits;
    {
      const auto precision = precision_scope(c, m.in_device);
      logits = m.forward(x, c.micro_batches);
    }
    if (logits.defined()) sum += lm_loss(logits, y).item<double>() * static_cast<double>(b);
    n += b;
  }
  m.train(true);
  return sum / static_cast<double>(n);
}

/// `n` characters sampled after `prompt`, each from the model's forward over
/// the last `context` characters. Across processes the last rank samples and
/// every rank learns the character through ProcessGroup::max.
std::string generate(Model& m, const Config& c, const Corpus& corpus, int64_t n) {
  torch::NoGradGuard no_grad;
  m.train(false);
  std::vector<int64_t> ids;
  for (unsigned char ch : c.prompt) {
    const auto it = std::find(corpus.chars.begin(), corpus.chars.end(), ch);
    if (it != corpus.chars.end()) ids.push_back(it - corpus.chars.begin());
  }
  if (ids.empty()) ids.push_back(0);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(c.common.seed + 1);
  for (int64_t k = 0; k < n; ++k) {
    const size_t from = ids.size() > static_cast<size_t>(c.context) ? ids.size() - c.context : 0;
    const std::vector<int64_t> window(ids.begin() + static_cast<std::ptrdiff_t>(from), ids.end());
    const auto x = torch::tensor(window, torch::kLong).view({1, -1}).to(m.in_device);
    torch::Tensor logits;
    {
      const auto precision = precision_scope(c, m.in_device);
      logits = m.forward(x, 1);
    }
    double next = 0;
    if (logits.defined()) {
      const auto probs = (logits[0][-1].to(torch::kFloat).cpu() / c.temperature).softmax(-1);
      next = static_cast<double>(at::multinomial(probs, 1, false, gen).item<int64_t>());
    }
    // The last rank's choice (every other rank has 0), on every rank; max, not
    // sum: with data-parallel replicas several last ranks choose alike.
    if (c.group.defined()) next = c.group.max(next);
    ids.push_back(static_cast<int64_t>(next));
  }
  m.train(true);
  return decode(corpus, ids);
}

int run(Config c) {
  examples::CommonFlags& common = c.common;
  c.group = examples::group_from_env();
  if (c.plain && c.group.defined()) throw std::runtime_error("--plain runs in one process");
  const mpipe::Schedule schedule = schedule_of(c.schedule);
  const int64_t virtual_stages = schedule == mpipe::Schedule::Interleaved1F1B ? 2 : 1;
  const int64_t n_stages = 4 * virtual_stages;
  const auto devices4 = examples::stage_devices(common.devices, 4);
  const bool cuda = devices4.front().is_cuda();
  // Defaults: a 10.8M-parameter model on a GPU, a tiny one on the CPU.
  const bool small = common.quick || !cuda;
  auto pick = [](int64_t& v, int64_t value) {
    if (v == 0) v = value;
  };
  pick(c.layers, small ? 2 : 6);
  pick(c.dim, small ? 64 : 384);
  pick(c.heads, small ? 4 : 6);
  pick(c.context, small ? 64 : 256);
  pick(c.batch, small ? 16 : 64);
  pick(c.steps, common.quick ? 200 : (cuda ? 2000 : 1000));
  if (c.warmup < 0) c.warmup = std::min<int64_t>(100, c.steps / 10);
  pick(c.log_every, common.quick ? 50 : 100);
  if (c.precision.empty()) c.precision = cuda ? "bf16" : "fp32";
  if (c.precision != "fp32" && c.precision != "bf16") {
    throw std::runtime_error("--precision must be fp32 or bf16, got " + c.precision);
  }
  if (c.dim % c.heads != 0) throw std::runtime_error("--dim must be a multiple of --heads");
  if (c.batch < c.micro_batches) {
    throw std::runtime_error("--batch " + std::to_string(c.batch) + " is smaller than --micro-batches " +
                             std::to_string(c.micro_batches));
  }
  if (c.group.defined() && virtual_stages > 1) {
    throw std::runtime_error("--schedule interleaved runs in one process here (its stages go to "
                             "devices by stage number, a rank holds a contiguous range)");
  }
  if (c.layers + 2 < n_stages) {
    throw std::runtime_error("--layers " + std::to_string(c.layers) + " gives " +
                             std::to_string(c.layers + 2) + " layers for " +
                             std::to_string(n_stages) + " stages; use --layers " +
                             std::to_string(n_stages - 2) + " or more");
  }
  torch::manual_seed(common.seed);
  if (cuda) {
    torch::cuda::manual_seed_all(common.seed);
    at::globalContext().setAllowTF32CuBLAS(true);
  }

  if (common.skip_if_no_data && !text_present(common.data)) {
    std::printf("no text found in %s: skipped\n", common.data.c_str());
    return examples::kSkipExitCode;
  }
  const std::string text = load_text(common.data);
  if (text.size() < 10000) {
    throw std::runtime_error("found " + std::to_string(text.size()) + " bytes of text in " +
                             common.data + "; install it with: apt-get install fortunes");
  }
  const Corpus corpus = make_corpus(text, c.val_chars);
  const auto vocab = static_cast<int64_t>(corpus.chars.size());
  if (c.eval_every == 0) c.eval_every = std::max<int64_t>(1, corpus.train.size(0) / (c.batch * c.context));
  const bool report = examples::reports(c.group);

  // The model: the plain module, or the pipeline's stages (this rank's).
  Layers layers(vocab, c.layers, c.dim, c.heads, c.context);
  Model m;
  std::string placement;
  if (c.plain) {
    m.plain = layers.all();
    m.plain->to(devices4.front());
    m.in_device = m.out_device = devices4.front();
    placement = "one module on " + devices4.front().str();
  } else {
    const auto sample = corpus.train.narrow(0, 0, (c.batch / c.micro_batches) * c.context)
                            .view({-1, c.context}).to(devices4.front());
    const auto sizes = stage_sizes(c, layers, n_stages, vocab, sample);
    m.pipe = mpipe::ModelPipeline(mpipe::ModelPipelineOptions()
                                      .checkpoint(checkpoint_of(c.checkpoint))
                                      .auto_cuda_graphs(c.graphs == "auto")
                                      .process_group(c.group));
    int64_t at = 0;
    std::string split;
    for (int64_t s = 0; s < n_stages; ++s) {
      const auto device = devices4[static_cast<size_t>(s % 4)];  // interleaved: stage s on s % 4
      nn::Sequential stage;
      for (int64_t k = 0; k < sizes[static_cast<size_t>(s)]; ++k) layers.push(stage, at + k);
      at += sizes[static_cast<size_t>(s)];
      split += (s ? "," : "") + std::to_string(sizes[static_cast<size_t>(s)]);
      if (examples::holds_stage(c.group, s, n_stages)) m.pipe->append(stage, device);
    }
    m.in_device = devices4.front();
    m.out_device = devices4.back();
    placement = std::to_string(n_stages) + " stages (layers " + split + ") on " +
                examples::device_list(devices4) +
                (c.group.defined() ? " across " + std::to_string(c.group.world_size()) + " processes"
                                   : std::string());
  }
  int64_t n_params = 0;
  for (const auto& p : layers.all()->parameters()) n_params += p.numel();
  // Where a replay gives the eager step's results, mpipe replays repeated
  // steps from CUDA graphs by default (docs/performance.md).
  const bool graphed = !c.plain && cuda && c.graphs == "auto" && !c.group.defined() &&
                       c.checkpoint == "never";
  const std::string graphs = graphed ? "CUDA graphs (training steps replayed from the 4th)"
                                     : "eager (no CUDA graphs)";
  if (report) {
    std::printf("mpipe %s transformer_lm: %s; %lld layers of %lld (%lld heads), context %lld, "
                "%.1fM parameters, vocabulary %lld; %lld train / %lld validation characters; batch "
                "%lld = %lld micro-batches, schedule %s, checkpoint %s, %s, %s%s\n",
                MPIPE_VERSION_STRING, placement.c_str(), static_cast<long long>(c.layers),
                static_cast<long long>(c.dim), static_cast<long long>(c.heads),
                static_cast<long long>(c.context), static_cast<double>(n_params) / 1e6,
                static_cast<long long>(vocab), static_cast<long long>(corpus.train.size(0)),
                static_cast<long long>(corpus.val.size(0)), static_cast<long long>(c.batch),
                static_cast<long long>(c.micro_batches), c.plain ? "none (plain)" : c.schedule.c_str(),
                c.checkpoint.c_str(), c.precision.c_str(), graphs.c_str(), common.quick ? " (quick)" : "");
    std::printf("unigram baseline: %.3f nats per character on the validation text\n",
                corpus.unigram);
  }

  // AdamW, with weight decay on matrices only.
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : m.parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).weight_decay(c.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(c.lr).betas({0.9, 0.95}).weight_decay(0)));
  torch::optim::AdamW opt(groups);

  // The trained weights, saved at each validation: each rank its own stages.
  std::filesystem::create_directories(common.out);
  std::string model_file = common.out + (c.plain ? "/plain.pt" : "/transformer_lm.pt");
  if (c.group.defined()) model_file = c.group.rank_path(model_file);
  auto save = [&] {
    if (c.plain) {
      torch::save(m.plain, model_file);
    } else {
      torch::save(m.pipe, model_file);
    }
  };
  // --resume, --checkpoint-every (Note [Resuming the examples] in training.h).
  // Job checkpoints hold a pipeline's stages: --plain's module is
  // checkpointed as the one stage of a pipeline that only holds it.
  mpipe::ModelPipeline holder{nullptr};
  if (c.plain) {
    holder = mpipe::ModelPipeline();
    holder->append(m.plain, m.in_device);
  }
  const auto checkpoints = examples::job_checkpoints(common, c.plain ? *holder : *m.pipe, opt);
  const auto resumed = examples::resume(common, checkpoints.get(), report);
  int64_t start = 0;
  std::vector<std::pair<int64_t, double>> train_curve, val_curve;
  torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions(m.out_device));
  int64_t logged_steps = 0;
  double val_loss = NAN;
  // A curve as two lists (steps, values) in a Position, and back.
  auto put_curve = [](examples::Position& at, const std::string& name,
                      const std::vector<std::pair<int64_t, double>>& curve) {
    std::vector<double> steps, values;
    for (const auto& p : curve) {
      steps.push_back(static_cast<double>(p.first));
      values.push_back(p.second);
    }
    at.set(name + "_steps", steps);
    at.set(name + "_values", values);
  };
  auto get_curve = [](const examples::Position& at, const std::string& name) {
    const auto steps = at.reals(name + "_steps"), values = at.reals(name + "_values");
    std::vector<std::pair<int64_t, double>> curve;
    for (size_t k = 0; k < steps.size() && k < values.size(); ++k) {
      curve.emplace_back(static_cast<int64_t>(steps[k]), values[k]);
    }
    return curve;
  };
  if (resumed) {
    start = resumed->integer("step");
    loss_sum = resumed->tensor("loss_sum").to(m.out_device);
    logged_steps = resumed->integer("logged_steps");
    val_loss = resumed->real("val_loss");
    train_curve = get_curve(*resumed, "train");
    val_curve = get_curve(*resumed, "val");
  }

  const auto train_in = corpus.train.to(m.in_device), train_out = corpus.train.to(m.out_device);
  const auto offsets_in = torch::arange(c.context, torch::TensorOptions(m.in_device).dtype(torch::kLong));
  const auto offsets_out = offsets_in.to(m.out_device);
  auto options = mpipe::TrainStepOptions(mpipe::chunks(c.micro_batches))
                     .schedule(schedule)
                     .virtual_stages(virtual_stages);
  const double flops = flops_per_token(c, vocab);
  double train_seconds = 0, interval_seconds = 0;
  auto t_interval = examples::Clock::now();
  for (int64_t step = start; step < c.steps; ++step) {
    // Random windows of the training text, from (seed, step): the same on
    // every rank, and a resumed run draws the windows it would have drawn.
    auto windows = at::make_generator<at::CPUGeneratorImpl>(common.seed * 1000003 + static_cast<uint64_t>(step));
    const auto starts = torch::randint(corpus.train.size(0) - c.context - 1, {c.batch, 1}, windows,
                                       torch::TensorOptions(torch::kLong));
    const auto x = train_in.index({starts.to(m.in_device) + offsets_in});
    const auto y = train_out.index({starts.to(m.out_device) + 1 + offsets_out});
    for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr_at(c, step));
    opt.zero_grad();
    torch::Tensor loss;
    {
      const auto precision = precision_scope(c, m.in_device);
      if (c.plain) {
        // As train_step does: each micro-batch's mean loss weighted by its
        // share of the rows, its gradients accumulated (--micro-batches 1:
        // the whole batch at once).
        loss = torch::zeros({}, torch::TensorOptions(m.out_device));
        const auto xs = x.chunk(c.micro_batches), ys = y.chunk(c.micro_batches);
        for (size_t i = 0; i < xs.size(); ++i) {
          const double share = static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0));
          const auto part = lm_loss(m.plain->forward(xs[i]), ys[i]) * share;
          part.backward();
          loss += part.detach();
        }
      } else {
        loss = m.pipe->train_step(x, y, lm_loss, options);
      }
    }
    // The norm of every gradient of the model: across ranks too (mpipe::clip_grad_norm).
    if (c.plain) {
      torch::nn::utils::clip_grad_norm_(m.plain->parameters(), c.clip);
    } else {
      mpipe::clip_grad_norm(*m.pipe, c.clip);
    }
    opt.step();
    if (loss.defined()) loss_sum += loss;
    ++logged_steps;
    const bool last = step + 1 == c.steps;
    const bool eval_now = (step + 1) % c.eval_every == 0 || last;
    if ((step + 1) % c.log_every == 0 || eval_now) {
      const double mean = loss_sum.item<double>() / static_cast<double>(logged_steps);  // syncs
      const double seconds = examples::seconds_since(t_interval);
      train_seconds += seconds;
      interval_seconds = seconds;
      const double tokens = static_cast<double>(logged_steps * c.batch * c.context);
      if (report) {
        train_curve.emplace_back(step + 1, mean);
        std::printf("step %5lld/%lld  loss %.3f  lr %.1e  %7.0fk tok/s  %6.2f TFLOP/s  ETA %s\n",
                    static_cast<long long>(step + 1), static_cast<long long>(c.steps), mean,
                    lr_at(c, step), tokens / interval_seconds / 1e3,
                    tokens * flops / interval_seconds / 1e12,
                    examples::format_duration(train_seconds / static_cast<double>(step + 1 - start) *
                                              static_cast<double>(c.steps - step - 1))
                        .c_str());
        std::fflush(stdout);
      }
      loss_sum.zero_();
      logged_steps = 0;
      if (eval_now) {
        val_loss = validate(m, c, corpus);
        save();
        if (report) {
          val_curve.emplace_back(step + 1, val_loss);
          std::printf("epoch %.1f: validation loss %.3f nats per character (%.3f bits); "
                      "%s of training; saved to %s\n",
                      static_cast<double>((step + 1) * c.batch * c.context) /
                          static_cast<double>(corpus.train.size(0)),
                      val_loss, val_loss / std::log(2.0), examples::format_duration(train_seconds).c_str(),
                      model_file.c_str());
          std::fflush(stdout);
        }
      }
      t_interval = examples::Clock::now();
    }
    examples::checkpoint_if_due(common, checkpoints.get(), step + 1, c.steps, [&] {
      examples::Position at;
      at.set("step", step + 1);
      at.set("loss_sum", loss_sum);
      at.set("logged_steps", logged_steps);
      at.set("val_loss", val_loss);
      put_curve(at, "train", train_curve);
      put_curve(at, "val", val_curve);
      return at;
    });
  }

  const int64_t n_generate = c.generate >= 0 ? c.generate : (common.quick ? 200 : 400);
  if (n_generate > 0) {
    const std::string sample = generate(m, c, corpus, n_generate);
    if (report) std::printf("--- sampled through the %s (temperature %.1f) ---\n%s\n---\n",
                            c.plain ? "plain model" : "pipeline's forward", c.temperature, sample.c_str());
  }
  if (!report) return 0;
  if (!train_curve.empty()) {
    const std::string plot = common.out + (c.plain ? "/plain_loss.svg" : "/loss.svg");
    char title[200];
    std::snprintf(title, sizeof title, "transformer_lm%s: validation loss %.3f after %lld steps",
                  c.plain ? " (plain)" : "", val_loss, static_cast<long long>(c.steps));
    write_loss_svg(plot, train_curve, val_curve, corpus.unigram, title, c.steps);
    std::printf("final validation loss %.3f nats per character (unigram baseline %.3f); %s of "
                "training; weights in %s, loss curve in %s\n",
                val_loss, corpus.unigram, examples::format_duration(train_seconds).c_str(),
                model_file.c_str(), plot.c_str());
    if (graphed) std::printf("CUDA graphs held: %zu\n", m.pipe->cuda_graphs_captured());
  } else {
    std::printf("final validation loss %.3f nats per character (unigram baseline %.3f)\n", val_loss,
                corpus.unigram);
  }
  if (c.below_unigram && !(val_loss < corpus.unigram)) {
    std::printf("FAILED: validation loss %.3f is not below the unigram baseline %.3f\n", val_loss,
                corpus.unigram);
    return 1;
  }
  if (c.max_val_loss > 0 && !(val_loss <= c.max_val_loss)) {
    std::printf("FAILED: validation loss %.3f is above --max-val-loss %.3f\n", val_loss, c.max_val_loss);
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace transformer_lm

int main(int argc, char** argv) {
  transformer_lm::Config c;
  CLI::App app{"Train a character-level transformer language model on Debian's fortunes through "
               "an mpipe pipeline"};
  app.add_option("--layers", c.layers, "transformer blocks (default 6 on a GPU, 2 on the CPU)")
      ->check(CLI::PositiveNumber);
  app.add_option("--dim", c.dim, "model width (default 384 on a GPU, 64 on the CPU)")
      ->check(CLI::PositiveNumber);
  app.add_option("--heads", c.heads, "attention heads (default 6 on a GPU, 4 on the CPU)")
      ->check(CLI::PositiveNumber);
  app.add_option("--context", c.context, "characters per window (default 256 on a GPU, 64 on the CPU)")
      ->check(CLI::PositiveNumber);
  app.add_option("-b,--batch", c.batch, "windows per step (default 64 on a GPU, 16 on the CPU)")
      ->check(CLI::PositiveNumber);
  app.add_option("--micro-batches", c.micro_batches, "micro-batches per step (default 8)")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", c.steps, "training steps (default 2000 on a GPU, 1000 on the CPU, "
                 "200 with --quick)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", c.warmup, "linear warm-up steps (default: a tenth of the steps, at most 100)");
  app.add_option("--lr", c.lr, "peak learning rate (default 1e-3; cosine decay to a tenth)");
  app.add_option("--weight-decay", c.weight_decay, "AdamW weight decay of the matrices (default 0.1)");
  app.add_option("--clip", c.clip, "clip the gradients' global norm to this (default 1)");
  app.add_option("--schedule", c.schedule, "gpipe, 1f1b (default), zbh1, interleaved (8 stages) or auto");
  app.add_option("--checkpoint", c.checkpoint, "activation checkpointing: never (default), "
                 "except-last or always");
  app.add_option("--balance", c.balance, "layers per stage, e.g. 2,2,2,2 (default auto: by a "
                 "profile in one process, by FLOPs across processes)");
  app.add_option("--precision", c.precision, "bf16 (autocast, the default on a GPU) or fp32");
  app.add_option("--graphs", c.graphs, "auto (default: on one GPU, repeated training steps and "
                 "inference calls are replayed from CUDA graphs) or off (every step eager)")
      ->check(CLI::IsMember({"auto", "off"}));
  app.add_flag("--plain", c.plain, "train the same layers as one plain module (no pipeline), "
               "accumulating gradients over the --micro-batches as the pipeline does "
               "(--micro-batches 1: the whole batch at once)");
  app.add_option("--eval-every", c.eval_every, "validate and save every N steps (default: every epoch)");
  app.add_option("--val-chars", c.val_chars, "validate on the first N characters of the validation "
                 "text (default: all of it)")->check(CLI::NonNegativeNumber);
  app.add_option("--log-every", c.log_every, "progress line every N steps");
  app.add_option("--generate", c.generate, "characters to sample at the end (default 400, 200 with --quick)");
  app.add_option("--prompt", c.prompt, "the text sampling starts from");
  app.add_option("--temperature", c.temperature, "sampling temperature (default 0.8)");
  app.add_option("--max-val-loss", c.max_val_loss, "exit 1 if the final validation loss is above this");
  app.add_flag("--below-unigram", c.below_unigram,
               "exit 1 unless the final validation loss is below the unigram baseline");
  examples::CommonFlags& f = c.common;
  f.data = transformer_lm::kDefaultData;
  f.out = "transformer_lm_out";
  examples::add_run_flags(app, f, "a brief run: the CPU's tiny model, 200 steps",
                          "folder of the fortunes text files (default " + std::string(transformer_lm::kDefaultData) + ")",
                          "folder for the weights, the loss curve and the job checkpoints");
  CLI11_PARSE(app, argc, argv);
  return examples::run_guarded([&] { return transformer_lm::run(c); });
}
