#include "kv_cache.h"

#include <algorithm>
#include <cstring>

namespace composite {

KVCache::KVCache(int n_layers, int kv_heads, int head_dim, int max_seq_len)
    : kv_heads_(kv_heads), head_dim_(head_dim), max_seq_len_(max_seq_len) {
  const size_t per_layer = static_cast<size_t>(kv_heads) * head_dim * max_seq_len;
  k_.assign(n_layers, std::vector<float>(per_layer, 0.f));
  v_.assign(n_layers, std::vector<float>(per_layer, 0.f));
}

void KVCache::write(int layer, const float* k_new, const float* v_new, int width, int pos, int count) {
  float* k = k_[layer].data();
  float* v = v_[layer].data();
  const size_t S = max_seq_len_;
  const size_t rows = static_cast<size_t>(kv_heads_) * head_dim_;
  for (size_t row = 0; row < rows; ++row) {
    std::memcpy(k + row * S + pos, k_new + row * width, sizeof(float) * count);
  }
  for (int h = 0; h < kv_heads_; ++h) {
    std::memcpy(v + (h * S + pos) * head_dim_, v_new + static_cast<size_t>(h) * width * head_dim_,
                sizeof(float) * count * head_dim_);
  }
}

void KVCache::clear() {
  for (auto& t : k_) std::fill(t.begin(), t.end(), 0.f);
  for (auto& t : v_) std::fill(t.begin(), t.end(), 0.f);
}

AttentionMask::AttentionMask(int width, int max_seq_len, float hidden)
    : width_(width),
      max_seq_len_(max_seq_len),
      hidden_(hidden),
      values_(static_cast<size_t>(width) * (max_seq_len + width), hidden) {
  const int row_len = max_seq_len + width;
  for (int r = 0; r < width; ++r) {
    for (int c = 0; c <= r; ++c) values_[static_cast<size_t>(r) * row_len + max_seq_len + c] = 0.f;
  }
}

float* AttentionMask::at(int pos) {
  if (pos != visible_until_) {
    const int row_len = max_seq_len_ + width_;
    const int lo = std::min(pos, visible_until_), hi = std::max(pos, visible_until_);
    const float value = pos > visible_until_ ? 0.f : hidden_;
    for (int r = 0; r < width_; ++r) {
      std::fill(values_.begin() + static_cast<size_t>(r) * row_len + lo,
                values_.begin() + static_cast<size_t>(r) * row_len + hi, value);
    }
    visible_until_ = pos;
  }
  return values_.data();
}

}  // namespace composite
