#include "eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <sstream>

#include "context_shift.h"
#include "error.h"

namespace composite {

namespace {

constexpr char kMagic[] = "COMPOSITE-KLD\n";  // composite/eval/kld_base.py's MAGIC
constexpr uint32_t kVersion = 1;

std::string read_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw RunnerError("cannot read " + what + " " + path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

template <typename T>
T take(const std::string& data, size_t* offset, const std::string& path) {
  if (*offset + sizeof(T) > data.size()) throw RunnerError("kld-base file " + path + " is truncated");
  T value;
  std::memcpy(&value, data.data() + *offset, sizeof(T));
  *offset += sizeof(T);
  return value;
}

// log-softmax in double precision, as composite.eval computes it.
std::vector<double> log_softmax(const float* logits, int n) {
  double top = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < n; ++i) top = std::max(top, static_cast<double>(logits[i]));
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(logits[i] - top);
  const double log_sum = top + std::log(sum);
  std::vector<double> out(n);
  for (int i = 0; i < n; ++i) out[i] = logits[i] - log_sum;
  return out;
}

}  // namespace

KldBase read_kld_base(const std::string& path) {
  const std::string data = read_file(path, "the kld-base file");
  const size_t magic = std::strlen(kMagic);
  if (data.compare(0, magic, kMagic) != 0) {
    throw RunnerError(path + " is not a kld-base file (composite.eval --kld-base-out writes them)");
  }
  size_t offset = magic;
  const auto version = take<uint32_t>(data, &offset, path);
  if (version != kVersion) {
    throw RunnerError("kld-base file " + path + " has version " + std::to_string(version) + "; this reads " +
                      std::to_string(kVersion));
  }
  const auto length = take<uint32_t>(data, &offset, path);
  if (offset + length > data.size()) throw RunnerError("kld-base file " + path + " is truncated");
  KldBase base;
  try {
    const nlohmann::json header = nlohmann::json::parse(data.substr(offset, length));
    base.k = header.at("k").get<int>();
    base.vocab_size = header.at("vocab_size").get<int>();
    base.ctx = header.at("ctx").get<int>();
    base.score = header.at("score").get<std::string>();
    base.bos_id = header.at("bos_id").is_null() ? -1 : header.at("bos_id").get<int64_t>();
    base.tokenizer_sha256 = header.at("tokenizer_sha256").get<std::string>();
    base.text_sha256 = header.at("text_sha256").get<std::string>();
    base.chunks = header.at("chunks").get<std::vector<std::vector<int64_t>>>();
    const int64_t records = header.at("records").get<int64_t>();
    offset += length;
    const size_t size = 12 + 8 * static_cast<size_t>(base.k);
    if (base.k < 1 || records < 0 || data.size() - offset != static_cast<size_t>(records) * size) {
      throw RunnerError("kld-base file " + path + " is truncated: its records do not fit its length");
    }
    for (int64_t r = 0; r < records; ++r) {
      ReferenceTokens ref;
      ref.token = take<int32_t>(data, &offset, path);
      ref.logp_token = take<float>(data, &offset, path);
      ref.logp_rest = take<float>(data, &offset, path);
      ref.ids.resize(base.k);
      ref.logps.resize(base.k);
      for (int i = 0; i < base.k; ++i) ref.ids[i] = take<int32_t>(data, &offset, path);
      for (int i = 0; i < base.k; ++i) ref.logps[i] = take<float>(data, &offset, path);
      base.records.push_back(std::move(ref));
    }
  } catch (const nlohmann::json::exception& e) {
    throw RunnerError("kld-base file " + path + " is malformed: " + e.what());
  }
  const int first = first_scored(base.ctx, base.score);
  size_t record = 0;
  bool aligned = true;
  for (const auto& chunk : base.chunks) {
    for (size_t p = first; p < chunk.size(); ++p, ++record) {
      aligned = aligned && record < base.records.size() && base.records[record].token == chunk[p];
    }
  }
  if (!aligned || record != base.records.size()) {
    throw RunnerError("kld-base file " + path + " is malformed: its records are not the tokens its chunks score");
  }
  return base;
}

int first_scored(int ctx, const std::string& score) { return score == "all" ? 1 : ctx / 2 + 1; }

std::vector<std::vector<int64_t>> eval_chunks(const std::vector<int64_t>& ids, int ctx, int64_t bos_id) {
  if (ctx < 2) throw RunnerError("--ctx must be at least 2, got " + std::to_string(ctx));
  if (ids.size() < 2) {
    throw RunnerError("the evaluation text has " + std::to_string(ids.size()) + " token(s); at least 2 are needed");
  }
  const size_t count = ids.size() / ctx;
  if (count == 0) {
    throw RunnerError("the evaluation text has " + std::to_string(ids.size()) +
                      " tokens, fewer than one chunk of --ctx " + std::to_string(ctx) + ": lower --ctx");
  }
  std::vector<std::vector<int64_t>> chunks;
  for (size_t i = 0; i < count; ++i) {
    std::vector<int64_t> chunk(ids.begin() + i * ctx, ids.begin() + (i + 1) * ctx);
    if (bos_id >= 0) chunk[0] = bos_id;
    chunks.push_back(std::move(chunk));
  }
  return chunks;
}

void EvalScores::add(const float* logits, int vocab_size, int64_t token, const ReferenceTokens* reference) {
  const std::vector<double> logq = log_softmax(logits, vocab_size);
  nll_.push_back(-logq[token]);
  if (!reference) return;
  ref_nll_.push_back(-static_cast<double>(reference->logp_token));
  dp_.push_back(std::exp(logq[token]) - std::exp(static_cast<double>(reference->logp_token)));
  const auto top = std::max_element(logq.begin(), logq.end()) - logq.begin();
  same_top_ += top == reference->ids[0];
  // The top k tokens, then one bin for the rest (composite/eval/metrics.py's Reference.kld).
  double kld = 0, q_known = 0;
  for (size_t i = 0; i < reference->ids.size(); ++i) {
    const double lp = reference->logps[i], lq = logq[reference->ids[i]];
    kld += std::exp(lp) * (lp - lq);
    q_known += std::exp(lq);
  }
  if (std::isfinite(reference->logp_rest)) {
    const double q_rest = std::max(1.0 - q_known, 1e-30);
    kld += std::exp(static_cast<double>(reference->logp_rest)) * (reference->logp_rest - std::log(q_rest));
  }
  kld_.push_back(kld);
}

double percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  const double rank = (values.size() - 1) * p / 100;
  const size_t low = static_cast<size_t>(std::floor(rank));
  const size_t high = std::min(low + 1, values.size() - 1);
  return values[low] + (values[high] - values[low]) * (rank - low);
}

