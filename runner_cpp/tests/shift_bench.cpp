// The cost of one context shift of a whole KV cache, in ms (a benchmark, not a test):
//   composite_shift_bench LAYERS KV_HEADS HEAD_DIM MAX_SEQ_LEN [float32|uint16|uint8]
// e.g. Llama 3.2 3B's shape: 28 8 128 1024. Shifts a full cache with the default keep and evict.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "context_shift.h"
#include "kv_cache.h"

using namespace composite;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s LAYERS KV_HEADS HEAD_DIM MAX_SEQ_LEN [float32|uint16|uint8]\n", argv[0]);
    return 2;
  }
  const int layers = std::atoi(argv[1]), kv = std::atoi(argv[2]), hd = std::atoi(argv[3]), S = std::atoi(argv[4]);
  const std::string kind = argc > 5 ? argv[5] : "float32";
  Encoding encoding;
  if (kind == "uint16") encoding = {Encoding::Kind::UInt16, 1e-3f, 32768};
  if (kind == "uint8") encoding = {Encoding::Kind::UInt8, 1e-2f, 128};
  KVCache cache(kv, hd, S, std::vector<std::pair<Encoding, Encoding>>(layers, {encoding, encoding}));
  const int keep = kDefaultKeep, evict = default_evict(S, keep);
  std::vector<float> inv_freq(hd / 2), cos, sin;
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = 1.f / (1 << (i % 16));
  rotation_by(inv_freq, -evict, &cos, &sin);
  double best = 1e9;
  for (int round = 0; round < 5; ++round) {
    const auto start = std::chrono::steady_clock::now();
    cache.shift(keep, evict, S, cos, sin);
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::printf(
      "%d layers x %d kv heads x %d head_dim x %d positions, %s: one shift (keep %d, evict %d) %.2f ms (best of 5)\n",
      layers, kv, hd, S, kind.c_str(), keep, evict, best);
  return 0;
}
