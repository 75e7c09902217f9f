// Paged decode attention for CPU: one query token per request, reading K/V straight from the
// block pool (no gathered copy). Two passes per (request, KV head): scores of the G query heads
// that share the KV head against every cached token, then a softmax-weighted sum of V.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float alpha, const float* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_slots, KV, D]; block_tables: [B, max_blocks] (int64);
// context_lens: [B] (int64). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs only");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t max_blocks = tables.size(1);
  const int64_t slot_stride = num_kv_heads * head_dim;
  const float fscale = static_cast<float>(scale);

  // One work item per request: every KV head's slice of a slot is read in one pass, so each
  // cached token's K and V rows are fetched once for all query heads.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lp[b];
      const int64_t* table = tp + b * max_blocks;
      scores.resize(num_heads * len);
      const float* qb = qp + b * num_heads * head_dim;
      for (int64_t t = 0; t < len; ++t) {
        const float* key = kp + (table[t / block_size] * block_size + t % block_size) * slot_stride;
        for (int64_t h = 0; h < num_heads; ++h)
          scores[h * len + t] = dot(qb + h * head_dim, key + (h / group) * head_dim, head_dim) * fscale;
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * len;
        const float m = *std::max_element(s, s + len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      float* ob = op + b * num_heads * head_dim;
      std::fill(ob, ob + num_heads * head_dim, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const float* value = vp + (table[t / block_size] * block_size + t % block_size) * slot_stride;
        for (int64_t h = 0; h < num_heads; ++h)
          axpy(scores[h * len + t], value + (h / group) * head_dim, ob + h * head_dim, head_dim);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU, fp32)");
}
