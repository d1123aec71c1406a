#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "error.h"
#include "generate.h"

using namespace composite;

namespace {

// Predicts "previous token + 1" (mod vocab) and records every call.
class CountingChain : public TokenChain {
 public:
  struct Call {
    std::string method;
    std::vector<int64_t> tokens;
    int pos;
  };
  explicit CountingChain(int vocab) : logits_(vocab, 0.f), seconds_(2, 0.0) {}

  const float* forward(const std::string& method, const std::vector<int64_t>& tokens, int pos) override {
    calls.push_back({method, tokens, pos});
    std::fill(logits_.begin(), logits_.end(), 0.f);
    logits_[(tokens.back() + 1) % logits_.size()] = 1.f;
    seconds_[0] += 0.001;
    seconds_[1] += 0.003;
    kv_seconds_ += 0.0005;
    return logits_.data();
  }
  const std::vector<double>& shard_seconds() const override { return seconds_; }
  double kv_write_seconds() const override { return kv_seconds_; }
  void reset_stats() override {
    seconds_.assign(seconds_.size(), 0.0);
    kv_seconds_ = 0;
  }

  void shift_cache(int keep, int evict, int used, const std::vector<float>&, const std::vector<float>&) override {
    shifts.push_back({keep, evict, used});
  }

  // Every row predicts its token + 1, as forward does.
  const float* forward_tree(const Tree& tree, int pos) override {
    calls.push_back({"verify", tree.tokens, pos});
    const size_t vocab = logits_.size();
    rows_.assign(tree.tokens.size() * vocab, 0.f);
    for (size_t r = 0; r < tree.tokens.size(); ++r) rows_[r * vocab + (tree.tokens[r] + 1) % vocab] = 1.f;
    return rows_.data();
  }
  void commit(const std::vector<int>& rows, int pos) override { commits.push_back({pos, rows}); }

  std::vector<Call> calls;
  std::vector<std::vector<int>> shifts;                   // keep, evict, used
  std::vector<std::pair<int, std::vector<int>>> commits;  // pos, rows

 private:
  std::vector<float> logits_, rows_;
  std::vector<double> seconds_;
  double kv_seconds_ = 0;
};

Limits limits(int max_new_tokens, int seq_len, std::vector<int64_t> eos = {}, int max_seq_len = 64) {
  return Limits{max_new_tokens, seq_len, max_seq_len, std::move(eos)};
}

}  // namespace

TEST(Generate, PrefillsInChunksAndSendsALoneLastTokenThroughDecode) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  const Generation g = generate(chain, {1, 2, 3, 4, 5, 6, 7}, 3, 100, limits(4, 64), greedy, nullptr);
  ASSERT_GE(chain.calls.size(), 3u);
  EXPECT_EQ(chain.calls[0].method, "prefill");
  EXPECT_EQ(chain.calls[0].tokens, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(chain.calls[1].pos, 3);
  EXPECT_EQ(chain.calls[2].method, "decode");
  EXPECT_EQ(chain.calls[2].tokens, (std::vector<int64_t>{7}));
  EXPECT_EQ(chain.calls[2].pos, 6);
  // Then decode, one position further each step.
  EXPECT_EQ(g.tokens, (std::vector<int64_t>{8, 9, 10, 11}));
  EXPECT_EQ(chain.calls.size(), 3u + 3u);
  for (size_t i = 3; i < chain.calls.size(); ++i) {
    EXPECT_EQ(chain.calls[i].method, "decode");
    EXPECT_EQ(chain.calls[i].pos, static_cast<int>(7 + i - 3));
  }
  EXPECT_EQ(g.stop_reason, "max_new_tokens");
  EXPECT_EQ(g.decode_calls, 3);
}

TEST(Generate, StopsOnAnyEosId) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  const Generation g = generate(chain, {1, 2}, 4, 100, limits(50, 64, {99, 5}), greedy, nullptr);
  EXPECT_EQ(g.tokens, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(g.stop_reason, "eos");
}

TEST(Generate, SeqLenCountsEveryToken) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  const Generation g = generate(chain, {1, 2, 3}, 4, 100, limits(50, 10), greedy, nullptr);
  EXPECT_EQ(g.tokens.size() + 3, 10u);
  EXPECT_EQ(g.stop_reason, "seq_len");
  const Generation full = generate(chain, {1, 2, 3}, 4, 100, Limits{500, 64, 64, {}}, greedy, nullptr);
  EXPECT_EQ(full.tokens.size() + 3, 64u);
  EXPECT_EQ(full.stop_reason, "max_seq_len");
}

TEST(Generate, EmitsEachTokenAsItIsChosen) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  std::vector<int64_t> seen;
  const Generation g = generate(chain, {40}, 4, 100, limits(5, 64), greedy, [&](int64_t t) { seen.push_back(t); });
  EXPECT_EQ(seen, g.tokens);
}

