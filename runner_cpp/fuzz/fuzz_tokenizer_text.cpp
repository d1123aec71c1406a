// libFuzzer: arbitrary bytes as prompt text and as token ids, through the three tokenizers (loaded
// once from COMPOSITE_FUZZ_SENTENCEPIECE, COMPOSITE_FUZZ_TIKTOKEN and COMPOSITE_FUZZ_HF_JSON) and the
// UTF-8 stream.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "error.h"
#include "tokenizer.h"

namespace {
std::unique_ptr<composite::Tokenizer> load(const char* variable, const char* type) {
  const char* path = std::getenv(variable);
  if (path == nullptr) std::abort();  // scripts/fuzz.sh sets all three
  return composite::load_tokenizer(path, type);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto sentencepiece = load("COMPOSITE_FUZZ_SENTENCEPIECE", "sentencepiece");
  static const auto tiktoken = load("COMPOSITE_FUZZ_TIKTOKEN", "tiktoken");
  static const auto hf_json = load("COMPOSITE_FUZZ_HF_JSON", "hf_json");
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<int64_t> ids;
  for (size_t i = 0; i + 1 < size; i += 2) ids.push_back(static_cast<int16_t>(data[i] | (data[i + 1] << 8)));
  for (const auto* tokenizer : {sentencepiece.get(), tiktoken.get(), hf_json.get()}) {
    for (bool parse_special : {true, false}) {
      try {
        tokenizer->encode(text, parse_special);
      } catch (const composite::RunnerError&) {
      }
    }
    composite::decode(*tokenizer, ids);
    composite::Utf8Stream stream;
    int64_t previous = -1;
    for (int64_t id : ids) {
      stream.push(tokenizer->token_bytes(id, previous));
      previous = id;
    }
    stream.finish();
  }
  return 0;
}
