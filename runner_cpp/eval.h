// --eval_text: perplexity of the export on a text, and with a kld-base file the KL divergence and
// the other figures of llama.cpp's llama-perplexity --kl-divergence against the reference it holds,
// where the shards really run (a phone's HTP). The chunking, the scored tokens, the metrics and the
// kld-base format are composite/eval's (scoring.py, metrics.py, kld_base.py); this computes the
// same.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "generate.h"
#include "tokenizer.h"

namespace composite {

struct EvalOptions {
  std::string text_path;
  int ctx = 0;                // 0: max_seq_len
  int limit_tokens = 0;       // 0: all
  std::string score = "all";  // or "second-half"
  std::string kld_base_path;  // empty: perplexity only
  bool stream = false;        // score the text token by token through a context shift, not in chunks
};

// The reference's distribution at one scored token: its top k tokens and the mass of the rest.
struct ReferenceTokens {
  int64_t token = 0;
  float logp_token = 0, logp_rest = 0;
  std::vector<int32_t> ids;
  std::vector<float> logps;
};

struct KldBase {
  int k = 0, vocab_size = 0, ctx = 0;
  std::string score, tokenizer_sha256, text_sha256;
  int64_t bos_id = -1;
  std::vector<std::vector<int64_t>> chunks;
  std::vector<ReferenceTokens> records;
};

// Reads a kld-base file (composite/eval/kld_base.py's layout); throws RunnerError naming the problem.
KldBase read_kld_base(const std::string& path);

// The position of a chunk's first scored token.
int first_scored(int ctx, const std::string& score);

// Non-overlapping chunks of ctx tokens (a shorter remainder left out), BOS in place of each first
// token when the export adds one. Throws RunnerError when there is not one chunk.
std::vector<std::vector<int64_t>> eval_chunks(const std::vector<int64_t>& ids, int ctx, int64_t bos_id);

// Accumulates per-token figures; summary() gives composite.eval's JSON keys.
class EvalScores {
 public:
  // logits of the tested model at the position before `token`; `reference` may be null.
  void add(const float* logits, int vocab_size, int64_t token, const ReferenceTokens* reference);
  nlohmann::json summary() const;

 private:
  std::vector<double> nll_, ref_nll_, kld_, dp_;
  int same_top_ = 0;
};

double percentile(std::vector<double> values, double p);

// Runs the evaluation through `chain`; prints composite.eval's summary lines on stdout and returns
// its JSON (also the stats written by --stats_json). options.stream: every token of the text after
// the first, each predicted from everything before it that the shifting cache still holds (shift:
// the context shift, or null to stop at max_seq_len), as composite.eval --stream does.
nlohmann::json evaluate(TokenChain& chain, const Manifest& manifest, const Tokenizer& tokenizer,
                        const std::string& tokenizer_path, const EvalOptions& options, ContextShift* shift = nullptr);

}  // namespace composite
