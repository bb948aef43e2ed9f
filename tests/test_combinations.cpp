// Combinations: a seeded sweep over pipelines and calls, the regression guard
// kept from an outside fuzzer. Each configuration (1 to 4 stages with several
// tensors, skips, a Linear applied twice, per-micro-batch state; threads,
// checkpoint mode, lanes) makes every call kind on one pipeline and compares,
// bit for bit, what the docs promise: the forward calls' outputs against a
// plain loop over the same micro-batches (forward's also against the whole
// batch); train_step's loss and gradients under every schedule against the
// canonical pipeline (GPipe, threads, Never, lanes 0) and a plain loop that
// weights each micro-batch's loss by rows / batch, over two steps;
// constant_train_step's loss and parameter gradients against its plain loop.
// Left out, as documented: a backward() of your own after a forward call, an
// input that several stages use, given programs, time chunks.
// MPIPE_COMBINATION=k replays configuration k alone.

#include "common.h"

#include <mpipe/mpipe.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <sstream>

using namespace mpipe_test;
using mpipe::Checkpoint;
using mpipe::Schedule;
using mpipe::Split;
using mpipe::Tensors;

namespace {

struct ComboRng {  // configuration k draws from a stream of its own
  explicit ComboRng(int64_t k) : g(20261207ull * 1000003ull + static_cast<uint64_t>(k)) {}
  int64_t uni(int64_t a, int64_t b) { return std::uniform_int_distribution<int64_t>(a, b)(g); }
  bool coin(double p = 0.5) { return std::uniform_real_distribution<double>(0, 1)(g) < p; }
  template <typename T>
  T pick(const std::vector<T>& v) { return v[static_cast<size_t>(uni(0, int64_t(v.size()) - 1))]; }
  std::mt19937_64 g;
};

struct ComboLayout {  // one stage
  bool sequential = false;  // Sequential(Linear, Tanh): Tensor forward(Tensor)
  bool tanh = true, leaky = false, twice = false, aux_in = false, aux_out = false, aux_mix = false;
  std::vector<std::string> stashes, pops, late_pops;  // late_pops: its own stashes, popped after
};

/// h = fc(x) [+ fc(2 x)] [+ pops]; [leaky state]; [tanh]; [* aux]; stashes
/// h / 2; [+ late pops]. Returns h [and the aux passed on, or aux + h / 10].
struct ComboStageImpl : torch::nn::Module, mpipe::Stateful {
  ComboStageImpl(ComboLayout layout, int64_t width) : l(std::move(layout)) {
    fc = register_module("fc", torch::nn::Linear(width, width));
  }
  Tensors forward(const Tensors& in) {
    torch::Tensor h = fc(in[0]);
    if (l.twice) h = h + fc(in[0] * 2);  // one weight reached twice
    for (const auto& n : l.pops) h = h + mpipe::pop(n);
    if (l.leaky) {
      torch::Tensor& v = state.get();
      v = v.defined() ? v * 0.5 + h : h;
      h = v;
    }
    if (l.tanh) h = torch::tanh(h);
    if (l.aux_in) h = h * in[1];
    for (const auto& n : l.stashes) mpipe::stash(n, h * 0.5);
    for (const auto& n : l.late_pops) h = h + mpipe::pop(n);
    Tensors out{h};
    if (l.aux_out) out.push_back(l.aux_mix ? in[1] + h * 0.1 : in[1]);
    return out;
  }
  void reset_state() override { state.clear(); }
  bool supports_state_snapshots() const override { return true; }
  std::any save_state() const override { return state.save(); }
  void load_state(const std::any& s) override { state.load(s); }
  ComboLayout l;
  torch::nn::Linear fc{nullptr};
  mpipe::PerMicroBatch<torch::Tensor> state;
};
TORCH_MODULE(ComboStage);

struct Combo {
  int64_t index = 0, n = 1, width = 3, batch = 1, lanes = 0;
  int64_t aux_stages = 0;  // stages 0 .. aux_stages - 1 take a second input
  bool dbl = false, aux_batched = true, threads = true;
  Checkpoint checkpoint = Checkpoint::Never;
  std::vector<ComboLayout> stages;

