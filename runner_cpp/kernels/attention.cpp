// composite::attention.out, the attention of XNNPACK shards' layers (composite/ops/attention.py
// defines the operator and its reference): a call's T tokens attend to the valid prefix of the
// runner's cache and, causally, to their own new entries. Only the valid slots are read, each KV
// head once for its whole group of query heads, and groups are spread over ExecuTorch's threadpool.
//
//   q          [kv, rep * T, hd]  scaled by 1/sqrt(hd); row r * T + i is head g * rep + r, token i
//   k_cache    [kv, hd, S]        sequence last        v_cache  [kv, S, hd]
//   k_new      [kv, hd, T]                             v_new    [kv, T, hd]
//   mask       [T, S + T]         the runner's: the valid slots are the cache columns visible
//                                 (0.0) before the first hidden one; the call's own are causal
//   out        [kv, rep * T, hd]
// All float32, or q, caches, new entries and out float16 (an fp16 shard; scores and sums stay float32).
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace composite {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

// Every hot loop runs over contiguous memory, so the compiler vectorizes it; on x86 the loops are
// also built for x86-64-v3 (AVX2, FMA, F16C) and v4 (AVX-512) and picked at load time.
#if defined(__x86_64__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define COMPOSITE_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define COMPOSITE_VECTOR_CLONES
#endif

struct Shape {
  int64_t rows, t, hd, s, valid;
};

using executorch::aten::Half;

// scores[r][j] for the valid cache slots and the call's own entries: one pass over each row of K
// (a head dimension across the slots) for all of the group's query rows.
template <typename T>
COMPOSITE_VECTOR_CLONES void scores_of_group(const T* q, const T* k_cache, const T* k_new, const Shape& n,
                                             float* scores) {
  const int64_t width = n.valid + n.t;
  std::fill(scores, scores + n.rows * width, 0.f);
  // Four head dimensions per pass: a score row (in L1) is loaded and stored once per four FMAs.
  int64_t d = 0;
  for (; d + 4 <= n.hd; d += 4) {
    const T *k0 = k_cache + d * n.s, *k1 = k0 + n.s, *k2 = k1 + n.s, *k3 = k2 + n.s;
    const T *n0 = k_new + d * n.t, *n1 = n0 + n.t, *n2 = n1 + n.t, *n3 = n2 + n.t;
    for (int64_t r = 0; r < n.rows; ++r) {
      const T* qr = q + r * n.hd + d;
      const float q0 = static_cast<float>(qr[0]), q1 = static_cast<float>(qr[1]);
      const float q2 = static_cast<float>(qr[2]), q3 = static_cast<float>(qr[3]);
      float* row = scores + r * width;
      for (int64_t j = 0; j < n.valid; ++j) {
        row[j] += q0 * static_cast<float>(k0[j]) + q1 * static_cast<float>(k1[j]) + q2 * static_cast<float>(k2[j]) +
                  q3 * static_cast<float>(k3[j]);
      }
      const int64_t own = r % n.t + 1;  // causal: token i sees the call's entries 0..i
      for (int64_t j = 0; j < own; ++j) {
        row[n.valid + j] += q0 * static_cast<float>(n0[j]) + q1 * static_cast<float>(n1[j]) +
                            q2 * static_cast<float>(n2[j]) + q3 * static_cast<float>(n3[j]);
      }
    }
  }
  for (; d < n.hd; ++d) {
    const T* k_row = k_cache + d * n.s;
    const T* k_new_row = k_new + d * n.t;
    for (int64_t r = 0; r < n.rows; ++r) {
      const float qd = static_cast<float>(q[r * n.hd + d]);
      float* row = scores + r * width;
      for (int64_t j = 0; j < n.valid; ++j) row[j] += qd * static_cast<float>(k_row[j]);
      const int64_t own = r % n.t + 1;
      for (int64_t j = 0; j < own; ++j) row[n.valid + j] += qd * static_cast<float>(k_new_row[j]);
    }
  }
}

// out[r] = softmax(scores[r]) . V over the same slots.
template <typename T>
COMPOSITE_VECTOR_CLONES void weighted_values(float* scores, const T* v_cache, const T* v_new, const Shape& n,
                                             float* sums, T* out) {
  const int64_t width = n.valid + n.t;
  for (int64_t r = 0; r < n.rows; ++r) {
    float* row = scores + r * width;
    const int64_t own = r % n.t + 1;
    float top = -INFINITY;
    for (int64_t j = 0; j < n.valid; ++j) top = std::max(top, row[j]);
    for (int64_t j = 0; j < own; ++j) top = std::max(top, row[n.valid + j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n.valid; ++j) sum += row[j] = std::exp(row[j] - top);
    for (int64_t j = 0; j < own; ++j) sum += row[n.valid + j] = std::exp(row[n.valid + j] - top);
    const float inverse = 1.f / sum;
    std::fill(sums, sums + n.hd, 0.f);
    // Four slots per pass: the sums (in L1) are loaded and stored once per four FMAs.
    int64_t j = 0;
    for (; j + 4 <= n.valid; j += 4) {
      const float p0 = row[j] * inverse, p1 = row[j + 1] * inverse;
      const float p2 = row[j + 2] * inverse, p3 = row[j + 3] * inverse;
      const T *v0 = v_cache + j * n.hd, *v1 = v0 + n.hd, *v2 = v1 + n.hd, *v3 = v2 + n.hd;
      for (int64_t d = 0; d < n.hd; ++d) {
        sums[d] += p0 * static_cast<float>(v0[d]) + p1 * static_cast<float>(v1[d]) + p2 * static_cast<float>(v2[d]) +
                   p3 * static_cast<float>(v3[d]);
      }
    }
    for (; j < n.valid; ++j) {
      const float p = row[j] * inverse;
      const T* v = v_cache + j * n.hd;
      for (int64_t d = 0; d < n.hd; ++d) sums[d] += p * static_cast<float>(v[d]);
    }
    for (int64_t j = 0; j < own; ++j) {
      const float p = row[n.valid + j] * inverse;
      const T* v = v_new + j * n.hd;
      for (int64_t d = 0; d < n.hd; ++d) sums[d] += p * static_cast<float>(v[d]);
    }
    T* o = out + r * n.hd;
    for (int64_t d = 0; d < n.hd; ++d) o[d] = static_cast<T>(sums[d]);
  }
}

template <typename T>
bool attend(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& k_new, const Tensor& v_new,
            const Shape& n, int64_t kv, Tensor& out) {
  const auto* qd = reinterpret_cast<const T*>(q.const_data_ptr());
  const auto* kc = reinterpret_cast<const T*>(k_cache.const_data_ptr());
  const auto* vc = reinterpret_cast<const T*>(v_cache.const_data_ptr());
  const auto* kn = reinterpret_cast<const T*>(k_new.const_data_ptr());
  const auto* vn = reinterpret_cast<const T*>(v_new.const_data_ptr());
  auto* o = reinterpret_cast<T*>(out.mutable_data_ptr());
  const int64_t rows = n.rows, hd = n.hd, s = n.s, t = n.t;
  return executorch::extension::parallel_for(0, kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(rows * (n.valid + t)));
    std::vector<float> sums(static_cast<size_t>(hd));
    for (int64_t g = begin; g < end; ++g) {
      scores_of_group(qd + g * rows * hd, kc + g * hd * s, kn + g * hd * t, n, scores.data());
      weighted_values(scores.data(), vc + g * s * hd, vn + g * t * hd, n, sums.data(), o + g * rows * hd);
    }
  });
}

