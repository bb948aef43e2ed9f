#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/timeline.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

namespace mpipe {

MPIPE_FUNC const char* to_string(TaskKind kind) {
  switch (kind) {
    case TaskKind::Forward: return "forward";
    case TaskKind::Backward: return "backward";
    case TaskKind::BackwardInput: return "input gradient";
    case TaskKind::BackwardWeight: return "weight gradient";
    case TaskKind::Recompute: return "recompute";
    case TaskKind::Copy: return "copy";
  }
  return "?";
}

namespace detail {

MPIPE_FUNC bool is_work(TaskKind k) { return k != TaskKind::Copy; }

MPIPE_FUNC double first_start(const Timeline& t) {
  double v = std::numeric_limits<double>::infinity();
  for (const auto& task : t.tasks) v = std::min(v, task.start_ms);
  return t.tasks.empty() ? 0.0 : v;
}

MPIPE_FUNC std::string escape(const std::string& s) {  // XML text and attribute values
  std::string out;
  for (char c : s) {
    switch (c) {
      case '"': out += "&quot;"; break;
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      default: out += (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
    }
  }
  return out;
}

MPIPE_FUNC std::string json_escape(const std::string& s) {  // inside a JSON string
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else {
      out += (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
    }
  }
  return out;
}

MPIPE_FUNC std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, std::isfinite(v) ? v : 0.0);
  return buf;
}

MPIPE_FUNC std::string letter(TaskKind k) {
  switch (k) {
    case TaskKind::Forward: return "F";
    case TaskKind::Backward: return "B";
    case TaskKind::BackwardInput: return "I";
    case TaskKind::BackwardWeight: return "W";
    case TaskKind::Recompute: return "R";
    case TaskKind::Copy: return "C";
  }
  return "?";
}

/// Distinct hues for consecutive items (golden-angle steps).
MPIPE_FUNC std::string colour(int64_t item, TaskKind kind) {
  const double hue = std::fmod(static_cast<double>(item) * 137.508, 360.0);
  const int light = kind == TaskKind::Backward || kind == TaskKind::BackwardInput ? 38
                    : kind == TaskKind::BackwardWeight                         ? 26
                    : kind == TaskKind::Recompute                              ? 78
                                                                               : 62;
  return "hsl(" + fixed(hue, 1) + ",70%," + std::to_string(light) + "%)";
}

/// A round tick step giving about `target` ticks over `span`.
MPIPE_FUNC double tick_step(double span, int target) {
  if (span <= 0) return 1;
  const double raw = span / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (raw <= m * mag) return m * mag;
  }
  return 10 * mag;
}

/// "stage 2 (cuda:0)" for a worker running one stage, else "worker 0: stages
/// 0, 2 (cuda:0)".
MPIPE_FUNC std::string row_label(const Timeline& t, int64_t rank) {
  std::vector<int64_t> stages;
  for (int64_t s = 0; s < t.n_stages; ++s) {
    if (t.rank_of(s) == rank) stages.push_back(s);
  }
  std::string dev = "?";
  if (!stages.empty() && stages[0] < static_cast<int64_t>(t.stage_devices.size())) {
    dev = t.stage_devices[static_cast<size_t>(stages[0])].str();
  }
  if (stages.size() == 1) return "stage " + std::to_string(stages[0]) + " (" + dev + ")";
  std::string list;
  for (int64_t s : stages) list += (list.empty() ? "" : ",") + std::to_string(s);
  return "worker " + std::to_string(rank) + ": stages " + list + " (" + dev + ")";
}

MPIPE_FUNC std::string plural(const std::string& noun, int64_t n) {
  if (n == 1) return noun;
  const bool es = noun.size() >= 2 && (noun.compare(noun.size() - 2, 2, "ch") == 0 ||
                                       noun.compare(noun.size() - 2, 2, "sh") == 0 ||
                                       noun.back() == 's' || noun.back() == 'x');
  return noun + (es ? "es" : "s");
}

}  // namespace detail

MPIPE_FUNC int64_t Timeline::rank_of(int64_t stage) const {
  return stage >= 0 && stage < static_cast<int64_t>(stage_ranks.size())
             ? stage_ranks[static_cast<size_t>(stage)]
             : stage;
}

MPIPE_FUNC int64_t Timeline::n_ranks() const {
  int64_t n = 0;
  for (int64_t s = 0; s < n_stages; ++s) n = std::max(n, rank_of(s) + 1);
  return n;
}