  std::string describe() const {
    const char* ckpt[] = {"Never", "ExceptLast", "Always"};
    std::ostringstream s;
    s << "configuration " << index << " (MPIPE_COMBINATION=" << index << " runs it alone): " << n
      << " stage(s), width " << width << ", batch " << batch << (dbl ? ", double" : ", float")
      << (threads ? ", threads" : ", inline") << ", checkpoint "
      << ckpt[static_cast<int>(checkpoint)] << ", lanes " << lanes;
    if (aux_stages > 0) s << ", a " << (aux_batched ? "" : "un") << "batched 2nd input";
    for (size_t j = 0; j < stages.size(); ++j) {
      const auto& l = stages[j];
      s << "\n  stage " << j << ":" << (l.sequential ? " Sequential(Linear, Tanh)" : " fc")
        << (l.twice ? " +fc(2x)" : "") << (l.leaky ? " leaky" : "")
        << (!l.sequential && l.tanh ? " tanh" : "") << (l.aux_in ? " *aux" : "")
        << (l.aux_out ? (l.aux_mix ? " passes aux+h/10" : " passes aux") : "");
      for (const auto& x : l.pops) s << " pop(" << x << ")";
      for (const auto& x : l.stashes) s << " stash(" << x << ")";
      for (const auto& x : l.late_pops) s << " then pop(" << x << ")";
    }
    return s.str();
  }
  /// Whether a stage returns its state to a stage that uses its input twice.
  bool carried_output_used_twice() const {
    for (size_t j = 0; j + 1 < stages.size(); ++j) {
      const auto& l = stages[j], &next = stages[j + 1];
      if (l.leaky && !l.tanh && !l.aux_in && l.late_pops.empty() && next.twice) return true;
    }
    return false;
  }
};

Combo random_combo(int64_t index, ComboRng& r) {
  Combo c;
  c.index = index;
  c.n = r.uni(1, 4);
  c.width = r.uni(3, 5);
  c.batch = r.pick<int64_t>({1, 2, 3, 4, 5, 6, 7, 9});
  c.dbl = r.coin();
  c.threads = r.coin(0.6);
  c.checkpoint = r.pick<Checkpoint>({Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always});
  c.lanes = r.pick<int64_t>({0, 0, 1, 2});
  c.aux_stages = r.coin(0.35) ? r.uni(1, c.n) : 0;
  c.aux_batched = r.coin();
  const bool state = r.coin(0.3);
  c.stages.resize(static_cast<size_t>(c.n));
  for (int64_t j = 0; j < c.n; ++j) {
    auto& l = c.stages[static_cast<size_t>(j)];
    l.tanh = r.coin(0.7);
    l.leaky = state && r.coin();
    l.twice = r.coin(0.25);
    l.aux_in = j < c.aux_stages;
    l.aux_out = j + 1 < c.aux_stages;
    l.aux_mix = l.aux_out && r.coin(0.3);
  }
  const int64_t skips = r.coin(0.4) ? r.uni(1, 2) : 0;
  for (int64_t k = 0; k < skips; ++k) {
    const std::string name = "skip" + std::to_string(k);
    const int64_t a = r.uni(0, c.n - 1), b = r.uni(a, c.n - 1);
    c.stages[static_cast<size_t>(a)].stashes.push_back(name);
    auto& popper = c.stages[static_cast<size_t>(b)];
    (a == b ? popper.late_pops : popper.pops).push_back(name);
  }
  for (auto& l : c.stages) {
    l.sequential = !l.leaky && !l.twice && !l.aux_in && l.stashes.empty() && l.pops.empty() &&
                   l.late_pops.empty() && r.coin(0.4);
    l.tanh = l.tanh || l.sequential;
  }
  return c;
}

std::string split_name(const std::optional<Split>& s) {
  if (!s) return "(none)";
  return s->by_count() ? "chunks(" + std::to_string(s->value()) + ")" : std::to_string(s->value());
}

/// (first row, rows) of each micro-batch; chunks(n) by torch.chunk's rule.
std::vector<std::pair<int64_t, int64_t>> combo_micro_batches(const std::optional<Split>& s,
                                                             int64_t batch) {
  const int64_t rows = !s ? batch
                       : s->by_count() ? (batch - 1) / s->value() + 1 : std::min(s->value(), batch);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t at = 0; at < batch; at += rows) out.push_back({at, std::min(rows, batch - at)});
  return out;
}

