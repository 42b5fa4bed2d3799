// One Llama-family decoder layer over a step's rows, in one call (services/cpu_kernels.py `decoder_layer`).
//
// Why one call: a decode or verify step of the 16-layer target issues a few hundred small aten operations per
// layer through Python; at 1-16 rows each costs more in dispatch than in arithmetic, and torch.compile's
// graph still pays guards, mask building and an SDPA call per layer. Here a layer is: RMSNorm, the fused
// q/k/v GEMM, rotary, the cache write, attention of every row over its slot, o-proj, residual, RMSNorm, the
// fused gate/up GEMM, SiLU·up, down-proj, residual; the GEMMs are linear.cpp's.
//
// Exactness: every row is computed alone. Its norm, rotary and activation touch only its own values; its
// GEMM outputs are linear.cpp's fixed-order dot products; its attention (one task per row and key head) runs
// over keys 0..its position in ascending order with fixed 8- or 32-wide lanes. So a row's bits do not depend
// on how many rows share the step, where they sit, or which thread ran them: the batch invariance greedy
// speculation relies on. Rounding follows the model's dtype at the points the module path rounds (norm
// output, q/k after rotary, attention output, each residual, the activation), with fp32 inside each.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace dspark {
namespace {

struct Bf16 {
  using T = uint16_t;
  static float ld(T v) { return from_bf16(v); }
  static T st(float f) { return to_bf16(f); }
};

struct F32 {
  using T = float;
  static float ld(T v) { return v; }
  static T st(float f) { return f; }
};

// Scores s[0..n) (n padded to 8 with −inf by the caller) → weights exp(s − max) in place; → their sum.
__attribute__((target("avx2,fma"))) float softmax_weights(float* s, int64_t padded) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < padded; ++j) top = std::max(top, s[j]);
  const __m256 m = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  return hsum8(total);
}

// silu(g) · u of one row's F gate and F up values (fp32), each rounded once to the dtype.
template <class D>
__attribute__((target("avx2,fma"))) void silu_mul_row(const typename D::T* gu, typename D::T* out, int64_t F) {
  alignas(32) float g[8], u[8], r[8];
  for (int64_t f = 0; f < F; f += 8) {
    const int64_t n = std::min<int64_t>(8, F - f);
    for (int64_t i = 0; i < 8; ++i) g[i] = i < n ? D::ld(gu[f + i]) : 0.f, u[i] = i < n ? D::ld(gu[F + f + i]) : 0.f;
    const __m256 gv = _mm256_load_ps(g);
    const __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.f),
                                     _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
    _mm256_store_ps(r, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_load_ps(u)));
    for (int64_t i = 0; i < n; ++i) out[f + i] = D::st(r[i]);
  }
}

// The dot product of a query and a key of Dh values, and acc += w · v over Dh, per dtype.
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) inline float dot(const uint16_t* q, const uint16_t* k,
                                                                               int64_t dh) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < dh; i += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + i), (__m512bh)_mm512_loadu_si512(k + i));
  return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) inline void axpy(float w, const uint16_t* v, float* acc,
                                                                               int64_t dh) {
  const __m512 wv = _mm512_set1_ps(w);
  for (int64_t i = 0; i < dh; i += 16) {
    const __m512 vv = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i))), 16));
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, vv, _mm512_loadu_ps(acc + i)));
  }
}

__attribute__((target("avx2,fma"))) inline float dot(const float* q, const float* k, int64_t dh) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < dh; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
  return hsum8(acc);
}

__attribute__((target("avx2,fma"))) inline void axpy(float w, const float* v, float* acc, int64_t dh) {
  const __m256 wv = _mm256_set1_ps(w);
  for (int64_t i = 0; i < dh; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
}

struct Shape {
  int64_t heads, kv_heads, dh, cache_len;
};

// The query heads of one key head for one row, over keys 0..p of its slot → out (that row's H·Dh values).
// No target of its own: always inlined into `attend_bf16` / `attend_fp32`, whose targets let the dtype's `dot`
// and `axpy` inline into it, while the fp32 path holds no AVX-512 code.
template <class D>
__attribute__((always_inline)) inline void attend_task(
    const typename D::T* q_row, const typename D::T* keys, const typename D::T* values, int64_t p, float scale,
    const Shape& s, int64_t g, typename D::T* out_row) {
  const int64_t group = s.heads / s.kv_heads, n = p + 1, padded = (n + 7) / 8 * 8;
  std::vector<float> score(padded), acc(s.dh);
  for (int64_t t = 0; t < group; ++t) {
    const int64_t h = g * group + t;
    const typename D::T* q = q_row + h * s.dh;
    for (int64_t j = 0; j < n; ++j) score[j] = dot(q, keys + j * s.dh, s.dh) * scale;
    std::fill(score.begin() + n, score.end(), -std::numeric_limits<float>::infinity());
    const float total = softmax_weights(score.data(), padded);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < n; ++j) axpy(score[j], values + j * s.dh, acc.data(), s.dh);
    const float inv = 1.f / total;
    for (int64_t i = 0; i < s.dh; ++i) out_row[h * s.dh + i] = D::st(acc[i] * inv);
  }
}

