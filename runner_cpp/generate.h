// The generation loop: prefill the prompt in chunks of the prefill method's width, then decode one
// token per call until a stop condition; and the stats of the run as JSON. The loop knows the
// shards only as a TokenChain, so the unit tests drive it with a fake.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "context_shift.h"
#include "manifest.h"
#include "sampler.h"
#include "speculate.h"

namespace composite {

// What the loop needs from the shards: ShardChain, or a fake.
class TokenChain {
 public:
  virtual ~TokenChain() = default;
  // Runs `tokens` (1 .. width of `method`) at positions pos..; returns the logits of the last one.
  virtual const float* forward(const std::string& method, const std::vector<int64_t>& tokens, int pos) = 0;
  // Seconds spent per shard and in KV-cache writes since the last reset_stats().
  virtual const std::vector<double>& shard_seconds() const = 0;
  virtual double kv_write_seconds() const = 0;
  virtual void reset_stats() = 0;
  // Context shift of the cache (KVCache::shift).
  virtual void shift_cache(int keep, int evict, int used, const std::vector<float>& cos,
                           const std::vector<float>& sin) = 0;
  // The verify method on a tree of tokens (speculate.h) whose root sits at pos: every row's logits,
  // [rows x vocab]. Nothing reaches the cache until commit(), which writes the new entries of
  // `rows` of that call to slots pos.. .
  virtual const float* forward_tree(const Tree& tree, int pos) = 0;
  virtual void commit(const std::vector<int>& rows, int pos) = 0;
};

struct Limits {
  int max_new_tokens = 128;
  int seq_len = 0;  // tokens in all, prompt included; 0: no limit (a context shift makes room)
  int max_seq_len = 0;
  std::vector<int64_t> eos_ids;
};

// Throws RunnerError when the prompt (`prompt_tokens` with everything before it in the cache)
// leaves nothing to generate, or, without a context shift, seq_len exceeds max_seq_len; with
// one, when the prompt alone (`prompt_only`) does not fit beside the kept tokens.
void check_limits(size_t prompt_tokens, const Limits& limits, const ContextShift* shift = nullptr,
                  size_t prompt_only = 0);

// Why generation ends after emitting `token`, the `generated`-th new one with `total` tokens in
// all, or "" to go on. composite/runtime/generate.py's stop_reason decides the same way.
std::string stop_reason(int64_t token, int generated, int total, const Limits& limits);

struct Generation {
  std::vector<int64_t> tokens;
  std::string stop_reason;
  int prompt_tokens = 0;
  int prefill_width = 1;
  int decode_calls = 0;  // calls after the first token: decode, and verify with a guesser
  int verify_calls = 0;
  int accepted = 0;  // guesses the verify calls accepted
  double prefill_seconds = 0, decode_seconds = 0;
  std::vector<double> prefill_shard_ms_per_token, decode_shard_ms_per_token;
  double prefill_kv_write_ms_per_token = 0, decode_kv_write_ms_per_token = 0;
  int in_cache = 0;  // tokens in the cache after the last call (the last token is not yet in it)
  int context_shifts = 0;
  double context_shift_seconds = 0;

  double prefill_tokens_per_s() const { return prefill_seconds > 0 ? prompt_tokens / prefill_seconds : 0.0; }
  // Tokens given out after the first (which the prompt's last call gives).
  int decoded() const { return tokens.empty() ? 0 : static_cast<int>(tokens.size()) - 1; }
  double decode_tokens_per_s() const { return decode_calls && decode_seconds > 0 ? decoded() / decode_seconds : 0.0; }
  double tokens_per_call() const { return decode_calls ? static_cast<double>(decoded()) / decode_calls : 0.0; }
};

// Places `prompt` at positions start_pos.. (the cache already holds the tokens before it, as in a
// chat's later turns) and generates after it. A lone last prompt token goes through "decode"
// rather than a padded "prefill" call. shift: makes room past max_seq_len, or null to stop there.
// guesser: guesses checked several per call by the verify method (greedy only), or null to
// decode a token per call.
Generation generate(TokenChain& chain, const std::vector<int64_t>& prompt, int prefill_width, int vocab_size,
                    const Limits& limits, Sampler& sampler, const std::function<void(int64_t)>& on_token,
                    int start_pos = 0, ContextShift* shift = nullptr, Guesser* guesser = nullptr);

// Facts of the run beside the generation itself.
struct RunInfo {
  double load_ms = 0;
  int threads = 0;
  uint64_t seed = 0;
  double peak_rss_mb = 0;
  std::vector<std::string> shard_backends, shard_layers;
  bool qnn_simulator = false;  // QNN shards ran on the x86 HTP simulator
  MemoryFigures memory;
};

// The --stats_json document (its keys are listed in docs/usage.md, "Stats").
nlohmann::json stats_json(const Generation& generation, const RunInfo& run);

}  // namespace composite