/// One configuration's pipeline, the same modules as a plain model, and the checks.
struct ComboRun {
  ComboRun(const Combo& combo, ComboRng& rng) : c(combo), r(rng) {
    torch::manual_seed(static_cast<uint64_t>(c.index));
    pipe = mpipe::ModelPipeline(mpipe::ModelPipelineOptions());
    for (const auto& l : c.stages) {
      if (l.sequential) {
        torch::nn::Sequential seq(torch::nn::Linear(c.width, c.width), torch::nn::Tanh());
        pipe->append(seq, "cpu");
        plain.push_back([seq](const Tensors& in) mutable { return Tensors{seq->forward(in[0])}; });
      } else {
        ComboStage s(l, c.width);
        pipe->append(s, "cpu");
        plain.push_back([s](const Tensors& in) mutable { return s->forward(in); });
      }
    }
    pipe->to(c.dbl ? torch::kDouble : torch::kFloat);
    set_options(false);
  }

  void set_options(bool canonical) {
    pipe->options.worker_threads(canonical || c.threads)
        .checkpoint(canonical ? Checkpoint::Never : c.checkpoint)
        .lanes(canonical ? 0 : c.lanes);
  }
  void reset() { mpipe::reset_states(*pipe); }
  torch::TensorOptions dtype() const {
    return torch::TensorOptions().dtype(c.dbl ? torch::kDouble : torch::kFloat);
  }
  Split random_split() {
    return r.coin(0.4) ? mpipe::chunks(r.uni(1, c.batch + 2)) : Split(r.uni(1, c.batch + 2));
  }
  torch::Tensor randn(at::IntArrayRef shape) { return torch::randn(shape, dtype()); }
  torch::Tensor random_aux(at::IntArrayRef batched_shape) {
    return torch::rand(c.aux_batched ? batched_shape : at::IntArrayRef{c.width}, dtype()) + 0.5;
  }
  std::vector<mpipe::Input> inputs(const torch::Tensor& x, const torch::Tensor& aux) const {
    std::vector<mpipe::Input> in{x};
    if (c.aux_stages > 0) in.push_back(c.aux_batched ? mpipe::Input(aux) : mpipe::unbatched(aux));
    return in;
  }
  /// A micro-batch's rows of the inputs, as the plain loop takes them.
  Tensors rows_of(const torch::Tensor& x, const torch::Tensor& aux,
                  std::pair<int64_t, int64_t> mb) const {
    Tensors in{x.narrow(0, mb.first, mb.second)};
    if (c.aux_stages > 0) in.push_back(c.aux_batched ? aux.narrow(0, mb.first, mb.second) : aux);
    return in;
  }
  Tensors chain(Tensors h) {
    for (auto& stage : plain) h = stage(h);
    return h;
  }
  /// The plain loop: micro-batch i, under its guard, for T steps on in(i, t);
  /// each output summed over the steps (reduce) and joined along the rows,
  /// or joined along the rows step by step, then concatenated or stacked.
  Tensors plain_loop(int64_t M, int64_t T, bool reduce, bool stack,
                     const std::function<Tensors(int64_t, int64_t)>& in) {
    std::vector<std::vector<Tensors>> per(static_cast<size_t>(M));  // [i][output][step]
    for (int64_t i = 0; i < M; ++i) {
      mpipe::MicroBatchGuard guard({i, M});
      auto& mine = per[static_cast<size_t>(i)];
      for (int64_t t = 0; t < T; ++t) {
        const Tensors y = chain(in(i, t));
        mine.resize(y.size());
        for (size_t k = 0; k < y.size(); ++k) {
          if (reduce && !mine[k].empty()) mine[k][0] = mine[k][0] + y[k];
          else mine[k].push_back(y[k]);
        }
      }
    }
    Tensors out;
    for (size_t k = 0; k < per[0].size(); ++k) {
      Tensors steps;
      for (int64_t t = 0; t < (reduce ? 1 : T); ++t) {
        Tensors parts;
        for (auto& p : per) parts.push_back(p[k][static_cast<size_t>(t)]);
        steps.push_back(torch::cat(parts, 0));
      }
      out.push_back(reduce ? steps[0] : stack ? torch::stack(steps, 0) : torch::cat(steps, 0));
    }
    return out;
  }
  /// Bit for bit (expect_close with no tolerance); both undefined is equal.
  static void same(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
    if (got.defined() || want.defined()) expect_close(got.detach(), want.detach(), 0.0, what);
  }
  static void same(const Tensors& got, const Tensors& want, const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t k = 0; k < got.size(); ++k) same(got[k], want[k], what + ", output " + std::to_string(k));
  }

  /// forward (kind 0), constant_forward (1) or sequence_forward (2), with
  /// gradients on or off: outputs against the plain loop.
  void check_forward_call(int kind) {
    const bool seq = kind == 2;
    const int64_t T = kind == 0 ? 1 : r.uni(1, 3);
    const bool reduce = kind == 0 || r.coin(), grad = r.coin(0.3);
    const bool vec = c.aux_stages > 0 || r.coin(0.3);
    std::optional<Split> split;
    if (kind == 0 || r.coin(0.6)) split = random_split();
    SCOPED_TRACE(std::string(kind == 0 ? "forward" : seq ? "sequence_forward" : "constant_forward") +
                 ", T " + std::to_string(T) + (reduce ? ", reduce" : "") + ", split " +
                 split_name(split) + (grad ? ", gradients on" : "") + (vec ? ", vector overload" : ""));
    const auto shape = seq ? std::vector<int64_t>{T, c.batch, c.width}
                           : std::vector<int64_t>{c.batch, c.width};
    const auto x = randn(shape), aux = random_aux(shape);
    Tensors got;
    {
      std::optional<torch::NoGradGuard> no_grad;
      if (!grad) no_grad.emplace();
      reset();
      const auto in = inputs(x, aux);
      if (kind == 0) got = vec ? pipe->forward(in, *split) : Tensors{pipe->forward(x, *split)};
      if (kind == 1) got = vec ? pipe->constant_forward(in, T, reduce, std::nullopt, split)
                               : Tensors{pipe->constant_forward(x, T, reduce, std::nullopt, split)};
      if (kind == 2) got = vec ? pipe->sequence_forward(in, reduce, std::nullopt, split)
                               : Tensors{pipe->sequence_forward(x, reduce, std::nullopt, split)};
    }
    torch::NoGradGuard no_grad;
    const auto mbs = combo_micro_batches(split, c.batch);
    reset();
    const auto M = static_cast<int64_t>(mbs.size());
    same(got, plain_loop(M, T, reduce, seq, [&](int64_t i, int64_t t) {
           const auto mb = mbs[static_cast<size_t>(i)];
           return seq ? rows_of(x[t], c.aux_batched ? aux[t] : aux, mb) : rows_of(x, aux, mb);
         }), "against the plain micro-batch loop");
    reset();
    if (kind == 0) same(got, chain(rows_of(x, aux, {0, c.batch})), "against the whole batch");
    reset();
  }

  void check_train_step() {
    const Split s1 = random_split(), s2 = random_split();
    const Schedule sch1 = r.pick(all_schedules()), sch2 = r.pick(all_schedules());
    const bool sum = r.coin(0.3), x_grad = r.coin(), aux_grad = c.aux_stages > 0 && r.coin();
    const bool vec = c.aux_stages > 0 || r.coin(0.3);
    SCOPED_TRACE("train_step, split " + split_name(s1) + ", " + schedule_name(sch1) +
                 ", then on top split " + split_name(s2) + ", " + schedule_name(sch2) +
                 (sum ? ", LossReduction::Sum" : "") +
                 (x_grad ? ", the input requires grad" : ", no input requires grad") +
                 (aux_grad ? " (the 2nd does)" : "") + (vec ? ", vector overload" : ""));
    const auto x = randn({c.batch, c.width}), aux = random_aux({c.batch, c.width});
    const auto y1 = randn({c.batch, c.width}), y2 = randn({c.batch, c.width});
    auto loss_fn = [sum](const torch::Tensor& o, const torch::Tensor& t) {
      return torch::mse_loss(o, t, sum ? at::Reduction::Sum : at::Reduction::Mean);
    };
    // A step of the pipeline under schedule s, or without s of the plain loop.
    auto step = [&](std::optional<Schedule> s, Split split, const torch::Tensor& y) {
      auto xs = x.clone().requires_grad_(x_grad), as = aux.clone().requires_grad_(aux_grad);
      torch::Tensor loss;
      reset();
      if (s) {
        auto o = schedule_options(*s, split.by_count() ? 1 : split.value(), c.n);
        if (split.by_count()) o.chunks(split.value());
        o.reduction(sum ? mpipe::LossReduction::Sum : mpipe::LossReduction::Mean);
        loss = vec ? pipe->train_step(inputs(xs, as), y, loss_fn, o)
                   : pipe->train_step(xs, y, loss_fn, o);
      }
      const auto mbs = combo_micro_batches(split, c.batch);
      const auto M = static_cast<int64_t>(mbs.size());
      for (int64_t i = 0; !s && i < M; ++i) {
        mpipe::MicroBatchGuard guard({i, M});
        const auto mb = mbs[static_cast<size_t>(i)];
        auto l = loss_fn(chain(rows_of(xs, as, mb))[0], y.narrow(0, mb.first, mb.second));
        if (!sum) l = l * (static_cast<double>(mb.second) / c.batch);
        loss = loss.defined() ? loss + l.detach() : l.detach();
        l.backward();
      }
      reset();
      return StepResult{loss, {xs.grad(), as.grad()}, grads_of(*pipe)};
    };
    zero_grads(*pipe);
    set_options(true);
    const auto canonical = step(Schedule::GPipe, s1, y1);
    set_options(false);
    zero_grads(*pipe);
    const auto first = step(sch1, s1, y1);
    const auto second = step(sch2, s2, y2);  // adds to the first step's gradients
    zero_grads(*pipe);
    const auto plain_first = step(std::nullopt, s1, y1);
    const auto plain_second = step(std::nullopt, s2, y2);
    zero_grads(*pipe);
    same(first, canonical, " against the canonical pipeline");
    same(first, plain_first, " against the plain micro-batch loop");
    same(second, plain_second, " of a second step on top, against the plain loop's");
  }
  struct StepResult {  // a training step's loss, inputs' gradients and .grad after it
    torch::Tensor loss;
    Tensors input_grads;
    std::map<std::string, torch::Tensor> grads;
  };
  void same(const StepResult& got, const StepResult& want, const std::string& what) const {
    same(got.loss, want.loss, "loss" + what);
    // The 2nd input's gradient only where one stage uses it (else: rounding).
    for (size_t k = 0; k < (c.aux_stages > 1 ? 1u : 2u); ++k) {
      same(got.input_grads[k], want.input_grads[k], "gradient of input " + std::to_string(k) + what);
    }
    for (const auto& g : want.grads) {
      same(got.grads.at(g.first), g.second, "gradient of " + g.first + what);
    }
  }

  void check_constant_train_step() {
    const int64_t T = r.uni(1, 3);
    const bool x_grad = r.coin(), vec = c.aux_stages > 0 || r.coin(0.3);
    std::optional<Split> split;
    if (r.coin(0.6)) split = random_split();
    SCOPED_TRACE("constant_train_step, T " + std::to_string(T) + ", split " + split_name(split) +
                 (x_grad ? ", the input requires grad" : "") + (vec ? ", vector overload" : ""));
    const auto x = randn({c.batch, c.width}), aux = random_aux({c.batch, c.width});
    const auto y = randn({c.batch, c.width});
    zero_grads(*pipe);
    auto xs = x.clone().requires_grad_(x_grad);
    const auto loss = vec ? pipe->constant_train_step(inputs(xs, aux), T, y, mse, std::nullopt, split)
                          : pipe->constant_train_step(xs, T, y, mse, std::nullopt, split);
    const auto grads = grads_of(*pipe);
    zero_grads(*pipe);
    // The plain loop from rest: each micro-batch's T outputs summed, joined, one loss.
    xs = x.clone().requires_grad_(x_grad);
    const auto mbs = combo_micro_batches(split, c.batch);
    reset();
    const auto out = plain_loop(static_cast<int64_t>(mbs.size()), T, true, false,
                                [&](int64_t i, int64_t) { return rows_of(xs, aux, mbs[size_t(i)]); });
    const auto want = mse(out[0], y);
    want.backward();
    reset();
    same(loss, want, "loss against the plain loop");
    // Where a stage returns its state (carried to the next step) to a stage
    // that uses its input twice, the parameter gradients differ in the last
    // bits: the next stage adds its two parts before the carried one joins
    // them, one backward of the plain loop adds the carried one first.
    for (const auto& g : grads_of(*pipe)) {
      const std::string of = "gradient of " + g.first;
      if (c.carried_output_used_twice()) {
        expect_rel(grads.at(g.first), g.second, c.dbl ? 1e-12 : 1e-5, of + " (within rounding)");
      } else {
        same(grads.at(g.first), g.second, of + " against the plain loop");
      }
    }
    zero_grads(*pipe);
  }

  const Combo& c;
  ComboRng& r;
  mpipe::ModelPipeline pipe{nullptr};
  std::vector<std::function<Tensors(const Tensors&)>> plain;  // its stages, outside the pipeline
};

}  // namespace

