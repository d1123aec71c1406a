#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "encoding.h"
#include "kv_cache.h"

using composite::AttentionMask;
using composite::Encoding;
using composite::KVCache;

TEST(KVCache, WritesOnlyTheValidNewEntriesAtThePosition) {
  const int kv = 2, hd = 3, S = 8, width = 4;
  KVCache cache(kv, hd, S, {{Encoding{}, Encoding{}}});
  std::vector<float> k_new(kv * hd * width), v_new(kv * width * hd);
  for (size_t i = 0; i < k_new.size(); ++i) k_new[i] = 100 + i;
  for (size_t i = 0; i < v_new.size(); ++i) v_new[i] = 200 + i;
  cache.write(0, k_new.data(), v_new.data(), width, 5, 2);
  for (int h = 0; h < kv; ++h) {
    for (int d = 0; d < hd; ++d) {
      for (int s = 0; s < S; ++s) {
        // k [kv, hd, S] from k_new [kv, hd, width]
        const float expected = (s == 5 || s == 6) ? k_new[(h * hd + d) * width + (s - 5)] : 0.f;
        EXPECT_EQ(static_cast<const float*>(cache.k(0))[(h * hd + d) * S + s], expected);
        // v [kv, S, hd] from v_new [kv, width, hd]
        const float expected_v = (s == 5 || s == 6) ? v_new[(h * width + (s - 5)) * hd + d] : 0.f;
        EXPECT_EQ(static_cast<const float*>(cache.v(0))[(h * S + s) * hd + d], expected_v);
      }
    }
  }
  cache.clear();
  EXPECT_EQ(static_cast<const float*>(cache.k(0))[5], 0.f);
}

TEST(KVCache, AQuantizedLayerKeepsItsEncodingAndEmptiesToTheZeroPoint) {
  const int kv = 1, hd = 2, S = 4, width = 2;
  const Encoding k16{Encoding::Kind::UInt16, 0.01f, 30000}, v8{Encoding::Kind::UInt8, 0.1f, 128};
  KVCache cache(kv, hd, S, {{Encoding{}, Encoding{}}, {k16, v8}});
  const uint16_t* k = static_cast<const uint16_t*>(cache.k(1));
  const uint8_t* v = static_cast<const uint8_t*>(cache.v(1));
  for (int i = 0; i < kv * hd * S; ++i) EXPECT_EQ(k[i], 30000);
  for (int i = 0; i < kv * hd * S; ++i) EXPECT_EQ(v[i], 128);
  const std::vector<uint16_t> k_new = {1, 2, 3, 4};  // [kv, hd, width]
  const std::vector<uint8_t> v_new = {5, 6, 7, 8};   // [kv, width, hd]
  cache.write(1, k_new.data(), v_new.data(), width, 1, 2);
  EXPECT_EQ(std::vector<uint16_t>(k, k + 8), (std::vector<uint16_t>{30000, 1, 2, 30000, 30000, 3, 4, 30000}));
  EXPECT_EQ(std::vector<uint8_t>(v, v + 8), (std::vector<uint8_t>{128, 128, 5, 6, 7, 8, 128, 128}));
}

