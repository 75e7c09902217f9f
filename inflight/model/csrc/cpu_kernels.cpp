// inflight's CPU kernels (fp32), built on first use by inflight/model/kernels.py.
//
// Paged decode attention: one query token per request, reading K/V straight from the block pool
// (no gathered copy). A work item is one request, or a part of its context when there are too
// few requests for the threads: every query head scores every cached token, a softmax per head,
// then a weighted sum of V. Each slot's K and V rows (all KV heads) are read once, in block
// order, with the next block prefetched; threads take items from a shared counter, so requests
// of very different lengths still balance.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// The vector width this build targets (-march=native).
#if defined(__AVX512F__)
constexpr int kVec = 16;   // floats per vector register
constexpr int kMaxRows = 14;  // 2 x 14 accumulators + 2 weight vectors of 32 zmm registers
#elif defined(__AVX2__)
constexpr int kVec = 8;
constexpr int kMaxRows = 6;   // 2 x 6 accumulators + 2 weight vectors of 16 ymm registers
#else
constexpr int kVec = 4;
constexpr int kMaxRows = 4;
#endif
constexpr int kNR = 2 * kVec;  // columns per panel
typedef float vec __attribute__((vector_size(kVec * sizeof(float))));

// Unaligned loads and stores of one vector (one instruction each, unlike a memcpy of an array
// of vectors, which GCC may route through the stack).
inline vec load_vec(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(vec));
  return v;
}
inline void store_vec(float* p, vec v) { __builtin_memcpy(p, &v, sizeof(vec)); }

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

// The lane sums of four vectors: out = {sum(a), sum(b), sum(c), sum(d)}.
inline void sum_lanes4(vec a, vec b, vec c, vec d, float* out) {
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
  auto fold = [](vec x) {  // 16 lanes -> 8
    const __m512d xd = _mm512_castps_pd(static_cast<__m512>(x));
    return _mm256_add_ps(_mm256_castpd_ps(_mm512_castpd512_pd256(xd)), _mm256_castpd_ps(_mm512_extractf64x4_pd(xd, 1)));
  };
  const __m256 a8 = fold(a), b8 = fold(b), c8 = fold(c), d8 = fold(d);
#else
  const __m256 a8 = static_cast<__m256>(a), b8 = static_cast<__m256>(b), c8 = static_cast<__m256>(c),
               d8 = static_cast<__m256>(d);
#endif
  const __m256 ab = _mm256_hadd_ps(a8, b8), cd = _mm256_hadd_ps(c8, d8);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // per 128-bit half: the four partial sums
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
#else
  const vec* v[4] = {&a, &b, &c, &d};
  for (int j = 0; j < 4; ++j) {
    float sum = 0.f;
    for (int e = 0; e < kVec; ++e) sum += (*v[j])[e];
    out[j] = sum;
  }
#endif
}

constexpr float kNoScore = -1e30f;  // a finite "minus infinity": the file is built with fast-math

// A row's attention over a long context is computed in parts (blocks of context at fixed
// positions, see the kernels below), each leaving its unnormalized output o (the sum of
// exp(score - m) * v), its max score m and its weight sum l; the parts are then folded into a
// running (O, M, L) in context order and O / L is the result. Whether the parts ran on one
// thread or on several is the caller's scheduling; the arithmetic is this one function's, the
// same code whichever path calls it (not inlined, so that no call site compiles it otherwise),
// and so a row's result is bit for bit the same whoever shares its step. (noclone too: GCC would
// compile a clone per constant argument, each apart.)
#if defined(__clang__)
#define INFLIGHT_ONE_BODY __attribute__((noinline))
#else
#define INFLIGHT_ONE_BODY __attribute__((noinline, noclone))
#endif
//
// fold_parts: for each of `rows` rows (o, O: rows x dim), (O, M, L) <- (O, M, L) + (o, m, l):
// with M' = max(M, m), O <- O e^(M - M') + o e^(m - M'), L likewise. A part that saw no token
// (l = 0) leaves the state as it is; an empty state (L = 0) becomes the part, copied (so a
// caller may compute a first part in place of the state, or finish a lone part as it is). The
// factors come 16 rows at a time, a whole vector of exp() whatever the row count (a loop's
// scalar remainder would round differently from its vector body), floored at e^-80: a part 80
// below the running max would weigh under 2e-35 of it, nothing in fp32.
constexpr int64_t kFoldRows = 16;

// dst = dst * a + src * b over n floats, each by the same instructions wherever the arrays lie: in
// whole vectors, the last few through a vector on the stack. (An auto-vectorized loop here took,
// for some rows, a path that rounded otherwise: GCC versions a loop on its pointers.)
inline void scale_add(float* __restrict dst, const float* __restrict src, float a, float b, int64_t n) {
  const vec va = vec{} + a, vb = vec{} + b;
  int64_t d = 0;
  for (; d + kVec <= n; d += kVec) store_vec(dst + d, load_vec(dst + d) * va + load_vec(src + d) * vb);
  if (d < n) {
    float x[kVec] = {}, y[kVec] = {};
    std::copy(dst + d, dst + n, x);
    std::copy(src + d, src + n, y);
    store_vec(x, load_vec(x) * va + load_vec(y) * vb);
    std::copy(x, x + (n - d), dst + d);
  }
}

INFLIGHT_ONE_BODY void fold_parts(float* __restrict O, float* __restrict M, float* __restrict L,
                                          const float* __restrict o, const float* m, const float* l, int64_t rows,
                                          int64_t dim) {
  for (int64_t r0 = 0; r0 < rows; r0 += kFoldRows) {
    const int64_t n = std::min(kFoldRows, rows - r0);
    float old_m[kFoldRows] = {}, new_m[kFoldRows] = {}, mx[kFoldRows], a[kFoldRows], b[kFoldRows];
    std::copy(M + r0, M + r0 + n, old_m);
    std::copy(m + r0, m + r0 + n, new_m);
#pragma omp simd
    for (int64_t i = 0; i < kFoldRows; ++i) {
      mx[i] = std::max(old_m[i], new_m[i]);
      a[i] = std::exp(std::max(old_m[i] - mx[i], -80.f));
      b[i] = std::exp(std::max(new_m[i] - mx[i], -80.f));
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = r0 + i;
      float* dst = O + r * dim;
      const float* src = o + r * dim;
      if (l[r] == 0.f) continue;
      if (L[r] == 0.f) {
        std::copy(src, src + dim, dst);
        M[r] = m[r], L[r] = l[r];
        continue;
      }
      scale_add(dst, src, a[i], b[i], dim);
      L[r] = L[r] * a[i] + l[r] * b[i];
      M[r] = mx[i];
    }
  }
}

// The folded rows' results: out = O / L (zeros for a row that saw no token). With `sinks` (gpt-oss's
// attention sinks: a learned score per head that joins the softmax's sum and weighs no value),
// out = O / (L + exp(sink - M)), row r's sink sinks[r % period].
INFLIGHT_ONE_BODY void finish_parts(const float* __restrict O, const float* L, int64_t rows, int64_t dim,
                                            float* __restrict out, const float* M = nullptr,
                                            const float* sinks = nullptr, int64_t period = 1) {
  for (int64_t r = 0; r < rows; ++r) {
    const float sink = sinks != nullptr && L[r] > 0.f ? std::exp(std::max(sinks[r % period] - M[r], -80.f)) : 0.f;
    const float inv = L[r] > 0.f ? 1.f / (L[r] + sink) : 0.f;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[r * dim + d] = O[r * dim + d] * inv;
  }
}

// An empty fold: O = 0, M = "minus infinity", L = 0.
inline void reset_parts(float* O, float* M, float* L, int64_t rows, int64_t dim) {
  std::fill(O, O + rows * dim, 0.f);
  std::fill(M, M + rows, kNoScore);
  std::fill(L, L + rows, 0.f);
}

// The KV pool's element type: fp32, or 16 bits (bf16 or fp16: `--kv-cache-dtype`), stored rounded
// to nearest even and widened to fp32 (exactly) as it is read, so that the attention arithmetic
// is the fp32 kernels' on the rounded values.
enum class KvType { kF32, kBF16, kF16 };

// n 16-bit values (bf16 or fp16) from src widened into dst; an fp32 pool is read in place.
inline void widen_kv(const void* src, KvType type, float* __restrict dst, int64_t n) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  if (type == KvType::kBF16) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      dst[i] = f;
    }
    return;
  }
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(h[i]);
}

// n fp32 values into the pool's type at dst, rounded to nearest even (as torch's `.to()`).
inline void narrow_kv(const float* __restrict src, KvType type, void* dst, int64_t n) {
  if (type == KvType::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  uint16_t* h = static_cast<uint16_t*>(dst);
  int64_t i = 0;
  if (type == KvType::kBF16) {
    for (; i < n; ++i) h[i] = c10::BFloat16(src[i]).x;
    return;
  }
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) h[i] = c10::detail::fp16_ieee_from_fp32_value(src[i]);
}

KvType kv_type(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "K and V pools of different types");
  if (k_cache.dtype() == torch::kFloat32) return KvType::kF32;
  if (k_cache.dtype() == torch::kBFloat16) return KvType::kBF16;
  TORCH_CHECK(k_cache.dtype() == torch::kFloat16, "a KV pool of float32, bfloat16 or float16 only");
  return KvType::kF16;
}

struct Pool {
  const void* k;           // [num_slots, num_kv_heads, dim]
  const void* v;
  KvType type;
  int64_t slot_stride;     // num_kv_heads * dim
  int64_t block_size;

  Pool(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t block)
      : k(k_cache.data_ptr()), v(v_cache.data_ptr()), type(kv_type(k_cache, v_cache)),
        slot_stride(k_cache.size(1) * k_cache.size(2)), block_size(block) {}

  int64_t element_bytes() const { return type == KvType::kF32 ? 4 : 2; }
  // Where value `offset` of `slot` of pool `base` (k or v) is.
  const char* at(const void* base, int64_t slot, int64_t offset = 0) const {
    return static_cast<const char*>(base) + (slot * slot_stride + offset) * element_bytes();
  }
  // n values from there as fp32: the pool's own memory when it is fp32, else widened into buf.
  const float* floats(const void* base, int64_t slot, int64_t offset, int64_t n, float* buf) const {
    if (type == KvType::kF32) return reinterpret_cast<const float*>(at(base, slot, offset));
    widen_kv(at(base, slot, offset), type, buf, n);
    return buf;
  }
};

// The PV product of the prefill kernel: o[j] += sum_i p[j * p_stride + i] * v_i for RB rows of
// o ([rows, kDim]) and CV vectors of columns starting at col, the RB x CV accumulators held in
// registers next to the CV vectors of the V row being read.
template <int64_t kDim, int64_t RB, int64_t CV>
inline void pv_rows(const float* p, int64_t p_stride, const float* const* vrow, int64_t nt, float* o, int64_t col) {
  vec acc[RB][CV];
  for (int64_t j = 0; j < RB; ++j)
    for (int64_t c = 0; c < CV; ++c) acc[j][c] = load_vec(o + j * kDim + col + c * kVec);
  for (int64_t i = 0; i < nt; ++i) {
    vec v[CV];
    for (int64_t c = 0; c < CV; ++c) v[c] = load_vec(vrow[i] + col + c * kVec);
    for (int64_t j = 0; j < RB; ++j) {
      const float pj = p[j * p_stride + i];
      for (int64_t c = 0; c < CV; ++c) acc[j][c] += pj * v[c];
    }
  }
  for (int64_t j = 0; j < RB; ++j)
    for (int64_t c = 0; c < CV; ++c) store_vec(o + j * kDim + col + c * kVec, acc[j][c]);
}

// pv_rows for a run-time row count below R (the remainder of a row block).
template <int64_t kDim, int64_t R, int64_t CV>
inline void pv_rows_upto(int64_t rows, const float* p, int64_t p_stride, const float* const* vrow, int64_t nt,
                         float* o, int64_t col) {
  if constexpr (R > 0) {
    if (rows == R) return pv_rows<kDim, R, CV>(p, p_stride, vrow, nt, o, col);
    pv_rows_upto<kDim, R - 1, CV>(rows, p, p_stride, vrow, nt, o, col);
  }
}

// Vector registers of this build: 32 with AVX-512, 16 with AVX2.
#if defined(__AVX512F__)
constexpr int64_t kVecRegs = 32;
#else
constexpr int64_t kVecRegs = 16;
#endif

// Column vectors per pass of pv_rows: at most a quarter of the registers (4 of 32, 2 of 16), and a
// divisor of the head's vector count, so that RB rows of accumulators, the V vectors and the
// broadcast weight all stay in registers (holding a whole 64-wide head, 8 AVX2 vectors per row,
// would spill).
constexpr int64_t pv_col_vectors(int64_t num_vectors) {
  int64_t cv = kVecRegs / 8;
  while (cv > 1 && num_vectors % cv != 0) --cv;
  return cv;
}

template <int64_t kDim>
void pv_tile(const float* p, int64_t p_stride, const float* const* vrow, int64_t nt, float* o, int64_t rows,
             int64_t dim) {
  if constexpr (kDim > 0 && kDim % kVec == 0) {
    constexpr int64_t kCV = pv_col_vectors(kDim / kVec);
    constexpr int64_t kRB = (kVecRegs - kCV - 2) / kCV;  // 6 rows with AVX2 and with AVX-512
    for (int64_t col = 0; col < kDim; col += kCV * kVec) {
      int64_t r = 0;
      for (; r + kRB <= rows; r += kRB)
        pv_rows<kDim, kRB, kCV>(p + r * p_stride, p_stride, vrow, nt, o + r * kDim, col);
      pv_rows_upto<kDim, kRB - 1, kCV>(rows - r, p + r * p_stride, p_stride, vrow, nt, o + r * kDim, col);
    }
  } else {
    for (int64_t i = 0; i < nt; ++i)
      for (int64_t r = 0; r < rows; ++r) {
        const float pi = p[r * p_stride + i];
        float* orow = o + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) orow[d] += pi * vrow[i][d];
      }
  }
}

// Pulls a contiguous range (the next KV block: blocks sit at random places in the pool, so the
// hardware prefetcher cannot guess) into the core's L2 a few lines per call of step(), spread over
// a loop's iterations: issued all at once, a block's 200 prefetches would stall the loads they
// precede. Into L2 (prefetcht1), not L1: a prefetch into L1 holds one of the L1's few miss
// buffers until its line arrives, and with them all taken the core stalled on the prefetches
// themselves (`perf annotate`: a third of the kernel's samples); L2 has more, and the loads then
// find each line there. On 2 Zen 4 cores, 64 requests of 100-400 tokens read their K/V at 31
// GB/s against 21 with prefetcht0 (a plain sum of 1 GB reads 33).
struct Prefetcher {
  const char* p;
  const char* end;
  int64_t lines_per_step;
  Prefetcher(const char* begin, int64_t num_bytes, int64_t steps)
      : p(begin), end(begin + num_bytes), lines_per_step((num_bytes / 64 + steps) / std::max<int64_t>(steps, 1)) {}
  void step() {
    for (int64_t j = 0; j < lines_per_step && p < end; ++j, p += 64) __builtin_prefetch(p, 0, 2);
  }
  void finish() {
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 2);
  }
};

// Scores of every query head against the n keys of one block (rows `stride` floats apart, KV
// head g at g * kDim), into scores[h * len + i]. A head's query stays in registers while it
// meets four keys at a time, four independent sums whose lanes are added together at the end.
template <int64_t kDim>
inline void score_block(const float* q, int64_t num_heads, int64_t group, const float* keys, int64_t stride,
                        int64_t n, float scale, float* scores, int64_t len, Prefetcher& next) {
  constexpr int64_t kNV = kDim / kVec;
  for (int64_t h = 0; h < num_heads; ++h) {
    vec qv[kNV];
    for (int64_t c = 0; c < kNV; ++c) qv[c] = load_vec(q + h * kDim + c * kVec);
    const float* kh = keys + (h / group) * kDim;
    float* s = scores + h * len;
    float sums[4];
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      vec a0{}, a1{}, a2{}, a3{};
      for (int64_t c = 0; c < kNV; ++c) {
        a0 += qv[c] * load_vec(kh + i * stride + c * kVec);
        a1 += qv[c] * load_vec(kh + (i + 1) * stride + c * kVec);
        a2 += qv[c] * load_vec(kh + (i + 2) * stride + c * kVec);
        a3 += qv[c] * load_vec(kh + (i + 3) * stride + c * kVec);
      }
      sum_lanes4(a0, a1, a2, a3, sums);
      for (int64_t j = 0; j < 4; ++j) s[i + j] = sums[j] * scale;
      next.step();
    }
    for (; i < n; ++i) {
      vec a{};
      for (int64_t c = 0; c < kNV; ++c) a += qv[c] * load_vec(kh + i * stride + c * kVec);
      sum_lanes4(a, vec{}, vec{}, vec{}, sums);
      s[i] = sums[0] * scale;
    }
  }
}

// out[h] += sum_i p[h * len + i] * v_i over the n value rows of one block, each head's output
// held in registers across the block.
template <int64_t kDim>
inline void value_block(const float* p, int64_t len, int64_t num_heads, int64_t group, const float* values,
                        int64_t stride, int64_t n, float* out, Prefetcher& next) {
  constexpr int64_t kNV = kDim / kVec;
  for (int64_t h = 0; h < num_heads; ++h) {
    vec acc[kNV];
    for (int64_t c = 0; c < kNV; ++c) acc[c] = load_vec(out + h * kDim + c * kVec);
    const float* vh = values + (h / group) * kDim;
    const float* ph = p + h * len;
    for (int64_t i = 0; i < n; ++i) {
      const float pi = ph[i];
      for (int64_t c = 0; c < kNV; ++c) acc[c] += pi * load_vec(vh + i * stride + c * kVec);
      if (i % 4 == 3) next.step();
    }
    for (int64_t c = 0; c < kNV; ++c) store_vec(out + h * kDim + c * kVec, acc[c]);
  }
}

// Soft-capping of attention scores (Gemma 2): cap * tanh(s / cap), in place; cap 0: none.
inline void soft_cap(float* s, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] * inv);
}

// ALiBi (BLOOM's, MPT's): s[i] += slope * (i + offset) for i in [begin, end), i + offset the
// distance of token i from the query (offset: the first token's position minus the query's).
inline void add_alibi(float* s, int64_t begin, int64_t end, float slope, int64_t offset) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) s[i] += slope * static_cast<float>(i + offset);
}

// One query row of attend_range: its query heads q ([num_heads, dim]), the tokens [t_first, t_end)
// of the context it sees, its scores (num_heads * (t_end - t_begin)) and its results: the
// unnormalized out ([num_heads, dim], the sum of exp(score - m) * v), and per head the max score m
// and the sum of the weights l, so that parts of one context computed apart can be folded
// (fold_parts).
struct Query {
  const float* q;
  int64_t t_first, t_end;
  float *scores, *out, *m, *l;
  int64_t pos;  // the query's own position (ALiBi's distances are from it)
};

// Attention of every query head of `count` queries over one part of one context, read from t_begin
// (each query's t_first's block's first token, a multiple of the block size: a sliding window
// starts inside a block), block by block, each block's K (then V) rows, every KV head, read once
// for all the queries (the rows of a speculative verify, each seeing one token more than the one
// before) while the next block is prefetched. Each query's arithmetic is exactly what it would be
// alone: the same calls on the same blocks in the same order. softcap > 0 caps the scaled scores
// (Gemma 2); slopes (ALiBi's, one a query head, or null) add slopes[h] * (t - pos) to head h's score
// of token t. widened: a block's K or V as fp32 (block_size * slot_stride floats) when the pool is
// 16-bit. then: then_bytes prefetched while the last V block is read (what the caller reads next).
template <int64_t kDim>
void attend_range(const Pool& pool, const int64_t* table, int64_t t_begin, const Query* queries, int64_t count,
                  int64_t num_heads, int64_t group, int64_t dim_rt, float scale, float softcap, const float* slopes,
                  float* widened, const char* then, int64_t then_bytes) {
  constexpr bool kBlocked = kDim > 0 && kDim % kVec == 0;
  const int64_t dim = kDim > 0 ? kDim : dim_rt;
  const int64_t bs = pool.block_size, stride = pool.slot_stride;
  int64_t t_end = t_begin;
  for (int64_t j = 0; j < count; ++j) {
    const Query& qr = queries[j];
    std::fill(qr.out, qr.out + num_heads * dim, 0.f);
    std::fill(qr.m, qr.m + num_heads, kNoScore);
    std::fill(qr.l, qr.l + num_heads, 0.f);
    t_end = std::max(t_end, qr.t_end);
  }
  if (t_end <= t_begin) return;
  const int64_t first_block = t_begin / bs, last_block = (t_end - 1) / bs;
  for (int64_t blk = first_block; blk <= last_block; ++blk) {
    const int64_t t0 = blk * bs, n = std::min(bs, t_end - t0);
    const float* keys = pool.floats(pool.k, table[blk] * bs, 0, n * stride, widened);
    // The next block's K, or after the last one the first block's V.
    const int64_t next_n = blk < last_block ? std::min(bs, t_end - t0 - bs) : std::min(bs, t_end - first_block * bs);
    Prefetcher next(blk < last_block ? pool.at(pool.k, table[blk + 1] * bs) : pool.at(pool.v, table[first_block] * bs),
                    next_n * stride * pool.element_bytes(), num_heads * ((n + 3) / 4));
    for (int64_t j = 0; j < count; ++j) {
      const Query& qr = queries[j];
      const int64_t nj = std::min(bs, qr.t_end - t0), len = qr.t_end - t_begin;
      if (nj <= 0) continue;
      if constexpr (kBlocked) {
        score_block<kDim>(qr.q, num_heads, group, keys, stride, nj, scale, qr.scores + t0 - t_begin, len, next);
      } else {
        for (int64_t i = 0; i < nj; ++i)
          for (int64_t h = 0; h < num_heads; ++h)
            qr.scores[h * len + t0 - t_begin + i] =
                dot<kDim>(qr.q + h * dim, keys + i * stride + (h / group) * dim, dim) * scale;
      }
    }
    next.finish();
  }
  for (int64_t j = 0; j < count; ++j) {
    const Query& qr = queries[j];
    const int64_t len = qr.t_end - t_begin;
    if (len <= 0) continue;
    // The tokens before t_first (out of the window) weigh nothing.
    const int64_t skip = std::min(std::max<int64_t>(qr.t_first - t_begin, 0), len);
    for (int64_t h = 0; h < num_heads; ++h) {
      float* s = qr.scores + h * len;
      std::fill(s, s + skip, 0.f);
      if (skip == len) continue;
      soft_cap(s + skip, len - skip, softcap);
      if (slopes != nullptr) add_alibi(s, skip, len, slopes[h], t_begin - qr.pos);
      const float mx = *std::max_element(s + skip, s + len);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = skip; t < len; ++t) {
        s[t] = std::exp(s[t] - mx);
        sum += s[t];
      }
      qr.m[h] = mx;
      qr.l[h] = sum;
    }
  }
  for (int64_t blk = first_block; blk <= last_block; ++blk) {
    const int64_t t0 = blk * bs, n = std::min(bs, t_end - t0);
    const float* values = pool.floats(pool.v, table[blk] * bs, 0, n * stride, widened);
    // The next block's V, or after the last one what the caller reads next.
    Prefetcher next(blk < last_block ? pool.at(pool.v, table[blk + 1] * bs) : then,
                    blk < last_block ? std::min(bs, t_end - t0 - bs) * stride * pool.element_bytes() : then_bytes,
                    num_heads * ((n + 3) / 4));
    for (int64_t j = 0; j < count; ++j) {
      const Query& qr = queries[j];
      const int64_t nj = std::min(bs, qr.t_end - t0), len = qr.t_end - t_begin;
      if (nj <= 0) continue;
      if constexpr (kBlocked) {
        value_block<kDim>(qr.scores + t0 - t_begin, len, num_heads, group, values, stride, nj, qr.out, next);
      } else {
        for (int64_t i = 0; i < nj; ++i)
          for (int64_t h = 0; h < num_heads; ++h)
            axpy<kDim>(qr.scores[h * len + t0 - t_begin + i], values + i * stride + (h / group) * dim,
                       qr.out + h * dim, dim);
      }
    }
    next.finish();
  }
}

void attend(const Pool& pool, const int64_t* table, int64_t t_begin, const Query* queries, int64_t count,
            int64_t num_heads, int64_t group, int64_t dim, float scale, float softcap, const float* slopes,
            float* widened, const char* then, int64_t then_bytes) {
  if (dim == 64)
    attend_range<64>(pool, table, t_begin, queries, count, num_heads, group, dim, scale, softcap, slopes, widened, then,
                     then_bytes);
  else if (dim == 128)
    attend_range<128>(pool, table, t_begin, queries, count, num_heads, group, dim, scale, softcap, slopes, widened,
                      then, then_bytes);
  else
    attend_range<0>(pool, table, t_begin, queries, count, num_heads, group, dim, scale, softcap, slopes, widened, then,
                    then_bytes);
}

// One float per query head (attention sinks' scores, ALiBi's slopes), or null where there are none.
inline const float* per_head(const c10::optional<torch::Tensor>& values, int64_t num_heads, const char* what) {
  if (!values.has_value() || !values->defined() || values->numel() == 0) return nullptr;
  TORCH_CHECK(values->dtype() == torch::kFloat32 && values->is_contiguous() && values->numel() == num_heads, what,
              ": one float32 a query head");
  return values->data_ptr<float>();
}

// A request's context is cut into parts of at least this many blocks (128 tokens of 16), at most
// two a thread: enough parts that a single stream spreads over the threads, few enough that a
// part's fixed costs (its softmax pass, its fold) stay small against reading its K/V. With 4, a
// batch of 64 requests of 100-400 tokens ran 0.97x (2 Zen 4 cores, each part a fold more).
constexpr int64_t kMinPartBlocks = 8;

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_slots, KV, D]; block_tables: [B, max_blocks] (int64);
// context_lens: [B] (int64). Returns [B, H, D]. window > 0: each query attends to its last
// `window` positions only (sliding-window attention); softcap > 0: scores soft-capped; alibi: ALiBi's
// slopes [H] (BLOOM's, MPT's), a score plus slope * (key position - query position). The pool
// may be 16-bit (bf16 or fp16): each block is widened to fp32 as it is read.
//
// Each request's visible context is cut into parts by its own length and the thread count
// alone (kMinPartBlocks), folded in order (fold_parts). Consecutive rows of one context cut the
// same way (a request verifying proposed tokens: one row a token, each seeing one more) form a
// group that reads each block once for all its rows. A work item is one group, its parts computed
// and folded on one thread; or, when there are too few groups to keep every thread busy (a single
// stream, the last requests of a batch), a run of a group's parts, folded after all are done.
// Either way each row's arithmetic is the same, in the same order: on a given number of threads, a
// request's result is the same bit for bit whoever shares its step, and a verify's rows are those
// of decoding one token at a time.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     int64_t block_size, double scale, int64_t window, double softcap,
                                     c10::optional<torch::Tensor> sinks, c10::optional<torch::Tensor> alibi) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "float32 queries only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64, "int64 tables only");
  const int64_t batch = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(2) == dim, "head shapes do not match");
  const int64_t group = num_heads / num_kv_heads;
  const float* sink = per_head(sinks, num_heads, "attention sinks");
  const float* slopes = per_head(alibi, num_heads, "ALiBi slopes");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const Pool pool(k_cache, v_cache, block_size);
  const float* qp = q.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t max_blocks = tables.size(1);
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  const int64_t threads = at::get_num_threads();
  const int64_t head_floats = num_heads * dim;
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= max_blocks * block_size, "context exceeds its block table");

  // A row's cut: from its first visible token's block (begin) to its last token in n parts of
  // `per` tokens (whole blocks), n = its blocks / kMinPartBlocks, at least 1 and at most two a
  // thread (an empty context is one empty part).
  auto first_visible = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, lp[b] - window) : int64_t{0}; };
  auto cut = [&](int64_t b) {
    const int64_t begin = first_visible(b) / block_size * block_size;
    const int64_t blocks = (lp[b] - begin + block_size - 1) / block_size;
    const int64_t n = std::max<int64_t>(1, std::min(2 * threads, blocks / kMinPartBlocks));
    return std::make_pair(begin, std::max<int64_t>(1, (blocks + n - 1) / n) * block_size);
  };
  // Groups of consecutive rows with the same cut over the same blocks, each part of a group one
  // slot a row (a row whose context ends before the part leaves it empty: l = 0).
  struct Group {
    int64_t first_row, rows, begin, per, end, first_part, num_parts;
    bool kept;  // its parts' results kept for the fold after the threads' work (cut into runs)
  };
  struct Part {
    int64_t group, t_begin, t_end, first_slot;
  };
  std::vector<Group> groups;
  for (int64_t b = 0; b < batch; ++b) {
    const auto [begin, per] = cut(b);
    if (!groups.empty() && lp[b] > begin) {
      Group& g = groups.back();
      const int64_t blocks = (lp[b] + block_size - 1) / block_size;
      if (g.begin == begin && g.per == per && lp[g.first_row] > begin &&
          std::equal(tp + b * max_blocks, tp + b * max_blocks + blocks, tp + g.first_row * max_blocks)) {
        ++g.rows;
        g.end = std::max(g.end, lp[b]);
        continue;
      }
    }
    groups.push_back({b, 1, begin, per, lp[b], 0, 0, false});
  }
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  std::vector<Part> parts;
  int64_t num_slots = 0, max_part_len = 0, max_rows = 0;
  for (Group& g : groups) {
    g.first_part = static_cast<int64_t>(parts.size());
    for (int64_t t = g.begin; t < std::max(g.end, g.begin + 1); t += g.per) {
      parts.push_back({static_cast<int64_t>(&g - groups.data()), t, std::min(g.end, t + g.per), num_slots});
      num_slots += g.rows;
      max_part_len = std::max(max_part_len, parts.back().t_end - t);
    }
    g.num_parts = static_cast<int64_t>(parts.size()) - g.first_part;
    max_rows = std::max(max_rows, g.rows);
  }
  const int64_t num_parts = static_cast<int64_t>(parts.size());

  // Work items, [first, last) parts of one group each, for its rows [row_begin, row_end): whole
  // groups; or, when the groups are fewer than twice the threads and some could be cut, about
  // two items a thread in all: runs of a group's consecutive parts, and where it has fewer parts
  // than that, each run for a share of its rows. An item of all its group's parts folds them on
  // its thread; the parts of runs are kept for the fold below. Most work first, so that the last
  // items the threads take are short.
  const bool by_part =
      threads > 1 && num_groups < 2 * threads && (num_parts > num_groups || max_rows > 1);
  struct Item {
    int64_t first, last, row_begin, row_end, tokens;
  };
  std::vector<Item> items;
  const int64_t want = (2 * threads + num_groups - 1) / num_groups;
  for (Group& g : groups) {
    const int64_t count = g.num_parts;
    const int64_t runs = by_part ? std::min(count, want) : 1;
    g.kept = runs > 1;
    const int64_t shares = by_part ? std::min(g.rows, (want + runs - 1) / runs) : 1;
    for (int64_t r = 0; r < runs; ++r)
      for (int64_t sh = 0; sh < shares; ++sh) {
        const int64_t first = g.first_part + count * r / runs, last = g.first_part + count * (r + 1) / runs;
        const int64_t row_begin = g.rows * sh / shares, row_end = g.rows * (sh + 1) / shares;
        items.push_back({first, last, row_begin, row_end,
                         (row_end - row_begin) * (parts[last - 1].t_end - parts[first].t_begin)});
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.tokens > b.tokens; });
  // The runs' parts leave each row's unnormalized output and statistics here, folded below.
  const bool kept = std::any_of(groups.begin(), groups.end(), [](const Group& g) { return g.kept; });
  std::vector<float> part_out(kept ? num_slots * head_floats : 0);
  std::vector<float> part_m(kept ? num_slots * num_heads : 0), part_l(kept ? num_slots * num_heads : 0);

  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scores(max_rows * num_heads * max_part_len);
    std::vector<float> widened(pool.type == KvType::kF32 ? 0 : block_size * pool.slot_stride);
    // Each row's part result (o, m, l) and running fold (O, M, L) in an item of all its parts.
    std::vector<float> o(max_rows * head_floats), m(max_rows * num_heads), l(max_rows * num_heads);
    std::vector<float> O(max_rows * head_floats), M(max_rows * num_heads), L(max_rows * num_heads);
    std::vector<Query> queries(max_rows);
    for (int64_t taken = next++; taken < num_items; taken = next++) {
      const Item& it = items[taken];
      const Group& g = groups[parts[it.first].group];
      const int64_t* table = tp + g.first_row * max_blocks;
      const int64_t rows = it.row_end - it.row_begin, row_floats = it.row_begin * head_floats;
      for (int64_t i = it.first; i < it.last; ++i) {
        const Part& pt = parts[i];
        // An item of all its parts computes the first in place of its rows' folds (what folding
        // it into empty ones would give), the next ones beside them.
        const bool first = !g.kept && i == it.first;
        for (int64_t j = it.row_begin; j < it.row_end; ++j) {
          const int64_t row = g.first_row + j;
          const int64_t slot = pt.first_slot + j;
          queries[j - it.row_begin] = {
              qp + row * head_floats, std::max(pt.t_begin, first_visible(row)), std::min(lp[row], pt.t_end),
              scores.data() + (j - it.row_begin) * num_heads * max_part_len,
              g.kept ? part_out.data() + slot * head_floats : (first ? O : o).data() + j * head_floats,
              g.kept ? part_m.data() + slot * num_heads : (first ? M : m).data() + j * num_heads,
              g.kept ? part_l.data() + slot * num_heads : (first ? L : l).data() + j * num_heads, lp[row] - 1};
        }
        // While the last V block is read, the next part's first K block comes (on this thread).
        const char* then = nullptr;
        int64_t then_bytes = 0;
        if (i + 1 < it.last) {
          const Part& after = parts[i + 1];
          then = pool.at(pool.k, table[after.t_begin / block_size] * block_size);
          then_bytes = std::min(block_size, after.t_end - after.t_begin) * pool.slot_stride * pool.element_bytes();
        }
        attend(pool, table, pt.t_begin, queries.data(), rows, num_heads, group, dim, fscale, fcap, slopes, widened.data(),
               then, then_bytes);
        const int64_t stats = it.row_begin * num_heads;
        if (!g.kept && !first)
          fold_parts(O.data() + row_floats, M.data() + stats, L.data() + stats, o.data() + row_floats, m.data() + stats,
                     l.data() + stats, rows * num_heads, dim);
      }
      if (!g.kept)
        finish_parts(O.data() + row_floats, L.data() + it.row_begin * num_heads, rows * num_heads, dim,
                     op + g.first_row * head_floats + row_floats, M.data() + it.row_begin * num_heads, sink, num_heads);
    }
  });
  if (kept) {
    std::vector<float> O(head_floats), M(num_heads), L(num_heads);
    for (const Group& g : groups)
      for (int64_t j = 0; j < (g.kept ? g.rows : 0); ++j) {
        reset_parts(O.data(), M.data(), L.data(), num_heads, dim);
        for (int64_t i = g.first_part; i < g.first_part + g.num_parts; ++i) {
          const int64_t slot = parts[i].first_slot + j;
          fold_parts(O.data(), M.data(), L.data(), part_out.data() + slot * head_floats, part_m.data() + slot * num_heads,
                     part_l.data() + slot * num_heads, num_heads, dim);
        }
        finish_parts(O.data(), L.data(), num_heads, dim, op + (g.first_row + j) * head_floats, M.data(), sink,
                     num_heads);
      }
  }
  return out;
}

// ---- Paged prefill attention: several new tokens per request (a prompt or a chunk of one),
// each attending causally to the request's cached tokens and to the new ones up to itself. The
// step's K/V are already in the pool. A work item is (request, KV head, tile of new tokens):
// the tile's query rows (tokens x heads of the group) share every K and V row they read. Scores
// for 16 context tokens at a time come from a transposed K tile; the softmax is the online
// (flash) form, so no score matrix is kept.

