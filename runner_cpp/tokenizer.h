// The tokenizers of the LLaMA families: SentencePiece (Llama 2, via libsentencepiece), Llama 3
// tiktoken (base64 ranks file + the Llama 3 pre-tokenizer regex), and Hugging Face byte-level BPE
// tokenizer.json (Llama 3 / 3.2 folders on the Hub). composite/tokenizer.py is the Python twin.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace composite {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of `text` (no BOS). With `parse_special`, special-token strings in the text
  // ("<|eot_id|>", "</s>") become their ids, as Hugging Face and llama.cpp do; without it they are
  // encoded as text.
  std::vector<int64_t> encode(const std::string& text, bool parse_special = true) const;
  // The raw bytes a token stands for; `previous` is the token before it (-1 at the start).
  // Special tokens stand for nothing.
  virtual std::string token_bytes(int64_t token, int64_t previous) const = 0;
  virtual int vocab_size() const = 0;
  virtual int64_t bos_id() const = 0;  // -1: the tokenizer adds none

 protected:
  // Strings matched before the text is split into words. `special` ones are matched only when
  // parsing special tokens; others (added tokens of a tokenizer.json) always.
  struct AddedToken {
    std::string text;
    int64_t id;
    bool special;
  };
  void set_added_tokens(std::vector<AddedToken> tokens);  // matched longest first
  // Appends the ids of `text`, which holds no added token to match.
  virtual void encode_ordinary(const std::string& text, std::vector<int64_t>* out) const = 0;

 private:
  std::vector<AddedToken> added_;
  std::array<bool, 256> first_bytes_{};  // bytes an added token starts with: a quick skip
};

// "sentencepiece", "tiktoken" or "hf_json"; throws RunnerError for anything it cannot load.
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

bool valid_utf8(const std::string& text);

// Decodes a whole sequence (tokens after the prompt) to text.
std::string decode(const Tokenizer& tokenizer, const std::vector<int64_t>& tokens, int64_t previous = -1);

}  // namespace composite
