#include "tokenizer.h"

#include <sentencepiece_processor.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "error.h"
#include "hf_tokenizer.h"
#include "pcre_regex.h"

namespace composite {

namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) {
    const auto status = processor_.Load(path);
    if (!status.ok()) throw RunnerError("tokenizer " + path + " is not a SentencePiece model: " + status.ToString());
    // SentencePiece itself reads "<s>" in text as characters; the control and unknown pieces are
    // the special tokens Hugging Face's Llama tokenizer and llama.cpp parse in a prompt.
    std::vector<AddedToken> specials;
    for (int id = 0; id < processor_.GetPieceSize(); ++id) {
      if (processor_.IsControl(id) || processor_.IsUnknown(id))
        specials.push_back({processor_.IdToPiece(id), id, true});
    }
    set_added_tokens(std::move(specials));
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
  void encode_ordinary(const std::string& text, std::vector<int64_t>* out) const override {
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok()) throw RunnerError("cannot tokenize the prompt: " + status.ToString());
    out->insert(out->end(), ids.begin(), ids.end());
  }

  sentencepiece::SentencePieceProcessor processor_;
};

// Llama 3's pre-tokenizer: words, up-to-three-digit numbers, punctuation runs, whitespace.
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr int kLlama3SpecialTokens = 256;

// Llama 3's special tokens in id order after the ranks (pytorch_tokenizers' LLAMA_SPECIAL_TOKENS).
std::vector<std::string> llama3_special_tokens() {
  std::vector<std::string> names = {"<|begin_of_text|>",
                                    "<|end_of_text|>",
                                    "<|reserved_special_token_0|>",
                                    "<|reserved_special_token_1|>",
                                    "<|finetune_right_pad_id|>",
                                    "<|step_id|>",
                                    "<|start_header_id|>",
                                    "<|end_header_id|>",
                                    "<|eom_id|>",
                                    "<|eot_id|>",
                                    "<|python_tag|>",
                                    "<|image|>"};
  for (int i = 2; names.size() < kLlama3SpecialTokens; ++i) {
    names.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
  }
  return names;
}

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
    std::vector<AddedToken> specials;
    for (const std::string& name : llama3_special_tokens()) {
      specials.push_back({name, base_tokens_ + static_cast<int64_t>(specials.size()), true});
    }
    set_added_tokens(std::move(specials));
  }

  std::string token_bytes(int64_t token, int64_t) const override {
    if (token >= 0 && token < base_tokens_) return decoder_[token];
    return "";  // special tokens print nothing
  }
  int vocab_size() const override { return base_tokens_ + kLlama3SpecialTokens; }
  int64_t bos_id() const override { return base_tokens_; }  // <|begin_of_text|>, the first special token

 private:
  void encode_ordinary(const std::string& text, std::vector<int64_t>* out) const override {
    for (const std::string& word : split_isolated(pattern_, text)) byte_pair_encode(word, out);
  }

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
  Regex pattern_{kLlama3Pattern, false, "the Llama 3 pre-tokenizer"};
};

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, const std::string& type) {
  std::ifstream probe(path);
  if (!probe) throw RunnerError("tokenizer " + path + " does not exist or is unreadable");
  if (type == "sentencepiece") return std::make_unique<SentencePieceTokenizer>(path);
  if (type == "tiktoken") return std::make_unique<TiktokenTokenizer>(path);
  if (type == "hf_json") return load_hf_json_tokenizer(path);
  throw RunnerError("tokenizer type '" + type +
                    "' is not supported by composite_runner (sentencepiece, tiktoken, hf_json are)");
}

void Tokenizer::set_added_tokens(std::vector<AddedToken> tokens) {
  tokens.erase(std::remove_if(tokens.begin(), tokens.end(), [](const AddedToken& t) { return t.text.empty(); }),
               tokens.end());
  std::stable_sort(tokens.begin(), tokens.end(),
                   [](const AddedToken& a, const AddedToken& b) { return a.text.size() > b.text.size(); });
  added_ = std::move(tokens);
  first_bytes_.fill(false);
  for (const AddedToken& token : added_) first_bytes_[static_cast<unsigned char>(token.text[0])] = true;
}

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool parse_special) const {
  if (!valid_utf8(text)) throw RunnerError("the prompt is not valid UTF-8");
  std::vector<int64_t> out;
  // Leftmost match first, the longest at one position; the text between matches is ordinary.
  size_t plain_start = 0;
  for (size_t at = 0; at < text.size();) {
    const AddedToken* found = nullptr;
    if (!first_bytes_[static_cast<unsigned char>(text[at])]) {
      ++at;
      continue;
    }
    for (const AddedToken& token : added_) {
      if ((parse_special || !token.special) && text.compare(at, token.text.size(), token.text) == 0) {
        found = &token;
        break;
      }
    }
    if (found == nullptr) {
      ++at;
      continue;
    }
    if (at > plain_start) encode_ordinary(text.substr(plain_start, at - plain_start), &out);
    out.push_back(found->id);
    at += found->text.size();
    plain_start = at;
  }
  if (plain_start < text.size()) encode_ordinary(text.substr(plain_start), &out);
  return out;
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

// Well-formed UTF-8 as RFC 3629 defines it: no overlong forms, no surrogates, nothing past
// U+10FFFF. PCRE2 matches without re-checking (PCRE2_NO_UTF_CHECK), so this is its guard.
bool valid_utf8(const std::string& text) {
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char lead = static_cast<unsigned char>(text[i]);
    if (lead < 0x80) {
      ++i;
      continue;
    }
    size_t extra = 0;
    unsigned char low = 0x80, high = 0xBF;  // the range of the second byte
    if (lead >= 0xC2 && lead <= 0xDF) {
      extra = 1;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      extra = 2;
      if (lead == 0xE0) low = 0xA0;   // overlong
      if (lead == 0xED) high = 0x9F;  // surrogates
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      extra = 3;
      if (lead == 0xF0) low = 0x90;   // overlong
      if (lead == 0xF4) high = 0x8F;  // beyond U+10FFFF
    } else {
      return false;
    }
    if (n - i <= extra) return false;
    const unsigned char second = static_cast<unsigned char>(text[i + 1]);
    if (second < low || second > high) return false;
    for (size_t k = 2; k <= extra; ++k) {
      if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return false;
    }
    i += extra + 1;
  }
  return true;
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
