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

namespace {

// The tree of the next verify call, cut to what can still be used: no deeper than the tokens left
// to generate and, without a context shift, than the cache. False where nothing is left to check
// (a decode call instead). composite/runtime/generate.py's guesses decides the same.
bool guesses(Guesser* guesser, const std::vector<int64_t>& history, int pos, int generated, const Limits& limits,
             const ContextShift* shift, Tree* tree) {
  if (!guesser || !guesser->tree(history, tree)) return false;
  int depth = limits.max_new_tokens - generated - 1;
  if (!shift) depth = std::min(depth, limits.max_seq_len - 1 - pos);
  if (tree->max_depth() > depth) *tree = tree->cut(depth);
  return tree->tokens.size() > 1;
}

}  // namespace

Generation generate(TokenChain& chain, const std::vector<int64_t>& prompt, int prefill_width, int vocab_size,
                    const Limits& limits, Sampler& sampler, const std::function<void(int64_t)>& on_token, int start_pos,
                    ContextShift* shift, Guesser* guesser) {
  check_limits(start_pos + prompt.size(), limits, shift, prompt.size());
  Generation g;
  g.prompt_tokens = static_cast<int>(prompt.size());
  g.prefill_width = prefill_width;
  chain.reset_stats();
  const int shifts_before = shift ? shift->shifts() : 0;
  const double shift_seconds_before = shift ? shift->seconds() : 0;
  std::vector<int64_t> no_history;
  std::vector<int64_t>& history = guesser ? guesser->begin(prompt, start_pos) : no_history;

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
  // Gives out one generated token; true when generation ends with it.
  auto emit = [&](int64_t t) {
    ++total;
    g.tokens.push_back(t);
    if (guesser) history.push_back(t);
    if (on_token) on_token(t);
    g.stop_reason = stop_reason(t, static_cast<int>(g.tokens.size()), total, limits);
    return !g.stop_reason.empty();
  };
  const auto decode_start = std::chrono::steady_clock::now();
  bool done = emit(token);
  Tree tree;
  std::vector<int64_t> choices, ahead;
  std::vector<int> path;
  while (!done) {
    if (!guesses(guesser, history, pos, static_cast<int>(g.tokens.size()), limits, shift, &tree)) {
      logits = run_call(chain, shift, "decode", {token}, &pos);
      ++g.decode_calls;
      token = sampler.sample(logits, vocab_size);
      ++pos;
      done = emit(token);
      continue;
    }
    if (shift) pos = shift->room(chain, pos, tree.max_depth() + 1);
    const float* rows = chain.forward_tree(tree, pos);
    ++g.decode_calls;
    ++g.verify_calls;
    choices.clear();
    for (size_t r = 0; r < tree.tokens.size(); ++r) choices.push_back(argmax(rows + r * vocab_size, vocab_size));
    accepted_path(tree, choices, &path, &ahead);
    guesser->learn(tree, choices);
    g.accepted += static_cast<int>(path.size()) - 1;
    size_t emitted = 0;
    while (emitted + 1 < ahead.size() && !done) done = emit(ahead[emitted++]);
    if (done) path.resize(emitted);  // the last token given out is not yet in the cache
    chain.commit(path, pos);
    pos += static_cast<int>(path.size());
    if (!done) {
      token = ahead.back();
      done = emit(token);
    }
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
  stats["tokens_per_call"] = g.tokens_per_call();
  stats["verify_calls"] = g.verify_calls;
  stats["accepted_per_call"] = g.verify_calls ? static_cast<double>(g.accepted) / g.verify_calls : 0.0;
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
