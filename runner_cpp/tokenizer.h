// Tokenizers of the two LLaMA families: SentencePiece (Llama 2, via libsentencepiece) and
// Llama 3 tiktoken (base64 ranks file + the Llama 3 pre-tokenizer regex, via PCRE2).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace composite {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of `text`, with bos_id prepended when `bos` and the tokenizer has one.
  virtual std::vector<int64_t> encode(const std::string& text, bool bos) const = 0;
  // The raw bytes a token stands for; `previous` is the token before it (-1 at the start).
  virtual std::string token_bytes(int64_t token, int64_t previous) const = 0;
  virtual int vocab_size() const = 0;
  virtual int64_t bos_id() const = 0;
};

// "sentencepiece" or "tiktoken"; throws RunnerError for anything it cannot load.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, const std::string& type);

// Splits a byte stream into complete UTF-8 characters: bytes of a character spread over several
// tokens are held back until it is complete; invalid bytes become U+FFFD.
class Utf8Stream {
 public:
  std::string push(const std::string& bytes);
  std::string finish();  // whatever is still pending, invalid tail as U+FFFD

 private:
  std::string pending_;
};

// Decodes a whole sequence (tokens after the prompt) to text.
std::string decode(const Tokenizer& tokenizer, const std::vector<int64_t>& tokens, int64_t previous = -1);

}  // namespace composite
