// libFuzzer: bytes as a tokenizer.json -> load, then encode and decode a fixed text. Anything but
// a RunnerError is a bug.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include "error.h"
#include "tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/composite_fuzz_tokenizer." + std::to_string(getpid()) + ".json";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    auto tokenizer = composite::load_tokenizer(path, "hf_json");
    const auto ids = tokenizer->encode("Once upon a time, 12 ünïcödé 😀<|eot_id|> tokens\n\t!");
    composite::decode(*tokenizer, ids);
    tokenizer->encode("<s> plain </s>", false);
  } catch (const composite::RunnerError&) {
  }
  return 0;
}
