// Next-token choice: greedy at temperature 0, else temperature + top-p with a seeded generator.
#pragma once
#include <cstdint>
#include <random>

namespace composite {

// The greedy choice: the first of the largest logits (torch.argmax's choice too).
int64_t argmax(const float* logits, int vocab);

class Sampler {
 public:
  Sampler(float temperature, float top_p, uint64_t seed);
  int64_t sample(const float* logits, int vocab);

 private:
  double uniform();  // [0, 1), identical on every platform for a seed
  float temperature_, top_p_;
  std::mt19937_64 rng_;
};

}  // namespace composite
