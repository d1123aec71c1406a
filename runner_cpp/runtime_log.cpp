// ExecuTorch's log sink for this program. The runtime's default prints every Info line (CPU probe
// details on every start); composite_runner shows errors only, unless COMPOSITE_LOG=info.
// ExecuTorch declares this function weak, so this definition replaces its default.
#include <executorch/runtime/platform/platform.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

extern "C" void et_pal_emit_log_message(et_timestamp_t /*timestamp*/, et_pal_log_level_t level, const char* filename,
                                        const char* /*function*/, size_t line, const char* message, size_t length) {
  static const bool verbose = [] {
    const char* setting = std::getenv("COMPOSITE_LOG");
    return setting != nullptr && std::strcmp(setting, "info") == 0;
  }();
  if (!verbose && level != kError && level != kFatal) return;
  std::fprintf(stderr, "executorch %c %s:%zu] %.*s\n", static_cast<char>(level), filename, line,
               static_cast<int>(length), message);
}
