// Context shift: a generation, a chat or a scored text goes on past the export's max_seq_len.
// When a call needs more cache slots than are left, the first `keep` tokens stay (the attention
// sinks), the oldest `evict` after them leave in one batch, and the rest move down, their keys
// rotated back by `evict` positions, so positions stay below max_seq_len.
// composite/runtime/context_shift.py is the Python twin (same defaults, checks and arithmetic).
#pragma once
#include <string>
#include <vector>

#include "manifest.h"

namespace composite {

class TokenChain;

constexpr int kDefaultKeep = 4;  // StreamingLLM's sink count

// Slots freed per shift when --evict is not given: a quarter of what can be evicted.
int default_evict(int window, int keep);

// cos and sin [head_dim/2] of RoPE's rotation by `distance` positions (angle in double, then float).
void rotation_by(const std::vector<float>& inv_freq, int distance, std::vector<float>* cos, std::vector<float>* sin);

class ContextShift {
 public:
  // keep < 0 / evict < 0: the defaults. Throws RunnerError naming what is out of range, or that
  // the export's manifest has no rope frequencies.
  ContextShift(const Manifest& manifest, int keep, int evict);

  // Whether a prompt of `tokens` fits beside the kept tokens with a slot left to generate; why not,
  // naming it `what`; check_prompt throws that as a RunnerError.
  bool fits(size_t tokens) const { return keep_ + static_cast<int>(tokens) < window_; }
  std::string too_long(const std::string& what, size_t tokens) const;
  void check_prompt(size_t tokens) const;
  // Makes room for `needed` more tokens after `used` slots; returns the slots used after it.
  int room(TokenChain& chain, int used, int needed);

  int keep() const { return keep_; }
  int evict() const { return evict_; }
  int shifts() const { return shifts_; }
  double seconds() const { return seconds_; }

 private:
  int window_, keep_, evict_;
  std::vector<float> inv_freq_;
  int shifts_ = 0;
  double seconds_ = 0;
};

}  // namespace composite
