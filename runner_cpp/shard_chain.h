// Loads every shard of an export (mmap) and runs them in order for one call of a method.
// Inputs are bound to runner-owned memory (the programs do not plan their inputs), so the KV
// cache is handed to the shards without copies; only the new entries are copied into it.
#pragma once
#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "encoding.h"
#include "generate.h"
#include "kv_cache.h"
#include "manifest.h"

namespace composite {

// Throws RunnerError when this build cannot run the export's shards, before any is loaded: on x86,
// QNN shards whose decode and prefill share weights (the simulator cannot load them).
void check_loadable_here(const Manifest& manifest);

class ShardChain : public TokenChain {
 public:
  // Keeps its own copy of the manifest: the chain must not outlive what it describes.
  explicit ShardChain(Manifest manifest);

  // Runs `tokens` (1 .. width of `method`) at positions pos..; returns logits of the last token.
  const float* forward(const std::string& method, const std::vector<int64_t>& tokens, int pos) override;

  const float* forward_tree(const Tree& tree, int pos) override;
  void commit(const std::vector<int>& rows, int pos) override;

  // Time spent per shard and in KV writes since the last reset_stats().
  const std::vector<double>& shard_seconds() const override { return shard_seconds_; }
  double kv_write_seconds() const override { return kv_write_seconds_; }
  void reset_stats() override;
  void shift_cache(int keep, int evict, int used, const std::vector<float>& cos,
                   const std::vector<float>& sin) override {
    cache_.shift(keep, evict, used, cos, sin);
  }

 private:
  struct HiddenConversion {  // into shard i's hidden input, from shard i-1's hidden output
    Encoding from, to;
    size_t numel = 0;
    std::vector<float> buffer;                // float storage keeps every encoding aligned
    executorch::extension::TensorPtr tensor;  // null when both sides share an encoding
  };
  struct MethodBuffers {
    int width = 0;
    std::vector<int64_t> tokens, positions;
    int64_t logits_index = 0;  // the row of the last valid token, for the head shard's multi-token methods
    std::unique_ptr<AttentionMask> mask;
    executorch::extension::TensorPtr tokens_tensor, positions_tensor, mask_tensor, logits_index_tensor;
    std::vector<HiddenConversion> conversions;  // per shard
  };
  void check_method(const ShardInfo& shard, const std::string& method);
  // Every shard's `method` on the tokens and positions in b; count: its first new entries
  // written at pos, or -1 to hold every shard's outputs for commit(). -> the last output.
  const float* run(const std::string& method, MethodBuffers& b, int pos, int count);

  const Manifest manifest_;
  std::vector<std::unique_ptr<executorch::extension::Module>> modules_;
  KVCache cache_;
  std::vector<executorch::extension::TensorPtr> k_tensors_, v_tensors_;
  std::map<std::string, MethodBuffers> buffers_;
  std::vector<std::vector<executorch::runtime::EValue>> inputs_;  // per shard, reused every call
  std::vector<std::vector<executorch::runtime::EValue>> held_;    // per shard, a forward_tree call's outputs
  std::vector<double> shard_seconds_;
  double kv_write_seconds_ = 0;
};

}  // namespace composite
