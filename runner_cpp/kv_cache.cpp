#include "kv_cache.h"

#include <algorithm>
#include <cstring>

namespace composite {

KVCache::KVCache(int kv_heads, int head_dim, int max_seq_len, std::vector<std::pair<Encoding, Encoding>> encodings)
    : kv_heads_(kv_heads), head_dim_(head_dim), max_seq_len_(max_seq_len), encodings_(std::move(encodings)) {
  const size_t per_layer = static_cast<size_t>(kv_heads) * head_dim * max_seq_len;
  for (const auto& [k, v] : encodings_) {
    k_.emplace_back((per_layer * k.element_size() + 3) / 4);
    v_.emplace_back((per_layer * v.element_size() + 3) / 4);
  }
  clear();
}

namespace {

// k [kv, hd, S] <- k_new [kv, hd, width]; v [kv, S, hd] <- v_new [kv, width, hd]; `bytes` per element.
void copy_entries(char* k, const char* k_new, char* v, const char* v_new, size_t k_bytes, size_t v_bytes, int kv_heads,
                  int head_dim, size_t S, int width, int pos, int count) {
  const size_t rows = static_cast<size_t>(kv_heads) * head_dim;
  for (size_t row = 0; row < rows; ++row) {
    std::memcpy(k + (row * S + pos) * k_bytes, k_new + row * width * k_bytes, k_bytes * count);
  }
  for (int h = 0; h < kv_heads; ++h) {
    std::memcpy(v + (h * S + pos) * head_dim * v_bytes, v_new + static_cast<size_t>(h) * width * head_dim * v_bytes,
                v_bytes * count * head_dim);
  }
}

}  // namespace

void KVCache::write(int layer, const void* k_new, const void* v_new, int width, int pos, int count) {
  copy_entries(static_cast<char*>(k(layer)), static_cast<const char*>(k_new), static_cast<char*>(v(layer)),
               static_cast<const char*>(v_new), encodings_[layer].first.element_size(),
               encodings_[layer].second.element_size(), kv_heads_, head_dim_, max_seq_len_, width, pos, count);
}

void KVCache::clear() {
  const size_t per_layer = static_cast<size_t>(kv_heads_) * head_dim_ * max_seq_len_;
  for (size_t layer = 0; layer < encodings_.size(); ++layer) {
    fill_zero(k_[layer].data(), encodings_[layer].first, per_layer);
    fill_zero(v_[layer].data(), encodings_[layer].second, per_layer);
  }
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
