// Hugging Face tokenizer.json with a byte-level BPE model (Llama 3 / 3.2 on the Hub).
#pragma once
#include <memory>
#include <string>

#include "tokenizer.h"

namespace composite {

// Throws RunnerError naming the file and the first part of it this reader does not support.
std::unique_ptr<Tokenizer> load_hf_json_tokenizer(const std::string& path);

}  // namespace composite
