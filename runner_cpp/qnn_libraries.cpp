#include "qnn_libraries.h"

#include <dlfcn.h>

#include <cstdint>
#include <cstring>

#include "error.h"
#include "qnn_interface_layout.h"

namespace composite {

namespace {
// QnnInterface_getProviders and backendGetBuildId, declared here so no QNN header is needed; where
// the latter sits comes from qnn_interface_layout.h.
using GetProviders = uint64_t (*)(const void*** providers, uint32_t* count);
using GetBuildId = uint64_t (*)(const char** build_id);
constexpr size_t kFunctionTableOffset = COMPOSITE_QNN_FUNCTION_TABLE_OFFSET;
constexpr size_t kBackendGetBuildIdIndex = COMPOSITE_QNN_BACKEND_GET_BUILD_ID_INDEX;
}  // namespace

std::string qnn_runtime_build_id() {
  // Same name ExecuTorch's QNN backend opens, so this is the library the shards will run on.
  // The handle is kept: closing it could unload a library the backend is about to reuse.
  void* library = dlopen("libQnnHtp.so", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    throw RunnerError(std::string("cannot open libQnnHtp.so for the QNN shards (") + (why ? why : "unknown") +
                      "); on the host run `eval \"$(python -m composite.qnn_host env)\"` first, on a device set "
                      "LD_LIBRARY_PATH to the folder holding the QNN libraries");
  }
  auto get_providers = reinterpret_cast<GetProviders>(dlsym(library, "QnnInterface_getProviders"));
  const void** providers = nullptr;
  uint32_t count = 0;
  if (get_providers == nullptr || get_providers(&providers, &count) != 0 || count == 0) {
    throw RunnerError("libQnnHtp.so offers no QNN interface provider");
  }
  GetBuildId get_build_id = nullptr;
  std::memcpy(&get_build_id,
              static_cast<const char*>(providers[0]) + kFunctionTableOffset + kBackendGetBuildIdIndex * sizeof(void*),
              sizeof(get_build_id));
  const char* build_id = nullptr;
  if (get_build_id == nullptr || get_build_id(&build_id) != 0 || build_id == nullptr) {
    throw RunnerError("libQnnHtp.so did not report its build id");
  }
  return build_id;
}

}  // namespace composite
