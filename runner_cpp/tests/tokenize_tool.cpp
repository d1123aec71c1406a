// composite_tokenize TYPE PATH: reads a JSON list of texts on stdin and prints, for each, the
// token ids (with BOS) and the text decoded back from them, as JSON. Used by the Python tests
// to hold the C++ tokenizers to the Python ones.
#include <iostream>
#include <nlohmann/json.hpp>

#include "error.h"
#include "tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: composite_tokenize TYPE PATH < texts.json\n";
    return 2;
  }
  try {
    auto tokenizer = composite::load_tokenizer(argv[2], argv[1]);
    nlohmann::json texts = nlohmann::json::parse(std::cin), out = nlohmann::json::array();
    for (const auto& text : texts) {
      auto ids = tokenizer->encode(text.get<std::string>(), true);
      std::vector<int64_t> body(ids.begin() + 1, ids.end());
      out.push_back({{"ids", ids}, {"text", composite::decode(*tokenizer, body, ids.front())}});
    }
    std::cout << out.dump() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  }
}