namespace {

constexpr int64_t kTokenTile = 16;
constexpr int64_t kMaxQueryRows = 48;
constexpr int64_t kTileVecs = kTokenTile / kVec;  // one score per tile token

// An item covers the context tokens [t_begin, t_end): the whole context its rows see, or one
// part of it (see kPrefillPartTokens); a part leaves its unnormalized output and softmax
// statistics at `part` of the call's part buffers (-1: a whole item writes its rows' output).
struct PrefillItem {
  int64_t segment, first, rows_tokens, kv_head, cost, t_begin, t_end, part;
};

// A row's context is computed in parts that start at multiples of this many tokens, folded in
// order (fold_parts), however the new tokens are chunked or batched: a row's result depends on its
// position and its context alone. A whole item folds its parts as its tiles cross their starts;
// when there are too few items for the threads (a few new tokens after a long context: a draft
// model's catch-up, the last small chunk of a prompt), each part is an item of its own, folded
// after. A multiple of kTokenTile; long enough that a fold (a row's output scaled and added) costs
// little against the part's tiles.
constexpr int64_t kPrefillPartTokens = 256;
static_assert(kPrefillPartTokens % kTokenTile == 0, "parts of whole tiles");

// Per-thread scratch of prefill_item, allocated once per call. Row counts are rounded up to a
// multiple of 4 (the score kernel's row block); the extra query rows stay zero.
struct PrefillScratch {
  std::vector<float> qs, o, kt, s, p, m, l;
  std::vector<float> fo, fm, fl;  // the fold of the parts before the current one
  std::vector<float> kw, vw;  // a tile's K and V rows widened to fp32 (a 16-bit pool)
  std::vector<int64_t> low, limit;  // each row's visible context positions: [low, limit)
  PrefillScratch(int64_t rows, int64_t dim)
      : qs((rows + 3) / 4 * 4 * dim), o(rows * dim), kt(dim * kTokenTile), s((rows + 3) / 4 * 4 * kTokenTile),
        p(rows * kTokenTile), m(rows), l(rows), fo(rows * dim), fm(rows), fl(rows), kw(kTokenTile * dim),
        vw(kTokenTile * dim), low(rows), limit(rows) {}
};

// The tile's keys transposed into kt[d * kTokenTile + i] (rows past nt zero), so that a score
// vector holds consecutive tokens. With AVX2 (AVX-512 builds too), 8 x 8 blocks at a time in
// 8-float vectors: element by element, an AVX-512 build's prefill attention ran 1.20x slower and
// 5 new tokens after 450 1.43x (2 Zen 4 cores, `kernels_bench.py --against`).
template <int64_t kDim>
inline void transpose_keys(const float* const* krow, int64_t nt, int64_t dim_rt, float* __restrict kt) {
  const int64_t dim = kDim > 0 ? kDim : dim_rt;
#if defined(__AVX2__)
  static_assert(kTokenTile % 8 == 0, "tile of whole 8-token groups");
  if (dim % 8 == 0) {
    for (int64_t i0 = 0; i0 < kTokenTile; i0 += 8)
      for (int64_t d0 = 0; d0 < dim; d0 += 8) {
        __m256 r[8];
        for (int64_t j = 0; j < 8; ++j) r[j] = i0 + j < nt ? _mm256_loadu_ps(krow[i0 + j] + d0) : _mm256_setzero_ps();
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        float* out = kt + d0 * kTokenTile + i0;
        _mm256_storeu_ps(out + 0 * kTokenTile, _mm256_permute2f128_ps(u0, u4, 0x20));
        _mm256_storeu_ps(out + 1 * kTokenTile, _mm256_permute2f128_ps(u1, u5, 0x20));
        _mm256_storeu_ps(out + 2 * kTokenTile, _mm256_permute2f128_ps(u2, u6, 0x20));
        _mm256_storeu_ps(out + 3 * kTokenTile, _mm256_permute2f128_ps(u3, u7, 0x20));
        _mm256_storeu_ps(out + 4 * kTokenTile, _mm256_permute2f128_ps(u0, u4, 0x31));
        _mm256_storeu_ps(out + 5 * kTokenTile, _mm256_permute2f128_ps(u1, u5, 0x31));
        _mm256_storeu_ps(out + 6 * kTokenTile, _mm256_permute2f128_ps(u2, u6, 0x31));
        _mm256_storeu_ps(out + 7 * kTokenTile, _mm256_permute2f128_ps(u3, u7, 0x31));
      }
    return;
  }
#endif
  for (int64_t i = 0; i < kTokenTile; ++i)
    for (int64_t d = 0; d < dim; ++d) kt[d * kTokenTile + i] = i < nt ? krow[i][d] : 0.f;
}

// One row of a prefill tile: its scores s (kTokenTile, those before `hidden` and from `visible` on
// masked) become the weights pr = exp(s - m') against the row's running max m' (its sum l and its
// output o rescaled to it). In the portable build, one body for every row (INFLIGHT_ONE_BODY):
// inlined into prefill_item, GCC compiled it so that rows of one call took different paths
// through its exp and sums, and a chunked prompt's rows differed from the whole prompt's in the
// last bit (seen once the file grew by an unrelated kernel, which changed what GCC inlined). The
// vector builds inline it: a call per row cost 9% of a 5-token prefill after 450 tokens on
// AVX-512, and their rows agree (tests/test_attention.py, run against every build).
#if defined(__AVX2__)
#define INFLIGHT_TILE_ROW inline __attribute__((always_inline))
#else
#define INFLIGHT_TILE_ROW INFLIGHT_ONE_BODY
#endif
INFLIGHT_TILE_ROW void tile_weights(float* __restrict s, float* __restrict pr, int64_t hidden, int64_t visible,
                                    float softcap, float& m, float& l, float* __restrict o, int64_t dim) {
  if (visible <= hidden) {
    std::fill(pr, pr + kTokenTile, 0.f);
    return;
  }
  soft_cap(s + hidden, visible - hidden, softcap);
  for (int64_t i = 0; i < hidden; ++i) s[i] = kNoScore;
  for (int64_t i = visible; i < kTokenTile; ++i) s[i] = kNoScore;
  float mx = m;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < kTokenTile; ++i) mx = std::max(mx, s[i]);
  // The first tile's old sum is empty. The exponents are floored at -80 and the masked
  // weights set to 0 after: a vector of exp() with a lane far below -87 (a masked score,
  // or e^x < 1e-38) takes glibc's slow path, a scalar call per lane, which cost a tenth of
  // this kernel's time. Weights below e^-80 = 2e-35 of the row's largest make no
  // difference to its fp32 sums.
  const float alpha = m == kNoScore ? 0.f : std::exp(m - mx);
#pragma omp simd
  for (int64_t i = 0; i < kTokenTile; ++i) pr[i] = std::exp(std::max(s[i] - mx, -80.f));
  for (int64_t i = 0; i < hidden; ++i) pr[i] = 0.f;
  for (int64_t i = visible; i < kTokenTile; ++i) pr[i] = 0.f;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < kTokenTile; ++i) sum += pr[i];
  l = l * alpha + sum;
  m = mx;
  if (alpha != 1.f) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] *= alpha;
  }
}

template <int64_t kDim>
void prefill_item(const Pool& pool, const int64_t* table, int64_t ctx_start, const float* q, int64_t num_heads,
                  int64_t group, int64_t dim_rt, float scale, int64_t window, float softcap, const float* sinks,
                  const float* slopes, const PrefillItem& it, PrefillScratch& sc, float* out, float* part_o, float* part_m, float* part_l) {
  const int64_t dim = kDim > 0 ? kDim : dim_rt;
  const int64_t bs = pool.block_size, stride = pool.slot_stride, rows = it.rows_tokens * group;
  float* qs = sc.qs.data();
  float* o = sc.o.data();
  float* kt = sc.kt.data();
  float* p = sc.p.data();
  std::fill(sc.qs.begin(), sc.qs.end(), 0.f);
  reset_parts(o, sc.m.data(), sc.l.data(), rows, dim);
  const float* vrow[kTokenTile];
  for (int64_t tq = 0; tq < it.rows_tokens; ++tq)
    for (int64_t hg = 0; hg < group; ++hg) {
      const int64_t r = tq * group + hg;
      const float* src = q + ((it.first + tq) * num_heads + it.kv_head * group + hg) * dim;
      for (int64_t d = 0; d < dim; ++d) qs[r * dim + d] = src[d] * scale;
      sc.limit[r] = ctx_start + it.first + tq + 1;
      sc.low[r] = window > 0 ? std::max<int64_t>(0, sc.limit[r] - window) : 0;
    }
  const int64_t max_len = std::min(ctx_start + it.first + it.rows_tokens, it.t_end);
  // From the tile holding the first row's first visible token: the rows are consecutive tokens.
  const int64_t start = std::max(sc.low[0] / kTokenTile * kTokenTile, it.t_begin);
  bool folded = false;
  for (int64_t t0 = start; t0 < max_len; t0 += kTokenTile) {
    if (t0 > start && t0 % kPrefillPartTokens == 0) {  // a new part: the last one folded, a fresh start
      if (!folded) reset_parts(sc.fo.data(), sc.fm.data(), sc.fl.data(), rows, dim);
      fold_parts(sc.fo.data(), sc.fm.data(), sc.fl.data(), o, sc.m.data(), sc.l.data(), rows, dim);
      reset_parts(o, sc.m.data(), sc.l.data(), rows, dim);
      folded = true;
    }
    const int64_t nt = std::min(kTokenTile, max_len - t0);
    const float* krow[kTokenTile];
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t t = t0 + i;
      const int64_t slot = table[t / bs] * bs + t % bs;
      krow[i] = pool.floats(pool.k, slot, it.kv_head * dim, dim, sc.kw.data() + i * dim);
      vrow[i] = pool.floats(pool.v, slot, it.kv_head * dim, dim, sc.vw.data() + i * dim);
    }
    transpose_keys<kDim>(krow, nt, dim, kt);
    // Scores of 4 query rows at a time: each K-tile vector is loaded once for the four. The
    // tile's 16 tokens are kTileVecs native vectors (one with AVX-512, two with AVX2).
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      vec acc[4][kTileVecs] = {};
      const float* q0 = qs + r0 * dim;
      for (int64_t d = 0; d < dim; ++d) {
        vec kd[kTileVecs];
        for (int64_t c = 0; c < kTileVecs; ++c) kd[c] = load_vec(kt + d * kTokenTile + c * kVec);
        for (int64_t j = 0; j < 4; ++j) {
          const float qv = q0[j * dim + d];
          for (int64_t c = 0; c < kTileVecs; ++c) acc[j][c] += qv * kd[c];
        }
      }
      float* srow = sc.s.data() + r0 * kTokenTile;
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t c = 0; c < kTileVecs; ++c) store_vec(srow + j * kTokenTile + c * kVec, acc[j][c]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::max<int64_t>(0, std::min(nt, sc.limit[r] - t0));
      const int64_t hidden = std::min(std::max<int64_t>(0, sc.low[r] - t0), kTokenTile);  // before the window
      if (slopes != nullptr)  // the row's head: it.kv_head's group's (r % group)-th; its position limit - 1
        add_alibi(sc.s.data() + r * kTokenTile, hidden, visible, slopes[it.kv_head * group + r % group],
                  t0 - (sc.limit[r] - 1));
      tile_weights(sc.s.data() + r * kTokenTile, p + r * kTokenTile, hidden, visible, softcap, sc.m[r], sc.l[r],
                   o + r * dim, dim);
    }
    pv_tile<kDim>(p, kTokenTile, vrow, nt, o, rows, dim);
  }
  if (it.part >= 0) {  // one part of the item's context: folded with the others by the caller
    const int64_t item_rows = static_cast<int64_t>(sc.m.size());  // the rows of the call's largest item
    std::copy(o, o + rows * dim, part_o + it.part * item_rows * dim);
    std::copy(sc.m.begin(), sc.m.begin() + rows, part_m + it.part * item_rows);
    std::copy(sc.l.begin(), sc.l.begin() + rows, part_l + it.part * item_rows);
    return;
  }
  // A lone part is its own fold (fold_parts copies a part into an empty fold).
  if (folded) fold_parts(sc.fo.data(), sc.fm.data(), sc.fl.data(), o, sc.m.data(), sc.l.data(), rows, dim);
  const float* result = folded ? sc.fo.data() : o;
  const float* weights = folded ? sc.fl.data() : sc.l.data();
  const float* maxima = folded ? sc.fm.data() : sc.m.data();
  for (int64_t tq = 0; tq < it.rows_tokens; ++tq)  // a token's rows: its heads of this KV head's group
    finish_parts(result + tq * group * dim, weights + tq * group, group, dim,
                 out + ((it.first + tq) * num_heads + it.kv_head * group) * dim, maxima + tq * group,
                 sinks != nullptr ? sinks + it.kv_head * group : nullptr, group);
}

}  // namespace

// q: [N, H, D], the new tokens of S requests back to back; segment s owns rows
// [q_starts[s], q_starts[s] + q_lens[s]), which sit at positions ctx_starts[s]... of a context
// whose blocks are block_tables[s] (the step's K/V already written; a 16-bit pool is widened to
// fp32 a tile of rows at a time). Returns [N, H, D].
// window > 0: each token attends to its last `window` positions only; softcap > 0: scores
// soft-capped; alibi: ALiBi's slopes (as paged_decode_attention).
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_tables, torch::Tensor q_starts, torch::Tensor q_lens,
                                      torch::Tensor ctx_starts, int64_t block_size, double scale, int64_t window,
                                      double softcap, c10::optional<torch::Tensor> sinks,
                                      c10::optional<torch::Tensor> alibi) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "float32 queries only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs only");
  for (const auto& t : {block_tables, q_starts, q_lens, ctx_starts})
    TORCH_CHECK(t.dtype() == torch::kInt64 && t.is_contiguous(), "int64 contiguous tables only");
  const int64_t num_heads = q.size(1), dim = q.size(2), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(2) == dim, "head shapes do not match");
  const int64_t group = num_heads / num_kv_heads, num_segments = q_starts.numel();
  const float* sink = per_head(sinks, num_heads, "attention sinks");
  const float* slopes = per_head(alibi, num_heads, "ALiBi slopes");
  const int64_t tokens_per_item = std::max<int64_t>(1, kMaxQueryRows / group);
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const int64_t* ctx = ctx_starts.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  std::vector<PrefillItem> items;
  for (int64_t s = 0; s < num_segments; ++s) {
    TORCH_CHECK(starts[s] >= 0 && lens[s] >= 0 && starts[s] + lens[s] <= q.size(0), "segment out of range");
    TORCH_CHECK(ctx[s] + lens[s] <= max_blocks * block_size, "context exceeds its block table");
    for (int64_t first = 0; first < lens[s]; first += tokens_per_item)
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        const int64_t n = std::min(tokens_per_item, lens[s] - first);
        const int64_t end = ctx[s] + first + n;
        items.push_back({s, first, n, g, window > 0 ? std::min(end, window + n) : end, 0, end, -1});
      }
  }
  // Too few items to keep the threads busy (a few new tokens of one request: one item a KV
  // head): each item whose visible context has several parts becomes one item a part, folded
  // below in order, as the item itself would have folded them.
  const int64_t threads = at::get_num_threads(), unsplit = static_cast<int64_t>(items.size());
  struct SplitItem {
    PrefillItem item;
    int64_t first_part, parts;
  };
  std::vector<SplitItem> split;
  int64_t num_parts = 0;
  if (threads > 1 && unsplit > 0 && unsplit < 2 * threads) {
    std::vector<PrefillItem> cut;
    for (const PrefillItem& it : items) {
      const int64_t end = ctx[it.segment] + it.first + it.rows_tokens;
      const int64_t low = window > 0 ? std::max<int64_t>(0, ctx[it.segment] + it.first + 1 - window) : 0;
      const int64_t begin = low / kTokenTile * kTokenTile;
      if (end - begin <= kPrefillPartTokens - begin % kPrefillPartTokens) {  // one part
        cut.push_back(it);
        continue;
      }
      split.push_back({it, num_parts, 0});
      for (int64_t t = begin; t < end;) {
        PrefillItem part = it;
        part.t_begin = t, part.t_end = std::min(end, (t / kPrefillPartTokens + 1) * kPrefillPartTokens);
        part.cost = part.t_end - t, part.part = num_parts++;
        cut.push_back(part);
        ++split.back().parts;
        t = part.t_end;
      }
    }
    items = std::move(cut);
  }
  const int64_t item_rows = tokens_per_item * group;
  std::vector<float> part_o(num_parts * item_rows * dim), part_m(num_parts * item_rows), part_l(num_parts * item_rows);
  // Longest contexts first, so that the last items the threads pick up are short.
  std::sort(items.begin(), items.end(), [](const PrefillItem& a, const PrefillItem& b) { return a.cost > b.cost; });
  auto out = torch::empty_like(q);
  const Pool pool(k_cache, v_cache, block_size);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    PrefillScratch scratch(item_rows, dim);
    for (int64_t i = next++; i < num_items; i = next++) {
      const PrefillItem& it = items[i];
      const float* qs = qp + starts[it.segment] * num_heads * dim;
      float* os = op + starts[it.segment] * num_heads * dim;
      const int64_t* table = tables + it.segment * max_blocks;
      if (dim == 64)
        prefill_item<64>(pool, table, ctx[it.segment], qs, num_heads, group, dim, fscale, window, fcap, sink, slopes,
                        it,
                        scratch, os, part_o.data(), part_m.data(), part_l.data());
      else if (dim == 128)
        prefill_item<128>(pool, table, ctx[it.segment], qs, num_heads, group, dim, fscale, window, fcap, sink, slopes,
                        it,
                        scratch, os, part_o.data(), part_m.data(), part_l.data());
      else
        prefill_item<0>(pool, table, ctx[it.segment], qs, num_heads, group, dim, fscale, window, fcap, sink, slopes,
                        it,
                        scratch, os, part_o.data(), part_m.data(), part_l.data());
    }
  });
  for (const SplitItem& sp : split) {  // each split item's parts folded into its rows
    const PrefillItem& it = sp.item;
    const int64_t rows = it.rows_tokens * group;
    std::vector<float> O(rows * dim), M(rows), L(rows);
    reset_parts(O.data(), M.data(), L.data(), rows, dim);
    for (int64_t i = sp.first_part; i < sp.first_part + sp.parts; ++i)
      fold_parts(O.data(), M.data(), L.data(), part_o.data() + i * item_rows * dim, part_m.data() + i * item_rows,
                 part_l.data() + i * item_rows, rows, dim);
    for (int64_t tq = 0; tq < it.rows_tokens; ++tq)  // a token's rows: its heads of this KV head's group
      finish_parts(O.data() + tq * group * dim, L.data() + tq * group, group, dim,
                   op + ((starts[it.segment] + it.first + tq) * num_heads + it.kv_head * group) * dim,
                   M.data() + tq * group, sink != nullptr ? sink + it.kv_head * group : nullptr, group);
  }
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

// rms_norm_row's arithmetic, writing over x.
inline void rms_norm_row_in_place(float* x, const float* __restrict w, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = w[i] * (x[i] * inv);
}

// LayerNorm of a row: (x - mean) / sqrt(var + eps) * w (+ b where b is not null), the variance
// the biased one, both in two passes over the row as torch's layer_norm computes them.
inline void layer_norm_row(const float* __restrict x, const float* __restrict w, const float* __restrict b,
                           float* __restrict out, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const float mean = sum / static_cast<float>(n);
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += (x[i] - mean) * (x[i] - mean);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  if (b != nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * ((x[i] - mean) * inv) + b[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * ((x[i] - mean) * inv);
  }
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1), "bad shapes");
}

// A LayerNorm's bias as a pointer (null: none), checked against its weight.
const float* norm_bias(const c10::optional<torch::Tensor>& bias, const torch::Tensor& weight) {
  if (!bias || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == weight.numel(),
              "a float32 bias as long as the weight");
  return bias->data_ptr<float>();
}

}  // namespace

namespace {

// norm_row(x, weight, out, n) over each row of x [N, H] into a new tensor.
template <typename NormRow>
torch::Tensor norm_rows(const torch::Tensor& x, const torch::Tensor& weight, NormRow norm_row) {
  check_rows(x, weight);
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * n, wp, op + r * n, n);
  });
  return out;
}

// The residual stream's update and the next norm in one pass: hidden += delta (in place), then
// norm_row(hidden, weight, out, n) over each row into a new tensor.
template <typename NormRow>
torch::Tensor add_norm_rows(torch::Tensor& hidden, const torch::Tensor& delta, const torch::Tensor& weight,
                            NormRow norm_row) {
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
      norm_row(h, wp, op + r * n, n);
    }
  });
  return out;
}

}  // namespace

// Llama's RMSNorm of each row of x [N, H]: w * x / sqrt(mean(x^2) + eps).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  const float e = static_cast<float>(eps);
  return norm_rows(x, weight, [e](const float* r, const float* w, float* o, int64_t n) { rms_norm_row(r, w, o, n, e); });
}

// hidden += delta (in place), then returns rms_norm(hidden) * weight.
torch::Tensor add_rms_norm_(torch::Tensor hidden, torch::Tensor delta, torch::Tensor weight, double eps) {
  const float e = static_cast<float>(eps);
  return add_norm_rows(hidden, delta, weight, [e](const float* r, const float* w, float* o, int64_t n) {
    rms_norm_row(r, w, o, n, e);
  });
}

// LayerNorm of each row of x [N, H] (StableLM's, StarCoder2's, Phi-2's; Command R's without a
// bias): weight * (x - mean) / sqrt(var + eps) + bias.
torch::Tensor layer_norm(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, double eps) {
  const float* bp = norm_bias(bias, weight);
  const float e = static_cast<float>(eps);
  return norm_rows(x, weight, [bp, e](const float* r, const float* w, float* o, int64_t n) {
    layer_norm_row(r, w, bp, o, n, e);
  });
}

// add_rms_norm_ with a LayerNorm: hidden += delta (in place), then returns layer_norm(hidden).
torch::Tensor add_layer_norm_(torch::Tensor hidden, torch::Tensor delta, torch::Tensor weight,
                              c10::optional<torch::Tensor> bias, double eps) {
  const float* bp = norm_bias(bias, weight);
  const float e = static_cast<float>(eps);
  return add_norm_rows(hidden, delta, weight, [bp, e](const float* r, const float* w, float* o, int64_t n) {
    layer_norm_row(r, w, bp, o, n, e);
  });
}

namespace {

// Where a step's new K and V go: a layer's KV pool (k_cache, v_cache: [num_slots, KV, D], fp32 or
// 16-bit) and a slot for each of `rows` tokens, checked once.
struct KvSlots {
  char* kp = nullptr;
  char* vp = nullptr;
  KvType kv = KvType::kF32;
  int64_t slot_bytes = 0, kv_width = 0;
  torch::Tensor slot_tensor;
  const int64_t* slots = nullptr;

  KvSlots(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slot_mapping, int64_t rows,
          int64_t num_kv_heads, int64_t head_dim)
      : kv(kv_type(k_cache, v_cache)), kv_width(num_kv_heads * head_dim) {
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                k_cache.size(1) == num_kv_heads && k_cache.size(2) == head_dim, "bad KV pool");
    slot_tensor = slot_mapping.contiguous();
    TORCH_CHECK(slot_tensor.dtype() == torch::kInt64 && slot_tensor.numel() == rows, "slots must be int64 [N]");
    slots = slot_tensor.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(slots[r] >= 0 && slots[r] < k_cache.size(0), "slot out of the KV pool");
    kp = static_cast<char*>(k_cache.data_ptr());
    vp = static_cast<char*>(v_cache.data_ptr());
    slot_bytes = kv_width * k_cache.element_size();
  }

  // Row r's k and v (kv_width values each, v right after k) into its slot (a 16-bit pool rounded to
  // nearest even, as torch's `.to()`).
  void store(const float* k, int64_t r) const {
    narrow_kv(k, kv, kp + slots[r] * slot_bytes, kv_width);
    narrow_kv(k + kv_width, kv, vp + slots[r] * slot_bytes, kv_width);
  }
};

void check_qkv(const torch::Tensor& qkv) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && qkv.dim() == 2 && qkv.stride(1) == 1, "float32 [N, width] rows only");
}

}  // namespace

// Rotary embedding (the rotate-half form) applied in place to the query and key heads at the
// front of each row of the fused projection qkv [N, (H + 2 KV) * D]. cos/sin: [max_pos, D];
// positions: [N] (int64). With a KV pool (k_cache, v_cache: [num_slots, KV, D]) and slots [N],
// each row's rotated key and its value are also written to its slot: the step's KV store (in a
// 16-bit pool rounded to nearest even, as torch's `.to()`).
void rotary_qk_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, c10::optional<torch::Tensor> k_cache,
                c10::optional<torch::Tensor> v_cache, c10::optional<torch::Tensor> slot_mapping) {
  check_qkv(qkv);
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "bad layout");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && positions.numel() == qkv.size(0), "positions must be int64 [N]");
  TORCH_CHECK(head_dim % 2 == 0 && cos.size(1) == head_dim, "head_dim mismatch");
  const int64_t rotated_heads = num_heads + num_kv_heads, half = head_dim / 2, row_stride = qkv.stride(0);
  const int64_t max_pos = cos.size(0);
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < qkv.size(0); ++r)
    TORCH_CHECK(pp[r] >= 0 && pp[r] < max_pos, "position out of the rotary table");
  c10::optional<KvSlots> store;
  if (slot_mapping.has_value()) {
    TORCH_CHECK(k_cache.has_value() && v_cache.has_value(), "a KV store needs both caches");
    store.emplace(*k_cache, *v_cache, *slot_mapping, qkv.size(0), num_kv_heads, head_dim);
  }
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, qkv.size(0), row_grain(rotated_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + pp[r] * head_dim;
      const float* s = sp + pp[r] * head_dim;
      float* row = base + r * row_stride;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        float* x = row + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s[i];
          x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
      if (store) store->store(row + num_heads * head_dim, r);
    }
  });
}

// Each row's k and v of the fused projection qkv [N, (H + 2 KV) * D] written to its slot of the KV
// pool, as `rotary_qk_` writes them, without a rotary (Hunyuan's: q and k normalized after theirs).
void store_kv_(torch::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, torch::Tensor k_cache,
               torch::Tensor v_cache, torch::Tensor slot_mapping) {
  check_qkv(qkv);
  const KvSlots slots(k_cache, v_cache, slot_mapping, qkv.size(0), num_kv_heads, head_dim);
  const float* base = qkv.data_ptr<float>();
  const int64_t row_stride = qkv.stride(0);
  at::parallel_for(0, qkv.size(0), row_grain(2 * num_kv_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) slots.store(base + r * row_stride + num_heads * head_dim, r);
  });
}

// LFM2's short convolution over a step's rows: bcx [N, 3H] fp32, each row's b, c and x thirds;
// taps [H, K] fp32, the depthwise convolution's; pool [num_slots, H] (fp32, bf16 or fp16), the
// layer's share of the paged pool; slots [N] (int64), each row's own slot; conv_slots [N, K]
// (int64), the slots of the K positions a row's convolution reads, oldest first and its own last
// (-1: before the first position, which reads as 0). Writes each row's b * x to its slot (rounded
// as the pool holds it: all rows first, so a row reads those before it in the same step), then
// returns c * sum_j taps[:, j] * pool[conv_slots[r, j]], [N, H], summed in tap order.
torch::Tensor short_conv_(const torch::Tensor& bcx, const torch::Tensor& taps, torch::Tensor pool,
                          const torch::Tensor& slot_mapping, const torch::Tensor& conv_slots) {
  check_qkv(bcx);
  const int64_t rows = bcx.size(0), hidden = bcx.size(1) / 3, k = taps.size(-1);
  TORCH_CHECK(bcx.size(1) == 3 * hidden && taps.dtype() == torch::kFloat32 && taps.dim() == 2 &&
                  taps.size(0) == hidden, "bcx [N, 3H] and taps [H, K] of float32");
  TORCH_CHECK(pool.dim() == 2 && pool.size(1) == hidden && pool.is_contiguous(), "a pool [slots, H]");
  const KvType type = kv_type(pool, pool);
  const torch::Tensor own = slot_mapping.contiguous(), read = conv_slots.contiguous();
  TORCH_CHECK(own.dtype() == torch::kInt64 && own.numel() == rows && read.dtype() == torch::kInt64 &&
                  read.dim() == 2 && read.size(0) == rows && read.size(1) == k, "slots [N] and conv_slots [N, K] of int64");
  const int64_t* own_slot = own.data_ptr<int64_t>();
  const int64_t* read_slot = read.data_ptr<int64_t>();
  const int64_t num_slots = pool.size(0);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(own_slot[r] >= 0 && own_slot[r] < num_slots, "slot out of the pool");
    for (int64_t j = 0; j < k; ++j) TORCH_CHECK(read_slot[r * k + j] < num_slots, "conv slot out of the pool");
  }
  const torch::Tensor by_tap = taps.t().contiguous();  // [K, H]: a tap's weights side by side
  const float* w = by_tap.data_ptr<float>();
  const float* base = bcx.data_ptr<float>();
  const int64_t stride = bcx.stride(0), slot_bytes = hidden * pool.element_size();
  char* p = static_cast<char*>(pool.data_ptr());
  const int64_t grain = row_grain(3 * hidden);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> bx(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const float* b = base + r * stride;
      const float* x = b + 2 * hidden;
#pragma omp simd
      for (int64_t c = 0; c < hidden; ++c) bx[c] = b[c] * x[c];
      narrow_kv(bx.data(), type, p + own_slot[r] * slot_bytes, hidden);
    }
  });
  torch::Tensor out = torch::empty({rows, hidden}, bcx.options().memory_format(at::MemoryFormat::Contiguous));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(hidden), wide(hidden);
    for (int64_t r = begin; r < end; ++r) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t slot = read_slot[r * k + j];
        if (slot < 0) continue;
        const char* at_slot = p + slot * slot_bytes;
        const float* v = reinterpret_cast<const float*>(at_slot);
        if (type != KvType::kF32) {
          widen_kv(at_slot, type, wide.data(), hidden);
          v = wide.data();
        }
        const float* tap = w + j * hidden;
#pragma omp simd
        for (int64_t c = 0; c < hidden; ++c) acc[c] += tap[c] * v[c];
      }
      const float* gate = base + r * stride + hidden;
#pragma omp simd
      for (int64_t c = 0; c < hidden; ++c) o[r * hidden + c] = gate[c] * acc[c];
    }
  });
  return out;
}

namespace {

// A gated MLP's activation: gate_up [N, 2I] (gate, then up) -> gated(gate, up) [N, I].
template <typename Gated>
torch::Tensor act_and_mul(const torch::Tensor& gate_up, Gated gated) {
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
      for (int64_t i = 0; i < inter; ++i) o[i] = gated(g[i], u[i]);
    }
  });
  return out;
}

}  // namespace

// SwiGLU's gate: silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  return act_and_mul(gate_up, [](float g, float u) {
    return g / (1.f + std::exp(std::min(-g, 80.f))) * u;  // no inf under fast-math
  });
}

// gpt-oss's experts' gate: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
torch::Tensor clamped_swiglu(torch::Tensor gate_up, double alpha, double limit) {
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);
  return act_and_mul(gate_up, [a, lim](float g, float u) {
    const float x = std::min(g, lim), y = std::min(std::max(u, -lim), lim);
    return (y + 1.f) * (x / (1.f + std::exp(std::min(-a * x, 80.f))));
  });
}

namespace {

// An ungated MLP's activation: x [N, I] -> act(x), every element.
template <typename Act>
torch::Tensor act_each(const torch::Tensor& x, Act act) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "float32 contiguous rows only");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t width = x.size(1);
  at::parallel_for(0, x.size(0), row_grain(width), [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin * width; i < end * width; ++i) op[i] = act(xp[i]);
  });
  return out;
}

// GELU in its tanh form.
inline float gelu_tanh_of(float x) {
  constexpr float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2 / pi)
  return 0.5f * x * (1.f + std::tanh(k0 * (x + k1 * x * x * x)));
}

}  // namespace

// An ungated MLP's activation (Arcee's): relu(x) ** 2, every element.
torch::Tensor relu_squared(torch::Tensor x) {
  return act_each(x, [](float v) {
    const float r = std::max(v, 0.f);
    return r * r;
  });
}

// An ungated MLP's activation (Phi-2's, StarCoder2's): gelu(x), its tanh form, every element.
torch::Tensor gelu_tanh(torch::Tensor x) { return act_each(x, [](float v) { return gelu_tanh_of(v); }); }

// Apertus's ungated MLP's activation, xIELU, with its numbers after their softplus: alpha_p x^2 +
// beta x where x > 0, else (expm1(min(x, eps)) - x) alpha_n + beta x, every element.
torch::Tensor xielu(torch::Tensor x, double alpha_p, double alpha_n, double beta, double eps) {
  const float ap = static_cast<float>(alpha_p), an = static_cast<float>(alpha_n), b = static_cast<float>(beta),
              e = static_cast<float>(eps);
  return act_each(x, [ap, an, b, e](float v) {
    return v > 0.f ? ap * v * v + b * v : (std::expm1(std::min(v, e)) - v) * an + b * v;
  });
}

// GeGLU's gate (Gemma): gelu(gate) * up, GELU in its tanh form.
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  return act_and_mul(gate_up, [](float x, float u) { return gelu_tanh_of(x) * u; });
}

// q and k of the fused projection qkv [N, (H + 2 KV) * D] RMS-normalized in place (Qwen3,
// OLMo 2, Gemma 3), each in groups of its scale's length: one head, or the whole projection.
void qk_norm_(torch::Tensor qkv, torch::Tensor q_scale, torch::Tensor k_scale, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double eps) {
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && qkv.dim() == 2 && qkv.stride(1) == 1, "float32 [N, width] rows only");
  TORCH_CHECK(q_scale.dtype() == torch::kFloat32 && k_scale.dtype() == torch::kFloat32 && q_scale.is_contiguous() &&
              k_scale.is_contiguous(), "float32 contiguous scales only");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t qg = q_scale.numel(), kg = k_scale.numel();
  TORCH_CHECK(qg > 0 && kg > 0 && q_size % qg == 0 && kv_size % kg == 0 && qkv.size(1) >= q_size + kv_size,
              "each scale must divide its projection");
  float* base = qkv.data_ptr<float>();
  const float* qw = q_scale.data_ptr<float>();
  const float* kw = k_scale.data_ptr<float>();
  const int64_t row_stride = qkv.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, qkv.size(0), row_grain(q_size + kv_size), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = base + r * row_stride;
      for (int64_t j = 0; j < q_size; j += qg) rms_norm_row_in_place(row + j, qw, qg, e);
      for (int64_t j = 0; j < kv_size; j += kg) rms_norm_row_in_place(row + q_size + j, kw, kg, e);
    }
  });
}

// ---- Greedy sampling's argmax of each row of the logits: the first index of the largest value,
// or of the first NaN, as torch.argmax picks. torch's reduction took 3.5 ms for 64 rows of a
// 49k vocabulary on two threads here (2% of a 64-request decode step); two vectorized passes
// over each row (its maximum, then the first index holding it) take 0.5 ms.

namespace {

// NaN tests on the bits: -ffast-math lets the compiler assume that no float is a NaN.
inline bool is_nan_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

int64_t row_argmax(const float* x, int64_t n) {
  int64_t i = 0;
  float mx = x[0];
  bool nan = false;
#if defined(__AVX2__)
  if (n >= 8) {
    __m256 vmax = _mm256_loadu_ps(x);
    __m256i vnan = _mm256_setzero_si256();
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf_bits = _mm256_set1_epi32(0x7f800000);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      vmax = _mm256_max_ps(vmax, v);
      const __m256i bits = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
      vnan = _mm256_or_si256(vnan, _mm256_cmpgt_epi32(bits, inf_bits));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (float v : lanes) mx = std::max(mx, v);
    nan = !_mm256_testz_si256(vnan, vnan);
  }
#endif
  for (; i < n; ++i) {
    mx = std::max(mx, x[i]);
    nan = nan || is_nan_bits(x[i]);
  }
  for (int64_t j = 0; j < n; ++j)
    if (nan ? is_nan_bits(x[j]) : x[j] == mx) return j;
  return 0;  // not reached
}

}  // namespace

// logits [N, V] (fp32) -> int64 [N].
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() == 2 && logits.size(1) > 0,
              "float32 [N, V] with V > 0 only");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(xp + r * n, n);
  });
  return out;
}