TEST(Quantized, ConvertsAsFloorOfClampedHalfUpAndBack) {
  const Encoding q16{Encoding::Kind::UInt16, 0.5f, 100}, q8{Encoding::Kind::UInt8, 0.25f, 10};
  const std::vector<float> x = {0.f, 0.25f, -0.25f, 1.0f, -100.f, 1e9f, -1e9f};
  std::vector<uint16_t> q(x.size());
  composite::convert(x.data(), Encoding{}, q.data(), q16, x.size());
  // 0.25 / 0.5 + 100 = 100.5 rounds up; -0.25 -> 99.5 -> 100; clamps at 0 and 65535
  EXPECT_EQ(q, (std::vector<uint16_t>{100, 101, 100, 102, 0, 65535, 0}));
  std::vector<float> back(q.size());
  composite::convert(q.data(), q16, back.data(), Encoding{}, q.size());
  EXPECT_EQ(back, (std::vector<float>{0.f, 0.5f, 0.f, 1.f, -50.f, 32717.5f, -50.f}));
  std::vector<uint8_t> q8s(q.size());
  composite::convert(q.data(), q16, q8s.data(), q8, q.size());  // through float: 0, 0.5, 0, 1, -50 ...
  EXPECT_EQ(q8s, (std::vector<uint8_t>{10, 12, 10, 14, 0, 255, 0}));
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

TEST(AttentionMask, ATreeRowSeesTheCacheItselfAndItsAncestorsOnly) {
  const int width = 5, S = 4;
  const float hidden = -30000.f;
  AttentionMask mask(width, S, hidden);
  const int row = S + width;
  float* m = mask.tree(2, {-1, 0, 1, 0});  // root -> a -> b, root -> c; row 4 is padding
  const bool sees[width][width] = {{1, 0, 0, 0, 0}, {1, 1, 0, 0, 0}, {1, 1, 1, 0, 0}, {1, 0, 0, 1, 0}, {0, 0, 0, 0, 1}};
  for (int r = 0; r < width; ++r) {
    for (int c = 0; c < S; ++c) EXPECT_EQ(m[r * row + c], c < 2 ? 0.f : hidden) << r << "," << c;
    for (int c = 0; c < width; ++c) EXPECT_EQ(m[r * row + S + c], sees[r][c] ? 0.f : hidden) << r << "," << c;
  }
}

TEST(KVCache, WritesTheChosenRowsInOrder) {
  const int kv = 2, hd = 3, S = 8, width = 4;
  KVCache cache(kv, hd, S, {{Encoding{}, Encoding{}}});
  std::vector<float> k_new(kv * hd * width), v_new(kv * width * hd);
  for (size_t i = 0; i < k_new.size(); ++i) k_new[i] = 100 + i;
  for (size_t i = 0; i < v_new.size(); ++i) v_new[i] = 200 + i;
  cache.write_rows(0, k_new.data(), v_new.data(), width, 3, {0, 2});  // rows 0 and 2 to slots 3 and 4
  const float* k = static_cast<const float*>(cache.k(0));
  const float* v = static_cast<const float*>(cache.v(0));
  for (int c = 0; c < kv * hd; ++c) {
    for (int s = 0; s < S; ++s) {
      const float want = s == 3 ? k_new[c * width] : s == 4 ? k_new[c * width + 2] : 0.f;
      EXPECT_EQ(k[c * S + s], want) << c << "," << s;
    }
  }
  for (int h = 0; h < kv; ++h) {
    for (int s = 0; s < S; ++s) {
      for (int d = 0; d < hd; ++d) {
        const int from = s == 3 ? 0 : s == 4 ? 2 : -1;
        const float want = from < 0 ? 0.f : v_new[(h * width + from) * hd + d];
        EXPECT_EQ(v[(h * S + s) * hd + d], want) << h << "," << s << "," << d;
      }
    }
  }
}

TEST(Float16, RoundsToNearestEvenAsTorchDoes) {
  // Expected bits from torch's float32 -> float16 conversion.
  const std::vector<std::pair<float, uint16_t>> cases = {
      {1.0f, 0x3c00},
      {1.00048828125f, 0x3c00},  // a tie rounds to the even 0x3c00
      {1.000732421875f, 0x3c01},
      {1.00146484375f, 0x3c02},  // a tie rounds up to the even 0x3c02
      {65504.f, 0x7bff},
      {65519.f, 0x7bff},
      {65520.f, 0x7c00},  // largest, then infinity
      {1e-8f, 0x0000},
      {2.9802322387695312e-08f, 0x0000},  // half the smallest subnormal: even 0
      {5.960464477539063e-08f, 0x0001},
      {8.940696716308594e-08f, 0x0002},  // 1.5 subnormals: even 2
      {-3.14159f, 0xc248},
      {6.1e-05f, 0x03ff},
      {1e9f, 0x7c00},
      {-0.f, 0x8000}};
  for (const auto& [value, bits] : cases) EXPECT_EQ(composite::half_from_float(value), bits) << value;
}

TEST(Float16, EveryFiniteHalfSurvivesTheRoundTrip) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    if ((bits & 0x7c00) == 0x7c00) continue;  // infinities and NaNs
    const uint16_t half = static_cast<uint16_t>(bits);
    EXPECT_EQ(composite::half_from_float(composite::float_from_half(half)), half) << bits;
  }
  EXPECT_EQ(composite::float_from_half(0x0001), 5.960464477539063e-08f);
  EXPECT_EQ(composite::float_from_half(0xc248), -3.140625f);
}

namespace {

// Key d of head h at position p before RoPE: any fixed values will do.
float raw_key(int h, int d, int p) { return 0.5f * std::sin(1.3f * p + 0.7f * d + 2.1f * h) + 0.1f * d; }

// The same key after RoPE at `position` (rotate-half pairs d and d + hd/2), as the model computes it.
float roped_key(int h, int d, int p, int position, int hd, const std::vector<float>& inv_freq) {
  const int half = hd / 2, i = d % half;
  const double angle = static_cast<double>(position) * inv_freq[i];
  const double c = std::cos(angle), s = std::sin(angle);
  const double x1 = raw_key(h, i, p), x2 = raw_key(h, i + half, p);
  return static_cast<float>(d < half ? x1 * c - x2 * s : x2 * c + x1 * s);
}

}  // namespace

