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
// also built for AVX2 and AVX-512 and picked at load time.
#if defined(__x86_64__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define COMPOSITE_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define COMPOSITE_VECTOR_CLONES
#endif

struct Shape {
  int64_t rows, t, hd, s, valid;
};

// scores[r][j] for the valid cache slots and the call's own entries: one pass over each row of K
// (a head dimension across the slots) for all of the group's query rows.
COMPOSITE_VECTOR_CLONES
void scores_of_group(const float* q, const float* k_cache, const float* k_new, const Shape& n, float* scores) {
  const int64_t width = n.valid + n.t;
  std::fill(scores, scores + n.rows * width, 0.f);
  for (int64_t d = 0; d < n.hd; ++d) {
    const float* k_row = k_cache + d * n.s;
    const float* k_new_row = k_new + d * n.t;
    for (int64_t r = 0; r < n.rows; ++r) {
      const float qd = q[r * n.hd + d];
      float* row = scores + r * width;
      for (int64_t j = 0; j < n.valid; ++j) row[j] += qd * k_row[j];
      const int64_t own = r % n.t + 1;  // causal: token i sees the call's entries 0..i
      for (int64_t j = 0; j < own; ++j) row[n.valid + j] += qd * k_new_row[j];
    }
  }
}

// out[r] = softmax(scores[r]) . V over the same slots.
COMPOSITE_VECTOR_CLONES
void weighted_values(float* scores, const float* v_cache, const float* v_new, const Shape& n, float* out) {
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
    float* o = out + r * n.hd;
    std::fill(o, o + n.hd, 0.f);
    for (int64_t j = 0; j < n.valid; ++j) {
      const float p = row[j] * inverse;
      const float* v = v_cache + j * n.hd;
      for (int64_t d = 0; d < n.hd; ++d) o[d] += p * v[d];
    }
    for (int64_t j = 0; j < own; ++j) {
      const float p = row[n.valid + j] * inverse;
      const float* v = v_new + j * n.hd;
      for (int64_t d = 0; d < n.hd; ++d) o[d] += p * v[d];
    }
  }
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
  const bool dtypes = q.scalar_type() == ScalarType::Float && k_cache.scalar_type() == ScalarType::Float &&
                      v_cache.scalar_type() == ScalarType::Float && k_new.scalar_type() == ScalarType::Float &&
                      v_new.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float &&
                      mask.scalar_type() == ScalarType::Float;
  ET_KERNEL_CHECK_MSG(context, dtypes, InvalidType, out, "composite::attention: takes float32 tensors");
  const float* first_row = mask.const_data_ptr<float>();
  int64_t valid = 0;
  while (valid < s && first_row[valid] == 0.f) ++valid;
  const Shape n{rows, t, hd, s, valid};
  const float* qd = q.const_data_ptr<float>();
  const float* kc = k_cache.const_data_ptr<float>();
  const float* vc = v_cache.const_data_ptr<float>();
  const float* kn = k_new.const_data_ptr<float>();
  const float* vn = v_new.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  const bool ran = executorch::extension::parallel_for(0, kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(rows * (valid + t)));
    for (int64_t g = begin; g < end; ++g) {
      scores_of_group(qd + g * rows * hd, kc + g * hd * s, kn + g * hd * t, n, scores.data());
      weighted_values(scores.data(), vc + g * s * hd, vn + g * t * hd, n, o + g * rows * hd);
    }
  });
  ET_KERNEL_CHECK_MSG(context, ran, Internal, out, "composite::attention: the threadpool failed");
  return out;
}

}  // namespace
}  // namespace composite

EXECUTORCH_LIBRARY(composite, "attention.out", composite::attention_out);