// ---- Work sharing for the weight matmuls: each thread owns a contiguous range of the panels and
// takes it chunk by chunk from the front, one sequential stream; a thread that runs out takes
// chunks from the back of another's range. On a shared host, where a core's speed changes from
// one moment to the next, a static split left one of two threads waiting for the other for
// about 7% of the matmuls' time over the burst of 64 requests (timed once with a build that
// recorded each thread's finish).

namespace {

class PanelRanges {
 public:
  PanelRanges(int64_t panels, int64_t owners) : ranges_(owners) {
    for (int64_t t = 0; t < owners; ++t) ranges_[t].store(pack(t * panels / owners, (t + 1) * panels / owners));
    chunk_ = std::max<int64_t>(1, panels / (owners * 8));
  }
  // Claims the next chunk of range r, from its front (its owner) or its back (another thread).
  bool claim(int64_t r, bool front, int64_t& begin, int64_t& end) {
    uint64_t cur = ranges_[r].load(std::memory_order_relaxed);
    for (;;) {
      const int64_t f = static_cast<int64_t>(cur & 0xffffffffu), b = static_cast<int64_t>(cur >> 32);
      if (f >= b) return false;
      const int64_t n = std::min(chunk_, b - f);
      begin = front ? f : b - n;
      end = front ? f + n : b;
      const uint64_t next = front ? pack(f + n, b) : pack(f, b - n);
      if (ranges_[r].compare_exchange_weak(cur, next, std::memory_order_relaxed)) return true;
    }
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }
  std::vector<std::atomic<uint64_t>> ranges_;
  int64_t chunk_;
};

// Runs fn(begin, end) over chunks of [0, panels) on every thread, balanced as above.
template <typename F>
void for_panels(int64_t panels, const F& fn) {
  const int64_t owners = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels));
  if (owners == 1) {
    fn(int64_t{0}, panels);
    return;
  }
  PanelRanges ranges(panels, owners);
  at::parallel_for(0, owners, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      int64_t begin, end;
      while (ranges.claim(t, true, begin, end)) fn(begin, end);
      for (int64_t v = 1; v < owners; ++v)
        while (ranges.claim((t + v) % owners, false, begin, end)) fn(begin, end);
    }
  });
}

// fn(first, rows) over rows [0, m) in blocks of at most max_rows, split evenly (8 rows of at most
// 7 as 4 + 4, not 7 + 1).
template <typename F>
void even_row_blocks(int64_t m, int64_t max_rows, const F& fn) {
  const int64_t blocks = (m + max_rows - 1) / max_rows;
  for (int64_t b = 0, r = 0; b < blocks; ++b) {
    const int rows = static_cast<int>((m - r) / (blocks - b));
    fn(r, rows);
    r += rows;
  }
}

// A weight matmul's loop: fn(p, first, rows) for every panel p of [0, panels) and every block of
// at most kRowBlock of the M rows, the panels shared among the threads (for_panels), each thread
// running one block of rows over all its panels before the next, so that the block's
// activations stay in L2 while its panels pass.
constexpr int64_t kRowBlock = 128;
template <typename F>
void panels_by_row_blocks(int64_t panels, int64_t M, const F& fn) {
  for_panels(panels, [&](int64_t begin, int64_t end) {
    for (int64_t first = 0; first < M; first += kRowBlock)
      for (int64_t p = begin; p < end; ++p) fn(p, first, std::min(kRowBlock, M - first));
  });
}

}  // namespace

// ---- Weight matmul y = x @ W.T (+ b) for the few-to-hundreds of rows of a step.
//
// W is packed once into panels of kNR output columns, [ceil(N / kNR), K, kNR], so a panel is
// one contiguous stream. The microkernel keeps an (mr x kNR) block of y in registers, walks K
// broadcasting one activation per row against the panel's vectors, and prefetches the next
// panel while it computes: at decode sizes the weights come from DRAM and the stream must
// overlap the arithmetic. When a panel's rows take several passes (more than kMaxRows rows),
// the first few share that work, each prefetching its part of the next panel spread evenly over
// its k: prefetched all in the first pass, the weight stream idled through the others, and the
// model's matmuls at 7-16 rows ran 1.2-1.4x slower (`kernels_bench.py --against e9c05c7`).
// Threads split the panels. Each output is a plain sum over k in order, so a row's result does
// not depend on how many other rows share the step.

namespace {


// How a pass of the microkernel prefetches the next panel: not at all, one k-row of it per k
// (the whole panel in one pass), or `pf_rows` k-rows from `pf` on, evenly spread over the pass.
enum class Prefetch { kNone, kEvery, kSpread };

// Up to kSpreadPasses passes over a panel all share the next panel's prefetches; of more, the
// first kSharedPassesOfMany do. The matmul is then bound by its arithmetic, and the prefetch
// work slows the passes that carry it (spread over all of 8 to 22 passes, the 48 to 512-row
// matmuls ran 1.07-1.15x slower; prefetched all in the first pass, the 40 to 64-row ones
// 1.03-1.10x slower than with three).
constexpr int64_t kSpreadPasses = 6;
constexpr int64_t kSharedPassesOfMany = 3;

// What a machine may want otherwise is chosen per machine by timing the candidates once per
// build (kernel_tuning.py; set_gemm_tuning): the rows a microkernel pass takes (at most
// kMaxRows: fewer accumulators and fewer activation streams through L1), and whether a panel's
// passes prefetch the next panel at all, apart for a panel taken in one pass (a few rows: the
// weight stream from DRAM is the whole cost) and in several (a core whose own prefetchers follow
// the stream may lose more to the prefetch instructions than they gain). On 2 Zen 4 cores every
// default held (docs/benchmarks.md). None of them changes a result: each output is the same
// in-order sum over k whichever rows share a pass.
struct GemmTuning {
  int64_t max_rows = kMaxRows;
  bool prefetch_one_pass = true;
  bool prefetch_passes = true;
};
GemmTuning g_gemm;

inline void prefetch_panel_row(const float* row) {
  __builtin_prefetch(row);
  if (kNR * sizeof(float) > 64) __builtin_prefetch(row + kVec);
}

template <int MR, Prefetch kPf>
inline void gemm_micro(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
                       const float* __restrict bias, float* __restrict y, int64_t ldy, const float* pf,
                       int64_t pf_rows) {
  vec a0[MR], a1[MR];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = vec{};
  int64_t due = 0;  // kSpread: k-rows owed, in units of 1 / K
  for (int64_t k = 0; k < K; ++k) {
    const vec w0 = *reinterpret_cast<const vec*>(w + k * kNR);
    const vec w1 = *reinterpret_cast<const vec*>(w + k * kNR + kVec);
    if constexpr (kPf == Prefetch::kEvery) {
      prefetch_panel_row(pf + k * kNR);
    } else if constexpr (kPf == Prefetch::kSpread) {
      prefetch_panel_row(pf);  // the same row again until its turn has passed: no branch
      due += pf_rows;
      const bool advance = due >= K;
      due -= advance ? K : 0;
      pf += advance ? kNR : 0;
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const float xv = x[r * ldx + k];
      a0[r] += xv * w0;
      a1[r] += xv * w1;
    }
  }
  if (bias != nullptr) {
    const vec b0 = load_vec(bias), b1 = load_vec(bias + kVec);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) a0[r] += b0, a1[r] += b1;
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    store_vec(y + r * ldy, a0[r]);
    store_vec(y + r * ldy + kVec, a1[r]);
  }
}

template <Prefetch kPf>
void gemm_rows(int mr, const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
               int64_t ldy, const float* pf, int64_t pf_rows) {
  switch (mr) {
#define INFLIGHT_ROWS(n)                                             \
  case n:                                                            \
    if constexpr (n <= kMaxRows) {                                   \
      gemm_micro<n, kPf>(x, ldx, w, K, bias, y, ldy, pf, pf_rows);   \
      return;                                                        \
    }                                                                \
    break;
    INFLIGHT_ROWS(1) INFLIGHT_ROWS(2) INFLIGHT_ROWS(3) INFLIGHT_ROWS(4) INFLIGHT_ROWS(5) INFLIGHT_ROWS(6)
    INFLIGHT_ROWS(7) INFLIGHT_ROWS(8) INFLIGHT_ROWS(9) INFLIGHT_ROWS(10) INFLIGHT_ROWS(11) INFLIGHT_ROWS(12)
    INFLIGHT_ROWS(13) INFLIGHT_ROWS(14)
#undef INFLIGHT_ROWS
    default:
      break;
  }
  TORCH_CHECK(false, "row block of ", mr, " rows is out of range");
}

}  // namespace

int64_t gemm_panel_width() { return kNR; }

int64_t gemm_max_rows() { return kMaxRows; }

void set_gemm_tuning(int64_t max_rows, bool prefetch_one_pass, bool prefetch_passes) {
  TORCH_CHECK(max_rows >= 1 && max_rows <= kMaxRows, "max_rows must be 1 to ", kMaxRows, ", not ", max_rows);
  g_gemm = {max_rows, prefetch_one_pass, prefetch_passes};
}

std::tuple<int64_t, bool, bool> gemm_tuning() {
  return {g_gemm.max_rows, g_gemm.prefetch_one_pass, g_gemm.prefetch_passes};
}

// W [N, K] -> panels [ceil(N / kNR), K, kNR], the last one padded with zero columns.
torch::Tensor pack_linear_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dtype() == torch::kFloat32 && weight.dim() == 2, "float32 [N, K] only");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kNR - 1) / kNR;
  auto padded = torch::zeros({panels * kNR, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kNR, k}).transpose(1, 2).contiguous();
}

// x [M, K] through packed W (out_features N) and an optional bias [N] -> [M, N].
// x's rows as the GEMM microkernels read them: in place, or copied a cache line further apart when
// a row is a multiple of 4 KB. Rows a multiple of 4 KB apart all fall into one L1 set (64 sets of
// 64-byte lines, 8 ways on the cores we run on), so a microkernel's 14 rows evict each other at
// every k (K = 2048 and 4096, every Llama's hidden size: two 1B-shaped layers at 64 rows 1.29x
// faster since on Zen 4, `kernels_bench.py --against`). Copying costs M x K floats against M x K x N FMAs.
constexpr int64_t kFewRows = 4;  // rows that share one L1 set with room left for the weights' lines
struct SpreadRows {
  torch::Tensor keep;
  const float* data;
  int64_t ld;
};
SpreadRows spread_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M <= kFewRows || (K * static_cast<int64_t>(sizeof(float))) % 4096 != 0)
    return {x, x.data_ptr<float>(), K};
  auto padded = torch::empty({M, K + 64 / static_cast<int64_t>(sizeof(float))}, x.options());
  padded.narrow(1, 0, K).copy_(x);
  return {padded, padded.data_ptr<float>(), padded.size(1)};
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                            int64_t out_features) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "float32 [M, K] contiguous only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kNR && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "weight was not packed for this kernel or does not match x");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), n_pad = panels * kNR;
  TORCH_CHECK(out_features <= n_pad && out_features > n_pad - kNR, "out_features does not match the packing");
  torch::Tensor padded_bias;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->numel() == out_features, "bias must be float32 [N]");
    padded_bias = torch::zeros({n_pad}, x.options());
    padded_bias.narrow(0, 0, out_features).copy_(*bias);
  }
  auto y = torch::empty({M, n_pad}, x.options());
  const SpreadRows rows_of_x = spread_rows(x);
  const float* xp = rows_of_x.data;
  const int64_t ldx = rows_of_x.ld;
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? padded_bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  panels_by_row_blocks(panels, M, [&](int64_t p, int64_t m_block, int64_t rows) {
    const float* w = wp + p * K * kNR;
    const float* b = bp != nullptr ? bp + p * kNR : nullptr;
    const float* next = w + K * kNR;  // the next panel, most often this thread's next one
    const int64_t max_rows = g_gemm.max_rows;
    const int64_t chunks = (rows + max_rows - 1) / max_rows;
    const bool prefetch = chunks == 1 ? g_gemm.prefetch_one_pass : g_gemm.prefetch_passes;
    const int64_t sharing = !prefetch ? 0 : chunks <= kSpreadPasses ? chunks : kSharedPassesOfMany;
    int64_t c = 0;
    even_row_blocks(rows, max_rows, [&](int64_t r, int mr) {
      const int64_t m = m_block + r;
      float* out = yp + m * n_pad + p * kNR;
      if (p + 1 == panels || c >= sharing) {
        gemm_rows<Prefetch::kNone>(mr, xp + m * ldx, ldx, w, K, b, out, n_pad, nullptr, 0);
      } else if (sharing == 1) {
        gemm_rows<Prefetch::kEvery>(mr, xp + m * ldx, ldx, w, K, b, out, n_pad, next, K);
      } else {
        const int64_t first = c * K / sharing, last = (c + 1) * K / sharing;
        gemm_rows<Prefetch::kSpread>(mr, xp + m * ldx, ldx, w, K, b, out, n_pad, next + first * kNR, last - first);
      }
      ++c;
    });
  });
  return out_features == n_pad ? y : y.narrow(1, 0, out_features).contiguous();
}

// ---- Weight matmuls straight from GGUF's blocks (and 16-bit weights), at any number of rows.
//
// With a handful of rows a matmul only streams its weights from DRAM. GGUF stores a row as
// blocks of consecutive weights w = d * q + m: q a small integer, d and m from fp16 scales.
// pack_gguf_blocks repacks them once, per panel of 16 output columns and per block of kK
// consecutive k, into one of a few layouts: the 16 columns' d (and m, in a layout with minima)
// in fp16, then the kK x 16 values, 4-bit q (column j in the low nibble of byte j, column j + 8
// in the high one), int8 q, or the stored fp16 / bf16 weights (no scales). The K-quants keep
// their super-blocks of 256: the 16 columns' D (and Dmin) in fp16, then each sub-block's 16
// integer scales (and minima) as bytes, then the values; a sub-block's d = D * scale and
// m = -(Dmin * minimum) are made as the kernels read them. Every type is read so that d is exact
// in fp32 (an 11-bit mantissa times an integer of at most 8 bits), as is d * q, and + m rounds
// once, as gguf's dequantization computes them: each weight is the fp32 value the loader would
// make, and each output the same in-order sum as packed_linear's, bit for bit.
//
//   layout    kK   sub-block  minima  values  bytes a weight  GGUF types (bytes a weight as stored)
//   Q4x32m    32   -          yes     4-bit   0.625           Q4_0 (0.5625), Q4_1 (0.625)
//   Q8x32     32   -          no      int8    1.0625          Q8_0 (1.0625), Q5_0 (0.6875)
//   Q8x32m    32   -          yes     int8    1.125           Q5_1 (0.75)
//   Q4K       256  32         yes     4-bit   0.578           Q4_K (0.5625)
//   Q8K       256  32         yes     int8    1.078           Q5_K (0.6875)
//   Q8K16     256  16         no      int8    1.070           Q6_K (0.8203), Q3_K (0.4297)
//   Q4K16m    256  16         yes     4-bit   0.641           Q2_K (0.3281)
//   Q6K16     256  16         no      6-bit   0.820           Q6_K, Q3_K with int8 activations only
//   IQ4x32    32   -          no      table   0.5625          IQ4_NL (0.5625)
//   IQ4K      256  32         no      table   0.539           IQ4_XS (0.5312)
//   MX4x32    32   -          no      table   0.5625          MXFP4 (0.5312)
//   I8K16     256  16         no      int8    1.078           IQ1_S-IQ3_S, TQ1_0, TQ2_0 (0.195-0.430), decoded
//   F16x32    32   -          -       fp16    2               F16
//   BF16x32   32   -          -       bf16    2               BF16
//
// Q6K16 holds Q6_K's q (0..63, w = d * (q - 32); Q3_K's q - 4 + 32 alike) in 6 bits, for the
// int8-activation matmuls (whose single stream is bound by the bytes it reads): per sub-block of 16 k, the low nibbles as the
// 4-bit layouts hold them (8 bytes a k-row), then per group of 4 k 16 bytes of high bit pairs,
// byte i = 4 c + kk holding, for k-row kk of the group, column c's pair in bits 0-1, column
// 4 + c's in bits 2-3, 8 + c's in 4-5 and 12 + c's in 6-7 (a8_unpack's order: one 16-byte
// broadcast and a shift per half). The fp32 matmuls keep Q6_K in Q8K16, which they unpack faster.
//
// IQ4x32 and IQ4K hold IQ4_NL's and IQ4_XS's 4-bit indices as the 4-bit layouts hold nibbles; a
// kernel turns 16 of them into their int8 values (kIQ4Values, w = d * value) with one byte
// shuffle, then reads them as the int8 layouts' values. IQ4_XS's sub-block scales are signed
// (6 bits, minus 32): d = D * scale times a value of at most 7 bits is exact in fp32, as gguf's.
// MX4x32 is IQ4x32 over MXFP4's table (kMXFP4Values: FP4 e2m1 doubled), its d the block's power
// of two 2^(e - 128) in fp16 (exact from 2^-24 to 2^15, where weights live; a block of zeros
// takes d = 0, any other scale is refused at load).
//
// I8K16 holds what model/grid_quants.py decodes the grid and ternary types into (they index
// codebooks, which no kernel here reads): per 256 weights D = d / 8 in fp32 (no exact fp16 form
// where d is small), per 16 an odd int8 scale of at most 31, int8 values of at most 124; D * scale
// times a value is exact in fp32, as gguf's d * (scale / 8) * value.

#if defined(__AVX2__)
namespace {

constexpr int64_t kQCols = 16;
// Rows per pass. AVX2: 2 x 5 accumulators, the scales and the weights need a register or two more
// than its 16, and the spill costs less than dequantizing the blocks again for a second pass
// (every weight matmul at 4 and 5 rows: 1.4x faster than in passes of 3 and 1 or 3 and 2).
// AVX-512: a panel's 16 columns are one register, so 12 rows take 12 of its 32 (16 spill: the
// embedded model's Q4_1 body at 16 rows 0.87x two passes of 8). A second pass dequantizes the
// panel again, so rows past 8 are one pass up to 12 (9 rows 1.25x, 12 rows 1.07x passes of 8
// and the rest; a verify of 8 proposed tokens is 9 rows), two even ones past it (13: 7 and 6).
// Steps of up to kQRegisterRows rows read the blocks in registers, in passes of kQMaxRows; larger
// ones dequantize each panel once into cache for the fp32 microkernel (gguf_blocks_gemm). With
// AVX-512 two passes still beat that on Zen 4: the embedded model's Q4_1 body at 12 and 16 rows
// 1.16x and 1.12x (`kernels_bench.py --against dc4d6ca`), two 1B-shaped layers of Q4_K and Q6_K
// at 16 rows 1.10x and 1.18x; even at 32 rows.
#if defined(__AVX512F__)
constexpr int kQMaxRows = 12;
constexpr int64_t kQRegisterRows = 16;
#else
constexpr int kQMaxRows = 5;
constexpr int64_t kQRegisterRows = 5;
#endif

enum class Values { kNibble, kInt8, kSixBit, kHalf, kBFloat16, kBFloat16Pairs, kNibbleTable };

// The tables kNibbleTable's 4-bit indices select (`nibble_values`).
enum class Table { kIQ4, kMXFP4 };

// K weights a block, in sub-blocks of Sub (Sub < K: a K-quant's super-block, with integer
// scales per sub-block, signed where SignedScales); D (d) in fp32 where FloatD, else in fp16;
// T: the values kNibbleTable's indices select.
template <int64_t K, int64_t Sub, bool Min, Values V, bool SignedScales = false, bool FloatD = false,
          Table T = Table::kIQ4>
struct Layout {
  static_assert(!(FloatD && Min), "fp32 scales without minima only");
  static constexpr Table kTable = T;
  static constexpr int64_t kK = K, kSub = Sub, kSubBlocks = K / Sub;
  static constexpr bool kMin = Min, kSuper = Sub < K, kSignedScales = SignedScales, kFloatD = FloatD;
  static constexpr Values kValues = V;
  static constexpr bool kScaled =
      V == Values::kNibble || V == Values::kInt8 || V == Values::kSixBit || V == Values::kNibbleTable;
  static constexpr bool kFourBit = V == Values::kNibble || V == Values::kNibbleTable;  // 8 bytes a k-row
  static constexpr int64_t kFloatScaleBytes = kScaled ? (Min ? 2 : 1) * kQCols * (FloatD ? 4 : 2) : 0;  // d (m) or D (Dmin)
  static constexpr int64_t kScaleBytes = kFloatScaleBytes + (kSuper ? (Min ? 2 : 1) * kSubBlocks * kQCols : 0);
  static constexpr int64_t kSubValueBytes =
      Sub * kQCols * (kFourBit ? 2 : V == Values::kSixBit ? 3 : V == Values::kInt8 ? 4 : 8) / 4;
  static constexpr int64_t kBlockBytes = kScaleBytes + kSubBlocks * kSubValueBytes;
};
using Q4x32m = Layout<32, 32, true, Values::kNibble>;
using Q8x32 = Layout<32, 32, false, Values::kInt8>;
using Q8x32m = Layout<32, 32, true, Values::kInt8>;
using Q4K = Layout<256, 32, true, Values::kNibble>;
using Q8K = Layout<256, 32, true, Values::kInt8>;
using Q8K16 = Layout<256, 16, false, Values::kInt8, true>;
using Q4K16m = Layout<256, 16, true, Values::kNibble>;
using Q6K16 = Layout<256, 16, false, Values::kSixBit, true>;
using F16x32 = Layout<32, 32, false, Values::kHalf>;
using BF16x32 = Layout<32, 32, false, Values::kBFloat16>;
// BF16 for bf16 activations (gguf_blocks_bf16_linear): k-rows in pairs, column c's weights at k and
// k + 1 side by side in one 32-bit lane (k's in the low half), as vdpbf16ps multiplies them.
using BF16P = Layout<32, 32, false, Values::kBFloat16Pairs>;
using IQ4x32 = Layout<32, 32, false, Values::kNibbleTable>;
using IQ4K = Layout<256, 32, false, Values::kNibbleTable, true>;
using MX4x32 = Layout<32, 32, false, Values::kNibbleTable, false, false, Table::kMXFP4>;
// The grid and ternary types (IQ1-IQ3, TQ), decoded at load into int8 values (model/grid_quants.py):
// D = d / 8 has no exact fp16 form where d is small, so it is kept in fp32.
using I8K16 = Layout<256, 16, false, Values::kInt8, true, true>;

// IQ4_NL's (and IQ4_XS's) 16 values, which its 4-bit indices select.
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's: FP4 (e2m1) doubled, so that w = 2^(e - 128) * value (ggml's kvalues_mxfp4).
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

template <Table T>
constexpr const int8_t* nibble_values() {
  return T == Table::kIQ4 ? kIQ4Values : kMXFP4Values;
}

// A table plus 128 (unsigned): the int8-activation matmuls' form where vpdpbusd takes them.
template <Table T>
struct BiasedValues {
  uint8_t v[16];
  constexpr BiasedValues() : v() {
    for (int i = 0; i < 16; ++i) v[i] = static_cast<uint8_t>(nibble_values<T>()[i] + 128);
  }
};
template <Table T>
constexpr BiasedValues<T> kBiasedValues{};

enum class LayoutId : int64_t {
  kQ4x32m, kQ8x32, kQ8x32m, kQ4K, kQ8K, kQ8K16, kQ4K16m, kF16x32, kBF16x32, kQ6K16, kBF16P, kIQ4x32, kIQ4K, kI8K16,
  kMX4x32, kCount
};

// fn(layout), called with a value of the layout's type.
template <class F>
void with_layout(LayoutId id, F&& fn) {
  switch (id) {
    case LayoutId::kQ4x32m: return fn(Q4x32m{});
    case LayoutId::kQ8x32: return fn(Q8x32{});
    case LayoutId::kQ8x32m: return fn(Q8x32m{});
    case LayoutId::kQ4K: return fn(Q4K{});
    case LayoutId::kQ8K: return fn(Q8K{});
    case LayoutId::kQ8K16: return fn(Q8K16{});
    case LayoutId::kQ4K16m: return fn(Q4K16m{});
    case LayoutId::kF16x32: return fn(F16x32{});
    case LayoutId::kBF16x32: return fn(BF16x32{});
    case LayoutId::kQ6K16: return fn(Q6K16{});
    case LayoutId::kBF16P: return fn(BF16P{});
    case LayoutId::kIQ4x32: return fn(IQ4x32{});
    case LayoutId::kIQ4K: return fn(IQ4K{});
    case LayoutId::kI8K16: return fn(I8K16{});
    case LayoutId::kMX4x32: return fn(MX4x32{});
    default: TORCH_CHECK(false, "unknown block layout");
  }
}

// Bytes of one panel (16 columns, all K) in a layout.
int64_t panel_bytes(LayoutId id, int64_t K) {
  int64_t bytes = 0;
  with_layout(id, [&](auto layout) { bytes = K / decltype(layout)::kK * decltype(layout)::kBlockBytes; });
  return bytes;
}

// kI8K16: not a GGUF type but the int8 form model/grid_quants.py decodes IQ1-IQ3 and TQ into: per
// 256 weights D (fp32), 16 int8 scales, 256 int8 values (w = D * scale * value).
enum class GgufType { kQ4_0, kQ4_1, kQ4_K, kQ5_0, kQ8_0, kQ5_1, kQ5_K, kQ6_K, kQ3_K, kQ2_K, kF16, kBF16, kIQ4_NL, kIQ4_XS,
                      kI8K16, kMXFP4 };

// A GGUF type as stored: the bytes and weights of one of its blocks (a super-block of 256 for
// the K-quants), and the layout it is packed into.
struct FileType {
  GgufType type;
  LayoutId layout;
  int64_t bytes, weights;
};

FileType file_type(const std::string& name) {
  static const std::vector<std::pair<std::string, FileType>> types = {
      {"Q4_0", {GgufType::kQ4_0, LayoutId::kQ4x32m, 18, 32}},   {"Q4_1", {GgufType::kQ4_1, LayoutId::kQ4x32m, 20, 32}},
      {"Q4_K", {GgufType::kQ4_K, LayoutId::kQ4K, 144, 256}}, {"Q5_0", {GgufType::kQ5_0, LayoutId::kQ8x32, 22, 32}},
      {"Q8_0", {GgufType::kQ8_0, LayoutId::kQ8x32, 34, 32}},    {"Q5_1", {GgufType::kQ5_1, LayoutId::kQ8x32m, 24, 32}},
      {"Q5_K", {GgufType::kQ5_K, LayoutId::kQ8K, 176, 256}},   {"Q6_K", {GgufType::kQ6_K, LayoutId::kQ8K16, 210, 256}},
      {"Q3_K", {GgufType::kQ3_K, LayoutId::kQ8K16, 110, 256}},  {"Q2_K", {GgufType::kQ2_K, LayoutId::kQ4K16m, 84, 256}},
      {"F16", {GgufType::kF16, LayoutId::kF16x32, 64, 32}},     {"BF16", {GgufType::kBF16, LayoutId::kBF16x32, 64, 32}},
      {"IQ4_NL", {GgufType::kIQ4_NL, LayoutId::kIQ4x32, 18, 32}}, {"IQ4_XS", {GgufType::kIQ4_XS, LayoutId::kIQ4K, 136, 256}},
      {"I8K16", {GgufType::kI8K16, LayoutId::kI8K16, 276, 256}}, {"MXFP4", {GgufType::kMXFP4, LayoutId::kMX4x32, 17, 32}}};
  for (const auto& [known, type] : types)
    if (known == name) return type;
  TORCH_CHECK(false, "unsupported block type ", name,
              " (Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, IQ4_NL, IQ4_XS, MXFP4, F16, BF16, I8K16)");
}

float half_at(const uint8_t* p);

// A K-quant's 6-bit scale and minimum of sub-block `sub` (of 8), as Q4_K and Q5_K pack them in 12 bytes.
void scale_min_k4(const uint8_t* scales, int64_t sub, int& sc, int& mn) {
  sc = sub < 4 ? scales[sub] & 0x3F : (scales[sub + 4] & 0x0F) | ((scales[sub - 4] >> 2) & 0x30);
  mn = sub < 4 ? scales[sub + 4] & 0x3F : (scales[sub + 4] >> 4) | ((scales[sub] >> 2) & 0x30);
}

// Block b (of the layout's kK weights) of a stored row: d and m (w = d * q + m; m unused where
// the layout has no minima) and the kK quants q (4-bit layouts: 0..15; int8 layouts: int8
// bytes), or for F16 and BF16 the kK stored values (2 bytes each) as they are.
void read_block(const FileType& file, const uint8_t* row, int64_t b, float& d, float& m, uint8_t* q) {
  auto int8 = [](int v) { return static_cast<uint8_t>(static_cast<int8_t>(v)); };
  switch (file.type) {
    case GgufType::kF16:
    case GgufType::kBF16:
      std::memcpy(q, row + b * 64, 64);
      d = m = 0.0f;
      return;
    case GgufType::kQ4_0:
    case GgufType::kQ4_1:
    case GgufType::kQ8_0: {
      const uint8_t* in = row + b * file.bytes;
      d = half_at(in);
      if (file.type == GgufType::kQ8_0) {
        std::memcpy(q, in + 2, 32);
        return;
      }
      // Q4_0: w = d (q - 8) = d q - 8 d exactly (an 11-bit mantissa times a 4-bit integer)
      m = file.type == GgufType::kQ4_1 ? half_at(in + 2) : -8.0f * d;
      const uint8_t* quants = in + (file.type == GgufType::kQ4_1 ? 4 : 2);
      for (int e = 0; e < 32; ++e) q[e] = e < 16 ? quants[e] & 0x0F : quants[e - 16] >> 4;
      return;
    }
    case GgufType::kIQ4_NL: {  // d, 16 bytes of 4-bit indices (low nibbles first): w = d * kIQ4Values[q]
      const uint8_t* in = row + b * file.bytes;
      d = half_at(in);
      for (int e = 0; e < 32; ++e) q[e] = e < 16 ? in[2 + e] & 0x0F : in[2 + e - 16] >> 4;
      return;
    }
    case GgufType::kMXFP4: {  // e (E8M0), 16 bytes of indices as IQ4_NL's: w = 2^(e - 128) * kMXFP4Values[q]
      const uint8_t* in = row + b * file.bytes;
      bool zeros = true;  // indices 0 and 8 are both 0
      for (int e = 0; e < 32; ++e) {
        q[e] = e < 16 ? in[1 + e] & 0x0F : in[1 + e - 16] >> 4;
        zeros = zeros && (q[e] & 7) == 0;
      }
      const int exponent = static_cast<int>(in[0]) - 128;
      TORCH_CHECK(zeros || (exponent >= -24 && exponent <= 15), "an MXFP4 block scale of 2^", exponent,
                  " has no exact fp16 form (2^-24 to 2^15 are kept)");
      d = zeros ? 0.0f : std::ldexp(1.0f, exponent);
      return;
    }
    case GgufType::kIQ4_XS:
      TORCH_CHECK(false, "IQ4_XS is read by super-block");
      return;
    case GgufType::kQ5_0:
    case GgufType::kQ5_1: {  // d, (Q5_1: m,) 32 fifth bits, 16 bytes of nibbles; Q5_0: w = d (q - 16)
      const uint8_t* in = row + b * file.bytes;
      const bool has_min = file.type == GgufType::kQ5_1;
      d = half_at(in);
      if (has_min) m = half_at(in + 2);
      uint32_t fifth;
      std::memcpy(&fifth, in + (has_min ? 4 : 2), 4);
      const uint8_t* quants = in + (has_min ? 8 : 6);
      for (int e = 0; e < 32; ++e) {
        const int v = (e < 16 ? quants[e] & 0x0F : quants[e - 16] >> 4) | (((fifth >> e) & 1) << 4);
        q[e] = has_min ? static_cast<uint8_t>(v) : int8(v - 16);
      }
      return;
    }
    case GgufType::kQ4_K:
    case GgufType::kQ5_K: {
      // d, dmin, 12 bytes of 6-bit scales sc and minima mn of 8 sub-blocks of 32, (Q5_K: 32 bytes
      // of fifth bits,) 128 bytes of nibbles: w = (d sc) q - (dmin mn), d sc and dmin mn exact
      const uint8_t* in = row + (b / 8) * file.bytes;
      const int64_t sub = b % 8;
      int sc, mn;
      scale_min_k4(in + 4, sub, sc, mn);
      d = half_at(in) * static_cast<float>(sc);
      m = -(half_at(in + 2) * static_cast<float>(mn));
      const bool fifth = file.type == GgufType::kQ5_K;
      const uint8_t* high = in + 16;
      const uint8_t* quants = in + (fifth ? 48 : 16) + (sub / 2) * 32;  // sub-block pairs: low, high nibbles
      for (int e = 0; e < 32; ++e) {
        const int low = (quants[e] >> (4 * (sub % 2))) & 0x0F;
        q[e] = static_cast<uint8_t>(fifth ? low | (((high[e] >> sub) & 1) << 4) : low);
      }
      return;
    }
    case GgufType::kQ6_K: {
      // 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d: 16 sub-blocks of 16,
      // w = (d sc) (q - 32) with q of 6 bits
      const uint8_t* in = row + (b / 16) * file.bytes;
      d = half_at(in + 208) * static_cast<float>(static_cast<int8_t>(in[192 + b % 16]));
      for (int e = 0; e < 16; ++e) {
        const int64_t i = (b % 16) * 16 + e, half = i / 128, quarter = (i % 128) / 32, l = i % 32;
        const int low = (in[half * 64 + (quarter % 2) * 32 + l] >> (quarter < 2 ? 0 : 4)) & 0x0F;
        const int high = (in[128 + half * 32 + l] >> (2 * quarter)) & 3;
        q[e] = int8((low | (high << 4)) - 32);
      }
      return;
    }
    case GgufType::kQ3_K:
    case GgufType::kQ2_K: {
      // 16 sub-blocks of 16 weights of 2 bits (Q3_K: and a third from its 32-byte mask).
      // Q3_K: 32 bytes of mask, 64 of quants, 12 of 6-bit scales, d: w = (d (sc - 32)) q, q in -4..3.
      // Q2_K: 16 bytes of 4-bit scale and minimum, 64 of quants, d, dmin: w = (d sc) q - (dmin mn).
      const bool q3 = file.type == GgufType::kQ3_K;
      const uint8_t* in = row + (b / 16) * file.bytes;
      const int64_t s = b % 16;
      const uint8_t* quants = in + (q3 ? 32 : 16) + (s / 8) * 32 + (s % 2) * 16;
      const int shift = 2 * static_cast<int>((s % 8) / 2);
      if (q3) {
        const uint8_t* scales = in + 96;
        const int low = s < 8 ? scales[s] & 0x0F : scales[s - 8] >> 4;
        const int high = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
        d = half_at(in + 108) * static_cast<float>((low | (high << 4)) - 32);
        for (int e = 0; e < 16; ++e) {
          const int set = (in[(s % 2) * 16 + e] >> (s / 2)) & 1;  // a set mask bit: no offset
          q[e] = int8(((quants[e] >> shift) & 3) - (set ? 0 : 4));
        }
      } else {
        d = half_at(in + 80) * static_cast<float>(in[s] & 0x0F);
        m = -(half_at(in + 82) * static_cast<float>(in[s] >> 4));
        for (int e = 0; e < 16; ++e) q[e] = (quants[e] >> shift) & 3;
      }
      return;
    }
  }
}

