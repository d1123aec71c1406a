// composite_tokenize TYPE PATH [--special-as-text]: reads a JSON list of texts on stdin and prints,
// for each, the token ids (with the tokenizer's BOS) and the text decoded back from them, as JSON.
// Used by the Python tests to hold the C++ tokenizers to the Python ones.
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>

#include "error.h"
#include "tokenizer.h"

int main(int argc, char** argv) {
  const bool special_as_text = argc == 4 && std::strcmp(argv[3], "--special-as-text") == 0;
  if (argc != 3 && !special_as_text) {
    std::cerr << "usage: composite_tokenize TYPE PATH [--special-as-text] < texts.json\n";
    return 2;
  }
  try {
    auto tokenizer = composite::load_tokenizer(argv[2], argv[1]);
    nlohmann::json texts = nlohmann::json::parse(std::cin), out = nlohmann::json::array();
    for (const auto& text : texts) {
      const auto body = tokenizer->encode(text.get<std::string>(), !special_as_text);
      std::vector<int64_t> ids;
      if (tokenizer->bos_id() >= 0) ids.push_back(tokenizer->bos_id());
      ids.insert(ids.end(), body.begin(), body.end());
      out.push_back({{"ids", ids}, {"text", composite::decode(*tokenizer, body, tokenizer->bos_id())}});
    }
    std::cout << out.dump() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  }
}
