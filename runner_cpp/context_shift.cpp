#include "context_shift.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "error.h"
#include "generate.h"

namespace composite {

int default_evict(int window, int keep) { return std::max(1, (window - keep) / 4); }

void rotation_by(const std::vector<float>& inv_freq, int distance, std::vector<float>* cos, std::vector<float>* sin) {
  cos->resize(inv_freq.size());
  sin->resize(inv_freq.size());
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const double angle = static_cast<double>(distance) * static_cast<double>(inv_freq[i]);
    (*cos)[i] = static_cast<float>(std::cos(angle));
    (*sin)[i] = static_cast<float>(std::sin(angle));
  }
}

ContextShift::ContextShift(const Manifest& manifest, int keep, int evict)
    : window_(manifest.max_seq_len), keep_(keep < 0 ? kDefaultKeep : keep), inv_freq_(manifest.rope_inv_freq) {
  // Room for a prompt token and a generated one; a prefill call narrower than its method fits
  // wherever the prompt does (check_prompt).
  if (keep_ > window_ - 2) {
    throw RunnerError("--keep " + std::to_string(keep_) + " leaves no room in the context of " +
                      std::to_string(window_) + " tokens (keep must be 0 .. " + std::to_string(window_ - 2) + ")");
  }
  evict_ = evict < 0 ? default_evict(window_, keep_) : evict;
  if (evict_ < 1 || evict_ > window_ - keep_) {
    throw RunnerError("--evict " + std::to_string(evict_) + " is out of range: 1 .. " +
                      std::to_string(window_ - keep_) + " tokens can be evicted past the " + std::to_string(keep_) +
                      " kept of " + std::to_string(window_));
  }
  if (inv_freq_.empty()) {
    throw RunnerError(
        "this export's manifest has no 'rope' entry (it predates context shift): export it again, or pass "
        "--no_context_shift");
  }
}

std::string ContextShift::too_long(const std::string& what, size_t tokens) const {
  return what + " has " + std::to_string(tokens) + " tokens, more than the context holds: max_seq_len " +
         std::to_string(window_) + " less " + std::to_string(keep_) + " kept (--keep) leaves room for " +
         std::to_string(window_ - keep_ - 1);
}

void ContextShift::check_prompt(size_t tokens) const {
  if (!fits(tokens)) throw RunnerError(too_long("the prompt", tokens));
}

int ContextShift::room(TokenChain& chain, int used, int needed) {
  if (used + needed <= window_) return used;
  const int evict = std::max(evict_, used + needed - window_);
  if (evict > used - keep_) {
    throw RunnerError("cannot make room for " + std::to_string(needed) + " tokens: only " +
                      std::to_string(used - keep_) + " of the " + std::to_string(used) +
                      " in the context can be evicted past the " + std::to_string(keep_) + " kept");
  }
  const auto started = std::chrono::steady_clock::now();
  std::vector<float> cos, sin;
  rotation_by(inv_freq_, -evict, &cos, &sin);
  chain.shift_cache(keep_, evict, used, cos, sin);
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  ++shifts_;
  return used - evict;
}

}  // namespace composite
