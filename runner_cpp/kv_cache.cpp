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

// The same for the entries of `rows` of the new ones, in that order, to slots pos.. .
void copy_rows(char* k, const char* k_new, char* v, const char* v_new, size_t k_bytes, size_t v_bytes, int kv_heads,
               int head_dim, size_t S, int width, int pos, const std::vector<int>& rows) {
  const size_t channels = static_cast<size_t>(kv_heads) * head_dim;
  for (size_t c = 0; c < channels; ++c) {
    for (size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(k + (c * S + pos + i) * k_bytes, k_new + (c * width + rows[i]) * k_bytes, k_bytes);
    }
  }
  for (int h = 0; h < kv_heads; ++h) {
    for (size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(v + (h * S + pos + i) * head_dim * v_bytes,
                  v_new + (static_cast<size_t>(h) * width + rows[i]) * head_dim * v_bytes, v_bytes * head_dim);
    }
  }
}

}  // namespace

void KVCache::write_rows(int layer, const void* k_new, const void* v_new, int width, int pos,
                         const std::vector<int>& rows) {
  copy_rows(static_cast<char*>(k(layer)), static_cast<const char*>(k_new), static_cast<char*>(v(layer)),
            static_cast<const char*>(v_new), encodings_[layer].first.element_size(),
            encodings_[layer].second.element_size(), kv_heads_, head_dim_, max_seq_len_, width, pos, rows);
}

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

void KVCache::shift(int keep, int evict, int used, const std::vector<float>& cos, const std::vector<float>& sin) {
  const size_t S = max_seq_len_, moved = used - keep - evict, half = head_dim_ / 2;
  const Encoding float32{};
  std::vector<float> x1(moved), x2(moved), y1(moved), y2(moved);
  for (size_t layer = 0; layer < encodings_.size(); ++layer) {
    const auto& [k_encoding, v_encoding] = encodings_[layer];
    char* k_bytes = static_cast<char*>(k(static_cast<int>(layer)));
    const size_t kb = k_encoding.element_size();
    for (int h = 0; h < kv_heads_; ++h) {
      for (size_t i = 0; i < half; ++i) {
        char* row1 = k_bytes + ((h * head_dim_ + i) * S) * kb;
        char* row2 = k_bytes + ((h * head_dim_ + i + half) * S) * kb;
        convert(row1 + (keep + evict) * kb, k_encoding, x1.data(), float32, moved);
        convert(row2 + (keep + evict) * kb, k_encoding, x2.data(), float32, moved);
        const float c = cos[i], s = sin[i];
        for (size_t j = 0; j < moved; ++j) {
          y1[j] = x1[j] * c - x2[j] * s;
          y2[j] = x2[j] * c + x1[j] * s;
        }
        convert(y1.data(), float32, row1 + keep * kb, k_encoding, moved);
        convert(y2.data(), float32, row2 + keep * kb, k_encoding, moved);
        fill_zero(row1 + (used - evict) * kb, k_encoding, evict);
        fill_zero(row2 + (used - evict) * kb, k_encoding, evict);
      }
    }
    char* v_bytes = static_cast<char*>(v(static_cast<int>(layer)));
    const size_t row = head_dim_ * v_encoding.element_size();
    for (int h = 0; h < kv_heads_; ++h) {
      char* head = v_bytes + h * S * row;
      std::memmove(head + keep * row, head + (keep + evict) * row, moved * row);
      fill_zero(head + (used - evict) * row, v_encoding, static_cast<size_t>(evict) * head_dim_);
    }
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

float* AttentionMask::tree(int pos, const std::vector<int>& parents) {
  at(pos);
  const int row_len = max_seq_len_ + width_;
  // Row i sees itself and its ancestors; a padding row past the tree sees itself only.
  for (int r = 0; r < width_; ++r) {
    float* own = values_.data() + static_cast<size_t>(r) * row_len + max_seq_len_;
    std::fill(own, own + width_, hidden_);
    own[r] = 0.f;
    if (r < static_cast<int>(parents.size())) {
      for (int a = parents[r]; a >= 0; a = parents[a]) own[a] = 0.f;
    }
  }
  return values_.data();
}

}  // namespace composite
