// CPU-side runtime settings: the threadpool XNNPACK runs on, and XNNPACK's packed-weight cache.
#pragma once

namespace composite {

// Sizes ExecuTorch's threadpool (threads <= 0: the performant cores, as ExecuTorch's llama runner
// does) and turns on XNNPACK's weight cache, so the decode and prefill methods of a shard pack
// their shared weights once. Call before loading any program. Returns the thread count in use.
int configure_cpu_backend(int threads);

}  // namespace composite