__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,avx2,fma"))) void attend_bf16(
    const uint16_t* q_row, const uint16_t* keys, const uint16_t* values, int64_t p, float scale, const Shape& s,
    int64_t g, uint16_t* out_row) {
  attend_task<Bf16>(q_row, keys, values, p, scale, s, g, out_row);
}

__attribute__((target("avx2,fma"))) void attend_fp32(const float* q_row, const float* keys, const float* values,
                                                      int64_t p, float scale, const Shape& s, int64_t g,
                                                      float* out_row) {
  attend_task<F32>(q_row, keys, values, p, scale, s, g, out_row);
}

inline void attend(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t p, float scale, const Shape& s,
                   int64_t g, uint16_t* out) {
  attend_bf16(q, k, v, p, scale, s, g, out);
}

inline void attend(const float* q, const float* k, const float* v, int64_t p, float scale, const Shape& s, int64_t g,
                   float* out) {
  attend_fp32(q, k, v, p, scale, s, g, out);
}

template <class D>
void rms_norm(const typename D::T* x, const typename D::T* w, typename D::T* out, int64_t N, int64_t d, float eps) {
  at::parallel_for(0, N, 8, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const typename D::T* row = x + n * d;
      float ss = 0.f;
      for (int64_t i = 0; i < d; ++i) ss += D::ld(row[i]) * D::ld(row[i]);
      const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
      for (int64_t i = 0; i < d; ++i) out[n * d + i] = D::st(D::ld(w[i]) * D::ld(D::st(D::ld(row[i]) * r)));
    }
  });
}

// HF's rotate_half rotary of `heads` heads of one row, in place; cos/sin fp32 [Dh].
template <class D>
void rotate(typename D::T* x, int64_t heads, int64_t dh, const float* cos, const float* sin) {
  const int64_t half = dh / 2;
  for (int64_t h = 0; h < heads; ++h) {
    typename D::T* v = x + h * dh;
    for (int64_t i = 0; i < half; ++i) {
      const float a = D::ld(v[i]), b = D::ld(v[i + half]);
      v[i] = D::st(a * cos[i] - b * sin[i]);
      v[i + half] = D::st(b * cos[i + half] + a * sin[i + half]);
    }
  }
}

template <class D>
void add_into(const typename D::T* a, const typename D::T* b, typename D::T* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = D::st(D::ld(a[i]) + D::ld(b[i]));
}

template <class D>
torch::Tensor layer(torch::Tensor x, torch::Tensor ln1, torch::Tensor qkv_w, std::optional<torch::Tensor> qkv_b,
                    torch::Tensor o_w, std::optional<torch::Tensor> o_b, torch::Tensor ln2, torch::Tensor gu_w,
                    std::optional<torch::Tensor> gu_b, torch::Tensor down_w, std::optional<torch::Tensor> down_b,
                    const float* cos, const float* sin, torch::Tensor k_cache, torch::Tensor v_cache,
                    const int64_t* slots, const int64_t* pos, const int64_t* seen, const Shape& s, float eps,
                    float scale) {
  using T = typename D::T;
  const int64_t N = x.size(0), d = x.size(1), q_width = s.heads * s.dh, kv_width = s.kv_heads * s.dh;
  const auto ptr = [](torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); };
  auto h = torch::empty_like(x);
  rms_norm<D>(ptr(x), ptr(ln1), ptr(h), N, d, eps);
  auto qkv = dspark::linear(h, qkv_w, qkv_b);  // [N, (H + 2 Hkv) Dh]
  TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "decoder_layer: qkv weight of (H + 2 Hkv) Dh outputs");
  T* keys = ptr(k_cache);
  T* values = ptr(v_cache);
  const int64_t row_width = q_width + 2 * kv_width;
  T* qkv_p = ptr(qkv);
  for (int64_t n = 0; n < N; ++n) {  // every row's key in the cache before any row attends
    T* row = qkv_p + n * row_width;
    rotate<D>(row, s.heads + s.kv_heads, s.dh, cos + n * s.dh, sin + n * s.dh);
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const int64_t at = ((slots[n] * s.kv_heads + g) * s.cache_len + pos[n]) * s.dh;
      std::memcpy(keys + at, row + q_width + g * s.dh, s.dh * sizeof(T));
      std::memcpy(values + at, row + q_width + kv_width + g * s.dh, s.dh * sizeof(T));
    }
  }
  auto attn = torch::empty({N, q_width}, x.options());
  T* attn_p = ptr(attn);
  at::parallel_for(0, N * s.kv_heads, 1, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; ++task) {
      const int64_t n = task / s.kv_heads, g = task % s.kv_heads;
      const int64_t base = (slots[n] * s.kv_heads + g) * s.cache_len * s.dh;
      attend(qkv_p + n * row_width, keys + base, values + base, seen[n], scale, s, g, attn_p + n * q_width);
    }
  });
  auto mid = dspark::linear(attn, o_w, o_b);  // [N, d]
  TORCH_CHECK(mid.size(1) == d, "decoder_layer: o-proj of d outputs");
  add_into<D>(ptr(x), ptr(mid), ptr(mid), N * d);  // mid = x + attention
  rms_norm<D>(ptr(mid), ptr(ln2), ptr(h), N, d, eps);
  auto gu = dspark::linear(h, gu_w, gu_b);  // [N, 2F]: gate, then up
  const int64_t F = gu.size(1) / 2;
  auto act = torch::empty({N, F}, x.options());
  at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) silu_mul_row<D>(ptr(gu) + n * 2 * F, ptr(act) + n * F, F);
  });
  auto out = dspark::linear(act, down_w, down_b);
  TORCH_CHECK(out.size(1) == d, "decoder_layer: down-proj of d outputs");
  add_into<D>(ptr(mid), ptr(out), ptr(out), N * d);
  return out;
}

}  // namespace

torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor ln1, torch::Tensor qkv_w, std::optional<torch::Tensor> qkv_b,
                            torch::Tensor o_w, std::optional<torch::Tensor> o_b, torch::Tensor ln2,
                            torch::Tensor gate_up_w, std::optional<torch::Tensor> gate_up_b, torch::Tensor down_w,
                            std::optional<torch::Tensor> down_b, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor pos,
                            std::optional<torch::Tensor> visible, int64_t n_heads, int64_t n_kv, double eps,
                            double scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layer: x [N, d] contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decoder_layer: caches [S, Hkv, L, Dh] contiguous");
  TORCH_CHECK(k_cache.scalar_type() == x.scalar_type() && ln1.scalar_type() == x.scalar_type(),
              "decoder_layer: one dtype");
  const Shape s{n_heads, n_kv, k_cache.size(3), k_cache.size(2)};
  TORCH_CHECK(k_cache.size(1) == n_kv && n_heads % n_kv == 0 && s.dh % 32 == 0, "decoder_layer: head layout");
  auto c = cos.to(torch::kFloat).contiguous(), sn = sin.to(torch::kFloat).contiguous();
  auto sl = slots.to(torch::kLong).contiguous(), ps = pos.to(torch::kLong).contiguous();
  TORCH_CHECK(c.size(0) == x.size(0) && c.size(1) == s.dh && sl.size(0) == x.size(0) && ps.size(0) == x.size(0),
              "decoder_layer: cos, sin [N, Dh], slots, pos [N]");
  // The last key each row sees: its own position (causal), or `visible` (a draft block sees all its rows).
  auto vs = visible.has_value() ? visible->to(torch::kLong).contiguous() : ps;
  TORCH_CHECK(vs.dim() == 1 && vs.size(0) == x.size(0), "decoder_layer: visible [N]");
  if (x.size(0) == 0) return x.clone();
  for (int64_t n = 0; n < x.size(0); ++n)
    TORCH_CHECK(ps.data_ptr<int64_t>()[n] >= 0 && ps.data_ptr<int64_t>()[n] < s.cache_len &&
                    vs.data_ptr<int64_t>()[n] >= 0 && vs.data_ptr<int64_t>()[n] < s.cache_len &&
                    sl.data_ptr<int64_t>()[n] >= 0 && sl.data_ptr<int64_t>()[n] < k_cache.size(0),
                "decoder_layer: a row beyond the cache");
  if (x.scalar_type() == torch::kBFloat16)
    return layer<Bf16>(x, ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b, c.data_ptr<float>(),
                       sn.data_ptr<float>(), k_cache, v_cache, sl.data_ptr<int64_t>(), ps.data_ptr<int64_t>(),
                       vs.data_ptr<int64_t>(), s,
                       static_cast<float>(eps), static_cast<float>(scale));
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "decoder_layer: bf16 or fp32");
  return layer<F32>(x, ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b, c.data_ptr<float>(),
                    sn.data_ptr<float>(), k_cache, v_cache, sl.data_ptr<int64_t>(), ps.data_ptr<int64_t>(),
                       vs.data_ptr<int64_t>(), s,
                    static_cast<float>(eps), static_cast<float>(scale));
}

}  // namespace dspark
