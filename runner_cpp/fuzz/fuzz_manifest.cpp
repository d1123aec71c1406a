// libFuzzer: manifest.json text -> parse_manifest. Anything but a RunnerError is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "error.h"
#include "manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    composite::parse_manifest(std::string(reinterpret_cast<const char*>(data), size), "/nonexistent");
  } catch (const composite::RunnerError&) {
  }
  return 0;
}
