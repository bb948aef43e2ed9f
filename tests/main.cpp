// Test entry point: prints what the run can reach. Tests that need one GPU end
// in _CUDA and those that need two end in _MultiCUDA; they skip themselves
// (GTEST_SKIP) when the devices are missing, see tests/common.h.
#include <gtest/gtest.h>

#include <mpipe/device.h>
#include <mpipe/version.h>

#include <cstdio>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!::testing::GTEST_FLAG(list_tests))
    std::printf("mpipe %s tests; CUDA devices visible: %lld\n", MPIPE_VERSION_STRING,
              static_cast<long long>(mpipe::cuda_device_count()));
  return RUN_ALL_TESTS();
}