TEST(Generate, RefusesAPromptThatLeavesNothingToGenerate) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  EXPECT_THROW(generate(chain, {}, 4, 100, limits(5, 64), greedy, nullptr), RunnerError);
  EXPECT_THROW(generate(chain, {1, 2, 3}, 4, 100, limits(5, 3), greedy, nullptr), RunnerError);
  EXPECT_THROW(check_limits(2, Limits{5, 65, 64, {}}), RunnerError);
  EXPECT_TRUE(chain.calls.empty());
}

TEST(Generate, StatsSplitPrefillAndDecodeTimePerToken) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  const Generation g = generate(chain, {1, 2, 3, 4}, 4, 100, limits(3, 64), greedy, nullptr);
  // One prefill call for 4 prompt tokens; two decode calls.
  ASSERT_EQ(g.prefill_shard_ms_per_token.size(), 2u);
  EXPECT_NEAR(g.prefill_shard_ms_per_token[1], 3.0 / 4, 1e-9);
  EXPECT_NEAR(g.decode_shard_ms_per_token[1], 3.0, 1e-9);
  EXPECT_NEAR(g.decode_kv_write_ms_per_token, 0.5, 1e-9);
  RunInfo info;
  info.shard_backends = {"XnnpackBackend", "QnnBackend"};
  const nlohmann::json stats = stats_json(g, info);
  EXPECT_EQ(stats["runner"], "composite_runner");
  EXPECT_EQ(stats["tokens"].get<std::vector<int64_t>>(), g.tokens);
  EXPECT_EQ(stats["shard_ms_per_token"].size(), 2u);
  EXPECT_EQ(stats["stop_reason"], "max_new_tokens");
}

TEST(Generate, PlacesAPromptAfterWhatTheCacheHolds) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  // A chat's later turn: 10 tokens already in the cache, 4 new ones prefilled from position 10.
  const Generation g = generate(chain, {1, 2, 3, 4}, 3, 100, limits(2, 64), greedy, nullptr, 10);
  ASSERT_EQ(chain.calls.size(), 3u);
  EXPECT_EQ(chain.calls[0].method, "prefill");
  EXPECT_EQ(chain.calls[0].pos, 10);
  EXPECT_EQ(chain.calls[1].method, "decode");
  EXPECT_EQ(chain.calls[1].pos, 13);
  EXPECT_EQ(chain.calls[2].pos, 14);  // the first generated token
  EXPECT_EQ(g.prompt_tokens, 4);
  EXPECT_EQ(g.tokens, (std::vector<int64_t>{5, 6}));
  // The tokens before count against the sequence limit.
  EXPECT_THROW(generate(chain, {1, 2, 3, 4}, 3, 100, limits(2, 14), greedy, nullptr, 10), RunnerError);
}

namespace {

composite::Manifest shift_manifest(int max_seq_len, int prefill) {
  composite::Manifest m;
  m.max_seq_len = max_seq_len;
  m.head_dim = 4;
  m.methods = {{"decode", 1}, {"prefill", prefill}};
  m.rope_inv_freq = {1.f, 0.01f};
  return m;
}

}  // namespace

TEST(Generate, PastTheContextEvictsAfterTheKeptTokensAndGoesOn) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  composite::ContextShift shift(shift_manifest(16, 4), 2, 5);
  const Generation g = generate(chain, {1, 2, 3, 4, 5, 6}, 4, 100, limits(30, 0, {}, 16), greedy, nullptr, 0, &shift);
  ASSERT_EQ(g.tokens.size(), 30u);
  EXPECT_EQ(g.stop_reason, "max_new_tokens");
  // 6 prompt tokens + 29 decode calls = 35 positions in a context of 16: shifts at 16, 27, 38-5...
  ASSERT_FALSE(chain.shifts.empty());
  for (const auto& s : chain.shifts) {
    EXPECT_EQ(s[0], 2);
    EXPECT_EQ(s[1], 5);
    EXPECT_EQ(s[2], 16);  // a decode call shifts only when the context is full
  }
  EXPECT_EQ(g.context_shifts, static_cast<int>(chain.shifts.size()));
  for (const auto& call : chain.calls) EXPECT_LT(call.pos + static_cast<int>(call.tokens.size()) - 1, 16);
  EXPECT_EQ(g.in_cache, 6 + 29 - 5 * g.context_shifts);
}

TEST(Generate, AContextShiftRefusesAPromptThatCannotFitAndOutOfRangeSettings) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  composite::ContextShift shift(shift_manifest(16, 4), 4, -1);
  EXPECT_EQ(shift.evict(), 3);  // a quarter of the 12 evictable
  EXPECT_THROW(generate(chain, std::vector<int64_t>(12, 1), 4, 100, limits(5, 0, {}, 16), greedy, nullptr, 0, &shift),
               RunnerError);
  EXPECT_THROW(composite::ContextShift(shift_manifest(16, 4), 15, -1), RunnerError);  // no room to generate
  EXPECT_NO_THROW(composite::ContextShift(shift_manifest(16, 4), 14, -1));
  EXPECT_THROW(composite::ContextShift(shift_manifest(16, 4), 4, 0), RunnerError);
  EXPECT_THROW(composite::ContextShift(shift_manifest(16, 4), 4, 13), RunnerError);
  composite::Manifest old = shift_manifest(16, 4);
  old.rope_inv_freq.clear();
  EXPECT_THROW(composite::ContextShift(old, 4, -1), RunnerError);
}

