#include "cpu_backend.h"

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/platform/runtime.h>

#include <cstdint>
#include <string>

#include "error.h"

// The executorch wheel ships libexecutorch_threadpool but not its headers; these are the
// non-virtual functions of that library this runner calls.
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  size_t get_thread_count() const;
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool
namespace executorch::extension::cpuinfo {
uint32_t get_num_performant_cores();
}  // namespace executorch::extension::cpuinfo

namespace composite {

int configure_cpu_backend(int threads) {
  namespace et = executorch::runtime;
  executorch::runtime::runtime_init();
  et::BackendOptions<1> xnnpack;
  xnnpack.set_option("weight_cache_enabled", true);
  if (et::set_option("XnnpackBackend", xnnpack.view()) != et::Error::Ok) {
    throw RunnerError("cannot enable the XNNPACK weight cache (is the XNNPACK backend linked?)");
  }
  auto* pool = executorch::extension::threadpool::get_threadpool();
  if (pool == nullptr) throw RunnerError("ExecuTorch's threadpool is unavailable");
  const uint32_t wanted =
      threads > 0 ? static_cast<uint32_t>(threads) : executorch::extension::cpuinfo::get_num_performant_cores();
  if (wanted > 0 && wanted != pool->get_thread_count() && !pool->_unsafe_reset_threadpool(wanted)) {
    throw RunnerError("cannot resize the threadpool to " + std::to_string(wanted) + " threads");
  }
  return static_cast<int>(pool->get_thread_count());
}

}  // namespace composite
