// inflight's CPU kernels (fp32), built on first use by inflight/model/kernels.py.
//
// Paged decode attention: one query token per request, reading K/V straight from the block pool
// (no gathered copy). A work item is one request: every query head scores every cached token,
// a softmax per head, then a weighted sum of V. Each slot's K and V rows (all KV heads) are read
// once, in block order, with the next block prefetched; threads take requests from a shared
// counter, so requests of very different lengths still balance.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

// kDim > 0 fixes the head size at compile time (fully unrolled, vectorised loops); 0 reads `dim`.
template <int64_t kDim>
inline float dot(const float* __restrict a, const float* __restrict b, int64_t dim) {
  const int64_t n = kDim > 0 ? kDim : dim;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

template <int64_t kDim>
inline void axpy(float alpha, const float* __restrict x, float* __restrict y, int64_t dim) {
  const int64_t n = kDim > 0 ? kDim : dim;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

inline void softmax_inplace(float* s, int64_t len) {
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

struct Pool {
  const float* k;          // [num_slots, num_kv_heads, dim]
  const float* v;
  int64_t slot_stride;     // num_kv_heads * dim
  int64_t block_size;
};

// Pulls one slot's K or V row (all KV heads) of the next block into cache while this one is
// computed: blocks sit at random places in the pool, so the hardware prefetcher cannot guess.
inline void prefetch_row(const float* row, int64_t num_floats) {
  for (int64_t i = 0; i < num_floats; i += 16) __builtin_prefetch(row + i);
}

// Attention of all query heads of one request (q, out: [num_heads, dim]) over its `len` cached
// tokens, reading each slot's row (every KV head) once, in block order. scores: num_heads * len.
template <int64_t kDim>
void attend_request(const Pool& pool, const int64_t* table, int64_t len, const float* q, int64_t num_heads,
                    int64_t group, int64_t dim, float scale, float* scores, float* out) {
  const int64_t bs = pool.block_size, stride = pool.slot_stride;
  std::fill(out, out + num_heads * dim, 0.f);
  if (len == 0) return;
  const int64_t num_blocks = (len + bs - 1) / bs;
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t t0 = blk * bs, n = std::min(bs, len - t0);
    const float* keys = pool.k + table[blk] * bs * stride;
    const float* next = blk + 1 < num_blocks ? pool.k + table[blk + 1] * bs * stride : pool.v + table[0] * bs * stride;
    for (int64_t i = 0; i < n; ++i) {
      prefetch_row(next + i * stride, stride);
      const float* key = keys + i * stride;
      for (int64_t h = 0; h < num_heads; ++h)
        scores[h * len + t0 + i] = dot<kDim>(q + h * dim, key + (h / group) * dim, dim) * scale;
    }
  }
  for (int64_t h = 0; h < num_heads; ++h) softmax_inplace(scores + h * len, len);
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t t0 = blk * bs, n = std::min(bs, len - t0);
    const float* values = pool.v + table[blk] * bs * stride;
    const float* next = blk + 1 < num_blocks ? pool.v + table[blk + 1] * bs * stride : values;
    for (int64_t i = 0; i < n; ++i) {
      prefetch_row(next + i * stride, stride);
      const float* value = values + i * stride;
      for (int64_t h = 0; h < num_heads; ++h)
        axpy<kDim>(scores[h * len + t0 + i], value + (h / group) * dim, out + h * dim, dim);
    }
  }
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_slots, KV, D]; block_tables: [B, max_blocks] (int64);
// context_lens: [B] (int64). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64, "int64 tables only");
  const int64_t batch = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(2) == dim, "head shapes do not match");
  const int64_t group = num_heads / num_kv_heads;
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const Pool pool{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), num_kv_heads * dim, block_size};
  const float* qp = q.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t max_blocks = tables.size(1);
  const float fscale = static_cast<float>(scale);
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max(max_len, lp[b]);

  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(num_heads * max_len);
    for (int64_t b = next++; b < batch; b = next++) {
      const float* qb = qp + b * num_heads * dim;
      float* ob = op + b * num_heads * dim;
      const int64_t* table = tp + b * max_blocks;
      if (dim == 64)
        attend_request<64>(pool, table, lp[b], qb, num_heads, group, dim, fscale, scores.data(), ob);
      else if (dim == 128)
        attend_request<128>(pool, table, lp[b], qb, num_heads, group, dim, fscale, scores.data(), ob);
      else
        attend_request<0>(pool, table, lp[b], qb, num_heads, group, dim, fscale, scores.data(), ob);
    }
  });
  return out;
}

// ---- Token-wise ops of a layer, fused: at decode sizes each separate PyTorch op costs more in
// dispatch than in arithmetic. All are fp32 and row-parallel; rows are independent.

namespace {

// Rows per parallel chunk: enough work per thread to pay for waking it.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

inline void rms_norm_row(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t n,
                         float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1), "bad shapes");
}

}  // namespace

// Llama's RMSNorm of each row of x [N, H]: w * x / sqrt(mean(x^2) + eps).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
  });
  return out;
}

// The residual stream's update and the next norm in one pass: hidden += delta (in place), then
// returns rms_norm(hidden) * weight.
torch::Tensor add_rms_norm_(torch::Tensor hidden, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_rows(hidden, weight);
  TORCH_CHECK(delta.sizes() == hidden.sizes() && delta.is_contiguous() && delta.dtype() == torch::kFloat32,
              "delta must match hidden");
  auto out = torch::empty_like(hidden);
  const int64_t n = hidden.size(1);
  float* hp = hidden.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, hidden.size(0), row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* h = hp + r * n;
      const float* d = dp + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) h[i] += d[i];
      rms_norm_row(h, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
  return out;
}

// Rotary embedding (the rotate-half form) applied in place to the query and key heads at the
// front of each row of the fused projection qkv [N, (H + 2 KV) * D]. cos/sin: [max_pos, D];
// positions: [N] (int64).
void rotary_qk_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32,
              "float32 only");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous(), "bad layout");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && positions.numel() == qkv.size(0), "positions must be int64 [N]");
  TORCH_CHECK(head_dim % 2 == 0 && cos.size(1) == head_dim, "head_dim mismatch");
  const int64_t rotated_heads = num_heads + num_kv_heads, half = head_dim / 2, row_stride = qkv.stride(0);
  const int64_t max_pos = cos.size(0);
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < qkv.size(0); ++r)
    TORCH_CHECK(pp[r] >= 0 && pp[r] < max_pos, "position out of the rotary table");
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, qkv.size(0), row_grain(rotated_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + pp[r] * head_dim;
      const float* s = sp + pp[r] * head_dim;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        float* x = base + r * row_stride + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s[i];
          x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

// SwiGLU's gate: gate_up [N, 2I] (gate, then up) -> silu(gate) * up [N, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 && gate_up.dim() == 2 && gate_up.is_contiguous() &&
              gate_up.size(1) % 2 == 0, "float32 [N, 2I] contiguous only");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, gate_up.size(0), row_grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * 2 * inter;
      const float* u = g + inter;
      float* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(std::min(-g[i], 80.f))) * u[i];  // no inf under fast-math
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU, fp32)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU, fp32)");
  m.def("add_rms_norm_", &add_rms_norm_, "hidden += delta, then RMSNorm (CPU, fp32)");
  m.def("rotary_qk_", &rotary_qk_, "Rotary embedding of the q and k heads of a fused qkv, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU, fp32)");
}
