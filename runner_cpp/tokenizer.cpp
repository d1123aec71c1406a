#include "tokenizer.h"

#include <memory>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <sentencepiece_processor.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "error.h"

namespace composite {

namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) {
    const auto status = processor_.Load(path);
    if (!status.ok()) throw RunnerError("tokenizer " + path + " is not a SentencePiece model: " + status.ToString());
  }
  std::vector<int64_t> encode(const std::string& text, bool bos) const override {
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok()) throw RunnerError("cannot tokenize the prompt: " + status.ToString());
    std::vector<int64_t> out;
    if (bos && processor_.bos_id() >= 0) out.push_back(processor_.bos_id());
    out.insert(out.end(), ids.begin(), ids.end());
    return out;
  }
  std::string token_bytes(int64_t token, int64_t previous) const override {
    if (token < 0 || token >= processor_.GetPieceSize()) return "";
    const int id = static_cast<int>(token);
    if (processor_.IsControl(id)) return "";
    if (processor_.IsUnknown(id)) return " \xE2\x81\x87 ";  // what SentencePiece prints for <unk>
    const std::string& piece = processor_.IdToPiece(id);
    if (processor_.IsByte(id)) return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
    std::string text;
    static const std::string kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's word boundary
    for (size_t i = 0; i < piece.size();) {
      if (piece.compare(i, kSpace.size(), kSpace) == 0) {
        text += ' ';
        i += kSpace.size();
      } else {
        text += piece[i++];
      }
    }
    // SentencePiece drops the boundary space at the start of a text.
    // (A model with a padded vocabulary can produce ids past the tokenizer's pieces.)
    const bool at_start =
        previous < 0 || (previous < processor_.GetPieceSize() && processor_.IsControl(static_cast<int>(previous)));
    if (at_start && !text.empty() && text[0] == ' ') text.erase(0, 1);
    return text;
  }
  int vocab_size() const override { return processor_.GetPieceSize(); }
  int64_t bos_id() const override { return processor_.bos_id(); }

 private:
  sentencepiece::SentencePieceProcessor processor_;
};

// Llama 3's pre-tokenizer: words, up-to-three-digit numbers, punctuation runs, whitespace.
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr int kLlama3SpecialTokens = 256;

std::string base64_decode(const std::string& in, bool* ok) {
  static int table[256];
  static bool ready = false;
  if (!ready) {
    for (int& t : table) t = -1;
    const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 64; ++i) table[static_cast<unsigned char>(alphabet[i])] = i;
    ready = true;
  }
  std::string out;
  int value = 0, bits = 0;
  size_t padding = 0;
  *ok = !in.empty() && in.size() % 4 == 0;
  for (char c : in) {
    if (c == '=') {
      ++padding;
      continue;
    }
    if (padding || table[static_cast<unsigned char>(c)] < 0) {
      *ok = false;
      return "";
    }
    value = (value << 6) | table[static_cast<unsigned char>(c)];
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((value >> bits) & 0xFF);
      value &= (1 << bits) - 1;  // keep only the bits not yet emitted
    }
  }
  if (padding > 2) *ok = false;
  return out;
}

