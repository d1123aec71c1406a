#include <gtest/gtest.h>

#include "kv_cache.h"

using composite::AttentionMask;
using composite::KVCache;

TEST(KVCache, WritesOnlyTheValidNewEntriesAtThePosition) {
  const int kv = 2, hd = 3, S = 8, width = 4;
  KVCache cache(1, kv, hd, S);
  std::vector<float> k_new(kv * hd * width), v_new(kv * width * hd);
  for (size_t i = 0; i < k_new.size(); ++i) k_new[i] = 100 + i;
  for (size_t i = 0; i < v_new.size(); ++i) v_new[i] = 200 + i;
  cache.write(0, k_new.data(), v_new.data(), width, 5, 2);
  for (int h = 0; h < kv; ++h) {
    for (int d = 0; d < hd; ++d) {
      for (int s = 0; s < S; ++s) {
        // k [kv, hd, S] from k_new [kv, hd, width]
        const float expected = (s == 5 || s == 6) ? k_new[(h * hd + d) * width + (s - 5)] : 0.f;
        EXPECT_EQ(cache.k(0)[(h * hd + d) * S + s], expected);
        // v [kv, S, hd] from v_new [kv, width, hd]
        const float expected_v = (s == 5 || s == 6) ? v_new[(h * width + (s - 5)) * hd + d] : 0.f;
        EXPECT_EQ(cache.v(0)[(h * S + s) * hd + d], expected_v);
      }
    }
  }
  cache.clear();
  EXPECT_EQ(cache.k(0)[5], 0.f);
}

TEST(AttentionMask, CacheColumnsFollowThePositionAndOwnColumnsAreCausal) {
  const int width = 3, S = 6;
  const float hidden = -30000.f;
  AttentionMask mask(width, S, hidden);
  const int row = S + width;
  float* m = mask.at(4);
  for (int r = 0; r < width; ++r) {
    for (int c = 0; c < S; ++c) EXPECT_EQ(m[r * row + c], c < 4 ? 0.f : hidden) << r << "," << c;
    for (int c = 0; c < width; ++c) EXPECT_EQ(m[r * row + S + c], c <= r ? 0.f : hidden);
  }
  m = mask.at(1);  // going back hides again
  for (int c = 0; c < S; ++c) EXPECT_EQ(m[c], c < 1 ? 0.f : hidden);
}
