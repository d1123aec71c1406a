#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace composite {

Sampler::Sampler(float temperature, float top_p, uint64_t seed)
    : temperature_(temperature), top_p_(top_p), rng_(seed) {}

double Sampler::uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

int64_t argmax(const float* logits, int vocab) { return std::max_element(logits, logits + vocab) - logits; }

int64_t Sampler::sample(const float* logits, int vocab) {
  const int64_t best = argmax(logits, vocab);
  if (temperature_ <= 0.f) return best;
  std::vector<double> probs(vocab);
  const double top = logits[best];
  double total = 0;
  for (int i = 0; i < vocab; ++i) total += probs[i] = std::exp((logits[i] - top) / temperature_);
  for (double& p : probs) p /= total;
  std::vector<int> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  int kept = vocab;
  if (top_p_ < 1.f) {
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
    // The smallest prefix whose mass reaches top_p, never empty.
    double mass = 0;
    kept = 0;
    while (kept < vocab && mass < top_p_) mass += probs[order[kept++]];
  }
  double mass = 0;
  for (int i = 0; i < kept; ++i) mass += probs[order[i]];
  const double target = uniform() * mass;
  double cumulative = 0;
  for (int i = 0; i < kept; ++i) {
    cumulative += probs[order[i]];
    if (target < cumulative) return order[i];
  }
  return order[kept - 1];
}

}  // namespace composite