TEST(Combinations, SeededSweepMatchesTheCanonicalPipelineAndThePlainModelBitForBit) {
  const char* only = std::getenv("MPIPE_COMBINATION");  // replays one configuration
  const auto* result = ::testing::UnitTest::GetInstance()->current_test_info()->result();
  int64_t failing = 0;
  for (int64_t k = 0; k < 500 && failing < 3; ++k) {
    if (only && *only && k != std::stoll(only)) continue;
    ComboRng rng(k);
    const Combo combo = random_combo(k, rng);
    SCOPED_TRACE(combo.describe());
    ComboRun run(combo, rng);
    const int before = result->total_part_count();
    // Every call kind, shuffled, and one more of any kind, on one pipeline.
    std::vector<int> calls{0, 1, 2, 3, 4, static_cast<int>(rng.uni(0, 4))};
    std::shuffle(calls.begin(), calls.end(), rng.g);
    for (int call : calls) {
      if (call < 3) run.check_forward_call(call);
      if (call == 3) run.check_train_step();
      if (call == 4) run.check_constant_train_step();
    }
    failing += result->total_part_count() > before ? 1 : 0;
  }
  EXPECT_LT(failing, 3) << "stopped after 3 failing configurations";
}

// Bad input is refused with a message naming what is wrong, and the next
// good call of the same pipeline still matches the plain model bit for bit.
TEST(Combinations, BadInputsNameWhatIsWrongAndTheNextCallStillMatches) {
  for (int64_t k = 1000; k < 1012; ++k) {
    ComboRng rng(k);
    const Combo combo = random_combo(k, rng);
    SCOPED_TRACE(combo.describe());
    ComboRun run(combo, rng);
    const auto x = run.randn({combo.batch, combo.width});
    const auto in = run.inputs(x, run.random_aux({combo.batch, combo.width}));
    MPIPE_EXPECT_ERROR(run.pipe->forward(in, 0),
                       "mpipe::ModelPipeline::forward: split_size must be positive, got 0");
    run.check_forward_call(0);
    MPIPE_EXPECT_ERROR(run.pipe->forward(in, mpipe::chunks(-1)),
                       "mpipe::ModelPipeline::forward: chunks must be positive, got -1");
    run.check_forward_call(1);
    MPIPE_EXPECT_ERROR(run.pipe->constant_forward(in, 0), "mpipe::ModelPipeline::constant_forward",
                       "T (the number of time steps) must be positive, got 0");
    run.check_forward_call(2);
    const auto batch = std::to_string(combo.batch), width = std::to_string(combo.width);
    MPIPE_EXPECT_ERROR(run.pipe->train_step(in, run.randn({combo.batch + 1, combo.width}), mse, 2),
                       "mpipe::ModelPipeline::train_step",
                       "target needs the input's batch size (" + batch + ")",
                       "[" + std::to_string(combo.batch + 1) + ", " + width + "]");
    run.check_train_step();
    MPIPE_EXPECT_ERROR(run.pipe->constant_train_step(in, -2, x, mse),
                       "mpipe::ModelPipeline::constant_train_step",
                       "T (the number of time steps) must be positive, got -2");
    run.check_constant_train_step();
  }
}