nlohmann::json EvalScores::summary() const {
  nlohmann::json out;
  double nll = 0;
  for (double v : nll_) nll += v;
  out["perplexity"] = std::exp(nll / nll_.size());
  out["tokens"] = nll_.size();
  if (!kld_.empty()) {
    double kld = 0, ref_nll = 0, dp2 = 0;
    for (double v : kld_) kld += v;
    for (double v : ref_nll_) ref_nll += v;
    for (double v : dp_) dp2 += v * v;
    out["kld_mean"] = kld / kld_.size();
    for (int p : {50, 90, 99}) out["kld_p" + std::to_string(p)] = percentile(kld_, p);
    out["kld_max"] = *std::max_element(kld_.begin(), kld_.end());
    out["top1_agreement"] = static_cast<double>(same_top_) / kld_.size();
    out["ppl_ratio"] = std::exp((nll - ref_nll) / nll_.size());
    out["rms_dp"] = std::sqrt(dp2 / dp_.size());
  }
  return out;
}

namespace {

// --stream: the text's tokens one decode call each, BOS in place of the first when the export adds
// one (as a chunk's), every next token scored.
nlohmann::json evaluate_stream(TokenChain& chain, const Manifest& manifest, std::vector<int64_t> ids,
                               ContextShift* shift) {
  if (ids.size() < 2)
    throw RunnerError("the evaluation text has " + std::to_string(ids.size()) + " token(s); at least 2 are needed");
  if (manifest.bos_id >= 0) ids[0] = manifest.bos_id;
  const size_t scored = shift ? ids.size() - 1 : std::min(ids.size() - 1, static_cast<size_t>(manifest.max_seq_len));
  EvalScores scores;
  double seconds = 0;
  int pos = 0;
  for (size_t i = 0; i < scored; ++i) {
    const auto started = std::chrono::steady_clock::now();
    if (shift) pos = shift->room(chain, pos, 1);
    const float* logits = chain.forward("decode", {ids[i]}, pos++);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    scores.add(logits, manifest.vocab_size, ids[i + 1], nullptr);
  }
  nlohmann::json result = scores.summary();
  result["tokens_per_s"] = seconds > 0 ? scored / seconds : 0.0;
  result["stream"] = true;
  result["ctx"] = manifest.max_seq_len;
  result["keep"] = shift ? shift->keep() : 0;
  result["evict"] = shift ? shift->evict() : 0;
  result["context_shifts"] = shift ? shift->shifts() : 0;
  std::printf(
      "perplexity %.4f over %zu tokens (streamed through a context of %d, keep %d, evict %d, %d shifts), "
      "%.1f tokens/s\n",
      result["perplexity"].get<double>(), scored, manifest.max_seq_len, result["keep"].get<int>(),
      result["evict"].get<int>(), result["context_shifts"].get<int>(), result["tokens_per_s"].get<double>());
  return result;
}

}  // namespace