MPIPE_FUNC double Timeline::makespan_ms() const {
  using namespace detail;
  if (tasks.empty()) return 0.0;
  double end = -std::numeric_limits<double>::infinity();
  for (const auto& t : tasks) end = std::max(end, t.end_ms);
  return end - first_start(*this);
}

MPIPE_FUNC double Timeline::bubble_fraction() const {
  using namespace detail;
  const double span = makespan_ms();
  if (span <= 0 || n_ranks() <= 0) return 0.0;
  double busy = 0;
  for (const auto& t : tasks) {
    if (is_work(t.kind)) busy += std::max(0.0, t.end_ms - t.start_ms);
  }
  return std::max(0.0, 1.0 - busy / (static_cast<double>(n_ranks()) * span));
}

MPIPE_FUNC std::string Timeline::to_chrome_trace() const {
  using namespace detail;
  std::ostringstream out;
  out << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"method\":\"" << json_escape(method)
      << "\",\"schedule\":\"" << json_escape(schedule) << "\",\"stages\":" << n_stages
      << ",\"workers\":" << n_ranks() << ",\"items\":" << n_items
      << ",\"makespan_ms\":" << fixed(makespan_ms(), 4)
      << ",\"bubble_measured\":" << fixed(bubble_fraction(), 4)
      << ",\"bubble_schedule\":" << fixed(schedule_bubble, 4) << "},\"traceEvents\":[";
  out << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"tid\":0,\"args\":{\"name\":\"mpipe "
      << json_escape(method) << "\"}}";
  for (int64_t j = 0; j < n_ranks(); ++j) {
    out << ",{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" << j
        << ",\"args\":{\"name\":\"" << json_escape(row_label(*this, j)) << "\"}}";
    out << ",{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":0,\"tid\":" << j
        << ",\"args\":{\"sort_index\":" << j << "}}";
  }
  const double t0 = first_start(*this);
  for (const auto& t : tasks) {
    out << ",{\"name\":\"" << letter(t.kind) << t.item << "\",\"cat\":\"" << to_string(t.kind)
        << "\",\"ph\":\"X\",\"pid\":0,\"tid\":" << rank_of(t.stage)
        << ",\"ts\":" << fixed((t.start_ms - t0) * 1000.0, 3)
        << ",\"dur\":" << fixed(std::max(0.0, t.end_ms - t.start_ms) * 1000.0, 3)
        << ",\"args\":{\"stage\":" << t.stage << ",\"" << json_escape(item_name) << "\":" << t.item
        << ",\"device\":\"" << json_escape(t.device.str()) << "\"}}";
  }
  out << "]}\n";
  return out.str();
}

