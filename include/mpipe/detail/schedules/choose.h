#pragma once

// Private: the definition of choose_schedule (declared and documented in
// mpipe/training.h, which includes this file at its end), and Tailored's
// search (Note [Choosing a schedule], Note [Greedy schedules]).

#include <mpipe/training.h>

#include <mpipe/detail/schedules/greedy.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace mpipe {
namespace detail {

/// What the model predicts for `programs` (time, bubble, per-device peaks).
inline ScheduleChoice::Candidate weigh(Schedule s, const std::vector<schedules::Program>& programs,
                                       const TrainStepOptions& options,
                                       const std::vector<int64_t>& labels,
                                       const std::vector<double>& bytes) {
  std::vector<int64_t> devices;  // of each worker: its first stage's
  for (const auto& p : programs) {
    devices.push_back(p.empty() ? -1 - static_cast<int64_t>(devices.size())
                                : labels[static_cast<size_t>(p.front().stage)]);
  }
  ScheduleChoice::Candidate c{s};
  const auto timed = schedules::simulate(programs, options.stage_costs(), devices);
  double busy = 0;
  for (const auto& t : timed) c.time = std::max(c.time, t.end), busy += t.end - t.start;
  // Per device: the sum of its workers' peaks (an upper bound: they may not
  // coincide), in bytes and in activations.
  std::vector<int64_t> seen;
  std::vector<double> in_bytes, in_units;
  for (size_t r = 0; r < programs.size(); ++r) {
    size_t d = static_cast<size_t>(std::find(seen.begin(), seen.end(), devices[r]) - seen.begin());
    if (d == seen.size()) {
      seen.push_back(devices[r]);
      in_bytes.push_back(0);
      in_units.push_back(0);
    }
    in_bytes[d] += schedules::peak_activations(programs[r], bytes);
    in_units[d] += schedules::peak_activations(programs[r]);
  }
  c.bubble = c.time > 0 ? 1.0 - busy / (static_cast<double>(seen.size()) * c.time) : 0.0;
  c.peak_memory = *std::max_element(in_bytes.begin(), in_bytes.end());
  c.peak_in_flight = *std::max_element(in_units.begin(), in_units.end());
  c.fits = options.memory_limit() <= 0 || c.peak_memory <= options.memory_limit();
  return c;
}

/// Faster, or as fast (within a relative 1e-9) with fewer peak bytes, then
/// fewer peak activations.
inline bool better(const ScheduleChoice::Candidate& a, const ScheduleChoice::Candidate& b) {
  const double eps = 1e-9 * std::max(std::abs(a.time), std::abs(b.time));
  if (a.time < b.time - eps) return true;
  if (a.time > b.time + eps) return false;
  if (a.peak_memory != b.peak_memory) return a.peak_memory < b.peak_memory;
  return a.peak_in_flight < b.peak_in_flight;
}

/// The worker of each stage in the placements the devices allow: one per
/// stage; the V (stage s with stage n-1-s) and, with virtual_stages v > 1,
/// Megatron's interleaving (stage s with s % (n / v)) where those stages
/// share a device.
inline std::vector<std::vector<int64_t>> placements(int64_t n_stages, int64_t v,
                                                    const std::vector<int64_t>& labels) {
  std::vector<std::vector<int64_t>> out(1);
  for (int64_t s = 0; s < n_stages; ++s) out[0].push_back(s);
  auto allowed = [&](const std::vector<int64_t>& worker_of) {
    for (int64_t s = 0; s < n_stages; ++s) {
      if (labels[static_cast<size_t>(s)] !=
          labels[static_cast<size_t>(worker_of[static_cast<size_t>(s)])]) {
        return false;
      }
    }
    return true;
  };
  if (n_stages % 2 == 0 && n_stages > 2) {
    auto vee = v_placement(n_stages);
    if (allowed(vee)) out.push_back(vee);
  }
  if (v > 1 && n_stages % v == 0) {
    std::vector<int64_t> inter;
    for (int64_t s = 0; s < n_stages; ++s) inter.push_back(s % (n_stages / v));
    if (allowed(inter)) out.push_back(inter);
  }
  return out;
}

}  // namespace detail