nlohmann::json evaluate(TokenChain& chain, const Manifest& manifest, const Tokenizer& tokenizer,
                        const std::string& tokenizer_path, const EvalOptions& options, ContextShift* shift) {
  const std::string text = read_file(options.text_path, "the evaluation text");
  if (!valid_utf8(text)) throw RunnerError("the evaluation text " + options.text_path + " is not UTF-8");
  if (text.find_first_not_of(" \t\n\r\f\v") == std::string::npos) throw RunnerError("the evaluation text is empty");
  std::vector<int64_t> ids = tokenizer.encode(text, false);
  if (options.limit_tokens > 0 && ids.size() > static_cast<size_t>(options.limit_tokens)) {
    ids.resize(options.limit_tokens);
  }
  if (options.stream) return evaluate_stream(chain, manifest, std::move(ids), shift);
  const int ctx = options.ctx ? options.ctx : manifest.max_seq_len;
  if (ctx > manifest.max_seq_len) {
    throw RunnerError("--ctx " + std::to_string(ctx) + " is larger than this export's max_seq_len " +
                      std::to_string(manifest.max_seq_len));
  }
  const auto chunks = eval_chunks(ids, ctx, manifest.bos_id);
  KldBase base;
  if (!options.kld_base_path.empty()) {
    base = read_kld_base(options.kld_base_path);
    const std::string& path = options.kld_base_path;
    auto differs = [&](const std::string& what, const std::string& theirs, const std::string& ours) {
      if (theirs != ours) {
        throw RunnerError("kld-base file " + path + " was written for another " + what + " ('" + theirs +
                          "', this evaluation has '" + ours + "')");
      }
    };
    differs("tokenizer", base.tokenizer_sha256, sha256_file(tokenizer_path));
    differs("text", base.text_sha256, sha256_bytes(text));
    differs("vocabulary size", std::to_string(base.vocab_size), std::to_string(manifest.vocab_size));
    differs("--ctx", std::to_string(base.ctx), std::to_string(ctx));
    differs("--score", base.score, options.score);
    differs("BOS", std::to_string(base.bos_id), std::to_string(manifest.bos_id));
    if (base.chunks != chunks) {
      throw RunnerError("kld-base file " + path + " was written for other tokens (--limit_tokens or the text differ)");
    }
  }
  const int first = first_scored(ctx, options.score);
  EvalScores scores;
  size_t record = 0;
  double seconds = 0;
  int64_t run = 0;
  for (const auto& chunk : chunks) {
    for (int position = 0; position + 1 < ctx; ++position) {
      const auto started = std::chrono::steady_clock::now();
      const float* logits = chain.forward("decode", {chunk[position]}, position);
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      ++run;
      if (position + 1 < first) continue;
      scores.add(logits, manifest.vocab_size, chunk[position + 1],
                 base.records.empty() ? nullptr : &base.records[record++]);
    }
  }
  nlohmann::json result = scores.summary();
  result["tokens_per_s"] = seconds > 0 ? run / seconds : 0.0;
  result["chunks"] = chunks.size();
  result["ctx"] = ctx;
  result["score"] = options.score;
  std::printf("perplexity %.4f over %lld tokens (%zu chunks of %d, scoring %s), %.1f tokens/s\n",
              result["perplexity"].get<double>(), static_cast<long long>(result["tokens"].get<int64_t>()),
              chunks.size(), ctx, options.score.c_str(), result["tokens_per_s"].get<double>());
  if (result.contains("kld_mean")) {
    std::printf(
        "against the reference: mean KLD %.6f (p50 %.6f, p90 %.6f, p99 %.6f, max %.6f), top-1 agreement %.2f%%, "
        "PPL ratio %.4f, RMS \u0394p %.3f%%\n",
        result["kld_mean"].get<double>(), result["kld_p50"].get<double>(), result["kld_p90"].get<double>(),
        result["kld_p99"].get<double>(), result["kld_max"].get<double>(), 100 * result["top1_agreement"].get<double>(),
        result["ppl_ratio"].get<double>(), 100 * result["rms_dp"].get<double>());
  }
  return result;
}

}  // namespace composite
