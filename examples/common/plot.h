#pragma once

// Training curves as an SVG line plot: loss or accuracy per epoch or step.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace examples {

/// One curve: its legend, its colour, its values, and where they sit along
/// the bottom (empty `x`: at 1, 2, 3, ..., the epochs).
struct PlotLine {
  std::string name;
  std::string colour;
  std::vector<double> values;
  std::vector<double> x = {};
  bool dashed = false;
};

/// Grid spacing for a value range: 1, 2 or 5 times a power of ten, with at
/// most `max_lines` steps across `range`.
inline double nice_tick(double range, int max_lines) {
  if (!(range > 0)) return 1;
  double tick = std::pow(10.0, std::floor(std::log10(range / max_lines)));
  for (int i = 0; range / tick > max_lines; ++i) tick *= (i % 3 == 1) ? 2.5 : 2;  // 1, 2, 5, 10, ...
  return tick;
}

/// Writes `lines` to `path` as a 640x400 SVG, `x_label` under the bottom axis.
/// The value axis spans the values, out to the grid lines around them (at
/// most 10 steps); `floor` and `ceiling`, where given, fix its ends (0 for a
/// loss, 1 for an accuracy; values beyond them are drawn at the edge). Labels
/// are in per cent when `percent` (values are fractions then). Writes
/// nothing when there are no values.
inline void write_line_plot(const std::string& path, const std::string& title,
                            const std::vector<PlotLine>& lines, const std::string& x_label,
                            bool percent, std::optional<double> floor = {},
                            std::optional<double> ceiling = {}) {
  double lo = floor.value_or(INFINITY), hi = ceiling.value_or(-INFINITY);
  double x_lo = INFINITY, x_hi = -INFINITY;
  auto x_of = [](const PlotLine& l, size_t i) { return l.x.empty() ? double(i + 1) : l.x[i]; };
  for (const auto& l : lines) {
    for (size_t i = 0; i < l.values.size(); ++i) {
      if (!floor) lo = std::min(lo, l.values[i]);
      if (!ceiling) hi = std::max(hi, l.values[i]);
      x_lo = std::min(x_lo, x_of(l, i));
      x_hi = std::max(x_hi, x_of(l, i));
    }
  }
  if (!(x_hi >= x_lo)) return;  // no values
  if (!(hi > lo)) hi = lo + 1;  // one value throughout
  if (!(x_hi > x_lo)) x_hi = x_lo + 1;
  const double tick = nice_tick(hi - lo, 10);
  lo = std::floor(lo / tick + 1e-9) * tick;
  hi = std::ceil(hi / tick - 1e-9) * tick;
  const double W = 640, H = 400, left = 60, right = 20, top = 40, bottom = 50;
  auto px = [&](double x) { return left + (W - left - right) * (x - x_lo) / (x_hi - x_lo); };
  auto py = [&](double v) { return top + (H - top - bottom) * (hi - std::clamp(v, lo, hi)) / (hi - lo); };
  std::ofstream f(path);
  f << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << title << "</text>\n";
  char label[32];
  for (double v = lo; v <= hi + tick * 1e-6; v += tick) {
    if (percent) {
      std::snprintf(label, sizeof label, "%g %%", std::round(v * 1000) / 10);
    } else {
      std::snprintf(label, sizeof label, "%g", std::round(v / tick) * tick);
    }
    f << "<line x1=\"" << left << "\" x2=\"" << W - right << "\" y1=\"" << py(v) << "\" y2=\"" << py(v)
      << "\" stroke=\"#ddd\"/>\n<text x=\"" << left - 6 << "\" y=\"" << py(v) + 4
      << "\" text-anchor=\"end\">" << label << "</text>\n";
  }
  const double x_tick = std::max(1.0, nice_tick(x_hi - x_lo, 10));  // epochs or steps: whole numbers
  for (double x = std::ceil(x_lo / x_tick - 1e-9) * x_tick; x <= x_hi + x_tick * 1e-6; x += x_tick) {
    std::snprintf(label, sizeof label, "%g", x + 0.0);  // not "-0"
    f << "<text x=\"" << px(x) << "\" y=\"" << H - bottom + 16 << "\" text-anchor=\"middle\">" << label
      << "</text>\n";
  }
  f << "<text x=\"" << W / 2 << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">" << x_label << "</text>\n";
  // The legend where the curves end away from it: below them if they end high.
  const bool ends_high = !lines.empty() && !lines[0].values.empty() &&
                         lines[0].values.back() > (lo + hi) / 2;
  double legend_y = ends_high ? H - bottom - 14 - 16 * double(lines.size() - 1) : top + 20;
  for (const auto& l : lines) {
    f << "<polyline fill=\"none\" stroke=\"" << l.colour << "\" stroke-width=\"2\""
      << (l.dashed ? " stroke-dasharray=\"4\"" : "") << " points=\"";
    for (size_t i = 0; i < l.values.size(); ++i) f << px(x_of(l, i)) << "," << py(l.values[i]) << " ";
    f << "\"/>\n<text x=\"" << W - right - 130 << "\" y=\"" << legend_y << "\" fill=\"" << l.colour
      << "\">" << l.name << "</text>\n";
    legend_y += 16;
  }
  f << "</svg>\n";
}

}  // namespace examples