// A K-quant super-block (number `b`, of 256 weights) of a stored row: its D and Dmin and each
// sub-block's integer scale and minimum, of which read_block's d and m are made: d = D * scale,
// m = -(Dmin * minimum).
void read_super_block(const FileType& file, const uint8_t* row, int64_t b, float& D, float& Dmin, int* scale,
                      int* minimum) {
  const uint8_t* in = row + b * file.bytes;
  switch (file.type) {
    case GgufType::kQ4_K:
    case GgufType::kQ5_K:
      D = half_at(in), Dmin = half_at(in + 2);
      for (int s = 0; s < 8; ++s) scale_min_k4(in + 4, s, scale[s], minimum[s]);
      return;
    case GgufType::kQ6_K:
      D = half_at(in + 208);
      for (int s = 0; s < 16; ++s) scale[s] = static_cast<int8_t>(in[192 + s]);
      return;
    case GgufType::kQ3_K:
      D = half_at(in + 108);
      for (int s = 0; s < 16; ++s) {
        const uint8_t* scales = in + 96;
        const int low = s < 8 ? scales[s] & 0x0F : scales[s - 8] >> 4;
        scale[s] = (low | (((scales[8 + s % 4] >> (2 * (s / 4))) & 3) << 4)) - 32;
      }
      return;
    case GgufType::kQ2_K:
      D = half_at(in + 80), Dmin = half_at(in + 82);
      for (int s = 0; s < 16; ++s) scale[s] = in[s] & 0x0F, minimum[s] = in[s] >> 4;
      return;
    case GgufType::kIQ4_XS: {
      // d, 16 bits of high scale pairs, 4 bytes of low scale nibbles, 128 bytes of indices: 8
      // sub-blocks of 32, w = (d (scale - 32)) kIQ4Values[q]
      D = half_at(in);
      const int high = in[2] | (in[3] << 8);
      for (int s = 0; s < 8; ++s) scale[s] = (((in[4 + s / 2] >> (4 * (s % 2))) & 0x0F) | (((high >> (2 * s)) & 3) << 4)) - 32;
      return;
    }
    case GgufType::kI8K16:
      std::memcpy(&D, in, sizeof(float));
      for (int s = 0; s < 16; ++s) scale[s] = static_cast<int8_t>(in[4 + s]);
      return;
    default:
      TORCH_CHECK(false, "not a K-quant");
  }
}

// All 256 values of K-quant super-block b of a stored row, as read_block gives them sub-block
// after sub-block: in a few straight loops over the stored bit planes (the compiler vectorizes
// them) where read_block's index arithmetic per value made packing Q6_K 4 ns a weight.
void read_super_values(const FileType& file, const uint8_t* row, int64_t b, uint8_t* q) {
  const uint8_t* in = row + b * file.bytes;
  switch (file.type) {
    case GgufType::kQ6_K:
      // Each half of 128: 64 bytes of low nibbles (ql), 32 of high bit pairs (qh); quarter t of
      // the half takes ql[l] (t = 0, 2) or ql[32 + l] (t = 1, 3), nibble t / 2, and bits 2t of qh[l].
      for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = in + half * 64;
        const uint8_t* qh = in + 128 + half * 32;
        uint8_t* y = q + half * 128;
        for (int l = 0; l < 32; ++l) {
          y[l] = static_cast<uint8_t>(((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32);
          y[32 + l] = static_cast<uint8_t>(((ql[32 + l] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
          y[64 + l] = static_cast<uint8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          y[96 + l] = static_cast<uint8_t>(((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
      }
      return;
    case GgufType::kQ4_K:
    case GgufType::kQ5_K: {
      // Sub-block pairs share 32 bytes of nibbles (low nibble: the even sub-block); Q5_K's fifth
      // bit of value e of sub-block s is bit s of high[e].
      const bool fifth = file.type == GgufType::kQ5_K;
      const uint8_t* high = in + 16;
      const uint8_t* quants = in + (fifth ? 48 : 16);
      for (int pair = 0; pair < 4; ++pair) {
        const uint8_t* nibbles = quants + pair * 32;
        uint8_t* y = q + pair * 64;
        for (int e = 0; e < 32; ++e) {
          y[e] = static_cast<uint8_t>(nibbles[e] & 0x0F);
          y[32 + e] = static_cast<uint8_t>(nibbles[e] >> 4);
        }
        if (fifth) {
          for (int e = 0; e < 32; ++e) {
            y[e] |= static_cast<uint8_t>(((high[e] >> (2 * pair)) & 1) << 4);
            y[32 + e] |= static_cast<uint8_t>(((high[e] >> (2 * pair + 1)) & 1) << 4);
          }
        }
      }
      return;
    }
    case GgufType::kIQ4_XS:
      // Sub-block s: 16 bytes at 8 + 16 s, the low nibbles its first 16 indices, the high ones the rest.
      for (int s = 0; s < 8; ++s)
        for (int e = 0; e < 16; ++e) {
          q[s * 32 + e] = in[8 + s * 16 + e] & 0x0F;
          q[s * 32 + 16 + e] = in[8 + s * 16 + e] >> 4;
        }
      return;
    case GgufType::kI8K16:
      std::memcpy(q, in + 20, 256);
      return;
    default: {  // Q3_K, Q2_K: sub-blocks of 16, one at a time
      float d, m;
      for (int64_t sub = 0; sub < 16; ++sub) read_block(file, row, b * 16 + sub, d, m, q + sub * 16);
    }
  }
}

// Prefetches sub-block `sub`'s share of the cache lines of the block kAhead blocks past blk, so
// that a super-block's 2-4 KB are asked for a few lines at a time as its sub-blocks are read. All
// of them at once, at the start of each block, filled the core's miss buffers and stalled it
// (Q6_K times one row of activations 1.6x slower on Zen 4).
template <class L, int64_t kAhead>
inline void prefetch_share(const uint8_t* blk, int64_t sub) {
  constexpr int64_t kLines = (L::kBlockBytes + 63) / 64, kPer = (kLines + L::kSubBlocks - 1) / L::kSubBlocks;
  for (int64_t line = sub * kPer; line < std::min(kLines, (sub + 1) * kPer); ++line)
    __builtin_prefetch(blk + kAhead * L::kBlockBytes + line * 64);
}

inline __m256 bytes_as_floats(const uint8_t* p, bool is_signed) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

// Eight fp16 values at p, as fp32 (exactly).
inline __m256 halves(const uint8_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = half_at(p + 2 * i);
  return _mm256_load_ps(f);
#endif
}

// One (sub-)block's scales (d; also m in a layout with minima) for the 16 columns of a panel;
// in a super-block layout, sub-block `sub`'s, made from D (Dmin) and its integer scales
// (minima) as read_block makes them: D * scale and -(Dmin * minimum), exact.
template <class L>
struct BlockScales {
  __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps(), m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  BlockScales(const uint8_t* blk, int64_t sub) {
    if constexpr (L::kFloatD) {
      const float* D = reinterpret_cast<const float*>(blk);
      d0 = _mm256_loadu_ps(D), d1 = _mm256_loadu_ps(D + 8);
    } else if constexpr (L::kScaled) {
      d0 = halves(blk), d1 = halves(blk + 16);
    }
    if constexpr (L::kScaled) {
      if constexpr (L::kMin) m0 = halves(blk + 32), m1 = halves(blk + 48);
      if constexpr (L::kSuper) {
        const uint8_t* integers = blk + L::kFloatScaleBytes + sub * kQCols;
        d0 = _mm256_mul_ps(d0, bytes_as_floats(integers, L::kSignedScales));
        d1 = _mm256_mul_ps(d1, bytes_as_floats(integers + 8, L::kSignedScales));
        if constexpr (L::kMin) {
          const uint8_t* minima = integers + L::kSubBlocks * kQCols;
          const __m256 negate = _mm256_set1_ps(-0.0f);
          m0 = _mm256_xor_ps(_mm256_mul_ps(m0, bytes_as_floats(minima, false)), negate);
          m1 = _mm256_xor_ps(_mm256_mul_ps(m1, bytes_as_floats(minima + 8, false)), negate);
        }
      }
    }
  }
};

inline __m256 bfloat16s(const uint8_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Q6K16: column c's q (0..63) at k-row kk of a sub-block's values q.
inline int six_bit(const uint8_t* q, int64_t kk, int64_t c) {
  const int low = (q[kk * 8 + c % 8] >> (c < 8 ? 0 : 4)) & 0x0F;
  const int high = (q[Q6K16::kSub * 8 + (kk / 4) * 16 + 4 * (c % 4) + kk % 4] >> (2 * (c / 4))) & 3;
  return low | (high << 4);
}

// The int8 values of k-row kk's 16 IQ4 indices (q: a sub-block's indices as the 4-bit layouts
// hold nibbles: columns 0-7 in the low nibbles, 8-15 in the high ones).
template <Table T>
inline __m128i iq4_row_values(const uint8_t* q, int64_t kk) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kk * 8));
  const __m128i indices = _mm_and_si128(_mm_unpacklo_epi64(bytes, _mm_srli_epi16(bytes, 4)), _mm_set1_epi8(0x0F));
  return _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nibble_values<T>())), indices);
}

// The 16 weights of k-row kk of a block (q: the block's values), as fp32: the one place both
// block matmuls compute them, so both give the loader's fp32 values.
template <class L>
inline void block_row(const uint8_t* q, int64_t kk, const BlockScales<L>& s, __m256& w0, __m256& w1) {
  __m256 q0, q1;
  if constexpr (L::kValues == Values::kNibble) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kk * 8));
    q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(bytes, low)));
    q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
  } else if constexpr (L::kValues == Values::kNibbleTable) {
    const __m128i values = iq4_row_values<L::kTable>(q, kk);
    q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values));
    q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(values, 8)));
  } else if constexpr (L::kValues == Values::kInt8) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kk * 16));
    q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  } else if constexpr (L::kValues == Values::kSixBit) {  // int8-activation packings only: a plain gather
    alignas(32) int32_t v[16];
    for (int64_t c = 0; c < 16; ++c) v[c] = six_bit(q, kk, c) - 32;
    q0 = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(v)));
    q1 = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(v + 8)));
  } else if constexpr (L::kValues == Values::kHalf) {
    w0 = halves(q + kk * 32), w1 = halves(q + kk * 32 + 16);
    return;
  } else if constexpr (L::kValues == Values::kBFloat16Pairs) {  // the lanes' low halves for even kk, else high
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (kk / 2) * 64));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (kk / 2) * 64 + 32));
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    w0 = _mm256_castsi256_ps(kk % 2 == 0 ? _mm256_slli_epi32(v0, 16) : _mm256_and_si256(v0, high));
    w1 = _mm256_castsi256_ps(kk % 2 == 0 ? _mm256_slli_epi32(v1, 16) : _mm256_and_si256(v1, high));
    return;
  } else {
    w0 = bfloat16s(q + kk * 32), w1 = bfloat16s(q + kk * 32 + 16);
    return;
  }
  if constexpr (L::kMin) {
    w0 = _mm256_fmadd_ps(s.d0, q0, s.m0), w1 = _mm256_fmadd_ps(s.d1, q1, s.m1);
  } else {
    w0 = _mm256_mul_ps(s.d0, q0), w1 = _mm256_mul_ps(s.d1, q1);
  }
}

template <int MR, class L>
inline void quant_micro(const float* __restrict x, int64_t ldx, const uint8_t* __restrict panel, int64_t K,
                        float* __restrict y, int64_t ldy) {
  __m256 a0[MR], a1[MR];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  constexpr int64_t kAhead = L::kSuper ? 1 : 4;  // blocks to prefetch ahead (a super-block is 2-4 KB)
  for (int64_t b = 0; b < K / L::kK; ++b) {
    const uint8_t* blk = panel + b * L::kBlockBytes;
    for (int64_t sub = 0; sub < L::kSubBlocks; ++sub) {
      prefetch_share<L, kAhead>(blk, sub);
      const BlockScales<L> scales(blk, sub);
      const uint8_t* q = blk + L::kScaleBytes + sub * L::kSubValueBytes;
      const float* xb = x + b * L::kK + sub * L::kSub;
      for (int64_t kk = 0; kk < L::kSub; ++kk) {
        __m256 w0, w1;
        block_row<L>(q, kk, scales, w0, w1);
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const __m256 xv = _mm256_set1_ps(xb[r * ldx + kk]);
          a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);
          a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(y + r * ldy, a0[r]);
    _mm256_storeu_ps(y + r * ldy + 8, a1[r]);
  }
}

#if defined(__AVX512F__)
// AVX-512 forms of the above: a block panel's 16 columns in one 512-bit register, so a k-row's
// weights take one unpacking, one conversion and one scaling instead of two, and each row one FMA.
// The same operations on each column as the 256-bit forms, so the same values bit for bit. (With
// 256-bit datapaths, as Zen 4's, a 512-bit operation costs two 256-bit ones; the gain is in the
// instructions that feed them: 1.2x at 5 rows there.)
inline __m512 bytes_as_floats16(const uint8_t* p, bool is_signed) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
}

template <class L>
struct BlockScales512 {
  __m512 d = _mm512_setzero_ps(), m = _mm512_setzero_ps();
  BlockScales512(const uint8_t* blk, int64_t sub) {
    if constexpr (L::kScaled) {
      d = L::kFloatD ? _mm512_loadu_ps(reinterpret_cast<const float*>(blk))
                     : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      if constexpr (L::kMin) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
      if constexpr (L::kSuper) {
        const uint8_t* integers = blk + L::kFloatScaleBytes + sub * kQCols;
        d = _mm512_mul_ps(d, bytes_as_floats16(integers, L::kSignedScales));
        if constexpr (L::kMin) {
          const __m512i negated = _mm512_xor_si512(
              _mm512_castps_si512(_mm512_mul_ps(m, bytes_as_floats16(integers + L::kSubBlocks * kQCols, false))),
              _mm512_set1_epi32(static_cast<int>(0x80000000u)));
          m = _mm512_castsi512_ps(negated);
        }
      }
    }
  }
};

// The layouts block_row512 reads (the others, the int8- and bf16-activation packings', are not
// read by the fp32 block matmul).
template <class L>
constexpr bool kRow512 = L::kFourBit || L::kValues == Values::kInt8 ||
                         L::kValues == Values::kHalf || L::kValues == Values::kBFloat16;

template <class L>
inline __m512 block_row512(const uint8_t* q, int64_t kk, const BlockScales512<L>& s) {
  __m512 v;
  if constexpr (L::kValues == Values::kNibble) {  // low nibbles: columns 0-7, high: 8-15
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kk * 8));
    const __m128i values = _mm_and_si128(_mm_unpacklo_epi64(bytes, _mm_srli_epi16(bytes, 4)), low);
    v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(values));
  } else if constexpr (L::kValues == Values::kNibbleTable) {
    v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(iq4_row_values<L::kTable>(q, kk)));
  } else if constexpr (L::kValues == Values::kInt8) {
    v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kk * 16))));
  } else if constexpr (L::kValues == Values::kHalf) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kk * 32)));
  } else {
    static_assert(L::kValues == Values::kBFloat16);
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kk * 32));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  if constexpr (L::kMin) return _mm512_fmadd_ps(s.d, v, s.m);
  return _mm512_mul_ps(s.d, v);
}

template <int MR, class L>
inline void quant_micro512(const float* __restrict x, int64_t ldx, const uint8_t* __restrict panel, int64_t K,
                           float* __restrict y, int64_t ldy) {
  __m512 acc[MR];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t kAhead = L::kSuper ? 1 : 4;
  for (int64_t b = 0; b < K / L::kK; ++b) {
    const uint8_t* blk = panel + b * L::kBlockBytes;
    for (int64_t sub = 0; sub < L::kSubBlocks; ++sub) {
      prefetch_share<L, kAhead>(blk, sub);
      const BlockScales512<L> scales(blk, sub);
      const uint8_t* q = blk + L::kScaleBytes + sub * L::kSubValueBytes;
      const float* xb = x + b * L::kK + sub * L::kSub;
      for (int64_t kk = 0; kk < L::kSub; ++kk) {
        const __m512 w = block_row512<L>(q, kk, scales);
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r * ldx + kk]), w, acc[r]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
#endif

// Rows in passes of at most 5 through the 256-bit microkernel (AVX2 builds' only form).
template <class L>
void quant_rows256(int rows, const float* x, int64_t K, const uint8_t* w, float* y, int64_t ldy) {
  for (int r = 0; r < rows; r += 5) {
    const float* xr = x + r * K;
    float* yr = y + r * ldy;
    switch (std::min(5, rows - r)) {
      case 5: quant_micro<5, L>(xr, K, w, K, yr, ldy); break;
      case 4: quant_micro<4, L>(xr, K, w, K, yr, ldy); break;
      case 3: quant_micro<3, L>(xr, K, w, K, yr, ldy); break;
      case 2: quant_micro<2, L>(xr, K, w, K, yr, ldy); break;
      default: quant_micro<1, L>(xr, K, w, K, yr, ldy);
    }
  }
}

// At most kQMaxRows rows of a block panel: in one 512-bit pass where the build and the layout
// have it (one row keeps the 256-bit form, 2% faster), else in 256-bit passes.
template <class L>
void quant_rows(int rows, const float* x, int64_t K, const uint8_t* w, float* y, int64_t ldy) {
#if defined(__AVX512F__)
  if constexpr (kRow512<L>) {
    switch (rows) {
      case 12: return quant_micro512<12, L>(x, K, w, K, y, ldy);
      case 11: return quant_micro512<11, L>(x, K, w, K, y, ldy);
      case 10: return quant_micro512<10, L>(x, K, w, K, y, ldy);
      case 9: return quant_micro512<9, L>(x, K, w, K, y, ldy);
      case 8: return quant_micro512<8, L>(x, K, w, K, y, ldy);
      case 7: return quant_micro512<7, L>(x, K, w, K, y, ldy);
      case 6: return quant_micro512<6, L>(x, K, w, K, y, ldy);
      case 5: return quant_micro512<5, L>(x, K, w, K, y, ldy);
      case 4: return quant_micro512<4, L>(x, K, w, K, y, ldy);
      case 3: return quant_micro512<3, L>(x, K, w, K, y, ldy);
      case 2: return quant_micro512<2, L>(x, K, w, K, y, ldy);
      default: break;
    }
  }
#endif
  quant_rows256<L>(rows, x, K, w, y, ldy);
}

// A block panel (16 columns, all K) dequantized into columns [0, 16) of an fp32 panel whose
// k-rows are `ld` floats apart (packed_linear's layout).
template <class L>
void dequantize_panel(const uint8_t* panel, int64_t K, float* w, int64_t ld) {
  for (int64_t b = 0; b < K / L::kK; ++b) {
    const uint8_t* blk = panel + b * L::kBlockBytes;
    for (int64_t sub = 0; sub < L::kSubBlocks; ++sub) {
      const BlockScales<L> scales(blk, sub);
      const uint8_t* q = blk + L::kScaleBytes + sub * L::kSubValueBytes;
      for (int64_t kk = 0; kk < L::kSub; ++kk) {
        __m256 w0, w1;
        block_row<L>(q, kk, scales, w0, w1);
        float* row = w + (b * L::kK + sub * L::kSub + kk) * ld;
        _mm256_storeu_ps(row, w0);
        _mm256_storeu_ps(row + 8, w1);
      }
    }
  }
}

float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// A block's scale as the packing stores it, in fp16: every d, m, D and Dmin is read from the
// file's fp16 and so has an exact fp16 form, except Q4_0's m = -8 d, past fp16's range where
// |d| > 8188 (a file no quantizer writes): refused, never rounded.
uint16_t exact_half(float x) {
  const at::Half h(x);
  TORCH_CHECK(static_cast<float>(h) == x, "a block scale of ", x, " has no exact fp16 form (Q4_0 scales above 8188 are not supported)");
  return h.x;
}

// pack_gguf_blocks's result, a uint8 tensor: a header of int64 [kMagic, K, N, segments, then per
// segment its layout, first panel, panels and byte offset], padded to 64 bytes, then each
// segment's panels ([panels][K / kK blocks][block bytes]). A fused matrix whose parts differ in
// layout (a Q4_K_M file's Q4_K q and k beside a Q6_K v) is one segment per run of parts that
// share one; every segment but the last then holds whole panels.
constexpr int64_t kPackedMagic = 0x31424647;  // "GFB1"
// The same packing, for matmuls with int8 activations (gguf_blocks_a8_linear, at every step size).
constexpr int64_t kPackedMagicA8 = 0x38414647;  // "GFA8"
// And for bf16 activations (gguf_blocks_bf16_linear): every part BF16, in BF16P.
constexpr int64_t kPackedMagicBF16 = 0x36314246;  // "FB16"
struct Segment {
  LayoutId layout;
  int64_t first, panels, offset;
};
struct PackedBlocks {
  int64_t K, N;
  bool int8_activations, bf16_activations;
  std::vector<Segment> segments;
  const uint8_t* base;
  int64_t panels() const { return segments.back().first + segments.back().panels; }
  // Panel p's segment and first byte.
  std::pair<LayoutId, const uint8_t*> panel(int64_t p) const {
    for (const auto& s : segments)
      if (p < s.first + s.panels) return {s.layout, base + s.offset + (p - s.first) * panel_bytes(s.layout, K)};
    TORCH_CHECK(false, "panel out of range");
  }
};

int64_t header_bytes(int64_t segments) { return ((4 + 4 * segments) * 8 + 63) / 64 * 64; }

// A packing's magic (kPackedMagic, kPackedMagicA8 or kPackedMagicBF16); 0 for another tensor.
int64_t packed_magic(const torch::Tensor& packed) {
  return packed.scalar_type() == torch::kUInt8 && packed.numel() >= 64
             ? reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>())[0]
             : 0;
}

// Reads a packed weight's header and checks it against x.
PackedBlocks read_packed(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "float32 [M, K] contiguous only");
  const bool shaped = packed.dtype() == torch::kUInt8 && packed.dim() == 1 && packed.is_contiguous() &&
                      packed.numel() >= 64;
  const int64_t* h = shaped ? reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>()) : nullptr;
  TORCH_CHECK(h != nullptr && (h[0] == kPackedMagic || h[0] == kPackedMagicA8 || h[0] == kPackedMagicBF16) && h[3] >= 1 &&
                  packed.numel() >= header_bytes(h[3]),
              "weight was not packed by pack_gguf_blocks");
  PackedBlocks view{h[1], h[2], h[0] == kPackedMagicA8, h[0] == kPackedMagicBF16, {}, packed.data_ptr<uint8_t>()};
  TORCH_CHECK(view.K == x.size(1), "x has ", x.size(1), " columns, the weight ", view.K);
  for (int64_t s = 0; s < h[3]; ++s) {
    const int64_t* e = h + 4 + 4 * s;
    TORCH_CHECK(e[0] >= 0 && e[0] < static_cast<int64_t>(LayoutId::kCount), "unknown block layout");
    view.segments.push_back({static_cast<LayoutId>(e[0]), e[1], e[2], e[3]});
  }
  const Segment& last = view.segments.back();
  TORCH_CHECK(last.offset + last.panels * panel_bytes(last.layout, view.K) <= packed.numel(), "packed weight is truncated");
  return view;
}

}  // namespace

bool gguf_blocks_available() { return true; }
int64_t gguf_blocks_max_rows() { return kQRegisterRows; }

// parts: GGUF rows, uint8 [N_i, K / weights a block * block bytes] each, of the types `kinds`
// ("Q4_K", "Q6_K", "F16", ...: file_type's), the rows of one matrix one after another (a fused
// q/k/v or gate/up, read where they lie) -> the packed weight the block matmuls read. With
// `int8_activations`, marked for gguf_blocks_a8_linear where every part is of a quantized type
// (a 16-bit part keeps the fp32 matmuls for the whole matrix); with `bf16_activations`, for
// gguf_blocks_bf16_linear where every part is BF16 (in BF16P).
torch::Tensor pack_gguf_blocks(std::vector<torch::Tensor> parts, std::vector<std::string> kinds, int64_t k,
                               bool int8_activations, bool bf16_activations) {
  TORCH_CHECK(!parts.empty() && kinds.size() == parts.size(), "one type for each part");
  struct Rows {
    FileType file;
    const uint8_t* first;
    int64_t count, stride;
  };
  std::vector<Rows> rows;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& blocks = parts[i];
    const FileType file = file_type(kinds[i]);
    TORCH_CHECK(blocks.dtype() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous(), "uint8 [N, bytes] only");
    TORCH_CHECK(k % file.weights == 0 && blocks.size(1) == k / file.weights * file.bytes,
                "rows are not ", kinds[i], " blocks of ", k, " weights");
    rows.push_back({file, blocks.data_ptr<uint8_t>(), blocks.size(0), blocks.size(1)});
  }
  // Int8 activations where every part is quantized; then Q6_K (and Q3_K) in 6 bits (Q6K16).
  bool scaled = true;
  for (const auto& r : rows) with_layout(r.file.layout, [&](auto l) { scaled = scaled && decltype(l)::kScaled; });
  const bool a8 = int8_activations && scaled;
  if (a8)
    for (auto& r : rows)
      if (r.file.layout == LayoutId::kQ8K16) r.file.layout = LayoutId::kQ6K16;
  bool all_bf16 = true;
  for (const auto& r : rows) all_bf16 = all_bf16 && r.file.layout == LayoutId::kBF16x32;
  const bool bf16 = bf16_activations && all_bf16;
  if (bf16)
    for (auto& r : rows) r.file.layout = LayoutId::kBF16P;
  // Segments: runs of parts that share a layout.
  std::vector<Segment> segments;
  std::vector<std::pair<size_t, size_t>> part_range;  // [first, last) part of each segment
  int64_t n = 0, panels = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (segments.empty() || segments.back().layout != rows[i].file.layout) {
      TORCH_CHECK(n % kQCols == 0, "parts of different block layouts must meet at a multiple of ", kQCols, " rows");
      segments.push_back({rows[i].file.layout, panels, 0, 0});
      part_range.push_back({i, i});
    }
    n += rows[i].count;
    part_range.back().second = i + 1;
    const int64_t segment_rows = n - segments.back().first * kQCols;
    segments.back().panels = (segment_rows + kQCols - 1) / kQCols;
    panels = segments.back().first + segments.back().panels;
  }
  int64_t bytes = header_bytes(static_cast<int64_t>(segments.size()));
  for (auto& s : segments) {
    s.offset = bytes;
    bytes += s.panels * panel_bytes(s.layout, k);
  }
  auto packed = torch::zeros({bytes}, parts[0].options());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  int64_t* h = reinterpret_cast<int64_t*>(dst);
  h[0] = a8 ? kPackedMagicA8 : bf16 ? kPackedMagicBF16 : kPackedMagic;
  h[1] = k, h[2] = n, h[3] = static_cast<int64_t>(segments.size());
  for (size_t s = 0; s < segments.size(); ++s) {
    int64_t* e = h + 4 + 4 * s;
    e[0] = static_cast<int64_t>(segments[s].layout), e[1] = segments[s].first, e[2] = segments[s].panels;
    e[3] = segments[s].offset;
  }
  for (size_t s = 0; s < segments.size(); ++s) {
    // Each row's type and first byte; each panel (16 rows) is written by one thread.
    std::vector<std::pair<const FileType*, const uint8_t*>> row_at;
    for (size_t i = part_range[s].first; i < part_range[s].second; ++i)
      for (int64_t r = 0; r < rows[i].count; ++r) row_at.push_back({&rows[i].file, rows[i].first + r * rows[i].stride});
    with_layout(segments[s].layout, [&](auto layout) {
      using L = decltype(layout);
      const int64_t blocks = k / L::kK, bytes_per_panel = blocks * L::kBlockBytes;
      uint8_t* panels_at = dst + segments[s].offset;
      at::parallel_for(0, segments[s].panels, 1, [&](int64_t begin, int64_t end) {
        uint8_t values[256];  // a super-block's values, or one block's (F16, BF16: 2 bytes each)
        const int64_t row_end = std::min<int64_t>(end * kQCols, static_cast<int64_t>(row_at.size()));
        for (int64_t row = begin * kQCols; row < row_end; ++row) {
          const FileType& file = *row_at[row].first;
          const uint8_t* in = row_at[row].second;
          const int64_t j = row % kQCols;
          for (int64_t b = 0; b < blocks; ++b) {
            uint8_t* out = panels_at + (row / kQCols) * bytes_per_panel + b * L::kBlockBytes;
            uint16_t* scales = reinterpret_cast<uint16_t*>(out);  // fp16 bits
            if constexpr (L::kSuper) {  // D, Dmin, then each sub-block's integer scale and minimum
              float D, Dmin = 0.0f;
              int scale[16], minimum[16] = {};
              read_super_block(file, in, b, D, Dmin, scale, minimum);
              if constexpr (L::kFloatD) {
                std::memcpy(out + j * sizeof(float), &D, sizeof(float));
              } else {
                scales[j] = exact_half(D);
              }
              if constexpr (L::kMin) scales[kQCols + j] = exact_half(Dmin);
              uint8_t* integers = out + L::kFloatScaleBytes;
              for (int64_t sub = 0; sub < L::kSubBlocks; ++sub) {
                integers[sub * kQCols + j] = static_cast<uint8_t>(scale[sub]);  // int8 where signed
                if constexpr (L::kMin) integers[(L::kSubBlocks + sub) * kQCols + j] = static_cast<uint8_t>(minimum[sub]);
              }
            }
            if constexpr (L::kSuper) read_super_values(file, in, b, values);
            for (int64_t sub = 0; sub < L::kSubBlocks; ++sub) {
              const uint8_t* sub_values = values;
              if constexpr (L::kSuper) {
                sub_values = values + sub * L::kSub;
              } else {
                float d, m = 0.0f;
                read_block(file, in, b * L::kSubBlocks + sub, d, m, values);
                if constexpr (L::kScaled) {
                  scales[j] = exact_half(d);
                  if constexpr (L::kMin) scales[kQCols + j] = exact_half(m);
                }
              }
              uint8_t* q = out + L::kScaleBytes + sub * L::kSubValueBytes;
              for (int64_t e = 0; e < L::kSub; ++e) {
                if constexpr (L::kFourBit) {
                  q[e * 8 + j % 8] |= j < 8 ? sub_values[e] : static_cast<uint8_t>(sub_values[e] << 4);
                } else if constexpr (L::kValues == Values::kInt8) {
                  q[e * kQCols + j] = sub_values[e];
                } else if constexpr (L::kValues == Values::kSixBit) {  // int8 q - 32 -> q, 6 bits
                  const int u = static_cast<int8_t>(sub_values[e]) + 32;
                  q[e * 8 + j % 8] |= static_cast<uint8_t>(j < 8 ? u & 0x0F : (u & 0x0F) << 4);
                  q[L::kSub * 8 + (e / 4) * 16 + 4 * (j % 4) + e % 4] |= static_cast<uint8_t>((u >> 4) << (2 * (j / 4)));
                } else if constexpr (L::kValues == Values::kBFloat16Pairs) {
                  std::memcpy(q + ((e / 2) * kQCols + j) * 4 + (e % 2) * 2, sub_values + 2 * e, 2);
                } else {
                  std::memcpy(q + (e * kQCols + j) * 2, sub_values + 2 * e, 2);
                }
              }
            }
          }
        }
      });
    });
  }
  return packed;
}

namespace {

// fn(layout, p, panel p's bytes, first row m, rows) for every block panel and every pass over it:
// the M rows in as few passes of at most max_rows as there can be, split evenly (each pass unpacks
// the panel again: 13 rows of at most 12 as 6 + 7, not 12 + 1), the panels shared out among the
// threads.
template <class F>
void for_block_panels(const PackedBlocks& w, int64_t M, int64_t max_rows, const F& fn) {
  for_panels(w.panels(), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const auto [layout, at] = w.panel(p);
      const uint8_t* panel = at;  // a lambda cannot capture a structured binding before C++20
      with_layout(layout, [&](auto l) {
        even_row_blocks(M, max_rows, [&](int64_t m, int rows) { fn(l, p, panel, m, rows); });
      });
    }
  });
}

}  // namespace

// x [M, K] through a weight packed by pack_gguf_blocks (out_features N) -> [M, N] (fp32).
torch::Tensor gguf_blocks_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  const PackedBlocks w = read_packed(x, packed);
  TORCH_CHECK(out_features == w.N, "out_features ", out_features, " does not match the packing (", w.N, ")");
  const int64_t M = x.size(0), K = x.size(1), panels = w.panels(), n_pad = panels * kQCols;
  auto y = torch::empty({M, n_pad}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_block_panels(w, M, kQMaxRows, [&](auto l, int64_t p, const uint8_t* panel, int64_t m, int rows) {
    quant_rows<decltype(l)>(rows, xp + m * K, K, panel, yp + m * n_pad + p * kQCols, n_pad);
  });
  return out_features == n_pad ? y : y.narrow(1, 0, out_features).contiguous();
}

namespace {
// A thread's scratch of at least `floats` floats, 64-byte aligned as the microkernel's panel loads
// need, kept for the thread's next matmul.
float* panel_scratch(int64_t floats) {
  thread_local std::vector<float> store;
  if (static_cast<int64_t>(store.size()) < floats + 16) store.resize(floats + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t{63});
}

}  // namespace

// x [M, K] through a weight packed by pack_gguf_blocks, for steps of many rows: each panel of
// kNR columns is dequantized once into an fp32 panel (in cache) that packed_linear's
// microkernel then runs over all M rows. The weights are the loader's fp32 values and each
// output the same in-order sum as packed_linear's: bit for bit its result on the dequantized
// weight, from a fraction of its memory.
torch::Tensor gguf_blocks_gemm(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  static_assert(kNR % kQCols == 0, "an fp32 panel holds whole block panels");
  constexpr int64_t kSub = kNR / kQCols;  // block panels per fp32 panel
  const PackedBlocks w = read_packed(x, packed);
  TORCH_CHECK(out_features == w.N, "out_features ", out_features, " does not match the packing (", w.N, ")");
  const int64_t M = x.size(0), K = x.size(1), qpanels = w.panels();
  const int64_t panels = (qpanels + kSub - 1) / kSub, n_pad = panels * kNR;
  auto y = torch::empty({M, n_pad}, x.options());
  const SpreadRows rows_of_x = spread_rows(x);
  const float* xp = rows_of_x.data;
  const int64_t ldx = rows_of_x.ld;
  float* yp = y.data_ptr<float>();
  panels_by_row_blocks(panels, M, [&](int64_t p, int64_t m_block, int64_t rows) {
    // Dequantized again for each block of rows: K x kNR values against rows x K x kNR FMAs.
    float* wf = panel_scratch(K * kNR);
    for (int64_t s = 0; s < kSub; ++s) {
      const int64_t qp = p * kSub + s;
      if (qp >= qpanels) {  // past the last block panel: zero columns, as pack_linear_weight pads
        for (int64_t k = 0; k < K; ++k) std::fill_n(wf + k * kNR + s * kQCols, kQCols, 0.0f);
        continue;
      }
      const auto [layout, at] = w.panel(qp);
      const uint8_t* panel = at;  // a lambda cannot capture a structured binding before C++20
      with_layout(layout, [&](auto l) { dequantize_panel<decltype(l)>(panel, K, wf + s * kQCols, kNR); });
    }
    even_row_blocks(rows, g_gemm.max_rows, [&](int64_t r, int mr) {
      const int64_t m = m_block + r;
      gemm_rows<Prefetch::kNone>(mr, xp + m * ldx, ldx, wf, K, nullptr, yp + m * n_pad + p * kNR, n_pad, nullptr, 0);
    });
  });
  return out_features == n_pad ? y : y.narrow(1, 0, out_features).contiguous();
}
// The rows of the weight a pack_gguf_blocks packing stands for ([N, K]: each an output column),
// in fp32 as the block matmuls dequantize them (the loader's values, bit for bit): fn(row, its K
// values), one block panel at a time, the panels spread over the threads. For quantizing a stored
// matrix again (`--quantization int8`) without its fp32 form whole.
std::pair<int64_t, int64_t> gguf_blocks_shape(const torch::Tensor& packed) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 1 && packed.is_contiguous() && packed.numel() >= 64,
              "weight was not packed by pack_gguf_blocks");
  const int64_t K = reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>())[1];
  return {read_packed(torch::empty({0, K}, torch::kFloat32), packed).N, K};
}

void dequantized_rows(const torch::Tensor& packed, const std::function<void(int64_t, const float*)>& fn) {
  const int64_t K = gguf_blocks_shape(packed).second;
  const PackedBlocks w = read_packed(torch::empty({0, K}, torch::kFloat32), packed);
  at::parallel_for(0, w.panels(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> columns(K * kQCols), row(K);  // one block panel, k-major; one of its rows
    for (int64_t p = begin; p < end; ++p) {
      const auto [layout, at] = w.panel(p);
      const uint8_t* panel = at;  // a lambda cannot capture a structured binding before C++20
      with_layout(layout, [&](auto l) { dequantize_panel<decltype(l)>(panel, K, columns.data(), kQCols); });
      for (int64_t c = 0; c < kQCols && p * kQCols + c < w.N; ++c) {
        for (int64_t k = 0; k < K; ++k) row[k] = columns[k * kQCols + c];
        fn(p * kQCols + c, row.data());
      }
    }
  });
}