TEST(Speculate, PromptLookupGivesThePlainTokensAndCommitsOnlyTheAcceptedPath) {
  CountingChain plain_chain(100), chain(100);
  Sampler greedy(0.f, 1.f, 0);
  const std::vector<int64_t> prompt = {5, 6, 7, 8, 9, 5, 6};
  const Generation plain = generate(plain_chain, prompt, 4, 100, limits(8, 64), greedy, nullptr);
  PromptLookup guesser(3, 5);
  const Generation g = generate(chain, prompt, 4, 100, limits(8, 64), greedy, nullptr, 0, nullptr, &guesser);
  EXPECT_EQ(g.tokens, plain.tokens);  // 7 8 9 10 ...
  // After 7, "5 6 7" matches at the start: 8 9 5 6 are guessed; the model (+1) accepts 8 and 9.
  ASSERT_GE(chain.calls.size(), 3u);  // two prefill calls, then the first verify call
  EXPECT_EQ(chain.calls[2].method, "verify");
  EXPECT_EQ(chain.calls[2].tokens, (std::vector<int64_t>{7, 8, 9, 5, 6}));
  EXPECT_EQ(chain.calls[2].pos, 7);
  ASSERT_FALSE(chain.commits.empty());
  EXPECT_EQ(chain.commits[0].first, 7);
  EXPECT_EQ(chain.commits[0].second, (std::vector<int>{0, 1, 2}));
  EXPECT_LT(g.decode_calls, plain.decode_calls);
  EXPECT_EQ(g.in_cache, plain.in_cache);
}

TEST(Speculate, AStopAmongTheAcceptedGuessesLeavesItOutOfTheCache) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  PromptLookup guesser(3, 5);
  const Generation g =
      generate(chain, {5, 6, 7, 8, 9, 5, 6}, 4, 100, limits(8, 64, {9}), greedy, nullptr, 0, nullptr, &guesser);
  EXPECT_EQ(g.tokens, (std::vector<int64_t>{7, 8, 9}));
  EXPECT_EQ(g.stop_reason, "eos");
  ASSERT_EQ(chain.commits.size(), 1u);
  EXPECT_EQ(chain.commits[0].second, (std::vector<int>{0, 1}));  // 7 and 8; 9, given out last, is not run
  EXPECT_EQ(g.in_cache, 9);
}

TEST(Speculate, LookaheadIsLosslessAndChecksThePooledNGrams) {
  // Counting modulo 4 repeats 0 1 2 3: the text's own n-grams predict it.
  CountingChain plain_chain(4), chain(4);
  Sampler greedy(0.f, 1.f, 0);
  const Generation plain = generate(plain_chain, {0, 1, 2, 3, 0, 1}, 4, 4, limits(30, 64), greedy, nullptr);
  Lookahead guesser(2, 3, 1);
  const Generation g = generate(chain, {0, 1, 2, 3, 0, 1}, 4, 4, limits(30, 64), greedy, nullptr, 0, nullptr, &guesser);
  EXPECT_EQ(g.tokens, plain.tokens);
  EXPECT_EQ(g.verify_calls, g.decode_calls - 1);  // a window to check every call, but when one token is left
  EXPECT_GT(g.tokens_per_call(), 1.5);
}

TEST(Speculate, GuessesStopShortOfTheTokensLeft) {
  CountingChain chain(100);
  Sampler greedy(0.f, 1.f, 0);
  PromptLookup guesser(3, 8);
  generate(chain, {5, 6, 7, 8, 9, 10, 11, 5, 6}, 4, 100, limits(3, 64), greedy, nullptr, 0, nullptr, &guesser);
  for (const auto& call : chain.calls) {
    if (call.method == "verify") EXPECT_LE(call.tokens.size(), 2u);  // the root and one guess: 3 tokens in all
  }
}

TEST(Speculate, BadFlagsAreRefusedInOneLine) {
  EXPECT_EQ(make_guesser(-1, "", 8, 0.f), nullptr);
  EXPECT_THROW(make_guesser(2, "", 0, 0.f), RunnerError);        // no verify method
  EXPECT_THROW(make_guesser(2, "", 8, 0.5f), RunnerError);       // sampling
  EXPECT_THROW(make_guesser(0, "", 8, 0.f), RunnerError);        // no n-gram
  EXPECT_THROW(make_guesser(2, "2,3,1", 8, 0.f), RunnerError);   // both
  EXPECT_THROW(make_guesser(-1, "4,3,1", 8, 0.f), RunnerError);  // 11 rows
  EXPECT_THROW(make_guesser(-1, "2,x,1", 8, 0.f), RunnerError);
  EXPECT_THROW(make_guesser(-1, "2,3,1,4", 8, 0.f), RunnerError);
  EXPECT_NE(make_guesser(-1, "2,3,1", 8, 0.f), nullptr);
}
