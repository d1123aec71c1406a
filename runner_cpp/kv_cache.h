// The KV cache the runner owns, and the additive attention mask per method.
// Layouts (manifest kv_cache): k [kv_heads, head_dim, S] (sequence last), v [kv_heads, S, head_dim].
// New entries for a call of T tokens: k [kv_heads, head_dim, T], v [kv_heads, T, head_dim].
#pragma once
#include <cstdint>
#include <vector>

namespace composite {

class KVCache {
 public:
  KVCache(int n_layers, int kv_heads, int head_dim, int max_seq_len);

  float* k(int layer) { return k_[layer].data(); }
  float* v(int layer) { return v_[layer].data(); }
  const float* k(int layer) const { return k_[layer].data(); }
  const float* v(int layer) const { return v_[layer].data(); }

  // Copies the first `count` of `width` new entries into slots pos .. pos+count-1, in place.
  void write(int layer, const float* k_new, const float* v_new, int width, int pos, int count);
  void clear();

 private:
  int kv_heads_, head_dim_, max_seq_len_;
  std::vector<std::vector<float>> k_, v_;
};

// Additive mask [T, S + T]: cache columns visible below the call's first position, the call's
// own T columns causal. Only the cache columns that change are rewritten.
class AttentionMask {
 public:
  AttentionMask(int width, int max_seq_len, float hidden);
  // The mask for a call whose first token is at `pos`.
  float* at(int pos);
  float* data() { return values_.data(); }

 private:
  int width_, max_seq_len_;
  float hidden_;
  int visible_until_ = 0;
  std::vector<float> values_;
};

}  // namespace composite
