#include <gtest/gtest.h>

#include <set>

#include "sampler.h"

using composite::Sampler;

TEST(Sampler, GreedyTakesTheLargestLogit) {
  const float logits[] = {0.1f, 3.f, 2.9f, -1.f};
  Sampler greedy(0.f, 1.f, 0);
  EXPECT_EQ(greedy.sample(logits, 4), 1);
}

TEST(Sampler, SameSeedSameDrawsAndTopPCutsTheTail) {
  const float logits[] = {0.1f, 3.f, 2.9f, -1.f};
  Sampler a(1.f, 1.f, 42), b(1.f, 1.f, 42);
  std::set<int64_t> seen;
  for (int i = 0; i < 200; ++i) {
    const int64_t x = a.sample(logits, 4);
    EXPECT_EQ(x, b.sample(logits, 4));
    seen.insert(x);
  }
  EXPECT_GE(seen.size(), 3u);  // temperature 1 explores
  Sampler nucleus(1.f, 0.5f, 1);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(nucleus.sample(logits, 4), 1);  // only the best token is in the nucleus
  Sampler pair(1.f, 0.9f, 3);
  for (int i = 0; i < 100; ++i) {
    const int64_t x = pair.sample(logits, 4);
    EXPECT_TRUE(x == 1 || x == 2);
  }
}
