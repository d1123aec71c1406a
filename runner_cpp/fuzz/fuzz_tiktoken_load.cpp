// libFuzzer: bytes as a tiktoken ranks file -> load, then encode and decode a fixed text.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "error.h"
#include "tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/composite_fuzz_ranks." + std::to_string(getpid());
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    auto tokenizer = composite::load_tokenizer(path, "tiktoken");
    const auto ids = tokenizer->encode("Once upon a time, 12 ünïcödé 😀 tokens\n\t!", true);
    composite::decode(*tokenizer, ids);
  } catch (const composite::RunnerError&) {
  }
  return 0;
}