MPIPE_FUNC std::string Timeline::to_svg() const {
  using namespace detail;
  const double left = 150, right = 30, top = 58, row = 30, gap = 8, width = 1000;
  const double plot = width - left - right;
  const int64_t rows = n_ranks();
  const double height = top + static_cast<double>(std::max<int64_t>(rows, 1)) * (row + gap) + 58;
  const double span = std::max(makespan_ms(), 1e-9);
  const double t0 = first_start(*this);
  auto x_of = [&](double ms) { return left + (ms - t0) / span * plot; };

  std::ostringstream out;
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << fixed(width, 0) << "\" height=\""
      << fixed(height, 0) << "\" viewBox=\"0 0 " << fixed(width, 0) << " " << fixed(height, 0)
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  out << "<rect x=\"0\" y=\"0\" width=\"" << fixed(width, 0) << "\" height=\"" << fixed(height, 0)
      << "\" fill=\"white\"/>\n";
  out << "<text x=\"" << fixed(left, 0) << "\" y=\"20\" font-size=\"15\" font-weight=\"bold\">mpipe "
      << escape(method) << (schedule.empty() ? "" : " (" + escape(schedule) + ")") << ": "
      << n_stages << " stages, " << n_items << " "
      << escape(plural(item_name, n_items)) << ", " << fixed(makespan_ms(), 2) << " ms</text>\n";
  out << "<text x=\"" << fixed(left, 0) << "\" y=\"40\">bubble: measured "
      << fixed(100 * bubble_fraction(), 1) << " %, schedule " << fixed(100 * schedule_bubble, 1)
      << " %  (F forward, B backward, I/W input/weight gradient, R recompute, C copy; colour = " << escape(item_name)
      << ")</text>\n";
  for (int64_t j = 0; j < rows; ++j) {
    const double y = top + static_cast<double>(j) * (row + gap);
    out << "<rect x=\"" << fixed(left, 1) << "\" y=\"" << fixed(y, 1) << "\" width=\""
        << fixed(plot, 1) << "\" height=\"" << fixed(row, 1) << "\" fill=\"#f2f2f2\"/>\n";
    out << "<text x=\"" << fixed(left - 8, 1) << "\" y=\"" << fixed(y + row / 2 + 4, 1)
        << "\" text-anchor=\"end\">" << escape(row_label(*this, j)) << "</text>\n";
  }
  for (const auto& t : tasks) {
    const double y0 = top + static_cast<double>(rank_of(t.stage)) * (row + gap);
    const bool copy = t.kind == TaskKind::Copy;
    // A pair's forward in the row's top half, its backward in the bottom half.
    const bool lower = t.paired && t.kind != TaskKind::Forward;
    const double y = copy ? y0 + row * 0.7 : lower ? y0 + row / 2 : y0;
    const double h = copy ? row * 0.3 : t.paired ? row / 2 : row;
    const double x = x_of(t.start_ms);
    const double w = std::max(0.5, x_of(t.end_ms) - x);
    out << "<rect x=\"" << fixed(x, 2) << "\" y=\"" << fixed(y, 1) << "\" width=\"" << fixed(w, 2)
        << "\" height=\"" << fixed(h, 1) << "\" fill=\""
        << (copy ? std::string("#888") : colour(t.item, t.kind))
        << "\" stroke=\"white\" stroke-width=\"0.5\"><title>" << to_string(t.kind) << " of "
        << escape(item_name) << " " << t.item << " on stage " << t.stage
        << (t.paired ? " (paired)" : "") << ": "
        << fixed(t.start_ms - t0, 3) << " - " << fixed(t.end_ms - t0, 3) << " ms</title></rect>\n";
    const std::string label = letter(t.kind) + std::to_string(t.item);
    if (!copy && w >= 7.5 * static_cast<double>(label.size()) + 4) {
      out << "<text x=\"" << fixed(x + w / 2, 2) << "\" y=\"" << fixed(y + h / 2 + 4, 1)
          << "\" text-anchor=\"middle\" font-size=\"11\" fill=\""
          << (t.kind == TaskKind::Backward || t.kind == TaskKind::BackwardInput ||
                      t.kind == TaskKind::BackwardWeight
                  ? "white"
                  : "black") << "\">" << label << "</text>\n";
    }
  }
  const double axis_y = top + static_cast<double>(std::max<int64_t>(rows, 1)) * (row + gap) + 4;
  out << "<line x1=\"" << fixed(left, 1) << "\" y1=\"" << fixed(axis_y, 1) << "\" x2=\""
      << fixed(left + plot, 1) << "\" y2=\"" << fixed(axis_y, 1) << "\" stroke=\"black\"/>\n";
  const double step = tick_step(span, 8);
  for (double ms = 0; ms <= span * (1 + 1e-9); ms += step) {
    const double x = left + ms / span * plot;
    out << "<line x1=\"" << fixed(x, 2) << "\" y1=\"" << fixed(axis_y, 1) << "\" x2=\""
        << fixed(x, 2) << "\" y2=\"" << fixed(axis_y + 5, 1) << "\" stroke=\"black\"/>\n";
    out << "<text x=\"" << fixed(x, 2) << "\" y=\"" << fixed(axis_y + 18, 1)
        << "\" text-anchor=\"middle\">" << fixed(ms, step < 1 ? (step < 0.1 ? 2 : 1) : 0)
        << "</text>\n";
  }
  out << "<text x=\"" << fixed(left + plot, 1) << "\" y=\"" << fixed(axis_y + 36, 1)
      << "\" text-anchor=\"end\">time since the first task (ms)</text>\n";
  out << "</svg>\n";
  return out.str();
}

namespace detail {
MPIPE_FUNC void write_file(const std::string& path, const std::string& text, const char* what) {
  std::ofstream f(path, std::ios::binary);
  TORCH_CHECK(f.good(), "mpipe::Timeline::", what, ": cannot open '", path, "' for writing");
  f << text;
  f.close();
  TORCH_CHECK(f.good(), "mpipe::Timeline::", what, ": writing '", path, "' failed");
}
}  // namespace detail

MPIPE_FUNC void Timeline::save_chrome_trace(const std::string& path) const {
  using namespace detail;
  write_file(path, to_chrome_trace(), "save_chrome_trace");
}

MPIPE_FUNC void Timeline::save_svg(const std::string& path) const {
  using namespace detail;
  write_file(path, to_svg(), "save_svg");
}

}  // namespace mpipe