// The weight a pack_gguf_blocks packing stands for, as fp32 [N, K].
torch::Tensor gguf_blocks_dequantize(torch::Tensor packed) {
  const auto [N, K] = gguf_blocks_shape(packed);
  auto out = torch::empty({N, K}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  const int64_t k = K;  // a lambda cannot capture a structured binding before C++20
  dequantized_rows(packed, [&](int64_t r, const float* values) { std::copy(values, values + k, op + r * k); });
  return out;
}

// ---- GGUF blocks times int8 activations (`--quantization int8-activations`), llama.cpp's way.
//
// A single stream on a few cores is compute-bound, and dequantizing each weight to fp32 (two or
// three instructions for every 8 weights before its multiply-add) costs more than streaming its
// bytes. Here the blocks stay integers: each step's activations are quantized per row and group
// of kA8Group = 32 consecutive k (qx in [-127, 127], sx = max|x| / 127, qx = round-half-even of
// x * 127 / max|x|), and each (sub-)block of S = 16 or 32 weights is an exact integer dot
// product: dot = sum qw * qx, with sum = sum qx where the layout has minima. Then, each rounded
// to fp32 in this order, per sub-block in k order (no fused multiply-add: a compiler barrier
// after every product; tests/test_gguf_a8.py reproduces it bit for bit):
//
//     t = dot * d;  t = t + sum * m (layouts with minima);  y = y + t * sx
//
// with d and m the sub-block's fp32 scale and minimum exactly as the fp32 path makes them (w =
// d * q + m). The same arithmetic at every number of rows, so a request's outputs do not depend
// on who shares its step. The packing is pack_gguf_blocks's, unchanged: each group of 4 k of a
// panel's 16 columns is rearranged in registers into four consecutive k per 32-bit lane (one
// vpermd or two vpermq and a vpshufb), then vpmaddubsw on |qw| and qx carrying qw's sign, pairs in
// int16 (at most 2 * 128 * 127, no saturation), vpmaddwd into int32; unsigned quants (4-bit, 5-bit,
// Q6_K's shifted by 32) into vpmaddubsw as they are, several groups' pairs summed in int16 first.
// Where the CPU has vpdpbusd on 256 bits (AVX-512 VNNI, AVX-VNNI), it takes the place of those
// three instructions, and signed quants go in as q + 128, unsigned, 128 sum qx taken off after
// (Q8_0's, Q5_0's and I8K16's only in steps of more than kA8BiasRows rows); integer sums either way, so the
// same dot bit for bit. The INFLIGHT_EMULATE_AVX_VNNI build tests that branch on any AVX2 CPU.
// With AVX-512 VNNI, a8_micro512 takes every step of more than one row: a panel's 16 columns in one
// register, up to 12 rows a pass, the same outputs bit for bit.

namespace {

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__) || defined(INFLIGHT_EMULATE_AVX_VNNI)
#define INFLIGHT_DPBUSD256 1
// vpdpbusd on 256 bits (AVX-512 VNNI's, AVX-VNNI's): acc + the four products of unsigned u8 and
// signed s8 bytes of each lane.
inline __m256i dpbusd256(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u8, s8);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#else  // INFLIGHT_EMULATE_AVX_VNNI: the same exact sums from AVX2 (bytes widened to 16 bits, vpmaddwd)
  const __m256i u_even = _mm256_and_si256(u8, _mm256_set1_epi16(0x00FF)), u_odd = _mm256_srli_epi16(u8, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s8, 8), 8), s_odd = _mm256_srai_epi16(s8, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
#endif
}
#endif

constexpr int64_t kA8Group = 32;  // k per activation scale: a sub-block never straddles two
constexpr int kA8MaxRows = 4;     // 2 x 4 int32 accumulators, the unpacked weights and |qw|

// An fp32 vector materialized as rounded: -ffast-math may then not fuse it into a multiply-add.
inline __m256 rounded(__m256 v) {
  asm volatile("" : "+x"(v));
  return v;
}

// Four consecutive activation bytes in every 32-bit lane.
inline __m256i four_bytes(const int8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm256_set1_epi32(four);
}

// Quants of k-rows [4 g, 4 g + 4) of a sub-block's values q, for the panel's columns 0-7 (c0)
// and 8-15 (c1): four consecutive k of one column in each 32-bit lane, as int8 (unsigned 0..15
// for the 4-bit layouts; IQ4's signed values for its indices, or with kBiased those plus 128).
template <class L, bool kBiased = false>
inline void a8_unpack(const uint8_t* q, int64_t g, __m256i& c0, __m256i& c1) {
  if constexpr (L::kFourBit || L::kValues == Values::kSixBit) {
    // 8 bytes a k-row, byte j: column j in its low nibble, column j + 8 in its high one. Dwords
    // [k0 c0-3, k0 c4-7, k1 c0-3, ...] -> [k0..k3 c0-3 | k0..k3 c4-7], then a 4 x 4 byte transpose.
    const __m256i rows = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * 32));
    const __m256i by_cols = _mm256_permutevar8x32_epi32(rows, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    const __m256i transpose = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                               0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i both = _mm256_shuffle_epi8(by_cols, transpose);
    const __m256i low = _mm256_set1_epi8(0x0F);
    c0 = _mm256_and_si256(both, low);
    c1 = _mm256_and_si256(_mm256_srli_epi16(both, 4), low);
    if constexpr (L::kValues == Values::kNibbleTable) {  // indices -> their signed values
      const void* values = kBiased ? static_cast<const void*>(kBiasedValues<L::kTable>.v)
                                   : static_cast<const void*>(nibble_values<L::kTable>());
      const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(values)));
      c0 = _mm256_shuffle_epi8(table, c0), c1 = _mm256_shuffle_epi8(table, c1);
    }
    if constexpr (L::kValues == Values::kSixBit) {
      // The group's 16 bytes of high pairs in both lanes; bits 4-5 of each byte from bits 0-1
      // (columns 0-3, low lane of c0), 2-3 (4-7), 4-5 (8-11, low lane of c1) or 6-7 (12-15).
      const __m256i high = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + L::kSub * 8 + g * 16)));
      const __m256i pair = _mm256_set1_epi8(0x30);
      c0 = _mm256_or_si256(c0, _mm256_and_si256(_mm256_sllv_epi32(high, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2)), pair));
      c1 = _mm256_or_si256(c1, _mm256_and_si256(_mm256_srlv_epi32(high, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), pair));
    }
  } else {
    // 16 bytes a k-row, byte j: column j. Bytes of k0 and k2 (k1 and k3) interleaved in each
    // lane, lanes regrouped by columns, then each column's (k0, k2) and (k1, k3) pairs into
    // one dword in k order.
    const __m256i k01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * 64));
    const __m256i k23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * 64 + 32));
    const __m256i gather = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                            0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_unpacklo_epi8(k01, k23), 0xD8);
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_unpackhi_epi8(k01, k23), 0xD8);
    c0 = _mm256_shuffle_epi8(lo, gather);
    c1 = _mm256_shuffle_epi8(hi, gather);
  }
}

// How a layout's quants enter the integer dots. Their range: 4-bit 0..15; Q5_K's and Q5_1's
// 0..31; Q6_K's (q - 32) and Q3_K's (q - 4), the signed layout of sub-blocks of 16, shifted by 32
// into 0..63 (Q6K16 holds them as q, 0..63, already; Q8K16 is shifted at the unpack); Q8_0's,
// Q5_0's, IQ4's and I8K16's signed (kUnsignedMax 0).
template <class L>
struct A8Quants {
  static constexpr bool kShifted = std::is_same_v<L, Q8K16> || std::is_same_v<L, Q6K16>;
  static constexpr int kShift = kShifted ? 32 : 0;
  static constexpr int kUnpackShift = std::is_same_v<L, Q8K16> ? 32 : 0;
  static constexpr int kUnsignedMax = L::kValues == Values::kNibble ? 15 : kShifted ? 63 : L::kMin ? 31 : 0;
};

// a8_unpack's quants of group g, shifted where the layout's are (Q8K16) and, with kBiased, signed
// int8 values plus 128 (their top bit flipped; IQ4's biased table has them made).
template <class L, bool kBiased = false>
inline void a8_quants(const uint8_t* q, int64_t g, __m256i& c0, __m256i& c1) {
  a8_unpack<L, kBiased>(q, g, c0, c1);
  if constexpr (A8Quants<L>::kUnpackShift > 0) {
    const __m256i shift = _mm256_set1_epi8(static_cast<char>(A8Quants<L>::kUnpackShift));
    c0 = _mm256_add_epi8(c0, shift), c1 = _mm256_add_epi8(c1, shift);
  }
  if constexpr (kBiased && L::kValues == Values::kInt8) {
    const __m256i top_bit = _mm256_set1_epi8(static_cast<char>(0x80));
    c0 = _mm256_xor_si256(c0, top_bit), c1 = _mm256_xor_si256(c1, top_bit);
  }
}

// Row r's sum of qx over the sub-block at k0 (isum: its sums of each 16 k, `sums` a row).
template <class L>
inline int32_t a8_sub_sum(const int32_t* isum, int r, int64_t sums, int64_t k0) {
  int32_t total = isum[r * sums + k0 / 16];
  if constexpr (L::kSub == 32) total += isum[r * sums + k0 / 16 + 1];
  return total;
}

// fn(blk, sub, q, k0) for every sub-block of a panel of K k-rows, in k order: its block, its index
// in the block, its values and its first k; the blocks ahead prefetched a share at a time. Both
// inlined (INFLIGHT_INLINE on fn), so that the kernels' accumulators stay in registers.
#define INFLIGHT_INLINE __attribute__((always_inline))
template <class L, class F>
INFLIGHT_INLINE inline void for_sub_blocks(const uint8_t* panel, int64_t K, const F& fn) {
  constexpr int64_t kAhead = L::kSuper ? 1 : 4;
  for (int64_t b = 0; b < K / L::kK; ++b) {
    const uint8_t* blk = panel + b * L::kBlockBytes;
    for (int64_t sub = 0; sub < L::kSubBlocks; ++sub) {
      prefetch_share<L, kAhead>(blk, sub);
      fn(blk, sub, blk + L::kScaleBytes + sub * L::kSubValueBytes, b * L::kK + sub * L::kSub);
    }
  }
}

// y[r][0, 16) = the panel times MR rows of quantized activations (qx [MR][K], sx [MR][K / 32],
// isum [MR][K / 16]: the sums of qx over each 16 k), in the arithmetic above.
template <int MR, class L, bool kBiasInt8>
void a8_micro(const int8_t* __restrict xq, const float* __restrict sx, const int32_t* __restrict isum, int64_t K,
              const uint8_t* __restrict panel, float* __restrict y, int64_t ldy) {
  static_assert(L::kScaled && L::kSub % 16 == 0 && kA8Group % L::kSub == 0, "a quantized layout");
  const int64_t groups = K / kA8Group, sums = K / 16;
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  constexpr int kShift = A8Quants<L>::kShift, kUnsignedMax = A8Quants<L>::kUnsignedMax;
  // Groups of 4 k whose int16 pair sums cannot overflow: at most 32767 / (2 * max * 127).
  [[maybe_unused]] constexpr int64_t kFlush = kUnsignedMax > 0 ? std::min<int64_t>(L::kSub / 4, 32767 / (2 * kUnsignedMax * 127)) : 1;
  static_assert(kUnsignedMax == 0 || (L::kSub / 4) % kFlush == 0, "whole flushes a sub-block");
#if defined(INFLIGHT_DPBUSD256)
  // Signed quants (IQ4's values; Q8_0's, Q5_0's and I8K16's where kBiasInt8) go into vpdpbusd biased by
  // 128, unsigned (its int32 sums cannot saturate, as vpmaddubsw's int16 pairs would), less 128
  // sum qx after: no |qw| and no sign per row. IQ4's table has them made; q + 128 is q with its
  // top bit flipped, which pays in steps of many rows only (a8_rows): else |qw| times qx
  // carrying qw's sign.
  constexpr int kBias = kUnsignedMax == 0 && (L::kValues == Values::kNibbleTable || kBiasInt8) ? 128 : 0;
  constexpr bool kUnsigned = kUnsignedMax > 0 || kBias > 0;
#else
  constexpr int kBias = 0;  // vpmaddubsw: signed quants as |qw| times qx carrying qw's sign
#endif
  for_sub_blocks<L>(panel, K, [&](const uint8_t* blk, int64_t sub, const uint8_t* q, int64_t k0) INFLIGHT_INLINE {
    __m256i a0[MR], a1[MR];
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
#if defined(INFLIGHT_DPBUSD256)
    // With one row, the odd groups go into a second pair of sums, so that the row's vpdpbusd
    // chains overlap instead of waiting on each other's latency (integer sums: the same totals).
    __m256i b0 = _mm256_setzero_si256(), b1 = _mm256_setzero_si256();
    for (int64_t g = 0; g < L::kSub / 4; ++g) {  // vpdpbusd: unsigned quants as they are, signed biased or as |qw|
      __m256i c0, c1;
      a8_quants<L, (kBias > 0)>(q, g, c0, c1);  // unsigned: as they are, shifted or biased
      const __m256i m0 = kUnsigned ? c0 : _mm256_abs_epi8(c0), m1 = kUnsigned ? c1 : _mm256_abs_epi8(c1);
      if constexpr (MR == 1) {
        if (g % 2 == 1) {
          const __m256i xb = four_bytes(xq + k0 + 4 * g);
          b0 = dpbusd256(b0, m0, kUnsigned ? xb : _mm256_sign_epi8(xb, c0));
          b1 = dpbusd256(b1, m1, kUnsigned ? xb : _mm256_sign_epi8(xb, c1));
          continue;
        }
      }
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m256i xb = four_bytes(xq + r * K + k0 + 4 * g);
        a0[r] = dpbusd256(a0[r], m0, kUnsigned ? xb : _mm256_sign_epi8(xb, c0));
        a1[r] = dpbusd256(a1[r], m1, kUnsigned ? xb : _mm256_sign_epi8(xb, c1));
      }
    }
    if constexpr (MR == 1) a0[0] = _mm256_add_epi32(a0[0], b0), a1[0] = _mm256_add_epi32(a1[0], b1);
#else
    if constexpr (kUnsignedMax > 0) {
      // Unsigned quants (Q6_K's and Q3_K's shifted up by 32) go into vpmaddubsw as they are;
      // the pair sums of kFlush groups add up in int16 before vpmaddwd widens them.
      for (int64_t g0 = 0; g0 < L::kSub / 4; g0 += kFlush) {
        __m256i h0[MR], h1[MR];
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) h0[r] = h1[r] = _mm256_setzero_si256();
        for (int64_t g = g0; g < g0 + kFlush; ++g) {
          __m256i c0, c1;
          a8_quants<L>(q, g, c0, c1);
          #pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) {
            const __m256i xb = four_bytes(xq + r * K + k0 + 4 * g);
            h0[r] = _mm256_add_epi16(h0[r], _mm256_maddubs_epi16(c0, xb));
            h1[r] = _mm256_add_epi16(h1[r], _mm256_maddubs_epi16(c1, xb));
          }
        }
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(h0[r], ones));
          a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(h1[r], ones));
        }
      }
    } else {  // signed quants of up to 8 bits (Q8_0, Q5_0, IQ4_NL, IQ4_XS, MXFP4, I8K16)
      for (int64_t g = 0; g < L::kSub / 4; ++g) {
        __m256i c0, c1;
        a8_unpack<L>(q, g, c0, c1);
        const __m256i m0 = _mm256_abs_epi8(c0), m1 = _mm256_abs_epi8(c1);  // |qw|: 128 for -128, unsigned
        #pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const __m256i xb = four_bytes(xq + r * K + k0 + 4 * g);
          a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(m0, _mm256_sign_epi8(xb, c0)), ones));
          a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(m1, _mm256_sign_epi8(xb, c1)), ones));
        }
      }
    }
#endif
    if constexpr (kShift || kBias)  // sum (q + shift) qx - shift sum qx over the sub-block (16 or 32 k)
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m256i off = _mm256_set1_epi32((kShift + kBias) * a8_sub_sum<L>(isum, r, sums, k0));
        a0[r] = _mm256_sub_epi32(a0[r], off), a1[r] = _mm256_sub_epi32(a1[r], off);
      }
    const BlockScales<L> s(blk, sub);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      __m256 t0 = rounded(_mm256_mul_ps(_mm256_cvtepi32_ps(a0[r]), s.d0));
      __m256 t1 = rounded(_mm256_mul_ps(_mm256_cvtepi32_ps(a1[r]), s.d1));
      if constexpr (L::kMin) {
        const __m256 sum = _mm256_set1_ps(static_cast<float>(a8_sub_sum<L>(isum, r, sums, k0)));
        t0 = _mm256_add_ps(t0, rounded(_mm256_mul_ps(sum, s.m0)));
        t1 = _mm256_add_ps(t1, rounded(_mm256_mul_ps(sum, s.m1)));
      }
      const __m256 scale = _mm256_set1_ps(sx[r * groups + k0 / kA8Group]);
      const __m256 p0 = rounded(_mm256_mul_ps(t0, scale)), p1 = rounded(_mm256_mul_ps(t1, scale));
      float* out = y + r * ldy;
      if (k0 == 0) {
        _mm256_storeu_ps(out, p0);
        _mm256_storeu_ps(out + 8, p1);
      } else {
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), p0));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_loadu_ps(out + 8), p1));
      }
    }
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INFLIGHT_A8_512 1
// vpdpbusd on 512 bits, its accumulator tied in place (GCC's builtin makes it a copy per call,
// and keeps accumulators passed as arrays in memory): acc + the four products of unsigned u8 and
// signed s8 bytes of each lane.
inline __m512i dpbusd512(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

inline __m512 rounded512(__m512 v) {
  asm volatile("" : "+v"(v));
  return v;
}

// a8_micro on AVX-512 VNNI, up to kA8Rows512 rows in one pass: the panel's 16 columns in one
// 512-bit register (a8_unpack's two halves joined), so that each group of 4 k costs a row one
// vpdpbusd instead of two; signed quants always biased by 128 (AVX-512 has no vpsignb), their
// 128 sum qx the accumulators' starting value; each row's outputs kept in registers across K
// instead of read and written back every sub-block. The same integer dots and the same fp32
// operations on each column in the same order as a8_micro: its outputs bit for bit, at every row
// count. (2 x MR accumulators, the weights and the scales: within the 32 registers up to 12 rows.)
template <int MR, class L>
void a8_micro512(const int8_t* __restrict xq, const float* __restrict sx, const int32_t* __restrict isum, int64_t K,
                 const uint8_t* __restrict panel, float* __restrict y, int64_t ldy) {
  static_assert(L::kScaled && L::kSub % 16 == 0 && kA8Group % L::kSub == 0, "a quantized layout");
  const int64_t groups = K / kA8Group, sums = K / 16;
  constexpr int kBias = A8Quants<L>::kUnsignedMax == 0 ? 128 : 0;  // signed quants: q + 128, unsigned
  constexpr int kOffset = A8Quants<L>::kShift + kBias;               // sum (q + offset) qx - offset sum qx
  __m512 out[MR];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) out[r] = _mm512_setzero_ps();
  for_sub_blocks<L>(panel, K, [&](const uint8_t* blk, int64_t sub, const uint8_t* q, int64_t k0) INFLIGHT_INLINE {
    __m512i acc[MR];
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_set1_epi32(-kOffset * a8_sub_sum<L>(isum, r, sums, k0));
    for (int64_t g = 0; g < L::kSub / 4; ++g) {
      __m256i c0, c1;
      a8_quants<L, (kBias > 0)>(q, g, c0, c1);
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1);
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * K + k0 + 4 * g, 4);
        acc[r] = dpbusd512(acc[r], w, _mm512_set1_epi32(four));
      }
    }
    const BlockScales512<L> s(blk, sub);
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      __m512 t = rounded512(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), s.d));
      if constexpr (L::kMin) {
        const __m512 sum = _mm512_set1_ps(static_cast<float>(a8_sub_sum<L>(isum, r, sums, k0)));
        t = _mm512_add_ps(t, rounded512(_mm512_mul_ps(sum, s.m)));
      }
      const __m512 p = rounded512(_mm512_mul_ps(t, _mm512_set1_ps(sx[r * groups + k0 / kA8Group])));
      out[r] = k0 == 0 ? p : _mm512_add_ps(out[r], p);
    }
  });
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, out[r]);
}

constexpr int kA8Rows512 = 12;

template <class L>
void a8_pass512(int rows, const int8_t* xq, const float* sx, const int32_t* isum, int64_t K, const uint8_t* w,
                float* y, int64_t ldy) {
  switch (rows) {
    case 12: return a8_micro512<12, L>(xq, sx, isum, K, w, y, ldy);
    case 11: return a8_micro512<11, L>(xq, sx, isum, K, w, y, ldy);
    case 10: return a8_micro512<10, L>(xq, sx, isum, K, w, y, ldy);
    case 9: return a8_micro512<9, L>(xq, sx, isum, K, w, y, ldy);
    case 8: return a8_micro512<8, L>(xq, sx, isum, K, w, y, ldy);
    case 7: return a8_micro512<7, L>(xq, sx, isum, K, w, y, ldy);
    case 6: return a8_micro512<6, L>(xq, sx, isum, K, w, y, ldy);
    case 5: return a8_micro512<5, L>(xq, sx, isum, K, w, y, ldy);
    case 4: return a8_micro512<4, L>(xq, sx, isum, K, w, y, ldy);
    case 3: return a8_micro512<3, L>(xq, sx, isum, K, w, y, ldy);
    default: return a8_micro512<2, L>(xq, sx, isum, K, w, y, ldy);
  }
}
constexpr int kA8PassRows = kA8Rows512;
#else
constexpr int kA8PassRows = kA8MaxRows;
#endif

// Steps of more rows than this take Q8_0's, Q5_0's and I8K16's quants biased by 128 into vpdpbusd (a8_micro,
// the 256-bit builds'):
// two 1B-shaped layers of Q8_0 1.14x at 16 rows and 1.28x at 64 (`kernels_bench.py --against`, 2 AMD
// EPYC Zen 4 cores); a variant biased from 2 rows on ran 0.89-0.95x at 4 (bound by memory there).
constexpr int64_t kA8BiasRows = 8;

template <class L, bool kBiasInt8>
void a8_pass(int rows, const int8_t* xq, const float* sx, const int32_t* isum, int64_t K, const uint8_t* w, float* y,
             int64_t ldy) {
  switch (rows) {
    case 4: return a8_micro<4, L, kBiasInt8>(xq, sx, isum, K, w, y, ldy);
    case 3: return a8_micro<3, L, kBiasInt8>(xq, sx, isum, K, w, y, ldy);
    case 2: return a8_micro<2, L, kBiasInt8>(xq, sx, isum, K, w, y, ldy);
    default: return a8_micro<1, L, kBiasInt8>(xq, sx, isum, K, w, y, ldy);
  }
}

template <class L>
void a8_rows(int rows, [[maybe_unused]] bool many, const int8_t* xq, const float* sx, const int32_t* isum, int64_t K,
             const uint8_t* w, float* y, int64_t ldy) {
  if constexpr (L::kScaled) {
#if defined(INFLIGHT_A8_512)
    if (rows > 1) return a8_pass512<L>(rows, xq, sx, isum, K, w, y, ldy);  // one row: a8_micro's two chains
#endif
#if defined(INFLIGHT_DPBUSD256)
    if constexpr (L::kValues == Values::kInt8 && !L::kMin && !std::is_same_v<L, Q8K16>)  // signed int8
      if (many) return a8_pass<L, true>(rows, xq, sx, isum, K, w, y, ldy);
#endif
    return a8_pass<L, false>(rows, xq, sx, isum, K, w, y, ldy);
  }
  TORCH_CHECK(false, "a 16-bit layout has no integer matmul");
}

// x [M, K] -> (qx int8 [M, K], sx [M, K / 32], sums of qx over each 16 k, int32 [M, K / 16]).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> a8_quantize(const torch::Tensor& x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "float32 [M, K] contiguous only");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kA8Group == 0, "K must be a multiple of ", kA8Group);
  auto q = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  auto s = torch::empty({m, k / kA8Group}, x.options());
  auto sums = torch::empty({m, k / 16}, x.options().dtype(torch::kInt32));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  int32_t* up = sums.data_ptr<int32_t>();
  at::parallel_for(0, m, row_grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < k / kA8Group; ++g) {
        const float* in = xp + r * k + g * kA8Group;
        float amax = 0.f;
        for (int64_t i = 0; i < kA8Group; ++i) amax = std::max(amax, std::fabs(in[i]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        sp[r * (k / kA8Group) + g] = amax / 127.f;
        int8_t* out = qp + r * k + g * kA8Group;
        for (int64_t half = 0; half < kA8Group / 16; ++half) {
          int32_t total = 0;
          for (int64_t i = half * 16; i < half * 16 + 16; ++i) {
            out[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(in[i] * inv))));
            total += out[i];
          }
          up[r * (k / 16) + g * (kA8Group / 16) + half] = total;
        }
      }
  });
  return {q, s, sums};
}

}  // namespace

// x [M, K] through a weight packed by pack_gguf_blocks with int8_activations -> [M, N] (fp32),
// every step size alike (the arithmetic above).
torch::Tensor gguf_blocks_a8_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  const PackedBlocks w = read_packed(x, packed);
  TORCH_CHECK(w.int8_activations, "weight was not packed for int8 activations");
  TORCH_CHECK(out_features == w.N, "out_features ", out_features, " does not match the packing (", w.N, ")");
  const int64_t M = x.size(0), K = x.size(1), panels = w.panels(), n_pad = panels * kQCols;
  auto [xq, sx, isum] = a8_quantize(x);
  auto y = torch::empty({M, n_pad}, x.options());
  const int8_t* qp = xq.data_ptr<int8_t>();
  const float* sp = sx.data_ptr<float>();
  const int32_t* up = isum.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  for_block_panels(w, M, kA8PassRows, [&](auto l, int64_t p, const uint8_t* panel, int64_t m, int rows) {
    a8_rows<decltype(l)>(rows, M > kA8BiasRows, qp + m * K, sp + m * (K / kA8Group), up + m * (K / 16), K, panel,
                         yp + m * n_pad + p * kQCols, n_pad);
  });
  return out_features == n_pad ? y : y.narrow(1, 0, out_features).contiguous();
}

bool gguf_blocks_int8_activations(const torch::Tensor& packed) { return packed_magic(packed) == kPackedMagicA8; }

// For tests: x's rows as gguf_blocks_a8_linear quantizes them (qx, sx, sums of each 16 qx), and
// a packing's integers: per weight q [N, K] (int16), per sub-block d and m [N, K / S] (fp32, m
// zero without minima), w = d * q + m bit for bit the loader's value.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> gguf_a8_quantize(torch::Tensor x) { return a8_quantize(x); }

namespace {

// Column c's integer q at k-row e of a sub-block's values, as a quantized layout holds it (w = d * q + m).
template <class L>
inline int quant_at(const uint8_t* values, int64_t e, int64_t c) {
  if constexpr (L::kFourBit) {
    const int v = (values[e * 8 + c % 8] >> (c < 8 ? 0 : 4)) & 0x0F;
    if constexpr (L::kValues == Values::kNibbleTable) return nibble_values<L::kTable>()[v];
    return v;
  } else if constexpr (L::kValues == Values::kSixBit) {
    return six_bit(values, e, c) - 32;
  } else {
    return static_cast<int8_t>(values[e * kQCols + c]);
  }
}

// fn(k0, d, m, values) for each sub-block of a quantized layout's panel, in k order: its first k,
// its 16 columns' d and m (fp32, as the kernels make them) and its values (quant_at reads them).
template <class L, class F>
void for_sub_block_scales(const uint8_t* panel, int64_t K, const F& fn) {
  for_sub_blocks<L>(panel, K, [&](const uint8_t* blk, int64_t sub, const uint8_t* values, int64_t k0) {
    const BlockScales<L> scales(blk, sub);
    alignas(32) float dv[16], mv[16];
    _mm256_store_ps(dv, scales.d0), _mm256_store_ps(dv + 8, scales.d1);
    _mm256_store_ps(mv, scales.m0), _mm256_store_ps(mv + 8, scales.m1);
    fn(k0, dv, mv, values);
  });
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> gguf_blocks_integers(torch::Tensor packed) {
  const int64_t K = reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>())[1];
  const PackedBlocks w = read_packed(torch::empty({0, K}, torch::kFloat32), packed);
  int64_t sub = 0;
  for (const auto& s : w.segments)
    with_layout(s.layout, [&](auto l) {
      using L = decltype(l);
      TORCH_CHECK(L::kScaled, "a 16-bit layout has no integers");
      TORCH_CHECK(sub == 0 || sub == L::kSub, "parts with different sub-blocks");
      sub = L::kSub;
    });
  auto q = torch::zeros({w.N, K}, torch::kInt16);
  auto d = torch::zeros({w.N, K / sub}, torch::kFloat32), m = torch::zeros({w.N, K / sub}, torch::kFloat32);
  int16_t* qp = q.data_ptr<int16_t>();
  float* dp = d.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  for (int64_t p = 0; p < w.panels(); ++p) {
    const auto [layout, at] = w.panel(p);
    const uint8_t* panel = at;
    with_layout(layout, [&](auto l) {
      using L = decltype(l);
      if constexpr (L::kScaled)
        for_sub_block_scales<L>(panel, K, [&](int64_t k0, const float* dv, const float* mv, const uint8_t* values) {
          for (int64_t c = 0; c < kQCols && p * kQCols + c < w.N; ++c) {
            const int64_t n = p * kQCols + c;
            dp[n * (K / sub) + k0 / sub] = dv[c], mp[n * (K / sub) + k0 / sub] = mv[c];
            for (int64_t e = 0; e < L::kSub; ++e) qp[n * K + k0 + e] = static_cast<int16_t>(quant_at<L>(values, e, c));
          }
        });
    });
  }
  return {q, d, m};
}

// ---- Greedy rows through a GGUF-block LM head: an integer screen, then the fp32 sums of the few
// columns it leaves (`gguf_blocks_greedy`).
//
// A greedy row wants only the argmax of its logits, and at the rows of a speculative verify or a
// batch of decodes the fp32 head is bound by its FMAs (49152 x 576 of them a row for the embedded
// model). The screen runs the int8-activation matmul (gguf_blocks_a8_linear's arithmetic, on the
// same fp32 packing: every quantized layout reads the same there) and bounds, per row and column,
// how far its value a can lie from the fp32 head's y:
//
//     |a - y| <= sum over groups g of 32 k: sx_g * T_g(v),
//     T_g(v) = sum over the group's weights of (1/2 + 2^-10) |w| + (2K + 16) * 127 * 2^-23 (|d q| + |m|)
//
// The first term is the activations' rounding (each x within sx (1/2 + 2^-10) of qx * sx, the
// fp32 roundings of 127 / max and of the product included); the second every fp32 rounding of
// both sums (y's K products in any order, a's sub-block terms d * dot and m * sum and their
// accumulation, w's own d * q + m: at most 2K + 16 roundings of 2^-24 of a term, each term at
// most (|d q| + |m|) * 127 sx_g). The bound b is then taken 2^-6 larger (its own fp32 sum) plus
// 2^-20 |a| (the roundings of a - b and a + b). Every column whose a + b reaches the row's
// largest a - b may hold the argmax (the argmax's y is at least every y, so its a + b at least
// every a - b); each of them is computed by the fp32 head's own kernel on its panel (quant_rows,
// one row: the same in-order sum bit for bit as gguf_blocks_linear at any number of rows), and
// the first largest wins, as argmax_rows takes it. So the token is the fp32 head's argmax
// exactly, never an approximation. A row with a value the bound cannot hold (an input, a value
// or a bound past 1e36, inf or NaN) takes every column.

namespace {

constexpr float kScreenSlack = 1.0f + 1.0f / 64;
constexpr float kScreenRelative = 1.0f / (1 << 20);

// |v| < 1e36 (so not inf nor NaN, and a column within the bound of it is finite in fp32 too).
// Bit tests: the file is built with fast-math, for which no value is inf or NaN.
inline bool in_range(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7fffffffu) < 0x7b4097ceu;  // 1e36f's bits
}

// The screen's rows need every part of the packing quantized (16-bit parts have no integer form).
bool screenable(const PackedBlocks& w) {
  if (w.int8_activations || w.bf16_activations || w.K % kA8Group != 0) return false;
  bool scaled = true;
  for (const auto& s : w.segments) with_layout(s.layout, [&](auto l) { scaled = scaled && decltype(l)::kScaled; });
  return scaled;
}

typedef int32_t ivec __attribute__((vector_size(kVec * sizeof(float))));

// R rows' 16 columns of a whole panel (rows `lda` apart; s: each row's sx_g times kScreenSlack,
// `groups` apart): a (the screen's values) becomes a + b; each row's floor (a vector, folded
// lane by lane) takes the largest a - b (also left in low, where given), and its wild lanes are
// set where a value is out of range. The rows' bounds are independent sums, so they overlap.
template <int R>
void screen_panel(float* a, int64_t lda, const float* s, const float* tab, int64_t groups, vec* floor, ivec* wild,
                  float* low, int64_t ldl) {
  constexpr int kParts = kQCols / kVec;
  vec b[R][kParts] = {};
  for (int64_t g = 0; g < groups; ++g)
    for (int j = 0; j < kParts; ++j) {
      const vec t = load_vec(tab + g * kQCols + j * kVec);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) b[r][j] += s[r * groups + g] * t;
    }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kParts; ++j) {
      float* ar = a + r * lda + j * kVec;
      const vec av = load_vec(ar);
      const ivec abs_a = reinterpret_cast<const ivec&>(av) & 0x7fffffff;
      const ivec abs_b = reinterpret_cast<const ivec&>(b[r][j]) & 0x7fffffff;
      wild[r] |= (abs_a >= 0x7b4097ce) | (abs_b >= 0x7b4097ce);  // in_range's test
      const vec bound = b[r][j] + reinterpret_cast<const vec&>(abs_a) * kScreenRelative;
      const vec lo = av - bound;
      floor[r] = lo > floor[r] ? lo : floor[r];
      if (low != nullptr) store_vec(low + r * ldl + j * kVec, lo);
      store_vec(ar, av + bound);
    }
}

}  // namespace

bool gguf_blocks_screenable(torch::Tensor packed) {
  if (packed_magic(packed) != kPackedMagic) return false;
  const int64_t K = reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>())[1];
  return screenable(read_packed(torch::empty({0, K}, torch::kFloat32), packed));
}

// The screen's table of a packing it reads (gguf_blocks_screenable), made once at load: T_g of
// each column, [panels, K / 32, 16] (fp32, each rounded up; columns past N zero), a panel's
// together as the screen reads them.
torch::Tensor gguf_blocks_screen_table(torch::Tensor packed) {
  TORCH_CHECK(gguf_blocks_screenable(packed), "the greedy screen reads a packing of quantized GGUF blocks (fp32)");
  const int64_t K = reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>())[1];
  const PackedBlocks w = read_packed(torch::empty({0, K}, torch::kFloat32), packed);
  const int64_t groups = K / kA8Group;
  const double quantized = 0.5 + 1.0 / 1024, rounded = (2.0 * K + 16) * 127 * std::ldexp(1.0, -23);
  auto table = torch::zeros({w.panels(), groups, kQCols}, torch::kFloat32);
  float* tp = table.data_ptr<float>();
  at::parallel_for(0, w.panels(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const auto [layout, at] = w.panel(p);
      const uint8_t* panel = at;  // a lambda cannot capture a structured binding before C++20
      with_layout(layout, [&](auto l) {
        using L = decltype(l);
        if constexpr (L::kScaled) {
          std::array<double, kQCols> sums{};
          for_sub_block_scales<L>(panel, K, [&](int64_t k0, const float* dv, const float* mv, const uint8_t* values) {
            for (int64_t e = 0; e < L::kSub; ++e) {
              for (int64_t c = 0; c < kQCols; ++c) {
                const double dq = static_cast<double>(dv[c]) * quant_at<L>(values, e, c), m = mv[c];
                sums[c] += quantized * std::fabs(dq + m) + rounded * (std::fabs(dq) + std::fabs(m));
              }
              if ((k0 + e + 1) % kA8Group == 0) {
                float* out = tp + (p * groups + (k0 + e) / kA8Group) * kQCols;
                for (int64_t c = 0; c < kQCols; ++c) out[c] = std::nextafter(static_cast<float>(sums[c]), INFINITY);
                sums.fill(0.0);
              }
            }
          });
        }
      });
      if ((p + 1) * kQCols > w.N)  // the padding columns: no weights, never candidates
        for (int64_t g = 0; g < groups; ++g)
          std::fill(tp + (p * groups + g) * kQCols + (w.N - p * kQCols), tp + (p * groups + g + 1) * kQCols, 0.0f);
    }
  });
  return table;
}

