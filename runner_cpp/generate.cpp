#include "generate.h"

#include <algorithm>
#include <chrono>

#include "error.h"

namespace composite {

namespace {

double since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::vector<double> ms_per(const std::vector<double>& seconds, int count) {
  std::vector<double> out;
  for (double s : seconds) out.push_back(count ? s * 1e3 / count : 0.0);
  return out;
}

}  // namespace

void check_limits(size_t prompt_tokens, const Limits& limits, const ContextShift* shift, size_t prompt_only) {
  if (prompt_tokens == 0) throw RunnerError("the prompt is empty");
  if (!shift && limits.seq_len > limits.max_seq_len) {
    throw RunnerError("--seq_len " + std::to_string(limits.seq_len) + " is beyond this export's max_seq_len " +
                      std::to_string(limits.max_seq_len));
  }
  if (shift) shift->check_prompt(prompt_only ? prompt_only : prompt_tokens);
  if (limits.seq_len && static_cast<int>(prompt_tokens) >= limits.seq_len) {
    throw RunnerError("the prompt has " + std::to_string(prompt_tokens) + " tokens but the sequence limit is " +
                      std::to_string(limits.seq_len) + " (max_seq_len " + std::to_string(limits.max_seq_len) +
                      "): nothing left to generate");
  }
}

std::string stop_reason(int64_t token, int generated, int total, const Limits& limits) {
  if (std::find(limits.eos_ids.begin(), limits.eos_ids.end(), token) != limits.eos_ids.end()) return "eos";
  if (generated >= limits.max_new_tokens) return "max_new_tokens";
  if (limits.seq_len && total >= limits.seq_len) {
    return limits.seq_len == limits.max_seq_len ? "max_seq_len" : "seq_len";
  }
  return "";
}

namespace {

// One call of `method` at *pos, after a context shift if the cache has no room for it.
const float* run_call(TokenChain& chain, ContextShift* shift, const std::string& method,
                      const std::vector<int64_t>& tokens, int* pos) {
  if (shift) *pos = shift->room(chain, *pos, static_cast<int>(tokens.size()));
  return chain.forward(method, tokens, *pos);
}

}  // namespace

Generation generate(TokenChain& chain, const std::vector<int64_t>& prompt, int prefill_width, int vocab_size,
                    const Limits& limits, Sampler& sampler, const std::function<void(int64_t)>& on_token, int start_pos,
                    ContextShift* shift) {
  check_limits(start_pos + prompt.size(), limits, shift, prompt.size());
  Generation g;
  g.prompt_tokens = static_cast<int>(prompt.size());
  g.prefill_width = prefill_width;
  chain.reset_stats();
  const int shifts_before = shift ? shift->shifts() : 0;
  const double shift_seconds_before = shift ? shift->seconds() : 0;

  const auto prefill_start = std::chrono::steady_clock::now();
  const float* logits = nullptr;
  int pos = start_pos;
  for (size_t start = 0; start < prompt.size(); start += prefill_width) {
    const size_t end = std::min(prompt.size(), start + prefill_width);
    const std::vector<int64_t> chunk(prompt.begin() + start, prompt.begin() + end);
    logits = run_call(chain, shift, chunk.size() == 1 ? "decode" : "prefill", chunk, &pos);
    pos += static_cast<int>(chunk.size());
  }
  int64_t token = sampler.sample(logits, vocab_size);
  g.prefill_seconds = since(prefill_start);
  g.prefill_shard_ms_per_token = ms_per(chain.shard_seconds(), g.prompt_tokens);
  g.prefill_kv_write_ms_per_token = chain.kv_write_seconds() * 1e3 / g.prompt_tokens;
  chain.reset_stats();

  int total = start_pos + g.prompt_tokens;  // tokens so far, the evicted ones included
  const auto decode_start = std::chrono::steady_clock::now();
  while (true) {
    g.tokens.push_back(token);
    if (on_token) on_token(token);
    g.stop_reason = stop_reason(token, static_cast<int>(g.tokens.size()), total + 1, limits);
    if (!g.stop_reason.empty()) break;
    logits = run_call(chain, shift, "decode", {token}, &pos);
    ++g.decode_calls;
    token = sampler.sample(logits, vocab_size);
    ++pos;
    ++total;
  }
  g.decode_seconds = since(decode_start);
  g.in_cache = pos;
  if (shift) {
    g.context_shifts = shift->shifts() - shifts_before;
    g.context_shift_seconds = shift->seconds() - shift_seconds_before;
  }
  g.decode_shard_ms_per_token = ms_per(chain.shard_seconds(), g.decode_calls);
  g.decode_kv_write_ms_per_token = g.decode_calls ? chain.kv_write_seconds() * 1e3 / g.decode_calls : 0.0;
  return g;
}

nlohmann::json stats_json(const Generation& g, const RunInfo& run) {
  nlohmann::json stats;
  stats["runner"] = "composite_runner";
  stats["tokens"] = g.tokens;
  stats["prompt_tokens"] = g.prompt_tokens;
  stats["stop_reason"] = g.stop_reason;
  stats["load_ms"] = run.load_ms;
  stats["time_to_first_token_ms"] = g.prefill_seconds * 1e3;
  stats["prefill_tokens_per_s"] = g.prefill_tokens_per_s();
  stats["decode_tokens_per_s"] = g.decode_tokens_per_s();
  stats["shard_ms_per_token"] = g.decode_shard_ms_per_token;
  stats["kv_write_ms_per_token"] = g.decode_kv_write_ms_per_token;
  stats["prefill_shard_ms_per_token"] = g.prefill_shard_ms_per_token;
  stats["prefill_kv_write_ms_per_token"] = g.prefill_kv_write_ms_per_token;
  stats["prefill_width"] = g.prefill_width;
  stats["context_shifts"] = g.context_shifts;
  stats["context_shift_ms"] = g.context_shift_seconds * 1e3;
  stats["threads"] = run.threads;
  stats["seed"] = run.seed;
  stats["peak_rss_mb"] = run.peak_rss_mb;
  stats["shard_backends"] = run.shard_backends;
  stats["shard_layers"] = run.shard_layers;
  stats["kv_cache_bytes"] = run.memory.kv_cache_bytes;
  stats["kv_cache_bytes_per_shard"] = run.memory.kv_cache_bytes_per_shard;
  stats["decode_io_bytes_per_shard"] = nlohmann::json::array();
  for (const auto& [in, out] : run.memory.decode_io_bytes_per_shard) {
    stats["decode_io_bytes_per_shard"].push_back({{"in", in}, {"out", out}});
  }
  stats["qnn_simulator"] = run.qnn_simulator;
  return stats;
}

}  // namespace composite
