#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "stderr_filter.h"

using composite::is_routine_native_line;
using composite::RoutineStderrFilter;

TEST(StderrFilter, KnowsTheRoutineLines) {
  EXPECT_TRUE(is_routine_native_line("[INFO] [Qnn ExecuTorch]: Destroy Qnn backend"));
  EXPECT_TRUE(is_routine_native_line(
      "[WARNING] [Qnn ExecuTorch]: Qnn API version 2.40.0 is used. The version is tested against 2.27.0."));
  EXPECT_TRUE(is_routine_native_line("[ERROR] [Qnn ExecuTorch]:  <E> unexpected GraphHtpSettings option 66"));
  EXPECT_TRUE(is_routine_native_line(" # LIBNATIVE: No alternate configuration present"));
  EXPECT_FALSE(is_routine_native_line("[WARNING] [Qnn ExecuTorch]: something else"));
  EXPECT_FALSE(is_routine_native_line("[ERROR] [Qnn ExecuTorch]: Failed to load context binary"));
  EXPECT_FALSE(is_routine_native_line("error: the prompt is empty"));
}

TEST(StderrFilter, ForwardsEverythingElseInOrder) {
  char path[] = "/tmp/composite_stderr_XXXXXX";
  const int file = mkstemp(path);
  ASSERT_GE(file, 0);
  const int saved = dup(2);
  dup2(file, 2);
  {
    RoutineStderrFilter filter;
    std::fprintf(stderr, "[INFO] [Qnn ExecuTorch]: Creating new backend bundle.\n");
    std::fprintf(stderr, "first\n");
    std::fprintf(stderr, "[ERROR] [Qnn ExecuTorch]:  <E> unexpected GraphHtpSettings option 66\n\n");
    std::fprintf(stderr, "[ERROR] [Qnn ExecuTorch]: a real failure\n");
    std::fprintf(stderr, "last, no newline");
  }
  dup2(saved, 2);
  close(saved);
  close(file);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  unlink(path);
  EXPECT_EQ(text.str(), "first\n[ERROR] [Qnn ExecuTorch]: a real failure\nlast, no newline");
}