namespace {

// The screen's pass over every panel: hi [M, n_pad] <- a + b (lp: a - b, where given), and per
// row (floors, wild [M]) the largest a - b and whether a value is out of range.
void screen_rows(const PackedBlocks& w, const torch::Tensor& x, const float* tp, float* hp, float* lp,
                 std::vector<float>& floors, std::vector<uint8_t>& wild) {
  const int64_t M = x.size(0), K = x.size(1), N = w.N, groups = K / kA8Group, n_pad = w.panels() * kQCols;
  auto [xq, sx, isum] = a8_quantize(x);
  const int64_t threads = at::get_num_threads();
  std::vector<float> slack(M * groups);  // each sx_g times kScreenSlack
  for (int64_t i = 0; i < M * groups; ++i) slack[i] = sx.data_ptr<float>()[i] * kScreenSlack;
  // Per thread and row, a vector of floors and of wild lanes, folded at the end.
  std::vector<vec> floor_lanes(threads * M, vec{} - std::numeric_limits<float>::max());
  std::vector<ivec> wild_lanes(threads * M, ivec{});
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      if (!in_range(xp[m * K + k])) wild_lanes[m][0] = 1;  // (the quantizer's max would pass over a NaN)
  const int8_t* qp = xq.data_ptr<int8_t>();
  const float* sp = sx.data_ptr<float>();
  const int32_t* up = isum.data_ptr<int32_t>();
  for_block_panels(w, M, kA8PassRows, [&](auto l, int64_t p, const uint8_t* panel, int64_t m, int rows) {
    float* out = hp + m * n_pad + p * kQCols;
    a8_rows<decltype(l)>(rows, M > kA8BiasRows, qp + m * K, sp + m * groups, up + m * (K / 16), K, panel, out, n_pad);
    const int64_t t = at::get_thread_num(), columns = std::min(kQCols, N - p * kQCols);
    const float* tab = tp + p * groups * kQCols;
    const float* s = slack.data() + m * groups;
    vec* floor = floor_lanes.data() + t * M + m;
    ivec* wild_at = wild_lanes.data() + t * M + m;
    float* low = lp != nullptr ? lp + m * n_pad + p * kQCols : nullptr;
    if (columns == kQCols) {
      switch (rows) {
#define INFLIGHT_SCREEN_ROWS(R) \
  case R: return screen_panel<R>(out, n_pad, s, tab, groups, floor, wild_at, low, n_pad);
        INFLIGHT_SCREEN_ROWS(1) INFLIGHT_SCREEN_ROWS(2) INFLIGHT_SCREEN_ROWS(3) INFLIGHT_SCREEN_ROWS(4)
        INFLIGHT_SCREEN_ROWS(5) INFLIGHT_SCREEN_ROWS(6) INFLIGHT_SCREEN_ROWS(7) INFLIGHT_SCREEN_ROWS(8)
        INFLIGHT_SCREEN_ROWS(9) INFLIGHT_SCREEN_ROWS(10) INFLIGHT_SCREEN_ROWS(11) INFLIGHT_SCREEN_ROWS(12)
#undef INFLIGHT_SCREEN_ROWS
        default: TORCH_CHECK(false, "a screen pass of ", rows, " rows");
      }
    }
    for (int r = 0; r < rows; ++r) {  // the last panel, part padding: column by column
      float b[kQCols] = {}, * a = out + r * n_pad;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t c = 0; c < columns; ++c) b[c] += s[r * groups + g] * tab[g * kQCols + c];
      for (int64_t c = 0; c < columns; ++c) {
        if (!in_range(a[c]) || !in_range(b[c])) wild_at[r][0] = 1;
        const float bound = b[c] + std::fabs(a[c]) * kScreenRelative;
        floor[r][0] = std::max(floor[r][0], a[c] - bound);
        if (low != nullptr) low[r * n_pad + c] = a[c] - bound;
        a[c] += bound;
      }
    }
  });
  floors.assign(M, -std::numeric_limits<float>::max());
  wild.assign(M, 0);
  for (int64_t i = 0; i < threads * M; ++i)
    for (int c = 0; c < kVec; ++c) {
      floors[i % M] = std::max(floors[i % M], floor_lanes[i][c]);
      if (wild_lanes[i][c] != 0) wild[i % M] = 1;
    }
}

// A packing and table the screen reads, checked against x.
PackedBlocks screened_packing(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& table) {
  const PackedBlocks w = read_packed(x, packed);
  TORCH_CHECK(screenable(w), "the greedy screen reads a packing of quantized GGUF blocks (fp32)");
  TORCH_CHECK(table.dtype() == torch::kFloat32 && table.is_contiguous() && table.dim() == 3 &&
                  table.size(0) == w.panels() && table.size(1) == w.K / kA8Group && table.size(2) == kQCols,
              "the screen's table does not match the packing");
  return w;
}

}  // namespace

// For tests: each row's and column's range [a - b, a + b] where the screen holds the fp32 head's
// value to lie, (lo, hi) [M, N].
std::tuple<torch::Tensor, torch::Tensor> gguf_blocks_screen_range(torch::Tensor x, torch::Tensor packed,
                                                                  torch::Tensor table) {
  const PackedBlocks w = screened_packing(x, packed, table);
  const int64_t M = x.size(0), n_pad = w.panels() * kQCols;
  auto lo = torch::empty({M, n_pad}, x.options()), hi = torch::empty({M, n_pad}, x.options());
  std::vector<float> floors;
  std::vector<uint8_t> wild;
  screen_rows(w, x, table.data_ptr<float>(), hi.data_ptr<float>(), lo.data_ptr<float>(), floors, wild);
  return {lo.narrow(1, 0, w.N).contiguous(), hi.narrow(1, 0, w.N).contiguous()};
}

// x [M, K] (greedy rows) through a packing the screen reads, with its table (gguf_blocks_screen_table)
// -> (each row's argmax over the N columns of gguf_blocks_linear(x, packed, N), bit for bit;
// the columns each row computed in fp32), both int64 [M].
std::tuple<torch::Tensor, torch::Tensor> gguf_blocks_greedy(torch::Tensor x, torch::Tensor packed, torch::Tensor table,
                                                            int64_t out_features) {
  const PackedBlocks w = screened_packing(x, packed, table);
  TORCH_CHECK(out_features == w.N && out_features > 0, "out_features ", out_features, " does not match the packing (", w.N, ")");
  const int64_t M = x.size(0), K = x.size(1), N = w.N, n_pad = w.panels() * kQCols;
  // Each row's a + b per column (kept between calls: fresh pages cost more than the screen).
  thread_local std::vector<float> store;
  if (static_cast<int64_t>(store.size()) < M * n_pad) store.resize(M * n_pad);
  float* hp = store.data();
  std::vector<float> floors;
  std::vector<uint8_t> wild;
  screen_rows(w, x, table.data_ptr<float>(), hp, nullptr, floors, wild);
  const float* xp = x.data_ptr<float>();
  auto ids = torch::empty({M}, x.options().dtype(torch::kInt64));
  auto computed = torch::empty({M}, x.options().dtype(torch::kInt64));
  int64_t* ip = ids.data_ptr<int64_t>();
  int64_t* cp = computed.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> candidates;
    alignas(64) float y[kQCols];
    for (int64_t m = begin; m < end; ++m) {
      const float floor = floors[m];
      const bool every = wild[m] != 0;
      const float* hi = hp + m * n_pad;
      candidates.clear();
      for (int64_t v0 = 0; v0 < N; v0 += kQCols) {
        bool any = every;
#pragma omp simd reduction(|| : any)
        for (int64_t c = 0; c < kQCols; ++c) any = any || hi[v0 + c] >= floor;
        if (any)
          for (int64_t v = v0; v < std::min(N, v0 + kQCols); ++v)
            if (every || hi[v] >= floor) candidates.push_back(v);
      }
      int64_t best = -1;
      float best_y = 0.0f;
      const float* xr = xp + m * K;
      for (size_t i = 0; i < candidates.size();) {
        const int64_t p = candidates[i] / kQCols;
        const auto [layout, at] = w.panel(p);
        const uint8_t* panel = at;  // a lambda cannot capture a structured binding before C++20
        with_layout(layout, [&](auto l) { quant_rows<decltype(l)>(1, xr, K, panel, y, kQCols); });
        for (; i < candidates.size() && candidates[i] / kQCols == p; ++i) {
          const float value = y[candidates[i] - p * kQCols];
          // argmax_rows's order: the first NaN, else the first largest.
          if (best < 0 || (!is_nan_bits(best_y) && (is_nan_bits(value) || value > best_y)))
            best = candidates[i], best_y = value;
        }
      }
      ip[m] = best;
      cp[m] = static_cast<int64_t>(candidates.size());
    }
  });
  return {ids, computed};
}

// ---- bf16 weights times bf16 activations (`--quantization bf16-activations`).
//
// A matrix stored in bf16 (a checkpoint's safetensors, a GGUF file's BF16 tensors) is packed in
// BF16P, the same bytes as BF16x32 with each pair of k-rows interleaved. Each step rounds its
// activations to bf16 (to nearest even, as torch's `.to(torch.bfloat16)`) and, where the CPU has
// AVX512_BF16 (Zen 4 and later, Cooper Lake, Sapphire Rapids and later), vdpbf16ps multiplies a
// pair of k of 16 columns by a pair of one row's activations and adds both products to the row's
// fp32 sums: 32 multiply-adds an instruction, twice an fp32 FMA's. Elsewhere the rounded
// activations go through the fp32 block matmuls (the weights widened in registers). Every product
// is exact in fp32 (8-bit by 8-bit significands); the sums' rounding differs between the two ways
// (vdpbf16ps adds the two products of a pair before or after each other as the CPU does, and
// flushes denormals), so the contract is a tolerance against the rounded activations times the
// weights summed exactly (tests/test_bf16.py). Either way a row's result does not depend on the
// step's other rows.

bool gguf_blocks_bf16_activations(const torch::Tensor& packed) { return packed_magic(packed) == kPackedMagicBF16; }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define INFLIGHT_BF16_DOT 1

namespace {

constexpr int kBF16MaxRows = 14;  // a zmm of sums a row (16 columns), the weights, broadcasts from memory

// x [M, K] (K a multiple of 32) -> [M, bf16_pairs_stride(K)] int32 lanes, the first K / 2 of a row
// each a pair of x's bf16 (k's in the low half). The rows are a cache line more than a multiple
// of 4 KB apart, so that a microkernel's rows do not all fall into the same L1 set (with rows 4 KB
// apart, more than 8 of them evicted each other: 14 rows ran slower than 8).
int64_t bf16_pairs_stride(int64_t k) { return k / 2 + 16; }
torch::Tensor bf16_pairs(const torch::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "K must be a multiple of 32");
  auto out = torch::empty({m, bf16_pairs_stride(k)}, x.options().dtype(torch::kInt32));
  const float* xp = x.data_ptr<float>();
  int32_t* op = out.data_ptr<int32_t>();
  at::parallel_for(0, m, row_grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < k; i += 32) {
        const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xp + r * k + i + 16), _mm512_loadu_ps(xp + r * k + i));
        _mm512_storeu_si512(op + r * bf16_pairs_stride(k) + i / 2, reinterpret_cast<const __m512i&>(b));
      }
  });
  return out;
}

// y[r][0, 16) = MR rows of bf16 activation pairs (x, ldx pairs a row) times a BF16P panel.
template <int MR>
void bf16_micro(const int32_t* __restrict x, int64_t ldx, const uint8_t* __restrict panel, int64_t K,
                float* __restrict y, int64_t ldy) {
  __m512 acc[MR];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int64_t kAhead = 4;  // blocks (1 KB each) ahead, a cache line for each pair of k
  for (int64_t b = 0; b < K / BF16P::kK; ++b) {
    const uint8_t* blk = panel + b * BF16P::kBlockBytes;
    for (int64_t i = 0; i < BF16P::kK / 2; ++i) {
      __builtin_prefetch(blk + kAhead * BF16P::kBlockBytes + i * 64);
      const __m512i wi = _mm512_loadu_si512(blk + i * 64);
      const __m512bh w = reinterpret_cast<const __m512bh&>(wi);
      #pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512i xi = _mm512_set1_epi32(x[r * ldx + b * (BF16P::kK / 2) + i]);
        acc[r] = _mm512_dpbf16_ps(acc[r], w, reinterpret_cast<const __m512bh&>(xi));
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}
template <int MR = kBF16MaxRows>
void bf16_rows(int rows, const int32_t* x, int64_t ldx, const uint8_t* panel, int64_t K, float* y, int64_t ldy) {
  if constexpr (MR > 1) {
    if (rows < MR) return bf16_rows<MR - 1>(rows, x, ldx, panel, K, y, ldy);
  }
  bf16_micro<MR>(x, ldx, panel, K, y, ldy);
}

}  // namespace
#endif

bool bf16_dot_products() {
#if defined(INFLIGHT_BF16_DOT)
  return true;
#else
  return false;
#endif
}

// x [M, K] through a weight packed by pack_gguf_blocks with bf16_activations -> [M, N] (fp32),
// every step size alike (the arithmetic above).
torch::Tensor gguf_blocks_bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  const PackedBlocks w = read_packed(x, packed);
  TORCH_CHECK(w.bf16_activations, "weight was not packed for bf16 activations");
  TORCH_CHECK(out_features == w.N, "out_features ", out_features, " does not match the packing (", w.N, ")");
#if defined(INFLIGHT_BF16_DOT)
  const int64_t M = x.size(0), K = x.size(1), panels = w.panels(), n_pad = panels * kQCols;
  const torch::Tensor pairs = bf16_pairs(x);
  auto y = torch::empty({M, n_pad}, x.options());
  const int32_t* xp = pairs.data_ptr<int32_t>();
  const int64_t ldx = bf16_pairs_stride(K);
  float* yp = y.data_ptr<float>();
  panels_by_row_blocks(panels, M, [&](int64_t p, int64_t m_block, int64_t rows) {
    const uint8_t* panel = w.panel(p).second;
    even_row_blocks(rows, kBF16MaxRows, [&](int64_t r, int mr) {
      const int64_t m = m_block + r;
      bf16_rows(mr, xp + m * ldx, ldx, panel, K, yp + m * n_pad + p * kQCols, n_pad);
    });
  });
  return out_features == n_pad ? y : y.narrow(1, 0, out_features).contiguous();
#else
  // The activations rounded to bf16 (each exactly an fp32), then the fp32 block matmuls.
  const torch::Tensor rounded = x.to(torch::kBFloat16).to(torch::kFloat32);
  return x.size(0) <= kQRegisterRows ? gguf_blocks_linear(rounded, packed, out_features)
                                     : gguf_blocks_gemm(rounded, packed, out_features);
#endif
}

#else
bool gguf_blocks_available() { return false; }
int64_t gguf_blocks_max_rows() { return 0; }
std::pair<int64_t, int64_t> gguf_blocks_shape(const torch::Tensor&) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
void dequantized_rows(const torch::Tensor&, const std::function<void(int64_t, const float*)>&) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
torch::Tensor gguf_blocks_dequantize(torch::Tensor) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
torch::Tensor gguf_blocks_gemm(torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
torch::Tensor pack_gguf_blocks(std::vector<torch::Tensor>, std::vector<std::string>, int64_t, bool, bool) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
torch::Tensor gguf_blocks_bf16_linear(torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
bool gguf_blocks_bf16_activations(const torch::Tensor&) { return false; }
bool bf16_dot_products() { return false; }
torch::Tensor gguf_blocks_linear(torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
torch::Tensor gguf_blocks_a8_linear(torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
bool gguf_blocks_int8_activations(const torch::Tensor&) { return false; }
bool gguf_blocks_screenable(torch::Tensor) { return false; }
torch::Tensor gguf_blocks_screen_table(torch::Tensor) { TORCH_CHECK(false, "the GGUF block matmul needs AVX2"); }
std::tuple<torch::Tensor, torch::Tensor> gguf_blocks_greedy(torch::Tensor, torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
std::tuple<torch::Tensor, torch::Tensor> gguf_blocks_screen_range(torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> gguf_a8_quantize(torch::Tensor) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> gguf_blocks_integers(torch::Tensor) {
  TORCH_CHECK(false, "the GGUF block matmul needs AVX2");
}
#endif

// ---- int8 weight matmuls (W8A8): y = sw * sum over groups g of sx_g * (qx_g . qw_g).
//
// The weight is quantized once, at load, symmetric per output column (qw in [-127, 127], its
// scale sw: `inflight/model/linear.py`); each step's activations dynamically, here, per row and
// per group of kI8Group consecutive k (qx in [-127, 127], sx_g = max|x_g| / 127; the last group
// of a row may be shorter): one scale per row lets a few large activations (the MLP's down
// projection has them) flatten every small one, and costs the embedded model 3.4% perplexity
// where groups of 64 cost 0.6% (benchmarks/quality.py). Each group's dot product is
// integer and exact (at most 64 * 127 * 127 < 2^24, so exact in fp32 too); the output is
// (((d_0 * sx_0) + d_1 * sx_1) + ...) * sw, each product and each sum rounded in that order (no
// fused multiply-add: tests/test_int8.py reproduces it bit for bit). Packed: a 64-byte header
// (int64 N, K, Kp (K rounded up to 4), panels), the columns' sw (fp32), 128 * sum of each
// group's qw (int32, [groups][columns]), then panels of kI8Cols columns, [Kp / 4][kI8Cols][4]
// bytes: four consecutive k of one column in one 32-bit lane, as vpdpbusd multiplies them.
//
// - AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes, four into each int32 lane; the
//   activations go in as qx + 128 (a flip of the sign bit) and 128 * sum qw comes off after.
// - AVX-VNNI (AVX2 parts with vpdpbusd on 256 bits: Alder Lake and later cores, Sierra Forest,
//   Zen 5): the same, 8 lanes at a time. INFLIGHT_EMULATE_AVX_VNNI builds this branch on any AVX2
//   CPU with vpdpbusd's sums made from AVX2 instructions, so that its logic is tested everywhere
//   (`kernels.TARGETS`, tests/test_kernel_builds.py).
// - AVX2: vpmaddubsw on |qx| and qw carrying qx's sign (vpsignb), pairs summed in int16 (at most
//   2 * 127 * 127, no saturation), then vpmaddwd into int32.
// - Elsewhere: plain integer loops.

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kI8Cols = 32;
constexpr int kI8MaxRows = 12;  // 2 x 12 accumulators + 2 weight vectors of 32 zmm registers
constexpr bool kI8Offset = true;
constexpr const char* kI8Isa = "avx512-vnni";
#elif defined(__AVX2__) && (defined(__AVXVNNI__) || defined(INFLIGHT_EMULATE_AVX_VNNI))
#define INFLIGHT_I8_AVX_VNNI 1
constexpr int64_t kI8Cols = 16;
constexpr int kI8MaxRows = 6;  // 2 x 6 accumulators + 2 weight vectors + a broadcast of 16 ymm registers
constexpr bool kI8Offset = true;
constexpr const char* kI8Isa = "avx-vnni";
#elif defined(__AVX2__)
constexpr int64_t kI8Cols = 16;
constexpr int kI8MaxRows = 4;
constexpr bool kI8Offset = false;
constexpr const char* kI8Isa = "avx2";
#else
constexpr int64_t kI8Cols = 8;
constexpr int kI8MaxRows = 4;
constexpr bool kI8Offset = false;
constexpr const char* kI8Isa = "generic";
#endif
constexpr int64_t kI8Header = 64;
constexpr int64_t kI8Group = 64;  // k per activation scale (a multiple of 4)

int64_t int8_groups(int64_t k) { return (k + kI8Group - 1) / kI8Group; }

struct Int8Packed {
  int64_t n, k, kp, panels, groups;
  const float* scales;
  const int32_t* offsets;  // 128 * sum of qw over each group: [groups][panels * kI8Cols]
  const int8_t* panel;     // the first panel
};

Int8Packed read_int8(const torch::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == torch::kInt8 && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= kI8Header, "not an int8 weight packed by pack_int8_weight");
  const int8_t* base = packed.data_ptr<int8_t>();
  int64_t h[4];
  std::memcpy(h, base, sizeof(h));
  const int64_t cols = h[3] * kI8Cols, groups = int8_groups(h[1]);
  TORCH_CHECK(packed.numel() == kI8Header + cols * 4 * (1 + groups) + h[3] * h[2] * kI8Cols,
              "int8 weight packed by another build (its panel width differs)");
  return {h[0], h[1], h[2], h[3], groups, reinterpret_cast<const float*>(base + kI8Header),
          reinterpret_cast<const int32_t*>(base + kI8Header + cols * 4),
          base + kI8Header + cols * 4 * (1 + groups)};
}

// Rows of x [M, K] -> qx [M, Kp] (zero past K) and sx [M, groups], a scale per group of
// kI8Group k; stored as the microkernel reads them (qx + 128, a flip of the sign bit, where
// kI8Offset), in the one pass.
void quantize_rows(const float* x, int64_t m, int64_t k, int64_t kp, int8_t* q, float* scale) {
  const int64_t groups = int8_groups(k);
  at::parallel_for(0, m, row_grain(k), [&](int64_t begin, int64_t end) {
    constexpr int kFlip = kI8Offset ? 0x80 : 0;
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * kI8Group, last = std::min(k, first + kI8Group);
        const float* row = x + r * k;
        float amax = 0.f;
        for (int64_t i = first; i < last; ++i) amax = std::max(amax, std::fabs(row[i]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        scale[r * groups + g] = amax / 127.f;
        int8_t* out = q + r * kp;
        for (int64_t i = first; i < last; ++i)
          out[i] = static_cast<int8_t>(
              static_cast<int>(std::max(-127.f, std::min(127.f, std::nearbyint(row[i] * inv)))) ^ kFlip);
      }
      for (int64_t i = k; i < kp; ++i) q[r * kp + i] = static_cast<int8_t>(kFlip);
    }
  });
}

// acc[r][c] = sum over the panel's k of qx[r] (as stored in xq: + 128 where kI8Offset) * qw[c].
template <int MR>
inline void int8_micro(const int8_t* __restrict xq, int64_t ldx, const int8_t* __restrict w, int64_t groups,
                       int32_t* __restrict acc) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i a0[MR], a1[MR];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i w0 = _mm512_load_si512(w + g * 128), w1 = _mm512_load_si512(w + g * 128 + 64);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * ldx + 4 * g, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      a0[r] = _mm512_dpbusd_epi32(a0[r], xb, w0);
      a1[r] = _mm512_dpbusd_epi32(a1[r], xb, w1);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_si512(acc + r * kI8Cols, a0[r]);
    _mm512_storeu_si512(acc + r * kI8Cols + 16, a1[r]);
  }
#elif defined(INFLIGHT_I8_AVX_VNNI)
  __m256i a0[MR], a1[MR];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + g * 64));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + g * 64 + 32));
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * ldx + 4 * g, 4);
      const __m256i xb = _mm256_set1_epi32(four);
      a0[r] = dpbusd256(a0[r], xb, w0);
      a1[r] = dpbusd256(a1[r], xb, w1);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kI8Cols), a0[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kI8Cols + 8), a1[r]);
  }
#elif defined(__AVX2__)
  __m256i a0[MR], a1[MR];
  const __m256i ones = _mm256_set1_epi16(1);
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + g * 64));
    const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + g * 64 + 32));
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * ldx + 4 * g, 4);
      const __m256i xb = _mm256_set1_epi32(four), ax = _mm256_abs_epi8(xb);
      a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xb)), ones));
      a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xb)), ones));
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kI8Cols), a0[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kI8Cols + 8), a1[r]);
  }
#else
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < kI8Cols; ++c) acc[r * kI8Cols + c] = 0;
  for (int64_t g = 0; g < groups; ++g)
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      for (int64_t c = 0; c < kI8Cols; ++c)
        for (int j = 0; j < 4; ++j)
          acc[r * kI8Cols + c] += int32_t{xq[r * ldx + 4 * g + j]} * int32_t{w[(g * kI8Cols + c) * 4 + j]};
#endif
}

void int8_rows(int mr, const int8_t* xq, int64_t ldx, const int8_t* w, int64_t groups, int32_t* acc) {
  switch (mr) {
#define INFLIGHT_I8_ROWS(n)                        \
  case n:                                          \
    if constexpr (n <= kI8MaxRows) {               \
      int8_micro<n>(xq, ldx, w, groups, acc);      \
      return;                                      \
    }                                              \
    break;
    INFLIGHT_I8_ROWS(1) INFLIGHT_I8_ROWS(2) INFLIGHT_I8_ROWS(3) INFLIGHT_I8_ROWS(4) INFLIGHT_I8_ROWS(5)
    INFLIGHT_I8_ROWS(6) INFLIGHT_I8_ROWS(7) INFLIGHT_I8_ROWS(8) INFLIGHT_I8_ROWS(9) INFLIGHT_I8_ROWS(10)
    INFLIGHT_I8_ROWS(11) INFLIGHT_I8_ROWS(12)
#undef INFLIGHT_I8_ROWS
    default:
      break;
  }
  TORCH_CHECK(false, "int8 row block of ", mr, " rows is out of range");
}

// Every panel against every row of xq, a group of k at a time: `group(rows_begin, mr, panel, g,
// acc)` takes each block's integer dots of group g (the vpdpbusd offset still in them), and
// `done(rows_begin, mr, panel)` follows a block's last group.
template <typename G, typename D>
void int8_panels(const Int8Packed& w, const int8_t* xq, int64_t m, const G& group, const D& done) {
  for_panels(w.panels, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t acc[kI8MaxRows * kI8Cols];
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* panel = w.panel + p * w.kp * kI8Cols;
      even_row_blocks(m, kI8MaxRows, [&](int64_t r, int mr) {
        for (int64_t g = 0; g < w.groups; ++g) {
          const int64_t first = g * kI8Group, steps = (std::min(w.kp, first + kI8Group) - first) / 4;
          int8_rows(mr, xq + r * w.kp + first, w.kp, panel + first * kI8Cols, steps, acc);
          group(r, mr, p, g, acc);
        }
        done(r, mr, p);
      });
    }
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int8_linear on AVX-512 VNNI, each output finished in registers: a block of MR rows runs over
// all of a panel's k, its integer sums of each group turned into the fp32 terms and added to fp32
// accumulators as the group ends (no trip through memory between groups). The int32 sums, the fp32
// sums, the two weight vectors and a broadcast take 4 MR + 3 of the 32 zmm registers. The same
// arithmetic as the other branches' epilogue in int8_linear, in the same order: bit for bit the
// same outputs. Its inner loop is int8_micro's, written again: passed between functions as arrays,
// GCC keeps vpdpbusd accumulators in memory (see int8_peak_thread).
constexpr int kI8FusedRows = 7;


template <int MR>
inline void int8_fused_micro(const int8_t* __restrict xq, int64_t kp, const float* __restrict sx, int64_t groups,
                             const int8_t* __restrict panel, const int32_t* __restrict offsets, int64_t cols,
                             const float* __restrict sw, float* __restrict y, int64_t ldy, int64_t width) {
  __m512 f0[MR], f1[MR];
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) f0[r] = f1[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * kI8Group, steps = (std::min(kp, first + kI8Group) - first) / 4;
    const int8_t* w = panel + first * kI8Cols;
    __m512i a0[MR], a1[MR];
    #pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_si512();
    for (int64_t s = 0; s < steps; ++s) {
      const __m512i w0 = _mm512_load_si512(w + s * 128), w1 = _mm512_load_si512(w + s * 128 + 64);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * kp + first + 4 * s, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        a0[r] = dpbusd512(a0[r], xb, w0);
        a1[r] = dpbusd512(a1[r], xb, w1);
      }
    }
    const __m512i o0 = _mm512_loadu_si512(offsets + g * cols), o1 = _mm512_loadu_si512(offsets + g * cols + 16);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 scale = _mm512_set1_ps(sx[r * groups + g]);
      __m512 t0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a0[r], o0)), scale);
      __m512 t1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a1[r], o1)), scale);
      asm volatile("" : "+v"(t0), "+v"(t1));  // rounded here: never fused into the sum below
      if (g == 0) {
        f0[r] = t0, f1[r] = t1;
      } else {
        f0[r] = _mm512_add_ps(f0[r], t0), f1[r] = _mm512_add_ps(f1[r], t1);
      }
    }
  }
  const __m512 s0 = _mm512_loadu_ps(sw), s1 = _mm512_loadu_ps(sw + 16);
  const __mmask16 m0 = static_cast<__mmask16>(width >= 16 ? 0xFFFF : (1u << width) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(width >= 32 ? 0xFFFF : width <= 16 ? 0 : (1u << (width - 16)) - 1);
  #pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_mul_ps(f0[r], s0));
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_mul_ps(f1[r], s1));
  }
}

void int8_fused_rows(int mr, const int8_t* xq, int64_t kp, const float* sx, int64_t groups, const int8_t* panel,
                     const int32_t* offsets, int64_t cols, const float* sw, float* y, int64_t ldy, int64_t width) {
  switch (mr) {
#define INFLIGHT_I8_FUSED(n) \
  case n: return int8_fused_micro<n>(xq, kp, sx, groups, panel, offsets, cols, sw, y, ldy, width);
    INFLIGHT_I8_FUSED(1) INFLIGHT_I8_FUSED(2) INFLIGHT_I8_FUSED(3) INFLIGHT_I8_FUSED(4) INFLIGHT_I8_FUSED(5)
    INFLIGHT_I8_FUSED(6) INFLIGHT_I8_FUSED(7)
#undef INFLIGHT_I8_FUSED
    default:
      TORCH_CHECK(false, "int8 row block of ", mr, " rows is out of range");
  }
}
#endif

// x's rows quantized, as the kernel multiplies them: (qx [M, Kp] as stored for it, sx [M, groups]).
std::tuple<torch::Tensor, torch::Tensor> quantize_x(const torch::Tensor& x, int64_t kp) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "float32 [M, K] contiguous only");
  auto q = torch::empty({x.size(0), kp}, x.options().dtype(torch::kInt8));
  auto s = torch::empty({x.size(0), int8_groups(x.size(1))}, x.options());
  quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), kp, q.data_ptr<int8_t>(), s.data_ptr<float>());
  return {q, s};
}

torch::Tensor signed_values(const torch::Tensor& q) {  // qx back from its stored form (tests)
  return kI8Offset ? q.bitwise_xor(-128) : q;
}

}  // namespace

std::string int8_isa() { return kI8Isa; }

namespace {
// One thread's share of int8_peak_ops: the int8 microkernel's inner instructions on register
// operands, as many independent accumulators as it keeps (its rows x two column vectors), for
// `iterations` rounds; returns the multiply-adds done (and folds the sums into `sink`).
int64_t int8_peak_thread(int64_t iterations, int64_t seed, std::atomic<int64_t>& sink) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // 24 independent vpdpbusd chains (zmm0-23: the kernel's 12 rows x 2 column vectors) on one
  // broadcast (zmm24) and two weight vectors (zmm25-26), written out: GCC keeps an array of
  // vpdpbusd accumulators partly in memory here, which would time stores, not the instruction.
  static_assert(kI8MaxRows == 12, "the peak loop below is written for 12 rows");
  const int32_t x = 0x01020304 + static_cast<int32_t>(seed), w0 = 0x03030303, w1 = static_cast<int32_t>(0xFBFBFBFB);
  alignas(64) int32_t lanes[16] = {};
  int64_t n = iterations;
#define INFLIGHT_DP2(a, b) "vpdpbusd %%zmm25, %%zmm24, %%zmm" #a "\n\tvpdpbusd %%zmm26, %%zmm24, %%zmm" #b "\n\t"
#define INFLIGHT_ADD(a, b) "vpaddd %%zmm" #b ", %%zmm" #a ", %%zmm" #a "\n\t"
  if (n > 0)
    asm volatile(
        "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"
        "vmovdqa64 %%zmm0, %%zmm1\n\tvmovdqa64 %%zmm0, %%zmm2\n\tvmovdqa64 %%zmm0, %%zmm3\n\t"
        "vmovdqa64 %%zmm0, %%zmm4\n\tvmovdqa64 %%zmm0, %%zmm5\n\tvmovdqa64 %%zmm0, %%zmm6\n\t"
        "vmovdqa64 %%zmm0, %%zmm7\n\tvmovdqa64 %%zmm0, %%zmm8\n\tvmovdqa64 %%zmm0, %%zmm9\n\t"
        "vmovdqa64 %%zmm0, %%zmm10\n\tvmovdqa64 %%zmm0, %%zmm11\n\tvmovdqa64 %%zmm0, %%zmm12\n\t"
        "vmovdqa64 %%zmm0, %%zmm13\n\tvmovdqa64 %%zmm0, %%zmm14\n\tvmovdqa64 %%zmm0, %%zmm15\n\t"
        "vmovdqa64 %%zmm0, %%zmm16\n\tvmovdqa64 %%zmm0, %%zmm17\n\tvmovdqa64 %%zmm0, %%zmm18\n\t"
        "vmovdqa64 %%zmm0, %%zmm19\n\tvmovdqa64 %%zmm0, %%zmm20\n\tvmovdqa64 %%zmm0, %%zmm21\n\t"
        "vmovdqa64 %%zmm0, %%zmm22\n\tvmovdqa64 %%zmm0, %%zmm23\n\t"
        "vpbroadcastd %[x], %%zmm24\n\tvpbroadcastd %[w0], %%zmm25\n\tvpbroadcastd %[w1], %%zmm26\n\t"
        "1:\n\t"
        INFLIGHT_DP2(0, 1) INFLIGHT_DP2(2, 3) INFLIGHT_DP2(4, 5) INFLIGHT_DP2(6, 7) INFLIGHT_DP2(8, 9)
        INFLIGHT_DP2(10, 11) INFLIGHT_DP2(12, 13) INFLIGHT_DP2(14, 15) INFLIGHT_DP2(16, 17)
        INFLIGHT_DP2(18, 19) INFLIGHT_DP2(20, 21) INFLIGHT_DP2(22, 23)
        "dec %[n]\n\tjnz 1b\n\t"
        INFLIGHT_ADD(0, 1) INFLIGHT_ADD(2, 3) INFLIGHT_ADD(4, 5) INFLIGHT_ADD(6, 7) INFLIGHT_ADD(8, 9)
        INFLIGHT_ADD(10, 11) INFLIGHT_ADD(12, 13) INFLIGHT_ADD(14, 15) INFLIGHT_ADD(16, 17)
        INFLIGHT_ADD(18, 19) INFLIGHT_ADD(20, 21) INFLIGHT_ADD(22, 23)
        INFLIGHT_ADD(0, 2) INFLIGHT_ADD(4, 6) INFLIGHT_ADD(8, 10) INFLIGHT_ADD(12, 14) INFLIGHT_ADD(16, 18)
        INFLIGHT_ADD(20, 22) INFLIGHT_ADD(0, 4) INFLIGHT_ADD(8, 12) INFLIGHT_ADD(16, 20) INFLIGHT_ADD(0, 8)
        INFLIGHT_ADD(0, 16)
        "vmovdqa64 %%zmm0, %[lanes]\n\t"
        : [n] "+r"(n), [lanes] "+m"(lanes)
        : [x] "m"(x), [w0] "m"(w0), [w1] "m"(w1)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
          "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24",
          "xmm25", "xmm26", "cc");
#undef INFLIGHT_DP2
#undef INFLIGHT_ADD
  int64_t total = 0;
  for (int32_t v : lanes) total += v;
  sink += total;
  return iterations * kI8MaxRows * 2 * 64;
#elif defined(INFLIGHT_I8_AVX_VNNI) || defined(__AVX2__)
  constexpr int kRows = kI8MaxRows;
  __m256i acc[2 * kRows];
  for (auto& a : acc) a = _mm256_setzero_si256();
  __m256i x = _mm256_set1_epi32(static_cast<int32_t>(0x01020304 + seed));
  const __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(-5);
#if !defined(INFLIGHT_I8_AVX_VNNI)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      asm volatile("" : "+x"(x));
#if defined(INFLIGHT_I8_AVX_VNNI)
      acc[2 * r] = dpbusd256(acc[2 * r], x, w0);
      acc[2 * r + 1] = dpbusd256(acc[2 * r + 1], x, w1);
#else  // the AVX2 kernel's sequence: |x| once, then per column vector the sign, two multiplies, an add
      const __m256i ax = _mm256_abs_epi8(x);
      acc[2 * r] = _mm256_add_epi32(acc[2 * r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, x)), ones));
      acc[2 * r + 1] =
          _mm256_add_epi32(acc[2 * r + 1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, x)), ones));
