#pragma once

// Training curves as an SVG line plot, one point per epoch.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace examples {

/// One curve: its legend, its colour, and its values at epochs 1, 2, ...
struct PlotLine {
  std::string name;
  std::string colour;
  std::vector<double> values;
};

/// Grid spacing for a value range: 1, 2 or 5 times a power of ten, with at
/// most `max_lines` steps across `range`.
inline double nice_tick(double range, int max_lines) {
  if (!(range > 0)) return 1;
  double tick = std::pow(10.0, std::floor(std::log10(range / max_lines)));
  for (int i = 0; range / tick > max_lines; ++i) tick *= (i % 3 == 1) ? 2.5 : 2;  // 1, 2, 5, 10, ...
  return tick;
}

/// Writes `lines` to `path` as a 640x400 SVG, the epochs along the bottom.
/// The value axis spans the values, out to the grid lines around them (at
/// most 10 steps); `floor` and `ceiling`, where given, fix its ends (0 for a
/// loss, 1 for an accuracy). Labels are in per cent when `percent` (values
/// are fractions then). Writes nothing when there are no values.
inline void write_epoch_plot(const std::string& path, const std::string& title,
                             const std::vector<PlotLine>& lines, bool percent,
                             std::optional<double> floor = {}, std::optional<double> ceiling = {}) {
  double lo = floor.value_or(INFINITY), hi = ceiling.value_or(-INFINITY);
  size_t n = 0;
  for (const auto& l : lines) {
    n = std::max(n, l.values.size());
    for (double v : l.values) {
      if (!floor) lo = std::min(lo, v);
      if (!ceiling) hi = std::max(hi, v);
    }
  }
  if (n == 0) return;
  if (!(hi > lo)) hi = lo + 1;  // one value throughout
  const double tick = nice_tick(hi - lo, 10);
  lo = std::floor(lo / tick + 1e-9) * tick;
  hi = std::ceil(hi / tick - 1e-9) * tick;
  const double W = 640, H = 400, left = 60, right = 20, top = 40, bottom = 50;
  auto px = [&](size_t i) { return left + (W - left - right) * (n > 1 ? double(i) / double(n - 1) : 0.5); };
  auto py = [&](double v) { return top + (H - top - bottom) * (hi - std::clamp(v, lo, hi)) / (hi - lo); };
  std::ofstream f(path);
  f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << title << "</text>\n";
  for (double v = lo; v <= hi + tick * 1e-6; v += tick) {
    char label[32];
    if (percent) {
      std::snprintf(label, sizeof label, "%g %%", std::round(v * 1000) / 10);
    } else {
      std::snprintf(label, sizeof label, "%g", std::round(v / tick) * tick);
    }
    f << "<line x1=\"" << left << "\" x2=\"" << W - right << "\" y1=\"" << py(v) << "\" y2=\"" << py(v)
      << "\" stroke=\"#ddd\"/>\n<text x=\"" << left - 6 << "\" y=\"" << py(v) + 4
      << "\" text-anchor=\"end\">" << label << "</text>\n";
  }
  for (size_t i = 0; i < n; ++i) {
    if (n <= 20 || (i + 1) % 10 == 0 || i == 0) {
      f << "<text x=\"" << px(i) << "\" y=\"" << H - bottom + 16 << "\" text-anchor=\"middle\">" << i + 1
        << "</text>\n";
    }
  }
  f << "<text x=\"" << W / 2 << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">epoch</text>\n";
  // The legend where the curves end away from it: below them if they end high.
  const bool ends_high = !lines.empty() && !lines[0].values.empty() &&
                         lines[0].values.back() > (lo + hi) / 2;
  double legend_y = ends_high ? H - bottom - 14 - 16 * double(lines.size() - 1) : top + 20;
  for (const auto& l : lines) {
    f << "<polyline fill=\"none\" stroke=\"" << l.colour << "\" stroke-width=\"2\" points=\"";
    for (size_t i = 0; i < l.values.size(); ++i) f << px(i) << "," << py(l.values[i]) << " ";
    f << "\"/>\n<text x=\"" << W - right - 130 << "\" y=\"" << legend_y << "\" fill=\"" << l.colour
      << "\">" << l.name << "</text>\n";
    legend_y += 16;
  }
  f << "</svg>\n";
}

}  // namespace examples
