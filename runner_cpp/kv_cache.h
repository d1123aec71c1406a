// The KV cache the runner owns, and the additive attention mask per method.
// Layouts (manifest kv_cache): k [kv_heads, head_dim, S] (sequence last), v [kv_heads, S, head_dim].
// New entries for a call of T tokens: k [kv_heads, head_dim, T], v [kv_heads, T, head_dim].
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "encoding.h"

namespace composite {

class KVCache {
 public:
  // encodings: per layer, the (k, v) encoding its shard takes the cache in (float32, or quantized).
  KVCache(int kv_heads, int head_dim, int max_seq_len, std::vector<std::pair<Encoding, Encoding>> encodings);

  void* k(int layer) { return k_[layer].data(); }
  void* v(int layer) { return v_[layer].data(); }
  const void* k(int layer) const { return k_[layer].data(); }
  const void* v(int layer) const { return v_[layer].data(); }
  const std::pair<Encoding, Encoding>& encoding(int layer) const { return encodings_[layer]; }

  // Copies the first `count` of `width` new entries, in the layer's own encoding, into slots
  // pos .. pos+count-1, in place.
  void write(int layer, const void* k_new, const void* v_new, int width, int pos, int count);
  // The entries of `rows` of the `width` new ones, in that order, into slots pos.. (a verify
  // call's accepted path).
  void write_rows(int layer, const void* k_new, const void* v_new, int width, int pos, const std::vector<int>& rows);
  void clear();  // every slot back to the encoding of 0.0

  // Context shift (context_shift.h): slots keep+evict .. used-1 move down to keep .. used-evict-1,
  // their keys rotated by the angle whose cos/sin [head_dim/2] are given (in float32, re-encoded
  // in the layer's encoding); the freed slots are emptied. composite/runtime/kv_cache.py's shift
  // computes the same.
  void shift(int keep, int evict, int used, const std::vector<float>& cos, const std::vector<float>& sin);

 private:
  int kv_heads_, head_dim_, max_seq_len_;
  std::vector<std::pair<Encoding, Encoding>> encodings_;
  std::vector<std::vector<float>> k_, v_;  // float storage keeps every encoding's data aligned
};

// Additive mask [T, S + T]: cache columns visible below the call's first position, the call's
// own T columns causal. Only the cache columns that change are rewritten.
class AttentionMask {
 public:
  AttentionMask(int width, int max_seq_len, float hidden);
  // The mask for a call whose first token is at `pos`.
  float* at(int pos);
  // The mask for a verify call at `pos` whose rows form a tree (parents[i] < i, -1 for the root):
  // each row sees the cache below pos, itself and its ancestors.
  float* tree(int pos, const std::vector<int>& parents);
  float* data() { return values_.data(); }

 private:
  int width_, max_seq_len_;
  float hidden_;
  int visible_until_ = 0;
  std::vector<float> values_;
};

}  // namespace composite