#endif
    }
  }
  alignas(32) int32_t lanes[8];
  int64_t total = 0;
  for (auto& a : acc) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
    for (int32_t v : lanes) total += v;
  }
  sink += total;
  return iterations * kRows * 2 * 32;
#else
  (void)iterations, (void)seed, (void)sink;
  return 0;  // the portable loops have no instruction of their own to time
#endif
}
}  // namespace

// The int8 roofline's peak: multiply-adds per second of the int8 matmul's inner instructions
// (vpdpbusd, or AVX2's vpmaddubsw sequence) on every intra-op thread at once, from registers; 0
// for the portable build. Timed beside the fp32 GEMM peak by benchmarks/peers.py.
double int8_peak_macs(int64_t iterations) {
  std::atomic<int64_t> sink{0}, macs{0};
  const int64_t threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) macs += int8_peak_thread(iterations, t, sink);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return sink.load() == 42 ? 0.0 : static_cast<double>(macs.load()) / seconds;  // `sink` keeps the sums alive
}

namespace {
// An int8 weight's packing being written (the layout above): each column's values, offsets and
// scale go in with `column`, which one thread may call for its own columns.
struct Int8Packing {
  torch::Tensor out;
  int64_t k, kp, cols, groups;
  float* sw;
  int32_t* offsets;
  int8_t* panel;

  Int8Packing(int64_t n, int64_t k_, const torch::TensorOptions& options) : k(k_), kp((k_ + 3) / 4 * 4) {
    const int64_t panels = (n + kI8Cols - 1) / kI8Cols;
    cols = panels * kI8Cols, groups = int8_groups(k);
    out = torch::zeros({kI8Header + cols * 4 * (1 + groups) + panels * kp * kI8Cols}, options.dtype(torch::kInt8));
    int8_t* base = out.data_ptr<int8_t>();
    const int64_t h[4] = {n, k, kp, panels};
    std::memcpy(base, h, sizeof(h));
    sw = reinterpret_cast<float*>(base + kI8Header);
    offsets = reinterpret_cast<int32_t*>(base + kI8Header + cols * 4);
    panel = base + kI8Header + cols * 4 * (1 + groups);
  }

  // Column `col`: its K values qw, its scale.
  void column(int64_t col, const int8_t* q, float scale) {
    const int64_t p = col / kI8Cols, c = col % kI8Cols;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t i = g * kI8Group; i < std::min(k, (g + 1) * kI8Group); ++i) sum += q[i];
      offsets[g * cols + col] = 128 * sum;
    }
    for (int64_t i = 0; i < k; ++i) panel[(p * (kp / 4) + i / 4) * kI8Cols * 4 + c * 4 + i % 4] = q[i];
    sw[col] = scale;
  }
};
}  // namespace

// qw int8 [N, K] and its per-column scales fp32 [N] -> the packed weight (int8, 1-D).
torch::Tensor pack_int8_weight(torch::Tensor q, torch::Tensor scales) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), "int8 [N, K] contiguous only");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.numel() == q.size(0), "scales must be float32 [N]");
  Int8Packing packing(q.size(0), q.size(1), q.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.contiguous().data_ptr<float>();
  for (int64_t col = 0; col < q.size(0); ++col) packing.column(col, qp + col * q.size(1), sp[col]);
  return packing.out;
}

namespace {
// The rows of a weight [N, K] quantized at load: an fp32 one, or one packed by pack_gguf_blocks
// (its rows as gguf_blocks_dequantize makes them, a block panel at a time): its shape, and
// fn(row, its K fp32 values) for every row, in parallel (`grain` rows at least a thread, fp32).
std::pair<int64_t, int64_t> weight_rows_shape(const torch::Tensor& w) {
  if (w.scalar_type() == torch::kUInt8) return gguf_blocks_shape(w);
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 2 && w.is_contiguous(),
              "float32 [N, K] contiguous or a pack_gguf_blocks packing only");
  return {w.size(0), w.size(1)};
}

void for_each_weight_row(const torch::Tensor& w, int64_t grain,
                         const std::function<void(int64_t, const float*)>& fn) {
  if (w.scalar_type() == torch::kUInt8) return dequantized_rows(w, fn);
  const float* wp = w.data_ptr<float>();
  const int64_t k = w.size(1);
  at::parallel_for(0, w.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r, wp + r * k);
  });
}
}  // namespace

// max |w| of each row of a weight [N, K] (exact; as for_each_weight_row takes it), the first half
// of quantizing it at load.
torch::Tensor row_absmax(torch::Tensor w) {
  const auto [rows, cols] = weight_rows_shape(w);
  const int64_t n = rows, k = cols;  // a lambda cannot capture a structured binding before C++20
  auto out = torch::empty({n}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  for_each_weight_row(w, 1, [&](int64_t r, const float* row) {
    float amax = 0.f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
    op[r] = amax;
  });
  return out;
}

// A weight [N, K] (as for_each_weight_row takes it) quantized and packed in one parallel pass:
// each row's qw = clamp(round_half_even(w * inv), -127, 127) with the row's `inv` (127 / max|w|,
// or 0), its scale `scales` as given: pack_int8_weight of the same q, byte for byte
// (linear.quantize_int8 computes the same q in torch, the reference of tests/test_int8.py).
torch::Tensor quantize_pack_int8(torch::Tensor w, torch::Tensor inv, torch::Tensor scales) {
  const auto [rows, cols] = weight_rows_shape(w);
  const int64_t n = rows, k = cols;  // a lambda cannot capture a structured binding before C++20
  TORCH_CHECK(inv.dtype() == torch::kFloat32 && inv.numel() == n && scales.dtype() == torch::kFloat32 &&
                  scales.numel() == n, "inv and scales must be float32 [N]");
  Int8Packing packing(n, k, torch::TensorOptions().dtype(torch::kInt8));
  const auto inv_c = inv.contiguous(), scales_c = scales.contiguous();
  const float* ip = inv_c.data_ptr<float>();
  const float* sp = scales_c.data_ptr<float>();
  for_each_weight_row(w, kI8Cols, [&](int64_t col, const float* row) {  // fp32: whole panels a thread, mostly
    thread_local std::vector<int8_t> q;
    q.resize(k);
    for (int64_t i = 0; i < k; ++i)
      q[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(row[i] * ip[col]))));
    packing.column(col, q.data(), sp[col]);  // columns apart: threads write distinct bytes
  });
  return packing.out;
}

// The exact integer dot products of each group, qx_g . qw_g [M, N, groups], of x's rows as the
// kernel quantizes them, with qx [M, K] and sx [M, groups] (tests).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> int8_dots(torch::Tensor x, torch::Tensor packed) {
  const Int8Packed w = read_int8(packed);
  TORCH_CHECK(x.size(1) == w.k, "x does not match the weight");
  auto [xq, s] = quantize_x(x, w.kp);
  const int64_t m = x.size(0), cols = w.panels * kI8Cols;
  auto dots = torch::empty({m, w.n, w.groups}, x.options().dtype(torch::kInt32));
  int32_t* dp = dots.data_ptr<int32_t>();
  int8_panels(
      w, xq.data_ptr<int8_t>(), m,
      [&](int64_t r0, int mr, int64_t p, int64_t g, const int32_t* acc) {
        for (int r = 0; r < mr; ++r)
          for (int64_t c = 0; c < kI8Cols && p * kI8Cols + c < w.n; ++c)
            dp[((r0 + r) * w.n + p * kI8Cols + c) * w.groups + g] =
                acc[r * kI8Cols + c] - (kI8Offset ? w.offsets[g * cols + p * kI8Cols + c] : 0);
      },
      [](int64_t, int, int64_t) {});
  return {dots, signed_values(xq).narrow(1, 0, w.k).contiguous(), s};
}

// x [M, K] through an int8 weight (out_features N) -> y [M, N] (no bias: the caller adds it).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  const Int8Packed w = read_int8(packed);
  TORCH_CHECK(x.size(1) == w.k && out_features == w.n, "x or out_features does not match the int8 weight");
  auto [xq, s] = quantize_x(x, w.kp);
  const int64_t m = x.size(0), cols = w.panels * kI8Cols;
  auto y = torch::empty({m, w.n}, x.options());
  float* yp = y.data_ptr<float>();
  const float* sx = s.data_ptr<float>();
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int8_t* xqp = xq.data_ptr<int8_t>();
  for_panels(w.panels, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t width = std::min(kI8Cols, w.n - p * kI8Cols);
      even_row_blocks(m, kI8FusedRows, [&](int64_t r, int mr) {
        int8_fused_rows(mr, xqp + r * w.kp, w.kp, sx + r * w.groups, w.groups, w.panel + p * w.kp * kI8Cols,
                        w.offsets + p * kI8Cols, cols, w.scales + p * kI8Cols, yp + r * w.n + p * kI8Cols, w.n, width);
      });
    }
  });
#else
  int8_panels(
      w, xq.data_ptr<int8_t>(), m,
      [&](int64_t r0, int mr, int64_t p, int64_t g, const int32_t* acc) {
        // The block's running sums stay in y (in cache): each group's products are rounded in
        // `term` and added after a compiler barrier, so that -ffast-math can neither fuse them
        // into a multiply-add nor reorder the sum (the contract above).
        const int32_t* offsets = w.offsets + g * cols + p * kI8Cols;
        alignas(64) float term[kI8Cols];
        for (int r = 0; r < mr; ++r) {
          const float scale = sx[(r0 + r) * w.groups + g];
          for (int64_t c = 0; c < kI8Cols; ++c)
            term[c] = static_cast<float>(acc[r * kI8Cols + c] - (kI8Offset ? offsets[c] : 0)) * scale;
          asm volatile("" : : "r"(term) : "memory");
          float* out = yp + (r0 + r) * w.n + p * kI8Cols;
          const int64_t width = std::min(kI8Cols, w.n - p * kI8Cols);
          if (g == 0) {
            for (int64_t c = 0; c < width; ++c) out[c] = term[c];
          } else {
            for (int64_t c = 0; c < width; ++c) out[c] += term[c];
          }
        }
      },
      [&](int64_t r0, int mr, int64_t p) {
        const int64_t c0 = p * kI8Cols, width = std::min(kI8Cols, w.n - c0);
        for (int r = 0; r < mr; ++r) {
          float* out = yp + (r0 + r) * w.n + c0;
          for (int64_t c = 0; c < width; ++c) out[c] *= w.scales[c0 + c];
        }
      });
#endif
  return y;
}

// One weight matmul as `Linear` and `DecoderStack` both run it: a weight kept as GGUF blocks
// (it has no fp32 panels) from its blocks, dequantized in registers for steps of at most
// gguf_blocks_max_rows() rows, into one fp32 panel at a time for larger ones (the bias added after);
// a weight packed int8 (`pack_int8_weight`: its "blocks" are int8) through `int8_linear`; any
// other from its fp32 panels. The one place that choice is made.
torch::Tensor linear_forward(const torch::Tensor& x, const torch::Tensor& packed,
                             const c10::optional<torch::Tensor>& blocks, const c10::optional<torch::Tensor>& bias,
                             int64_t out_features) {
  if (blocks.has_value() && blocks->scalar_type() == torch::kInt8) {  // pack_int8_weight's
    torch::Tensor y = int8_linear(x, *blocks, out_features);
    return bias.has_value() ? y.add_(*bias) : y;
  }
  if (blocks.has_value()) {
    torch::Tensor y = gguf_blocks_int8_activations(*blocks)   ? gguf_blocks_a8_linear(x, *blocks, out_features)
                      : gguf_blocks_bf16_activations(*blocks) ? gguf_blocks_bf16_linear(x, *blocks, out_features)
                      : x.size(0) <= gguf_blocks_max_rows() ? gguf_blocks_linear(x, *blocks, out_features)
                                                     : gguf_blocks_gemm(x, *blocks, out_features);
    return bias.has_value() ? y.add_(*bias) : y;
  }
  return packed_linear(x, packed, bias, out_features);
}

// ---- A step's decoder layers in one call. Driven from Python, a 64-request decode step spent
// 6-8 ms between these kernels (Python frames, argument conversion and dispatch, slowed by caches
// that each kernel had just filled with megabytes of weights and K/V), a 16-request step as
// much, and a single stream 1.6 ms of 10. Here the same kernels run back to back on the same
// inputs in the same order, so every output is bit for bit the Python loop's
// (tests/test_decoder_stack.py), and the GIL is released meanwhile.

namespace {

// A torch.profiler range, as Python's record_function opens; close to free when no profiler
// is listening.
class Range {
 public:
  explicit Range(const std::string& name) : guard_(at::RecordScope::USER_SCOPE) {
    if (guard_.isActive()) guard_.before(name);
  }

 private:
  at::RecordFunction guard_;
};

struct StackLinear {
  torch::Tensor packed;                 // pack_linear_weight's panels
  c10::optional<torch::Tensor> blocks;  // pack_gguf_blocks's, if the weight has them
  c10::optional<torch::Tensor> bias;
  int64_t out_features;
  std::string label;
};

// The ops of inflight/model/layer_plan.py's Op, as a plan names them.
enum class PlanOp {
  kAddRmsNorm, kMatmul, kRotaryStoreKv, kAttention, kSiluAndMul, kGeluTanhAndMul, kQkNorm, kAddResidual, kRmsNorm,
  kScale, kRoutedExperts, kReluSquared, kAddLayerNorm, kLayerNorm, kGeluTanh, kAdd, kXielu, kRotary, kStoreKv,
  kShortConv, kLatentAttention, kRelu, kGelu
};
const std::vector<std::pair<std::string, PlanOp>> kPlanOps = {
    {"add_rms_norm", PlanOp::kAddRmsNorm},   {"matmul", PlanOp::kMatmul},
    {"rotary_store_kv", PlanOp::kRotaryStoreKv}, {"attention", PlanOp::kAttention},
    {"silu_and_mul", PlanOp::kSiluAndMul},   {"gelu_tanh_and_mul", PlanOp::kGeluTanhAndMul},
    {"qk_norm", PlanOp::kQkNorm},            {"add_residual", PlanOp::kAddResidual},
    {"rms_norm", PlanOp::kRmsNorm},          {"scale", PlanOp::kScale},
    {"routed_experts", PlanOp::kRoutedExperts}, {"relu_squared", PlanOp::kReluSquared},
    {"add_layer_norm", PlanOp::kAddLayerNorm}, {"layer_norm", PlanOp::kLayerNorm},
    {"gelu_tanh", PlanOp::kGeluTanh},        {"add", PlanOp::kAdd},
    {"xielu", PlanOp::kXielu},               {"rotary", PlanOp::kRotary},
    {"store_kv", PlanOp::kStoreKv},          {"short_conv", PlanOp::kShortConv},
    {"latent_attention", PlanOp::kLatentAttention}, {"relu", PlanOp::kRelu},
    {"gelu", PlanOp::kGelu}};
constexpr int64_t kMaxRegs = 8;

torch::Tensor run_linear(const StackLinear& lin, const torch::Tensor& x) {
  Range r(lin.label);
  return linear_forward(x, lin.packed, lin.blocks, lin.bias, lin.out_features);
}

// experts.py's row_sigmoid: torch.sigmoid in fp64, so that each element is the same whether it
// falls in PyTorch's vector loop or the scalar one after it (which rounded some a unit apart).
inline torch::Tensor row_sigmoid(const torch::Tensor& x) {
  return torch::sigmoid(x.to(torch::kDouble)).to(x.scalar_type());
}

// A layer's routed-experts MLP (model/experts.py's RoutedExperts, the same ATen ops in the same
// order, so the same values bit for bit): each token through the top_k experts its router scores
// highest (the scores plus `choice_bias` where there is one: GLM-4.5's, ERNIE 4.5's), weighted by
// the softmax over all of them (renormalized over the chosen where `normalize`), or by their
// sigmoids (GLM-4.5's), times `scale`; chosen within the token's `groups_kept` best of `groups`
// groups where `groups` > 1 (DeepSeek's); each expert one matmul over the tokens that chose it; a shared
// expert every token runs, scaled by the sigmoid of its one-output gate where it has one, added
// after. Without a router, a dense MLP (a layer of a MoE model that has no experts).
struct StackExperts {
  c10::optional<StackLinear> router;
  std::vector<StackLinear> gate_up, down, shared;  // shared: gate/up, down and (maybe) gate, or none
  int64_t top_k = 1;
  bool normalize = false, sigmoid = false;
  c10::optional<torch::Tensor> choice_bias;
  double scale = 1.0;
  int64_t groups = 1, groups_kept = 1;
  double sparsemixer_eps = -1;  // >= 0: Phi-3.5-MoE's sparse mixer chooses (`sparsemixer`)
  double swiglu_alpha = 0, swiglu_limit = 0;  // limit > 0: gpt-oss's clamped SwiGLU (clamped_swiglu), else silu

  torch::Tensor act(const torch::Tensor& gate_up_out) const {
    return swiglu_limit > 0 ? clamped_swiglu(gate_up_out, swiglu_alpha, swiglu_limit) : silu_and_mul(gate_up_out);
  }

  torch::Tensor forward(const torch::Tensor& x) const {
    if (!router) return run_linear(down[0], act(run_linear(gate_up[0], x)));
    Range r("routed experts");
    const torch::Tensor logits = run_linear(*router, x).to(torch::kFloat);
    torch::Tensor weights, chosen;
    if (sparsemixer_eps >= 0) {
      std::tie(weights, chosen) = sparsemixer(logits);
    } else {
      choose(logits, weights, chosen);
    }
    weights = weights.to(x.scalar_type());
    auto out = torch::zeros_like(x);
    if (x.size(0) == 1 && x.scalar_type() == torch::kFloat) {  // one token: its experts in id order, as below
      const torch::Tensor ids = chosen.contiguous(), ws = weights.contiguous();
      std::vector<std::pair<int64_t, float>> picks;
      for (int64_t k = 0; k < top_k; ++k) picks.emplace_back(ids.data_ptr<int64_t>()[k], ws.data_ptr<float>()[k]);
      std::sort(picks.begin(), picks.end());
      for (const auto& [e, w] : picks)
        out.add_(run_linear(down[e], act(run_linear(gate_up[e], x))).mul_(w));
    } else {
      add_routed(x, weights, chosen, out);
    }
    if (shared.size() == 3)
      out += row_sigmoid(run_linear(shared[2], x)) * run_linear(shared[1], act(run_linear(shared[0], x)));
    else if (shared.size() == 2)
      out += run_linear(shared[1], act(run_linear(shared[0], x)));
    return out;
  }

  // Each token's top_k experts and their weights from the router's logits: the softmax or the
  // sigmoids, the choice by those plus the choice bias within the best groups, renormalized, scaled.
  void choose(const torch::Tensor& logits, torch::Tensor& weights, torch::Tensor& chosen) const {
    const torch::Tensor scores = sigmoid ? row_sigmoid(logits) : torch::softmax(logits, -1);
    torch::Tensor choice = choice_bias ? scores + *choice_bias : scores;
    if (groups > 1) choice = within_groups(choice);
    if (!choice_bias && groups == 1) {
      std::tie(weights, chosen) = torch::topk(scores, top_k, -1);
    } else {
      chosen = std::get<1>(torch::topk(choice, top_k, -1));
      weights = scores.gather(1, chosen);
    }
    if (normalize) {
      const torch::Tensor total = weights.sum(-1, true);
      weights = weights / (sigmoid ? total + 1e-20 : total);
    }
    if (scale != 1.0) weights = weights * scale;
  }

  // Phi-3.5-MoE's choice (experts.py's `sparsemixer`, the same ATen ops): the best expert, weighted
  // by the softmax over those within a relative 2 * eps of it, then the best of the rest alike.
  std::pair<torch::Tensor, torch::Tensor> sparsemixer(const torch::Tensor& logits) const {
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<torch::Tensor> weights, chosen;
    torch::Tensor left = logits;
    for (int64_t k = 0; k < top_k; ++k) {
      const auto [best, index] = left.max(-1, true);
      const torch::Tensor far = (best - logits).div(logits.abs().clamp(best)).gt(2 * sparsemixer_eps);
      weights.push_back(torch::softmax(left.masked_fill(far, -inf), -1).gather(1, index));
      chosen.push_back(index);
      left = left.scatter(1, index, -inf);
    }
    return {torch::cat(weights, 1), torch::cat(chosen, 1)};
  }

  // `choice` [tokens, experts] with every expert outside the token's `groups_kept` best groups at
  // -inf: a group scored by its best expert (softmax scoring) or its best two's sum (sigmoid).
  torch::Tensor within_groups(const torch::Tensor& choice) const {
    const torch::Tensor per_group = choice.view({choice.size(0), groups, -1});
    const torch::Tensor best = sigmoid ? std::get<0>(per_group.topk(2, -1)).sum(-1) : per_group.amax(-1);
    const torch::Tensor mask = torch::zeros_like(best, torch::kBool)
                                   .scatter_(1, std::get<1>(torch::topk(best, groups_kept, -1)), true);
    return choice.masked_fill(mask.logical_not().repeat_interleave(per_group.size(2), 1),
                              -std::numeric_limits<float>::infinity());
  }

  // Every (token, choice) pair grouped by expert: each expert one matmul over its tokens, its
  // outputs weighted into `out` in expert order.
  void add_routed(const torch::Tensor& x, const torch::Tensor& weights, const torch::Tensor& chosen,
                  torch::Tensor& out) const {
    const int64_t num_experts = static_cast<int64_t>(gate_up.size());
    const torch::Tensor flat = chosen.flatten();
    const torch::Tensor order = torch::argsort(flat, /*stable=*/true, /*dim=*/0);
    const torch::Tensor rows_of = torch::div(order, top_k, "floor");
    const torch::Tensor pair_weights = weights.flatten();
    const torch::Tensor counts = torch::bincount(flat, {}, num_experts);
    const int64_t* count = counts.data_ptr<int64_t>();
    for (int64_t e = 0, start = 0; e < num_experts; ++e) {
      if (count[e] == 0) continue;
      const torch::Tensor pairs = order.narrow(0, start, count[e]), rows = rows_of.narrow(0, start, count[e]);
      start += count[e];
      const torch::Tensor y = run_linear(down[e], act(run_linear(gate_up[e], x.index_select(0, rows))));
      out.index_add_(0, rows, y * pair_weights.index_select(0, pairs).unsqueeze(1));
    }
  }
};

// A layer's latent attention (DeepSeek's MLA; model/latent.py, the same ATen ops in the same order,
// so the same values bit for bit): the latent's RMSNorm scale, each head's key and value
// up-projections [heads, nope, rank] and [heads, v, rank], and where the query has a rank its norm
// and up-projection.
struct StackLatent {
  torch::Tensor kv_norm, k_up, v_up;  // (the up-projections empty where kept as stored: heads below)
  c10::optional<torch::Tensor> q_norm;
  c10::optional<StackLinear> q_up;
  std::vector<StackLinear> k_heads, v_heads;  // the up-projections a matmul a head, where kept as stored
};

// model/latent.py's norm of the latent and of the query's rank: fp32, transformers' epsilon.
torch::Tensor latent_rms_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  return weight * at::rms_norm(x.to(torch::kFloat), {x.size(-1)}, c10::nullopt, 1e-6).to(x.scalar_type());
}

// model/latent.py's rotary of the last dim: pairs (2i, 2i + 1) where interleaved, else (i, i + half);
// the result in halves either way.
torch::Tensor latent_rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                            bool interleaved) {
  const int64_t n = x.size(-1), half = n / 2;
  const torch::Tensor a = interleaved ? x.slice(-1, 0, n, 2) : x.narrow(-1, 0, half);
  const torch::Tensor b = interleaved ? x.slice(-1, 1, n, 2) : x.narrow(-1, half, half);
  return torch::cat({a * cos - b * sin, b * cos + a * sin}, -1);
}

// model/latent.py's _per_head: head h of x [tokens, heads, in] through linears[h] (x's slice made
// contiguous, as Linear makes its input), stacked [tokens, heads, out].
torch::Tensor per_head(const std::vector<StackLinear>& linears, const torch::Tensor& x) {
  std::vector<torch::Tensor> heads;
  for (size_t h = 0; h < linears.size(); ++h)
    heads.push_back(run_linear(linears[h], x.select(1, static_cast<int64_t>(h)).contiguous()));
  return torch::stack(heads, 1);
}

struct PlanStep {
  PlanOp op;
  int64_t src, dst;
  int64_t param;  // the index of the step's weight among its layer's norms (the norm ops) or matmuls
  std::vector<int64_t> release;  // registers dropped after the step (layer_plan.released_after)
};

}  // namespace

std::vector<std::string> plan_ops() {
  std::vector<std::string> names;
  for (const auto& entry : kPlanOps) names.push_back(entry.first);
  return names;
}

class DecoderStack {
 public:
  // plans: a layer's steps (op name, source register, destination register, weight index,
  // registers to release after it), as layer_plan.py writes them, one plan for each kind of layer
  // (layer_plan.for_mixer); layer i runs plans[layer_plans[i]], and after the last layer register
  // `output` holds the result. norms holds each layer's norm
  // weights, layer after layer, norm_biases a LayerNorm's bias beside each (or none), qk_norms each layer's q and k scales (where the plan has
  // qk_norm); packed, blocks, biases and out_features each layer's matmuls (as
  // inflight.model.linear.Linear holds them). Per layer: its attention window (0: none), which of
  // forward's rotary tables it reads, and the factor of its `scale` steps.
  DecoderStack(const std::vector<std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, std::vector<int64_t>>>>& plans,
               std::vector<int64_t> layer_plans, int64_t output, int64_t num_layers, std::vector<torch::Tensor> norms,
               std::vector<c10::optional<torch::Tensor>> norm_biases, std::vector<torch::Tensor> qk_norms, std::vector<torch::Tensor> packed,
               std::vector<c10::optional<torch::Tensor>> blocks, std::vector<c10::optional<torch::Tensor>> biases,
               std::vector<int64_t> out_features, std::vector<int64_t> windows, std::vector<int64_t> rope_tables,
               std::vector<double> residual_scales, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double eps, double attention_scale, double softcap)
      : layer_plans_(std::move(layer_plans)), norms_(std::move(norms)), norm_biases_(std::move(norm_biases)), qk_norms_(std::move(qk_norms)), windows_(std::move(windows)),
        rope_tables_(std::move(rope_tables)), residual_scales_(std::move(residual_scales)), num_layers_(num_layers),
        output_(output), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        attention_scale_(attention_scale), softcap_(softcap) {
    TORCH_CHECK(num_layers > 0 && norms_.size() % num_layers == 0 && packed.size() % num_layers == 0,
                "the same number of norms and of matmuls in every layer");
    TORCH_CHECK(norm_biases_.empty() || norm_biases_.size() == norms_.size(), "a bias for every norm, or none");
    for (size_t i = 0; i < norm_biases_.size(); ++i) norm_bias(norm_biases_[i], norms_[i]);  // checked once, here
    TORCH_CHECK(blocks.size() == packed.size() && biases.size() == packed.size() && out_features.size() == packed.size(),
                "blocks, biases and out_features for every matmul");
    TORCH_CHECK(static_cast<int64_t>(windows_.size()) == num_layers && static_cast<int64_t>(rope_tables_.size()) ==
                    num_layers && static_cast<int64_t>(residual_scales_.size()) == num_layers,
                "a window, a rotary table and a residual scale for every layer");
    TORCH_CHECK(qk_norms_.empty() || static_cast<int64_t>(qk_norms_.size()) == 2 * num_layers,
                "a q and a k scale for every layer, or none");
    norms_per_layer_ = static_cast<int64_t>(norms_.size()) / num_layers;
    matmuls_per_layer_ = static_cast<int64_t>(packed.size()) / num_layers;
    for (size_t i = 0; i < packed.size(); ++i)
      linears_.push_back({packed[i], blocks[i], biases[i], out_features[i], "matmul -> " + std::to_string(out_features[i])});
    TORCH_CHECK(output >= 0 && output < kMaxRegs, "output register out of range");
    TORCH_CHECK(static_cast<int64_t>(layer_plans_.size()) == num_layers, "a plan for every layer");
    for (int64_t p : layer_plans_)
      TORCH_CHECK(p >= 0 && p < static_cast<int64_t>(plans.size()), "no such plan: ", p);
    for (const auto& plan : plans) {
      plans_.emplace_back();
      for (const auto& [name, src, dst, param, release] : plan) {
        auto found = std::find_if(kPlanOps.begin(), kPlanOps.end(), [&](const auto& e) { return e.first == name; });
        TORCH_CHECK(found != kPlanOps.end(), "DecoderStack: no kernel for the plan's op ", name);
        TORCH_CHECK(src >= 0 && src < kMaxRegs && dst >= 0 && dst < kMaxRegs, "register out of range in op ", name);
        const PlanOp op = found->second;
        if (op == PlanOp::kAddRmsNorm || op == PlanOp::kRmsNorm || op == PlanOp::kAddLayerNorm ||
            op == PlanOp::kLayerNorm)
          TORCH_CHECK(param >= 0 && param < norms_per_layer_, "no such norm: ", param);
        if (op == PlanOp::kMatmul) TORCH_CHECK(param >= 0 && param < matmuls_per_layer_, "no such matmul: ", param);
        if (op == PlanOp::kQkNorm) TORCH_CHECK(!qk_norms_.empty(), "a qk_norm step needs the layers' q and k scales");
        for (int64_t r : release) TORCH_CHECK(r >= 0 && r < kMaxRegs, "register out of range in op ", name);
        plans_.back().push_back({op, src, dst, param, release});
      }
    }
  }

  int64_t num_layers() const { return num_layers_; }

  // Layer `layer`'s routed-experts MLP (the plan's routed_experts step), its matmuls as the
  // constructor's are given, in order: the router where `routed`, each expert's gate/up, each
  // one's down, then the shared expert's `shared` matmuls: gate/up, down and (3) its gate.
  // `sigmoid`, `choice_bias`, `scale`, `groups` and `groups_kept`: how the router scores and
  // chooses (StackExperts).
  void set_experts(int64_t layer, std::vector<torch::Tensor> packed, std::vector<c10::optional<torch::Tensor>> blocks,
                   std::vector<c10::optional<torch::Tensor>> biases, std::vector<int64_t> out_features, bool routed,
                   int64_t shared, int64_t top_k, bool normalize, double swiglu_alpha, double swiglu_limit,
                   bool sigmoid, c10::optional<torch::Tensor> choice_bias, double scale, int64_t groups,
                   int64_t groups_kept, double sparsemixer_eps) {
    TORCH_CHECK(layer >= 0 && layer < num_layers_, "no such layer: ", layer);
    const int64_t n = static_cast<int64_t>(packed.size());
    TORCH_CHECK(static_cast<int64_t>(blocks.size()) == n && static_cast<int64_t>(biases.size()) == n &&
                    static_cast<int64_t>(out_features.size()) == n,
                "blocks, biases and out_features for every matmul");
    TORCH_CHECK(shared == 0 || shared == 2 || shared == 3, "a shared expert of 2 or 3 matmuls, or none");
    const int64_t experts = (n - (routed ? 1 : 0) - shared) / 2;
    TORCH_CHECK(experts >= 1 && n == (routed ? 1 : 0) + 2 * experts + shared && (routed || experts == 1) &&
                    (routed || shared == 0) && top_k >= 1 && top_k <= experts,
                "a router, each expert's gate/up and down, and a shared expert's matmuls, or one dense MLP");
    TORCH_CHECK(!choice_bias || (choice_bias->dtype() == torch::kFloat32 && choice_bias->numel() == experts),
                "a float32 choice bias per expert");
    TORCH_CHECK(groups == 1 || (experts % groups == 0 && groups_kept >= 1 && groups_kept < groups &&
                                top_k <= groups_kept * (experts / groups) && (!sigmoid || experts / groups >= 2)),
                "groups that divide the experts, fewer kept than there are, holding top_k");
    if (experts_.empty()) experts_.resize(num_layers_);
    StackExperts made;
    std::vector<StackLinear> all;
    for (int64_t i = 0; i < n; ++i)
      all.push_back({packed[i], blocks[i], biases[i], out_features[i], "matmul -> " + std::to_string(out_features[i])});
    int64_t at = 0;
    if (routed) made.router = all[at++];
    made.gate_up.assign(all.begin() + at, all.begin() + at + experts);
    made.down.assign(all.begin() + at + experts, all.begin() + at + 2 * experts);
    at += 2 * experts;
    if (shared) {
      made.shared.assign(all.begin() + at, all.end());
      TORCH_CHECK(shared == 2 || made.shared[2].out_features == 1, "a shared expert's gate has one output");
    }
    made.top_k = top_k, made.normalize = normalize, made.sigmoid = sigmoid, made.choice_bias = choice_bias;
    made.scale = scale, made.groups = groups, made.groups_kept = groups_kept;
    made.sparsemixer_eps = sparsemixer_eps;
    made.swiglu_alpha = swiglu_alpha, made.swiglu_limit = swiglu_limit;
    experts_[layer] = std::move(made);
  }

  // Each layer's xIELU numbers (Apertus's: alpha_p, alpha_n, beta, eps after their softplus), four a
  // layer, layer after layer.
  void set_xielu(std::vector<double> numbers) {
    TORCH_CHECK(static_cast<int64_t>(numbers.size()) == 4 * num_layers_, "four xIELU numbers for every layer");
    xielu_ = std::move(numbers);
  }

  // Each layer's short-convolution taps [H, K] (LFM2's), an empty tensor for a layer that attends.
  void set_conv(std::vector<torch::Tensor> taps) {
    TORCH_CHECK(static_cast<int64_t>(taps.size()) == num_layers_, "taps (or none) for every layer");
    conv_ = std::move(taps);
  }

  // Each layer's latent attention (set where the plan has latent_attention): the shapes (the latent's
  // rank, each head's key part without rotary, the rotated part, each head's value; whether the
  // rotated dims pair as neighbours), then per layer the latent's norm scale, the key and value
  // up-projections (empty where kept as stored), and where the query has a rank its norm scale and
  // up-projection's matmul (an empty norm: none); last the up-projections kept as stored, a matmul a
  // head, layer after layer (the key's heads, then the value's), or none.
  void set_latent(int64_t rank, int64_t nope, int64_t rope, int64_t v, bool interleaved,
                  std::vector<torch::Tensor> kv_norms, std::vector<torch::Tensor> k_ups, std::vector<torch::Tensor> v_ups,
                  std::vector<torch::Tensor> q_norms, std::vector<torch::Tensor> packed,
                  std::vector<c10::optional<torch::Tensor>> blocks, std::vector<c10::optional<torch::Tensor>> biases,
                  std::vector<int64_t> out_features, std::vector<torch::Tensor> head_packed,
                  std::vector<c10::optional<torch::Tensor>> head_blocks,
                  std::vector<c10::optional<torch::Tensor>> head_biases, std::vector<int64_t> head_out_features) {
    const auto n = static_cast<size_t>(num_layers_);
    TORCH_CHECK(kv_norms.size() == n && k_ups.size() == n && v_ups.size() == n && q_norms.size() == n &&
                    packed.size() == n && blocks.size() == n && biases.size() == n && out_features.size() == n,
                "latent attention's weights for every layer");
    const size_t per_layer = 2 * static_cast<size_t>(num_heads_);
    TORCH_CHECK((head_packed.empty() || head_packed.size() == n * per_layer) &&
                    head_blocks.size() == head_packed.size() && head_biases.size() == head_packed.size() &&
                    head_out_features.size() == head_packed.size(),
                "a key and a value up-projection a head in every layer, or none");
    TORCH_CHECK(rank + rope == head_dim_ && num_kv_heads_ == 1 && rope % 2 == 0,
                "latent attention reads one key head of the latent and the rotated part");
    latent_.clear();
    for (size_t i = 0; i < n; ++i) {
      StackLatent made{kv_norms[i], k_ups[i], v_ups[i], c10::nullopt, c10::nullopt, {}, {}};
      if (head_packed.empty()) {
        TORCH_CHECK(k_ups[i].sizes() == torch::IntArrayRef({num_heads_, nope, rank}) &&
                        v_ups[i].sizes() == torch::IntArrayRef({num_heads_, v, rank}),
                    "layer ", i, ": up-projections of [heads, nope, rank] and [heads, v, rank]");
      } else {
        for (size_t j = i * per_layer; j < (i + 1) * per_layer; ++j) {
          StackLinear lin{head_packed[j], head_blocks[j], head_biases[j], head_out_features[j],
                          "matmul -> " + std::to_string(head_out_features[j])};
          TORCH_CHECK(lin.out_features == (j - i * per_layer < per_layer / 2 ? rank : v),
                      "layer ", i, ": a head's up-projections give the latent's rank and a value");
          (j - i * per_layer < per_layer / 2 ? made.k_heads : made.v_heads).push_back(std::move(lin));
        }
      }
      if (q_norms[i].numel()) {
        made.q_norm = q_norms[i];
        made.q_up = StackLinear{packed[i], blocks[i], biases[i], out_features[i],
                                "matmul -> " + std::to_string(out_features[i])};
      }
      latent_.push_back(std::move(made));
    }
    latent_rank_ = rank, latent_nope_ = nope, latent_rope_ = rope, latent_v_ = v, latent_interleaved_ = interleaved;
  }

