// The QNN HTP library this process will load, asked for its build id, so that a runtime that
// differs from the one the shards were compiled with is reported before the first token.
#pragma once
#include <string>

namespace composite {

// Build id of the "libQnnHtp.so" the loader finds (e.g. "v2.51.0.260929181845"); throws
// RunnerError naming the problem when the library cannot be opened or does not answer.
std::string qnn_runtime_build_id();

}  // namespace composite