// A shifted cache equals the cache of the same tokens computed at their new positions: float32
// up to rounding, a quantized layer within 1.25 steps of its encoding (the first encoding's half
// step, rotated, then the second's), values moved exactly.
TEST(KVCache, AContextShiftMovesTheEntriesAndReRotatesTheKeysToTheirNewPositions) {
  const int kv = 2, hd = 8, S = 32, keep = 3, evict = 7, used = 30;
  const std::vector<float> inv_freq = {1.f, 0.3f, 0.05f, 0.001f};
  const Encoding k16{Encoding::Kind::UInt16, 0.0001f, 32768}, v8{Encoding::Kind::UInt8, 0.05f, 100};
  const Encoding k8{Encoding::Kind::UInt8, 0.01f, 128}, f16{Encoding::Kind::Float16};
  const std::vector<std::pair<Encoding, Encoding>> layers = {
      {Encoding{}, Encoding{}}, {k16, v8}, {k8, f16}, {f16, f16}};
  KVCache cache(kv, hd, S, layers);
  for (size_t layer = 0; layer < layers.size(); ++layer) {
    std::vector<float> k_new(kv * hd * used), v_new(kv * used * hd);
    for (int h = 0; h < kv; ++h) {
      for (int d = 0; d < hd; ++d) {
        for (int p = 0; p < used; ++p) {
          k_new[(h * hd + d) * used + p] = roped_key(h, d, p, p, hd, inv_freq);
          v_new[(h * used + p) * hd + d] = raw_key(h + 5, d, p);
        }
      }
    }
    std::vector<float> k_encoded(k_new.size() * 2), v_encoded(v_new.size() * 2);  // room for any encoding
    convert(k_new.data(), Encoding{}, k_encoded.data(), layers[layer].first, k_new.size());
    convert(v_new.data(), Encoding{}, v_encoded.data(), layers[layer].second, v_new.size());
    cache.write(static_cast<int>(layer), k_encoded.data(), v_encoded.data(), used, 0, used);
  }
  std::vector<float> v_before(kv * S * hd), cos(hd / 2), sin(hd / 2);
  convert(cache.v(1), v8, v_before.data(), Encoding{}, v_before.size());
  for (int i = 0; i < hd / 2; ++i) {
    cos[i] = static_cast<float>(std::cos(-evict * static_cast<double>(inv_freq[i])));
    sin[i] = static_cast<float>(std::sin(-evict * static_cast<double>(inv_freq[i])));
  }
  cache.shift(keep, evict, used, cos, sin);
  for (size_t layer = 0; layer < layers.size(); ++layer) {
    const auto& [k_enc, v_enc] = layers[layer];
    std::vector<float> k(kv * hd * S), v(kv * S * hd);
    convert(cache.k(static_cast<int>(layer)), k_enc, k.data(), Encoding{}, k.size());
    convert(cache.v(static_cast<int>(layer)), v_enc, v.data(), Encoding{}, v.size());
    const float step = k_enc.kind == Encoding::Kind::Float32 ? 1e-6f
                       : k_enc.kind == Encoding::Kind::Float16
                           ? 1e-3f
                           : k_enc.scale * 1.25f;  // a half step rotated, then a half step
    for (int h = 0; h < kv; ++h) {
      for (int d = 0; d < hd; ++d) {
        for (int slot = 0; slot < S; ++slot) {
          const float got = k[(h * hd + d) * S + slot];
          if (slot >= used - evict) {
            EXPECT_EQ(got, 0.f) << "freed slot " << slot;
            EXPECT_EQ(v[(h * S + slot) * hd + d], 0.f);
            continue;
          }
          const int source = slot < keep ? slot : slot + evict;  // the token that now sits here
          EXPECT_NEAR(got, roped_key(h, d, source, slot, hd, inv_freq), step) << "layer " << layer << " slot " << slot;
        }
      }
    }
    if (layer == 1) {  // values move as they are: bit for bit
      for (int h = 0; h < kv; ++h) {
        for (int slot = keep; slot < used - evict; ++slot) {
          for (int d = 0; d < hd; ++d) EXPECT_EQ(v[(h * S + slot) * hd + d], v_before[(h * S + slot + evict) * hd + d]);
        }
      }
    }
  }
}