Tensor& attention_out(KernelRuntimeContext& context, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      const Tensor& k_new, const Tensor& v_new, const Tensor& mask, Tensor& out) {
  const bool shapes_fit = q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && k_new.dim() == 3 &&
                          v_new.dim() == 3 && out.dim() == 3 && mask.dim() == 2;
  ET_KERNEL_CHECK_MSG(context, shapes_fit, InvalidArgument, out, "composite::attention: tensors of the wrong rank");
  const int64_t kv = q.size(0), rows = q.size(1), hd = q.size(2), s = k_cache.size(2), t = k_new.size(2);
  const bool consistent = t > 0 && rows % t == 0 && k_cache.size(0) == kv && k_cache.size(1) == hd &&
                          v_cache.size(0) == kv && v_cache.size(1) == s && v_cache.size(2) == hd &&
                          k_new.size(0) == kv && k_new.size(1) == hd && v_new.size(0) == kv && v_new.size(1) == t &&
                          v_new.size(2) == hd && mask.size(0) == t && mask.size(1) == s + t && out.size(0) == kv &&
                          out.size(1) == rows && out.size(2) == hd;
  ET_KERNEL_CHECK_MSG(context, consistent, InvalidArgument, out, "composite::attention: shapes do not agree");
  const ScalarType type = q.scalar_type();
  const bool dtypes = (type == ScalarType::Float || type == ScalarType::Half) && k_cache.scalar_type() == type &&
                      v_cache.scalar_type() == type && k_new.scalar_type() == type && v_new.scalar_type() == type &&
                      out.scalar_type() == type &&
                      (mask.scalar_type() == ScalarType::Float || mask.scalar_type() == type);
  ET_KERNEL_CHECK_MSG(context, dtypes, InvalidType, out,
                      "composite::attention: takes all float32 or all float16 tensors (the mask may be float32)");
  // The valid slots: the cache columns before the first one the mask hides.
  int64_t valid = 0;
  if (mask.scalar_type() == ScalarType::Float) {
    const float* first_row = mask.const_data_ptr<float>();
    while (valid < s && first_row[valid] == 0.f) ++valid;
  } else {
    const auto* first_row = reinterpret_cast<const Half*>(mask.const_data_ptr());
    while (valid < s && static_cast<float>(first_row[valid]) == 0.f) ++valid;
  }
  const Shape n{rows, t, hd, s, valid};
  const bool ran = type == ScalarType::Float ? attend<float>(q, k_cache, v_cache, k_new, v_new, n, kv, out)
                                             : attend<Half>(q, k_cache, v_cache, k_new, v_new, n, kv, out);
  ET_KERNEL_CHECK_MSG(context, ran, Internal, out, "composite::attention: the threadpool failed");
  return out;
}

}  // namespace
}  // namespace composite

EXECUTORCH_LIBRARY(composite, "attention.out", composite::attention_out);