  // ALiBi's slopes, one a query head, the same in every layer (BLOOM's, MPT's), or none.
  void set_alibi(torch::Tensor slopes) {
    per_head(slopes, num_heads_, "ALiBi slopes");  // checked once, here
    alibi_ = slopes;
  }
  // Each layer's attention sinks (gpt-oss's: a score per query head, `finish_parts`), or none.
  void set_sinks(std::vector<torch::Tensor> sinks) {
    TORCH_CHECK(sinks.empty() || static_cast<int64_t>(sinks.size()) == num_layers_, "sinks for every layer, or none");
    for (const auto& t : sinks) per_head(t, num_heads_, "attention sinks");  // checked once, here
    sinks_ = std::move(sinks);
  }

  // Runs every layer over the step's packed tokens. hidden [N, hidden_size], the embeddings, is
  // the residual stream and is updated in place; returns register `output` after the last
  // layer. cos and sin are the rotary tables the layers' indices name. The rest describes the
  // step as AttentionMetadata does: the first num_decodes tokens are decodes (decode_tables,
  // decode_lens), the others prefill segments (prefill_tables, query_starts, query_lens,
  // context_starts).
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor positions, std::vector<torch::Tensor> cos,
                        std::vector<torch::Tensor> sin, std::vector<torch::Tensor> k_caches,
                        std::vector<torch::Tensor> v_caches, torch::Tensor slot_mapping, int64_t num_decodes,
                        c10::optional<torch::Tensor> decode_tables, c10::optional<torch::Tensor> decode_lens,
                        c10::optional<torch::Tensor> prefill_tables, c10::optional<torch::Tensor> query_starts,
                        c10::optional<torch::Tensor> query_lens, c10::optional<torch::Tensor> context_starts,
                        int64_t block_size, c10::optional<torch::Tensor> conv_slots) const {
    const int64_t tokens = hidden.size(0);
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers_ &&
                    static_cast<int64_t>(v_caches.size()) == num_layers_,
                "one K and one V pool per layer");
    TORCH_CHECK(cos.size() == sin.size(), "a sin table for every cos table");
    for (int64_t t : rope_tables_)
      TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(cos.size()), "no rotary table ", t);
    TORCH_CHECK(num_decodes >= 0 && num_decodes <= tokens, "more decodes than tokens");
    TORCH_CHECK(num_decodes == 0 || (decode_tables.has_value() && decode_lens.has_value()), "decodes need tables");
    TORCH_CHECK(num_decodes == tokens || (prefill_tables.has_value() && query_starts.has_value() &&
                                          query_lens.has_value() && context_starts.has_value()),
                "prefill tokens need prefill tables");
    // Layer i's attention of q [tokens, heads, head_dim] over its pool: the decodes in one call, the
    // prefill segments in another.
    auto attend = [&](const torch::Tensor& q, int64_t i) {
      torch::Tensor decoded, prefilled;
      if (num_decodes > 0)
        decoded = paged_decode_attention(q.narrow(0, 0, num_decodes).contiguous(), k_caches[i], v_caches[i],
                                         *decode_tables, *decode_lens, block_size, attention_scale_, windows_[i],
                                         softcap_, layer_sinks(i), alibi_);
      if (num_decodes < tokens)
        prefilled = paged_prefill_attention(q.narrow(0, num_decodes, tokens - num_decodes).contiguous(), k_caches[i],
                                            v_caches[i], *prefill_tables, *query_starts, *query_lens,
                                            *context_starts, block_size, attention_scale_, windows_[i], softcap_,
                                            layer_sinks(i), alibi_);
      return !prefilled.defined() ? decoded : !decoded.defined() ? prefilled : torch::cat({decoded, prefilled});
    };
    std::array<torch::Tensor, kMaxRegs> reg;
    for (int64_t i = 0; i < num_layers_; ++i) {
      for (const PlanStep& step : plans_[layer_plans_[i]]) {
        const torch::Tensor& src = reg[step.src];
        switch (step.op) {
          case PlanOp::kAddRmsNorm: {
            const torch::Tensor& weight = norms_[i * norms_per_layer_ + step.param];
            if (src.defined()) {
              Range r("token ops: add_rms_norm_");
              reg[step.dst] = add_rms_norm_(hidden, src, weight, eps_);
            } else {
              Range r("token ops: rms_norm");
              reg[step.dst] = rms_norm(hidden, weight, eps_);
            }
            break;
          }
          case PlanOp::kAddLayerNorm: {
            const int64_t at = i * norms_per_layer_ + step.param;
            if (src.defined()) {
              Range r("token ops: add_layer_norm_");
              reg[step.dst] = add_layer_norm_(hidden, src, norms_[at], norm_bias_at(at), eps_);
            } else {
              Range r("token ops: layer_norm");
              reg[step.dst] = layer_norm(hidden, norms_[at], norm_bias_at(at), eps_);
            }
            break;
          }
          case PlanOp::kLayerNorm: {
            Range r("token ops: layer_norm");
            const int64_t at = i * norms_per_layer_ + step.param;
            reg[step.dst] = layer_norm(src.contiguous(), norms_[at], norm_bias_at(at), eps_);
            break;
          }
          case PlanOp::kGeluTanh: {
            Range r("token ops: gelu_tanh");
            reg[step.dst] = gelu_tanh(src.contiguous());
            break;
          }
          case PlanOp::kRelu: {  // ATen's, as the Python interpreter's
            Range r("token ops: relu");
            reg[step.dst] = torch::relu(src);
            break;
          }
          case PlanOp::kGelu: {
            Range r("token ops: gelu");
            reg[step.dst] = torch::gelu(src);
            break;
          }
          case PlanOp::kAdd: {
            reg[step.dst].add_(src);
            break;
          }
          case PlanOp::kRotary: {
            Range r("token ops: rotary");
            rotary_qk_(src, positions, cos[rope_tables_[i]], sin[rope_tables_[i]], num_heads_, num_kv_heads_,
                       head_dim_, c10::nullopt, c10::nullopt, c10::nullopt);
            reg[step.dst] = src;
            break;
          }
          case PlanOp::kStoreKv: {
            Range r("token ops: store_kv");
            store_kv_(src, num_heads_, num_kv_heads_, head_dim_, k_caches[i], v_caches[i], slot_mapping);
            reg[step.dst] = src;
            break;
          }
          case PlanOp::kXielu: {
            TORCH_CHECK(static_cast<int64_t>(xielu_.size()) == 4 * num_layers_, "the layers' xIELU numbers are not set");
            Range r("token ops: xielu");
            const double* p = xielu_.data() + 4 * i;
            reg[step.dst] = xielu(src.contiguous(), p[0], p[1], p[2], p[3]);
            break;
          }
          case PlanOp::kMatmul: {
            const StackLinear& lin = linears_[i * matmuls_per_layer_ + step.param];
            Range r(lin.label);
            reg[step.dst] = linear_forward(src, lin.packed, lin.blocks, lin.bias, lin.out_features);
            break;
          }
          case PlanOp::kRotaryStoreKv: {
            Range r("token ops: rotary");
            rotary_qk_(src, positions, cos[rope_tables_[i]], sin[rope_tables_[i]], num_heads_, num_kv_heads_,
                       head_dim_, k_caches[i], v_caches[i], slot_mapping);
            reg[step.dst] = src;
            break;
          }
          case PlanOp::kAttention: {
            Range r("attention");
            const torch::Tensor q =
                src.view({tokens, num_heads_ + 2 * num_kv_heads_, head_dim_}).narrow(1, 0, num_heads_);
            reg[step.dst] = attend(q, i).view({tokens, num_heads_ * head_dim_});
            break;
          }
          case PlanOp::kLatentAttention: {  // model/latent.py's latent_attention, step by step
            TORCH_CHECK(static_cast<int64_t>(latent_.size()) == num_layers_, "the layers' latent attention is not set");
            Range r("latent attention");
            const StackLatent& lat = latent_[i];
            const int64_t rank = latent_rank_, rope = latent_rope_, nope = latent_nope_;
            const std::vector<torch::Tensor> parts = src.split_with_sizes({src.size(1) - rank - rope, rank + rope}, 1);
            torch::Tensor q = parts[0];
            const torch::Tensor& kv = parts[1];
            if (lat.q_up) q = run_linear(*lat.q_up, latent_rms_norm(q, *lat.q_norm));
            const std::vector<torch::Tensor> qs = q.reshape({tokens, num_heads_, nope + rope}).split_with_sizes({nope, rope}, 2);
            const torch::Tensor freq_cos = cos[rope_tables_[i]].index_select(0, positions).narrow(1, 0, rope / 2);
            const torch::Tensor freq_sin = sin[rope_tables_[i]].index_select(0, positions).narrow(1, 0, rope / 2);
            const torch::Tensor k_rope = latent_rotate(kv.narrow(1, rank, rope), freq_cos, freq_sin, latent_interleaved_);
            const torch::Tensor row = torch::cat({latent_rms_norm(kv.narrow(1, 0, rank), lat.kv_norm), k_rope}, 1);
            k_caches[i].view({-1, rank + rope}).index_copy_(0, slot_mapping, row.to(k_caches[i].scalar_type()));
            const torch::Tensor q_latent = lat.k_heads.empty()
                                               ? torch::bmm(qs[0].transpose(0, 1), lat.k_up).transpose(0, 1)
                                               : per_head(lat.k_heads, qs[0]);  // the up-projection as stored
            const torch::Tensor query = torch::cat(
                {q_latent, latent_rotate(qs[1], freq_cos.unsqueeze(1), freq_sin.unsqueeze(1), latent_interleaved_)}, 2);
            const torch::Tensor read = attend(query.contiguous(), i).view({tokens, num_heads_, rank + rope});
            const torch::Tensor latent = read.narrow(2, 0, rank);
            const torch::Tensor values = lat.v_heads.empty()
                                             ? torch::bmm(latent.transpose(0, 1), lat.v_up.transpose(1, 2)).transpose(0, 1)
                                             : per_head(lat.v_heads, latent);
            reg[step.dst] = values.reshape({tokens, num_heads_ * latent_v_});
            break;
          }
          case PlanOp::kSiluAndMul: {
            Range r("token ops: silu_and_mul");
            reg[step.dst] = silu_and_mul(src);
            break;
          }
          case PlanOp::kGeluTanhAndMul: {
            Range r("token ops: gelu_tanh_and_mul");
            reg[step.dst] = gelu_tanh_and_mul(src);
            break;
          }
          case PlanOp::kReluSquared: {
            Range r("token ops: relu_squared");
            reg[step.dst] = relu_squared(src.contiguous());
            break;
          }
          case PlanOp::kQkNorm: {
            Range r("token ops: qk_norm_");
            qk_norm_(src, qk_norms_[2 * i], qk_norms_[2 * i + 1], num_heads_, num_kv_heads_, head_dim_, eps_);
            reg[step.dst] = src;
            break;
          }
          case PlanOp::kAddResidual: {
            if (src.defined()) hidden.add_(src);
            reg[step.dst] = hidden;
            break;
          }
          case PlanOp::kRmsNorm: {
            Range r("token ops: rms_norm");
            reg[step.dst] = rms_norm(src.contiguous(), norms_[i * norms_per_layer_ + step.param], eps_);
            break;
          }
          case PlanOp::kScale: {
            reg[step.dst] = src.mul(residual_scales_[i]);
            break;
          }
          case PlanOp::kShortConv: {
            TORCH_CHECK(static_cast<int64_t>(conv_.size()) == num_layers_ && conv_[i].defined() && conv_[i].numel(),
                        "layer ", i, " has no convolution set");
            TORCH_CHECK(conv_slots.has_value(), "a short convolution needs the step's conv slots");
            Range r("token ops: short_conv_");
            reg[step.dst] = short_conv_(src, conv_[i], k_caches[i], slot_mapping, *conv_slots);
            break;
          }
          case PlanOp::kRoutedExperts: {
            TORCH_CHECK(!experts_.empty() && !experts_[i].gate_up.empty(), "layer ", i, " has no experts set");
            reg[step.dst] = experts_[i].forward(src);
            break;
          }
        }
        for (int64_t r : step.release) reg[r].reset();
      }
    }
    TORCH_CHECK(reg[output_].defined(), "the plan never writes its output register");
    return reg[output_];
  }

 private:
  c10::optional<torch::Tensor> norm_bias_at(int64_t at) const {
    return norm_biases_.empty() ? c10::optional<torch::Tensor>() : norm_biases_[at];
  }

  c10::optional<torch::Tensor> layer_sinks(int64_t layer) const {
    return sinks_.empty() ? c10::optional<torch::Tensor>() : c10::optional<torch::Tensor>(sinks_[layer]);
  }

  std::vector<int64_t> layer_plans_;  // which of plans_ each layer runs
  std::vector<torch::Tensor> norms_;
  std::vector<c10::optional<torch::Tensor>> norm_biases_;  // beside norms_ (LayerNorms'), or none
  std::vector<torch::Tensor> qk_norms_, sinks_;
  c10::optional<torch::Tensor> alibi_;
  std::vector<int64_t> windows_, rope_tables_;
  std::vector<double> residual_scales_;
  std::vector<double> xielu_;  // four a layer (set_xielu), where the plan has xielu
  std::vector<StackLinear> linears_;
  std::vector<StackExperts> experts_;  // per layer, where the plan routes to experts (set_experts)
  std::vector<std::vector<PlanStep>> plans_;
  std::vector<torch::Tensor> conv_;  // per layer, where the plan convolves (set_conv)
  std::vector<StackLatent> latent_;  // per layer, where the plan's attention is latent (set_latent)
  int64_t latent_rank_ = 0, latent_nope_ = 0, latent_rope_ = 0, latent_v_ = 0;
  bool latent_interleaved_ = true;
  int64_t num_layers_, output_, norms_per_layer_ = 0, matmuls_per_layer_ = 0;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, attention_scale_, softcap_;
};

// Which of the file's instruction-set branches this build compiled (kernels.TARGETS); an AVX2
// build with AVX-VNNI's int8 matmul says so.
std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(INFLIGHT_I8_AVX_VNNI)
  return "avx2+avx-vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

// GGUF's grid and ternary quants (IQ1_S ... IQ3_S, TQ1_0, TQ2_0) decoded into the I8K16 blocks
// the block matmuls read (model/grid_quants.py says why every weight is w = D s v exactly): per
// 256 weights the fp32 D = d / 8, 16 int8 sub-block scales s = 2 ls + 1 and 256 int8 values v.
// The formats are llama.cpp's (ggml-common.h); the codebooks are passed in as gguf-py holds them:
// grid [entries, width] of int8 (IQ2's 8..43, IQ3_XXS's 4..62, IQ3_S's 1..15, IQ1's -1..1) and
// ksigns, IQ2's 128 sign bytes (bit j set: the j-th of 8 weights negative). raw: uint8 [blocks,
// block bytes] -> out, uint8 [blocks, 276]; returns the number of the first block whose d is inf or
// NaN, else -1 (the caller refuses such a block).
namespace {

enum class GridKind { kIQ2_XXS, kIQ2_XS, kIQ2_S, kIQ3_XXS, kIQ3_S, kIQ1_S, kIQ1_M, kTQ1_0, kTQ2_0 };

// Each type's name, block bytes and codebook shape (entries, width; 0 for none): every index its
// bits can form is a row of the codebook.
struct GridFormat {
  const char* name;
  GridKind kind;
  int64_t bytes, entries, width;
};
constexpr GridFormat kGridFormats[] = {
    {"IQ2_XXS", GridKind::kIQ2_XXS, 66, 256, 8}, {"IQ2_XS", GridKind::kIQ2_XS, 74, 512, 8},
    {"IQ2_S", GridKind::kIQ2_S, 82, 1024, 8},    {"IQ3_XXS", GridKind::kIQ3_XXS, 98, 256, 4},
    {"IQ3_S", GridKind::kIQ3_S, 110, 512, 4},    {"IQ1_S", GridKind::kIQ1_S, 50, 2048, 8},
    {"IQ1_M", GridKind::kIQ1_M, 56, 2048, 8},    {"TQ1_0", GridKind::kTQ1_0, 54, 0, 0},
    {"TQ2_0", GridKind::kTQ2_0, 66, 0, 0}};

struct GridTables {
  const int8_t* grid;
  int64_t width;
  const uint8_t* ksigns;
};

inline uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t read_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 8 weights from the grid row `index` (width 8) times `mult`, negative where `signs` has the bit.
inline void grid8(const GridTables& t, uint32_t index, uint8_t signs, int mult, int8_t* v) {
  const int8_t* g = t.grid + index * t.width;
  for (int j = 0; j < 8; ++j) v[j] = static_cast<int8_t>((signs >> j & 1 ? -mult : mult) * g[j]);
}

// One super-block of `kind` at b: its d (as stored, fp16 bits; IQ1_M's assembled), ls per 16
// weights, and the values.
void decode_grid_block(GridKind kind, const uint8_t* b, const GridTables& t, uint16_t& d_bits,
                       int ls[16], int8_t v[256]) {
  d_bits = read_u16(b);
  if (kind == GridKind::kIQ2_XXS) {  // per 32: 4 grid bytes, then a word of 4 x 7 sign bits and ls in its top 4
    for (int ib = 0; ib < 8; ++ib) {
      const uint8_t* q = b + 2 + 8 * ib;
      const uint32_t aux = read_u32(q + 4);
      ls[2 * ib] = ls[2 * ib + 1] = static_cast<int>(aux >> 28);
      for (int l = 0; l < 4; ++l) grid8(t, q[l], t.ksigns[(aux >> 7 * l) & 127], 1, v + 32 * ib + 8 * l);
    }
  } else if (kind == GridKind::kIQ2_XS) {  // per 8: 9 index bits, 7 sign bits; 4-bit ls per 16
    for (int g = 0; g < 32; ++g) {
      const uint16_t q = read_u16(b + 2 + 2 * g);
      grid8(t, q & 511, t.ksigns[q >> 9], 1, v + 8 * g);
    }
    for (int j = 0; j < 16; ++j) ls[j] = (b[66 + j / 2] >> 4 * (j % 2)) & 15;
  } else if (kind == GridKind::kIQ2_S) {  // per 8: an index byte, 2 high bits in qh, a sign byte; ls per 16
    for (int g = 0; g < 32; ++g) {
      const uint32_t index = b[2 + g] | ((b[66 + g / 4] >> 2 * (g % 4)) & 3u) << 8;
      grid8(t, index, b[34 + g], 1, v + 8 * g);
    }
    for (int j = 0; j < 16; ++j) ls[j] = (b[74 + j / 2] >> 4 * (j % 2)) & 15;
  } else if (kind == GridKind::kIQ3_XXS) {  // per 4: an index byte (grid of 4); per 32 a word as IQ2_XXS's
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t aux = read_u32(b + 66 + 4 * ib);
      ls[2 * ib] = ls[2 * ib + 1] = static_cast<int>(aux >> 28);
      for (int l = 0; l < 4; ++l) {
        const uint8_t signs = t.ksigns[(aux >> 7 * l) & 127];
        for (int h = 0; h < 2; ++h) {
          const uint32_t index = b[2 + 8 * ib + 2 * l + h];
          for (int j = 0; j < 4; ++j)
            v[32 * ib + 8 * l + 4 * h + j] =
                static_cast<int8_t>((signs >> (4 * h + j) & 1 ? -2 : 2) * t.grid[index * t.width + j]);
        }
      }
    }
  } else if (kind == GridKind::kIQ3_S) {  // per 4: an index byte and a bit of qh; a sign bit a weight; ls per 32
    for (int i = 0; i < 64; ++i) {
      const uint32_t index = b[2 + i] | ((b[66 + i / 8] >> (i % 8)) & 1u) << 8;
      for (int j = 0; j < 4; ++j) {
        const int w = 4 * i + j;
        v[w] = static_cast<int8_t>((b[74 + w / 8] >> (w % 8) & 1 ? -8 : 8) * t.grid[index * t.width + j]);
      }
    }
    for (int j = 0; j < 16; ++j) ls[j] = (b[106 + j / 4] >> 4 * (j / 2 % 2)) & 15;
  } else if (kind == GridKind::kIQ1_S) {  // per 32: a word of 4 x 3 index bits, ls in bits 12-14, the delta's sign in 15
    for (int ib = 0; ib < 8; ++ib) {
      const uint16_t h = read_u16(b + 34 + 2 * ib);
      ls[2 * ib] = ls[2 * ib + 1] = (h >> 12) & 7;
      const int delta = h & 0x8000 ? -1 : 1;
      for (int l = 0; l < 4; ++l) {
        const uint32_t index = b[2 + 4 * ib + l] | ((h >> 3 * l) & 7u) << 8;
        for (int j = 0; j < 8; ++j) v[32 * ib + 8 * l + j] = static_cast<int8_t>(8 * t.grid[index * t.width + j] + delta);
      }
    }
  } else if (kind == GridKind::kIQ1_M) {  // per 8: an index byte and a nibble (3 index bits, the delta's sign)
    const uint8_t* sc = b + 48;
    uint16_t words[4];
    for (int k = 0; k < 4; ++k) words[k] = read_u16(sc + 2 * k);
    d_bits = static_cast<uint16_t>((words[0] >> 12) | ((words[1] >> 8) & 0xF0) | ((words[2] >> 4) & 0xF00) |
                                   (words[3] & 0xF000));
    for (int j = 0; j < 16; ++j) ls[j] = (words[j / 4] >> 3 * (j % 4)) & 7;
    for (int g = 0; g < 32; ++g) {
      const int nibble = (b[32 + g / 2] >> 4 * (g % 2)) & 15;
      const uint32_t index = b[g] | (nibble & 7u) << 8;
      const int delta = nibble & 8 ? -1 : 1;
      for (int j = 0; j < 8; ++j) v[8 * g + j] = static_cast<int8_t>(8 * t.grid[index * t.width + j] + delta);
    }
  } else if (kind == GridKind::kTQ1_0) {  // base-3 digits: 5 a byte (32 + 16 bytes), 4 a byte (4 bytes); d last
    d_bits = read_u16(b + 52);
    static constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};
    auto digit = [](uint8_t byte, uint8_t pow) {  // the byte times 3^p (mod 256), its top trit
      return static_cast<int8_t>(8 * ((static_cast<uint8_t>(byte * pow) * 3 >> 8) - 1));
    };
    for (int p = 0; p < 5; ++p) {
      for (int i = 0; i < 32; ++i) v[32 * p + i] = digit(b[i], kPow3[p]);
      for (int i = 0; i < 16; ++i) v[160 + 16 * p + i] = digit(b[32 + i], kPow3[p]);
    }
    for (int p = 0; p < 4; ++p)
      for (int i = 0; i < 4; ++i) v[240 + 4 * p + i] = digit(b[48 + i], kPow3[p]);
    std::fill(ls, ls + 16, 0);
  } else {  // TQ2_0: 2 bits a weight, 4 a byte across 32-byte runs; d last
    d_bits = read_u16(b + 64);
    for (int i = 0; i < 64; ++i)
      for (int s = 0; s < 4; ++s)
        v[128 * (i / 32) + 32 * s + i % 32] = static_cast<int8_t>(8 * (((b[i] >> 2 * s) & 3) - 1));
    std::fill(ls, ls + 16, 0);
  }
}

}  // namespace

int64_t grid_int8_blocks(const std::string& kind, torch::Tensor raw, torch::Tensor grid, torch::Tensor ksigns,
                         torch::Tensor out) {
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(), "uint8 [blocks, bytes] blocks");
  TORCH_CHECK(grid.dtype() == torch::kInt8 && grid.dim() == 2 && grid.is_contiguous(), "an int8 [entries, width] grid");
  TORCH_CHECK(ksigns.dtype() == torch::kUInt8 && ksigns.numel() == 128, "128 sign bytes");
  const GridFormat* format = nullptr;
  for (const GridFormat& f : kGridFormats)
    if (kind == f.name) format = &f;
  TORCH_CHECK(format != nullptr, "not a grid or ternary type: ", kind);
  TORCH_CHECK(format->entries == 0 || (grid.size(0) == format->entries && grid.size(1) == format->width),
              kind, "'s codebook is ", format->entries, " x ", format->width);
  const int64_t blocks = raw.size(0), bytes = raw.size(1);
  TORCH_CHECK(bytes == format->bytes, "a ", kind, " block is ", format->bytes, " bytes");
  const GridTables t{grid.data_ptr<int8_t>(), grid.size(1), ksigns.data_ptr<uint8_t>()};
  TORCH_CHECK(out.dtype() == torch::kUInt8 && out.is_contiguous() && out.numel() == blocks * 276,
              "uint8 [blocks, 276] out");
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint16_t d_bits;
      int ls[16];
      uint8_t* o = dst + i * 276;
      decode_grid_block(format->kind, in + i * bytes, t, d_bits, ls, reinterpret_cast<int8_t*>(o + 20));
      const float big_d = c10::detail::fp16_ieee_to_fp32_value(d_bits) * 0.125f;  // exact: a power of two
      std::memcpy(o, &big_d, 4);
      for (int j = 0; j < 16; ++j) o[4 + j] = static_cast<uint8_t>(2 * ls[j] + 1);
    }
  });
  for (int64_t i = 0; i < blocks; ++i) {  // by its bits: this file is built with fast-math
    uint32_t bits;
    std::memcpy(&bits, dst + i * 276, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u) return i;
  }
  return -1;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "The instruction-set branch this build compiled: avx512, avx2+avx-vnni, avx2 or generic");
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention (CPU, fp32 arithmetic over an fp32 or 16-bit pool)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("block_size"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), py::arg("alibi") = py::none());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Paged causal prefill attention (CPU, fp32 arithmetic over an fp32 or 16-bit pool)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("q_starts"), py::arg("q_lens"),
        py::arg("ctx_starts"), py::arg("block_size"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("alibi") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU, fp32)");
  m.def("add_rms_norm_", &add_rms_norm_, "hidden += delta, then RMSNorm (CPU, fp32)");
  m.def("layer_norm", &layer_norm, "LayerNorm of each row, its bias optional (CPU, fp32)");
  m.def("add_layer_norm_", &add_layer_norm_, "hidden += delta, then LayerNorm (CPU, fp32)");
  m.def("rotary_qk_", &rotary_qk_, "Rotary embedding of the q and k heads of a fused qkv, in place (and KV store)",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("k_cache") = py::none(), py::arg("v_cache") = py::none(),
        py::arg("slot_mapping") = py::none());
  m.def("store_kv_", &store_kv_, "Each row's k and v of a fused qkv written to its slot of the KV pool");
  m.def("short_conv_", &short_conv_, "LFM2's short convolution: each row's b * x to its pool slot, then c * conv");
  m.def("argmax_rows", &argmax_rows, "First index of the largest value (or first NaN) of each row (CPU, fp32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU, fp32)");
  m.def("clamped_swiglu", &clamped_swiglu, "gpt-oss's (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up (CPU, fp32)");
  m.def("relu_squared", &relu_squared, "relu(x) ** 2 (CPU, fp32)");
  m.def("gelu_tanh", &gelu_tanh, "gelu(x), its tanh form (CPU, fp32)");
  m.def("xielu", &xielu, "xIELU(x) with its numbers after their softplus (CPU, fp32)");
  m.def("qk_norm_", &qk_norm_, "RMSNorm of the q and k of a fused qkv in groups of each scale's length, in place");
  m.def("gemm_panel_width", &gemm_panel_width, "Output columns per packed weight panel (32 with AVX-512)");
  m.def("gemm_max_rows", &gemm_max_rows, "The most rows the fp32 microkernel takes in one pass (this build)");
  m.def("set_gemm_tuning", &set_gemm_tuning,
        "The fp32 matmuls' rows a pass (<= gemm_max_rows()) and whether one-pass and several-pass panels prefetch",
        py::arg("max_rows"), py::arg("prefetch_one_pass"), py::arg("prefetch_passes"));
  m.def("gemm_tuning", &gemm_tuning, "(max_rows, prefetch_one_pass, prefetch_passes) the fp32 matmuls use now");
  m.def("pack_linear_weight", &pack_linear_weight, "Pack W [N, K] for packed_linear");
  m.def("packed_linear", &packed_linear, "x @ W.T (+ b) with a packed W (CPU, fp32)");
  m.def("row_absmax", &row_absmax, "max |w| of each row of an fp32 [N, K] weight");
  m.def("quantize_pack_int8", &quantize_pack_int8,
        "An fp32 [N, K] weight quantized with each row's inv (127 / max|w|) and packed as pack_int8_weight packs it");
  m.def("int8_peak_macs", &int8_peak_macs,
        "Multiply-adds per second of the int8 matmul's inner instructions on every thread (0: portable build)");
  m.def("int8_isa", &int8_isa, "The int8 matmul's branch: avx512-vnni, avx-vnni, avx2 or generic");
  m.def("pack_int8_weight", &pack_int8_weight, "int8 [N, K] weight and its fp32 column scales -> packed (int8)");
  m.def("int8_linear", &int8_linear, "x @ W.T with W packed int8, x quantized per row and group of 64 k (CPU, W8A8)");
  m.def("int8_dots", &int8_dots, "The int8 matmul's exact integer dots, with x's quantized rows and scales");
  m.def("linear_forward", &linear_forward,
        "x @ W.T (+ b): from the GGUF blocks where given (in registers up to gguf_blocks_max_rows() rows), else "
        "the packed W");
  m.def("plan_ops", &plan_ops, "The layer-plan ops DecoderStack runs (inflight/model/layer_plan.py's Op)");
  m.def("gguf_blocks_available", &gguf_blocks_available, "Whether this build has the GGUF block matmul (AVX2)");
  m.def("gguf_blocks_max_rows", &gguf_blocks_max_rows,
        "Steps of up to this many rows read GGUF blocks in registers, larger ones a dequantized panel at a time");
  // Without the GIL: a model's tokenizer loads in another thread meanwhile (LoadedModel.load).
  m.def("pack_gguf_blocks", &pack_gguf_blocks,
        "Pack GGUF rows (Q2_K..Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS, MXFP4, F16, BF16, I8K16; one or "
        "more parts) for the block matmuls",
        py::arg("parts"), py::arg("kinds"), py::arg("k"), py::arg("int8_activations") = false,
        py::arg("bf16_activations") = false, py::call_guard<py::gil_scoped_release>());
  m.def("grid_int8_blocks", &grid_int8_blocks,
        "GGUF grid or ternary blocks (IQ1_S-IQ3_S, TQ1_0, TQ2_0) -> I8K16 blocks (fp32 d / 8, int8 scales, values)",
        py::arg("kind"), py::arg("raw"), py::arg("grid"), py::arg("ksigns"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_blocks_dequantize", &gguf_blocks_dequantize,
        "The fp32 [N, K] weight a pack_gguf_blocks packing stands for (its values, bit for bit)");
  m.def("gguf_blocks_linear", &gguf_blocks_linear, "x @ W.T with W as packed GGUF blocks (CPU, fp32)");
  m.def("gguf_blocks_a8_linear", &gguf_blocks_a8_linear,
        "x @ W.T with W as packed GGUF blocks and x quantized to int8 per row and 32 k (integer dots)");
  m.def("gguf_blocks_int8_activations", &gguf_blocks_int8_activations,
        "Whether a pack_gguf_blocks packing is marked for int8 activations (every part quantized)");
  m.def("gguf_blocks_screenable", &gguf_blocks_screenable,
        "Whether gguf_blocks_greedy reads this packing (fp32, every part quantized)");
  m.def("gguf_blocks_screen_table", &gguf_blocks_screen_table,
        "The greedy screen's bound of each column of a packing, per group of 32 k [panels, K / 32, 16]");
  m.def("gguf_blocks_greedy", &gguf_blocks_greedy,
        "Each row's argmax of gguf_blocks_linear(x), exactly, by an integer screen and the fp32 sums of what it leaves",
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_blocks_screen_range", &gguf_blocks_screen_range,
        "Where the greedy screen holds each of gguf_blocks_linear(x)'s values to lie: (lo, hi) (tests)");
  m.def("gguf_blocks_bf16_linear", &gguf_blocks_bf16_linear,
        "x @ W.T with W as packed BF16 blocks and x rounded to bf16 (vdpbf16ps where the CPU has AVX512_BF16)");
  m.def("gguf_blocks_bf16_activations", &gguf_blocks_bf16_activations,
        "Whether a pack_gguf_blocks packing is marked for bf16 activations (every part BF16)");
  m.def("bf16_dot_products", &bf16_dot_products, "Whether this build multiplies bf16 pairs with AVX512_BF16");
  m.def("gguf_a8_quantize", &gguf_a8_quantize, "x's rows as gguf_blocks_a8_linear quantizes them (tests)");
  m.def("gguf_blocks_integers", &gguf_blocks_integers, "A packing's q [N, K] and per sub-block d, m (tests)");
  m.def("gguf_blocks_gemm", &gguf_blocks_gemm,
        "x @ W.T with W as packed GGUF blocks, dequantized a panel at a time (steps of many rows)");
  // module_local: another build of this file in the same process (kernels_bench.py --against)
  // registers its own DecoderStack.
  py::class_<DecoderStack>(m, "DecoderStack", py::module_local(), "A step's decoder layers in one call (CPU, fp32)")
      .def(py::init<const std::vector<std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, std::vector<int64_t>>>>&,
                    std::vector<int64_t>, int64_t, int64_t, std::vector<torch::Tensor>, std::vector<c10::optional<torch::Tensor>>,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<c10::optional<torch::Tensor>>, std::vector<c10::optional<torch::Tensor>>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>, int64_t,
                    int64_t, int64_t, double, double, double>())
      .def("forward", &DecoderStack::forward, "Runs every layer; returns the last MLP output (hidden updated in place)",
           py::call_guard<py::gil_scoped_release>())
      .def("set_experts", &DecoderStack::set_experts,
           "A layer's routed-experts MLP: its matmuls (router, gate/ups, downs, shared), whether routed and shared, "
           "top_k, whether the chosen weights are renormalized, the clamped SwiGLU's alpha and limit (0: silu), "
           "whether sigmoids score the experts, their bias for the choice, the weights' scale, the expert groups and "
           "how many of them a token's choice keeps, and the sparse mixer's eps (negative: none)")
      .def("set_alibi", &DecoderStack::set_alibi, "ALiBi's slopes, one a query head, in every layer")
      .def("set_sinks", &DecoderStack::set_sinks, "Each layer's attention sinks (a score per query head), or none")
      .def("set_xielu", &DecoderStack::set_xielu, "Each layer's xIELU numbers, four a layer")
      .def("set_conv", &DecoderStack::set_conv, "Each layer's short-convolution taps, or an empty tensor")
      .def("set_latent", &DecoderStack::set_latent,
           "Latent attention's shapes, then each layer's latent norm, key and value up-projections, and the query "
           "rank's norm (empty: none) and up-projection's matmul");
}
