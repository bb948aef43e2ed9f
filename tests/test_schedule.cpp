#include <gtest/gtest.h>

#include <mpipe/schedule.h>

#include <set>
#include <utility>

using mpipe::schedules::Clock;
using mpipe::schedules::Task;
using mpipe::schedules::fill_drain;

TEST(Schedule, FillDrainExactSmall) {
  // 3 micro-batches through 2 stages.
  const std::vector<Clock> expected = {
      {{0, 0}},
      {{0, 1}, {1, 0}},
      {{0, 2}, {1, 1}},
      {{1, 2}},
  };
  EXPECT_EQ(fill_drain(3, 2), expected);
  // 2 items through 3 stages.
  const std::vector<Clock> expected2 = {
      {{0, 0}},
      {{0, 1}, {1, 0}},
      {{1, 1}, {2, 0}},
      {{2, 1}},
  };
  EXPECT_EQ(fill_drain(2, 3), expected2);
  EXPECT_EQ(fill_drain(1, 1), (std::vector<Clock>{{{0, 0}}}));
}

TEST(Schedule, FillDrainInvariants) {
  for (int64_t m = 1; m <= 7; ++m) {
    for (int64_t n = 1; n <= 6; ++n) {
      const auto clocks = fill_drain(m, n);
      ASSERT_EQ(static_cast<int64_t>(clocks.size()), m + n - 1) << m << "x" << n;
      std::set<std::pair<int64_t, int64_t>> seen;
      std::vector<int64_t> next_item(static_cast<size_t>(n), 0);
      for (size_t k = 0; k < clocks.size(); ++k) {
        std::set<int64_t> stages_this_clock;
        for (const Task& t : clocks[k]) {
          EXPECT_EQ(t.stage + t.index, static_cast<int64_t>(k));  // wavefront
          EXPECT_TRUE(stages_this_clock.insert(t.stage).second);  // one task per stage
          EXPECT_TRUE(seen.insert({t.stage, t.index}).second);    // each task once
          EXPECT_EQ(t.index, next_item[t.stage]++);               // items in order
        }
      }
      EXPECT_EQ(static_cast<int64_t>(seen.size()), m * n);
    }
  }
}

TEST(Schedule, FillDrainEmptyAndInvalid) {
  EXPECT_TRUE(fill_drain(0, 4).empty());
  EXPECT_TRUE(fill_drain(4, 0).empty());
  EXPECT_THROW(fill_drain(-1, 2), std::invalid_argument);
  EXPECT_THROW(fill_drain(2, -1), std::invalid_argument);
}

TEST(Schedule, BubbleFraction) {
  EXPECT_DOUBLE_EQ(mpipe::schedules::fill_drain_bubble(8, 4), 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(mpipe::schedules::fill_drain_bubble(1, 1), 0.0);
  EXPECT_DOUBLE_EQ(mpipe::schedules::fill_drain_bubble(0, 4), 0.0);
}