inline ScheduleChoice choose_schedule(int64_t n_micro, int64_t n_stages,
                                      const TrainStepOptions& options,
                                      const std::vector<int64_t>& stage_devices) {
  detail::check_sizes("choose_schedule", n_micro, n_stages);
  const auto& given = options.activation_bytes();
  TORCH_CHECK_VALUE(given.empty() || static_cast<int64_t>(given.size()) == n_stages,
                    "mpipe::choose_schedule: ", given.size(), " activation sizes for ", n_stages,
                    " stages");
  TORCH_CHECK_VALUE(stage_devices.empty() || static_cast<int64_t>(stage_devices.size()) == n_stages,
                    "mpipe::choose_schedule: ", stage_devices.size(), " devices for ", n_stages,
                    " stages");
  std::vector<int64_t> labels = stage_devices;
  for (int64_t s = static_cast<int64_t>(labels.size()); s < n_stages; ++s) labels.push_back(s);
  const std::vector<double> bytes =
      given.empty() ? std::vector<double>(static_cast<size_t>(n_stages), 0.0) : given;
  const bool tailored = options.schedule() == Schedule::Tailored;
  // Built once per question (a step calls it every time).
  std::ostringstream key;
  key.precision(17);  // every double exactly: nearby costs are other questions
  key << n_micro << ' ' << n_stages << ' ' << options.virtual_stages() << ' ' << tailored << ' '
      << options.memory_limit();
  for (const auto& c : options.stage_costs()) {
    key << ' ' << c.forward << ' ' << c.backward_input << ' ' << c.backward_weight << ' '
        << c.transfer;
  }
  for (double b : bytes) key << ' ' << b;
  for (int64_t l : labels) key << ' ' << l;
  static std::mutex mutex;
  static std::map<std::string, ScheduleChoice> answers;
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = answers.find(key.str());
  if (found != answers.end()) return found->second;
  if (answers.size() >= 256) answers.clear();

  ScheduleChoice choice{Schedule::GPipe, {}, {}};
  std::vector<std::vector<schedules::Program>> programs;
  std::vector<Schedule> candidates = {Schedule::GPipe, Schedule::OneFOneB, Schedule::ZeroBubbleH1};
  if (options.virtual_stages() > 1) candidates.push_back(Schedule::Interleaved1F1B);
  const auto places = detail::placements(n_stages, options.virtual_stages(), labels);
  for (size_t k = 1; k < places.size(); ++k) {  // the V, where the devices allow it
    if (places[k] != detail::v_placement(n_stages)) continue;
    candidates.push_back(Schedule::ZeroBubbleV);
    // DualPipeV's pairs charged F + B (Note [DualPipeV]): what it gains by
    // overlapping them is not predicted.
    if (n_micro >= n_stages) candidates.push_back(Schedule::DualPipeV);
  }
  for (Schedule s : candidates) {
    programs.push_back(programs_for(s, n_micro, n_stages, options.virtual_stages()));
    choice.candidates.push_back(detail::weigh(s, programs.back(), options, labels, bytes));
  }
  // Tailored: the fastest within its bound of the list-scheduled programs and
  // the built-ins; the bound is memory_limit, or without one 1F1B's peak.
  const ScheduleChoice::Candidate one_f_one_b = choice.candidates[1];
  auto within = [&](const ScheduleChoice::Candidate& c) {
    return options.memory_limit() > 0 ? c.fits
                                      : c.peak_memory <= one_f_one_b.peak_memory &&
                                            c.peak_in_flight <= one_f_one_b.peak_in_flight;
  };
  int pick = -1;
  ScheduleChoice::Candidate best{Schedule::Tailored};
  std::vector<schedules::Program> best_programs;
  for (size_t k = 0; k < candidates.size(); ++k) {
    if (within(choice.candidates[k]) && (pick < 0 || detail::better(choice.candidates[k], best))) {
      pick = 0, best = choice.candidates[k], best_programs = programs[k];
    }
  }
  for (const auto& place : places) {
    const int64_t workers = *std::max_element(place.begin(), place.end()) + 1;
    const int64_t held = n_stages / workers, most = std::min(n_micro, n_stages);
    for (const char* order : {"IFW", "FIW", "IWF"}) {
      // With a stage per worker the two caps are one.
      for (bool by_units : held == 1 ? std::vector<bool>{false} : std::vector<bool>{false, true}) {
        // Raising the cap stops paying once two caps in a row are no faster.
        double last = std::numeric_limits<double>::infinity();
        int64_t stale = 0;
        for (int64_t cap = by_units ? held : 1; cap <= (by_units ? held : 1) * most && stale < 2;
             ++cap) {
          auto p = detail::greedy_programs(n_micro, place, options.stage_costs(),
                                           {order, cap, by_units});
          const auto c = detail::weigh(Schedule::Tailored, p, options, labels, bytes);
          stale = c.time < last * (1 - 1e-9) ? 0 : stale + 1;
          last = std::min(last, c.time);
          if (within(c) && (pick < 0 || detail::better(c, best))) {
            pick = 0, best = c, best_programs = std::move(p);
          }
        }
      }
    }
  }
  if (pick < 0) {  // nothing within the bound: the fewest peak bytes
    for (size_t k = 0; k < candidates.size(); ++k) {
      if (pick < 0 || choice.candidates[k].peak_memory < best.peak_memory) {
        pick = 0, best = choice.candidates[k], best_programs = programs[k];
      }
    }
  }
  best.schedule = Schedule::Tailored;
  best.fits = options.memory_limit() <= 0 || best.peak_memory <= options.memory_limit();
  choice.candidates.push_back(best);
  programs.push_back(best_programs);
  // Auto: the fastest built-in that fits, the earlier among equals (if none
  // fits, the fewest peak bytes); Tailored only where it is faster still.
  int chosen = -1, least = -1;
  for (size_t k = 0; k + 1 < choice.candidates.size(); ++k) {
    const auto& c = choice.candidates[k];
    const int i = static_cast<int>(k);
    if (c.fits && (chosen < 0 || detail::better(c, choice.candidates[static_cast<size_t>(chosen)]))) {
      chosen = i;
    }
    if (least < 0 || c.peak_memory < choice.candidates[static_cast<size_t>(least)].peak_memory) {
      least = i;
    }
  }
  const auto& built = choice.candidates.back();
  if (built.fits && (chosen < 0 || built.time < choice.candidates[static_cast<size_t>(chosen)].time *
                                                    (1 - 1e-9))) {
    chosen = static_cast<int>(choice.candidates.size()) - 1;
  }
  const size_t at = tailored ? choice.candidates.size() - 1
                             : static_cast<size_t>(chosen >= 0 ? chosen : least);
  choice.schedule = choice.candidates[at].schedule;
  choice.programs = programs[at];
  answers.emplace(key.str(), choice);
  return choice;
}

}  // namespace mpipe