class TiktokenTokenizer : public Tokenizer {
 public:
  explicit TiktokenTokenizer(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw RunnerError("cannot read tokenizer " + path);
    std::string line;
    int line_number = 0;
    long max_rank = -1;
    while (std::getline(in, line)) {
      ++line_number;
      if (line.empty()) continue;
      const auto space = line.find(' ');
      bool ok = space != std::string::npos;
      std::string bytes = ok ? base64_decode(line.substr(0, space), &ok) : "";
      long rank = -1;
      if (ok) {
        char* end = nullptr;
        rank = std::strtol(line.c_str() + space + 1, &end, 10);
        ok = end != line.c_str() + space + 1 && *end == '\0' && rank >= 0 && rank < INT_MAX - kLlama3SpecialTokens;
      }
      if (!ok)
        throw RunnerError("tokenizer " + path + " line " + std::to_string(line_number) + " is not '<base64> <rank>'");
      encoder_[bytes] = static_cast<int>(rank);
      max_rank = std::max(max_rank, rank);
    }
    if (encoder_.empty()) throw RunnerError("tokenizer " + path + " holds no tokens");
    // Ranks number the tokens 0..N-1; a file whose ranks run far past its token count is not a
    // tiktoken model (and would make the decoder table arbitrarily large).
    if (static_cast<size_t>(max_rank) >= 2 * encoder_.size() + 1024) {
      throw RunnerError("tokenizer " + path + " has rank " + std::to_string(max_rank) + " for only " +
                        std::to_string(encoder_.size()) + " tokens: not a tiktoken ranks file");
    }
    decoder_.resize(static_cast<size_t>(max_rank) + 1);
    for (const auto& [bytes, rank] : encoder_) decoder_[rank] = bytes;
    base_tokens_ = static_cast<int>(decoder_.size());
    int error_code = 0;
    PCRE2_SIZE error_offset = 0;
    regex_.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kLlama3Pattern), PCRE2_ZERO_TERMINATED,
                               PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr));
    if (!regex_) throw RunnerError("PCRE2 cannot compile the Llama 3 pattern");
    match_.reset(pcre2_match_data_create_from_pattern(regex_.get(), nullptr));
  }

  std::vector<int64_t> encode(const std::string& text, bool bos) const override {
    std::vector<int64_t> out;
    if (bos) out.push_back(bos_id());
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    PCRE2_SIZE offset = 0;
    while (offset < text.size()) {
      // The first match validates the whole text as UTF-8; later ones need not repeat it.
      const int rc = pcre2_match(regex_.get(), subject, text.size(), offset, offset == 0 ? 0 : PCRE2_NO_UTF_CHECK,
                                 match_.get(), nullptr);
      if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21) {
        throw RunnerError("the prompt is not valid UTF-8");
      }
      if (rc < 0) break;
      const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match_.get());
      if (span[1] == span[0]) break;  // the pattern always consumes; guard against a stall
      byte_pair_encode(text.substr(span[0], span[1] - span[0]), &out);
      offset = span[1];
    }
    return out;
  }

  std::string token_bytes(int64_t token, int64_t) const override {
    if (token >= 0 && token < base_tokens_) return decoder_[token];
    return "";  // special tokens print nothing
  }
  int vocab_size() const override { return base_tokens_ + kLlama3SpecialTokens; }
  int64_t bos_id() const override { return base_tokens_; }  // <|begin_of_text|>, the first special token

 private:
  // Merges the lowest-ranked adjacent pair until no pair is in the vocabulary.
  void byte_pair_encode(const std::string& piece, std::vector<int64_t>* out) const {
    const auto whole = encoder_.find(piece);
    if (whole != encoder_.end()) {
      out->push_back(whole->second);
      return;
    }
    std::vector<size_t> starts(piece.size() + 1);
    for (size_t i = 0; i <= piece.size(); ++i) starts[i] = i;
    auto rank_of = [&](size_t i) -> int {  // rank of parts i and i+1 merged
      if (i + 2 >= starts.size()) return INT_MAX;
      const auto found = encoder_.find(piece.substr(starts[i], starts[i + 2] - starts[i]));
      return found == encoder_.end() ? INT_MAX : found->second;
    };
    while (starts.size() > 2) {
      int best = INT_MAX;
      size_t at = 0;
      for (size_t i = 0; i + 2 < starts.size(); ++i) {
        const int r = rank_of(i);
        if (r < best) best = r, at = i;
      }
      if (best == INT_MAX) break;
      starts.erase(starts.begin() + at + 1);
    }
    for (size_t i = 0; i + 1 < starts.size(); ++i) {
      const auto found = encoder_.find(piece.substr(starts[i], starts[i + 1] - starts[i]));
      if (found == encoder_.end()) throw RunnerError("the tiktoken file lacks a single-byte token");
      out->push_back(found->second);
    }
  }

  std::unordered_map<std::string, int> encoder_;
  std::vector<std::string> decoder_;
  int base_tokens_ = 0;
  // Owned by these handles alone: the tokenizer can be moved but not copied.
  std::unique_ptr<pcre2_code, decltype(&pcre2_code_free)> regex_{nullptr, pcre2_code_free};
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match_{nullptr, pcre2_match_data_free};
};

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, const std::string& type) {
  std::ifstream probe(path);
  if (!probe) throw RunnerError("tokenizer " + path + " does not exist or is unreadable");
  if (type == "sentencepiece") return std::make_unique<SentencePieceTokenizer>(path);
  if (type == "tiktoken") return std::make_unique<TiktokenTokenizer>(path);
  throw RunnerError("tokenizer type '" + type + "' is not supported by composite_runner (sentencepiece, tiktoken are)");
}

namespace {

// Length of the UTF-8 sequence a lead byte starts, 0 if it cannot start one.
int sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

const char kReplacement[] = "\xEF\xBF\xBD";

}  // namespace

std::string Utf8Stream::push(const std::string& bytes) {
  pending_ += bytes;
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const int length = sequence_length(static_cast<unsigned char>(pending_[i]));
    if (length == 0) {
      out += kReplacement;
      ++i;
      continue;
    }
    if (i + length > pending_.size()) {
      // Incomplete: keep it if every byte so far is a continuation byte, else it is broken.
      bool continuing = true;
      for (size_t j = i + 1; j < pending_.size(); ++j)
        continuing &= (static_cast<unsigned char>(pending_[j]) & 0xC0) == 0x80;
      if (continuing) break;
      out += kReplacement;
      ++i;
      continue;
    }
    bool valid = true;
    for (int j = 1; j < length; ++j) valid &= (static_cast<unsigned char>(pending_[i + j]) & 0xC0) == 0x80;
    if (!valid) {
      out += kReplacement;
      ++i;
      continue;
    }
    out.append(pending_, i, length);
    i += length;
  }
  pending_.erase(0, i);
  return out;
}

std::string Utf8Stream::finish() {
  std::string out = pending_.empty() ? "" : kReplacement;
  pending_.clear();
  return out;
}

std::string decode(const Tokenizer& tokenizer, const std::vector<int64_t>& tokens, int64_t previous) {
  Utf8Stream stream;
  std::string text;
  for (int64_t t : tokens) {
    text += stream.push(tokenizer.token_bytes(t, previous));
    previous = t;
  }
  return text + stream.finish();
}

}  // namespace composite
