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
#include <type_traits>
#include <vector>

#include "ops.h"
#include "attend.h"
#include "simd.h"

namespace dspark {
namespace {

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

// bf16 rows 16 values at a time (AVX512-BF16), rounded where the scalar templates above round (to nearest even,
// as torch; `vcvtneps2bf16` treats denormal inputs as zero, values no activation here reaches). The scalar
// templates serve fp32, where there is nothing to widen or round and the compiler vectorises them.
#define DSPARK_BF16 __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,avx2,fma")))

inline __mmask16 first(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

DSPARK_BF16 inline __m512 ld16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

DSPARK_BF16 inline void st16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

DSPARK_BF16 inline __m512 round16(__m512 v) {  // v rounded to bf16, as fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

DSPARK_BF16 void norm_row_bf16(const uint16_t* row, const uint16_t* w, uint16_t* out, int64_t d, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 v = ld16(row + i, first(d - i));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(d) + eps));
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = first(d - i);
    st16(out + i, _mm512_mul_ps(ld16(w + i, m), round16(_mm512_mul_ps(ld16(row + i, m), r))), m);
  }
}

void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t N, int64_t d, float eps) {
  at::parallel_for(0, N, 8, [&](int64_t b, int64_t e) {  // a lambda takes no target: the row function has it
    for (int64_t n = b; n < e; ++n) norm_row_bf16(x + n * d, w, out + n * d, d, eps);
  });
}

DSPARK_BF16 void rotate_bf16(uint16_t* x, int64_t heads, int64_t dh, const float* cos, const float* sin) {
  const int64_t half = dh / 2;  // a multiple of 16: the kernel serves head_dim a multiple of 32
  for (int64_t h = 0; h < heads; ++h) {
    uint16_t* v = x + h * dh;
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 a = ld16(v + i, 0xFFFF), b = ld16(v + i + half, 0xFFFF);
      st16(v + i, _mm512_sub_ps(_mm512_mul_ps(a, _mm512_loadu_ps(cos + i)), _mm512_mul_ps(b, _mm512_loadu_ps(sin + i))),
           0xFFFF);
      st16(v + i + half, _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(cos + i + half)),
                                       _mm512_mul_ps(a, _mm512_loadu_ps(sin + i + half))), 0xFFFF);
    }
  }
}

DSPARK_BF16 void add_into_bf16(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 m = first(count - i);
    st16(out + i, _mm512_add_ps(ld16(a + i, m), ld16(b + i, m)), m);
  }
}

DSPARK_BF16 void silu_mul_row_bf16(const uint16_t* gu, uint16_t* out, int64_t F) {
  for (int64_t f = 0; f < F; f += 16) {
    const __mmask16 m = first(F - f);
    const __m512 g = ld16(gu + f, m), u = ld16(gu + F + f, m);
    const __m256 lo = _mm512_castps512_ps256(g), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1));
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    const __m256 s_lo = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, lo))));
    const __m256 s_hi = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, hi))));
    const __m512 sig = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(s_lo)), _mm256_castps_pd(s_hi), 1));
    st16(out + f, _mm512_mul_ps(_mm512_mul_ps(g, sig), u), m);
  }
}

template <class D>
void norm_rows(const typename D::T* x, const typename D::T* w, typename D::T* out, int64_t N, int64_t d, float eps) {
  if constexpr (std::is_same_v<D, Bf16>) rms_norm_bf16(x, w, out, N, d, eps);
  else rms_norm<D>(x, w, out, N, d, eps);
}

template <class D>
void rotate_row(typename D::T* x, int64_t heads, int64_t dh, const float* cos, const float* sin) {
  if constexpr (std::is_same_v<D, Bf16>) rotate_bf16(x, heads, dh, cos, sin);
  else rotate<D>(x, heads, dh, cos, sin);
}

template <class D>
void add_rows(const typename D::T* a, const typename D::T* b, typename D::T* out, int64_t count) {
  if constexpr (std::is_same_v<D, Bf16>) add_into_bf16(a, b, out, count);
  else add_into<D>(a, b, out, count);
}

template <class D>
void silu_mul(const typename D::T* gu, typename D::T* out, int64_t F) {
  if constexpr (std::is_same_v<D, Bf16>) silu_mul_row_bf16(gu, out, F);
  else silu_mul_row<D>(gu, out, F);
}

// Rows [q (heads), k, v] of `width` values: q and k rotated in place, k and v written at each row's slot and
// position.
template <class D>
void store_rows(typename D::T* rows, int64_t N, int64_t width, int64_t q_heads, const float* cos, const float* sin,
                typename D::T* keys, typename D::T* values, const int64_t* slots, const int64_t* pos, const Shape& s) {
  const int64_t k_at = q_heads * s.dh, v_at = k_at + s.kv_heads * s.dh;
  for (int64_t n = 0; n < N; ++n) {
    typename D::T* row = rows + n * width;
    rotate_row<D>(row, q_heads + s.kv_heads, s.dh, cos + n * s.dh, sin + n * s.dh);
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const int64_t at = ((slots[n] * s.kv_heads + g) * s.cache_len + pos[n]) * s.dh;
      std::memcpy(keys + at, row + k_at + g * s.dh, s.dh * sizeof(typename D::T));
      std::memcpy(values + at, row + v_at + g * s.dh, s.dh * sizeof(typename D::T));
    }
  }
}

template <class D>
torch::Tensor layer(torch::Tensor x, torch::Tensor ln1, torch::Tensor qkv_w, std::optional<torch::Tensor> qkv_b,
                    torch::Tensor o_w, std::optional<torch::Tensor> o_b, torch::Tensor ln2, torch::Tensor gu_w,
                    std::optional<torch::Tensor> gu_b, torch::Tensor down_w, std::optional<torch::Tensor> down_b,
                    const float* cos, const float* sin, torch::Tensor k_cache, torch::Tensor v_cache,
                    const int64_t* slots, const int64_t* pos, const int64_t* seen, const Shape& s, float eps,
                    float scale, std::optional<torch::Tensor> normed) {
  using T = typename D::T;
  const int64_t N = x.size(0), d = x.size(1), q_width = s.heads * s.dh, kv_width = s.kv_heads * s.dh;
  const auto ptr = [](torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); };
  // The attention's input: RMSNorm(x), or the caller's (a chain drafter's [emb; hidden] rows, 2d wide).
  auto h = normed.has_value() ? *normed : torch::empty_like(x);
  if (!normed.has_value()) norm_rows<D>(ptr(x), ptr(ln1), ptr(h), N, d, eps);
  auto qkv = dspark::linear(h, qkv_w, qkv_b);  // [N, (H + 2 Hkv) Dh]
  TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "decoder_layer: qkv weight of (H + 2 Hkv) Dh outputs");
  T* keys = ptr(k_cache);
  T* values = ptr(v_cache);
  const int64_t row_width = q_width + 2 * kv_width;
  T* qkv_p = ptr(qkv);
  // every row's key in the cache before any row attends
  store_rows<D>(qkv_p, N, row_width, s.heads, cos, sin, keys, values, slots, pos, s);
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
  add_rows<D>(ptr(x), ptr(mid), ptr(mid), N * d);  // mid = x + attention
  auto h2 = torch::empty_like(x);
  norm_rows<D>(ptr(mid), ptr(ln2), ptr(h2), N, d, eps);
  auto gu = dspark::linear(h2, gu_w, gu_b);  // [N, 2F]: gate, then up
  const int64_t F = gu.size(1) / 2;
  auto act = torch::empty({N, F}, x.options());
  at::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) silu_mul<D>(ptr(gu) + n * 2 * F, ptr(act) + n * F, F);
  });
  auto out = dspark::linear(act, down_w, down_b);
  TORCH_CHECK(out.size(1) == d, "decoder_layer: down-proj of d outputs");
  add_rows<D>(ptr(mid), ptr(out), ptr(out), N * d);
  return out;
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.size(0) == x.size(1) &&
                  w.scalar_type() == x.scalar_type() && w.is_contiguous(),
              "rms_norm: x [N, d] contiguous, w [d] of its dtype");
  auto out = torch::empty_like(x);
  if (x.scalar_type() == torch::kBFloat16)
    norm_rows<Bf16>(reinterpret_cast<uint16_t*>(x.data_ptr()), reinterpret_cast<uint16_t*>(w.data_ptr()),
                    reinterpret_cast<uint16_t*>(out.data_ptr()), x.size(0), x.size(1), static_cast<float>(eps));
  else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "rms_norm: bf16 or fp32");
    norm_rows<F32>(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
                   static_cast<float>(eps));
  }
  return out;
}

void context_rows(torch::Tensor x, torch::Tensor kv_w, std::optional<torch::Tensor> kv_b, torch::Tensor cos,
                  torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache, int64_t slot, int64_t start) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == x.scalar_type(),
              "context_rows: x [P, d], caches [S, Hkv, L, Dh] contiguous, one dtype");
  const int64_t P = x.size(0);
  const Shape s{0, k_cache.size(1), k_cache.size(3), k_cache.size(2)};
  TORCH_CHECK(slot >= 0 && slot < k_cache.size(0) && start >= 0 && start + P <= s.cache_len,
              "context_rows: rows beyond the cache");
  auto c = cos.to(torch::kFloat).contiguous(), sn = sin.to(torch::kFloat).contiguous();
  TORCH_CHECK(c.size(0) == P && c.size(1) == s.dh, "context_rows: cos, sin [P, Dh]");
  auto kv = dspark::linear(x, kv_w, kv_b);  // [P, 2 Hkv Dh]
  TORCH_CHECK(kv.size(1) == 2 * s.kv_heads * s.dh, "context_rows: a k/v weight of 2 Hkv Dh outputs");
  std::vector<int64_t> slots(P, slot), pos(P);
  for (int64_t i = 0; i < P; ++i) pos[i] = start + i;
  if (x.scalar_type() == torch::kBFloat16)
    store_rows<Bf16>(reinterpret_cast<uint16_t*>(kv.data_ptr()), P, kv.size(1), 0, c.data_ptr<float>(),
                     sn.data_ptr<float>(), reinterpret_cast<uint16_t*>(k_cache.data_ptr()),
                     reinterpret_cast<uint16_t*>(v_cache.data_ptr()), slots.data(), pos.data(), s);
  else
    store_rows<F32>(kv.data_ptr<float>(), P, kv.size(1), 0, c.data_ptr<float>(), sn.data_ptr<float>(),
                    k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots.data(), pos.data(), s);
}

torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor ln1, torch::Tensor qkv_w, std::optional<torch::Tensor> qkv_b,
                            torch::Tensor o_w, std::optional<torch::Tensor> o_b, torch::Tensor ln2,
                            torch::Tensor gate_up_w, std::optional<torch::Tensor> gate_up_b, torch::Tensor down_w,
                            std::optional<torch::Tensor> down_b, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor pos,
                            std::optional<torch::Tensor> visible, std::optional<torch::Tensor> normed,
                            int64_t n_heads, int64_t n_kv, double eps, double scale) {
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
  TORCH_CHECK(!normed.has_value() || (normed->dim() == 2 && normed->size(0) == x.size(0) && normed->is_contiguous() &&
                                      normed->scalar_type() == x.scalar_type()),
              "decoder_layer: normed [N, d_in] contiguous, x's dtype");
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
                       static_cast<float>(eps), static_cast<float>(scale), normed);
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "decoder_layer: bf16 or fp32");
  return layer<F32>(x, ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up_w, gate_up_b, down_w, down_b, c.data_ptr<float>(),
                    sn.data_ptr<float>(), k_cache, v_cache, sl.data_ptr<int64_t>(), ps.data_ptr<int64_t>(),
                       vs.data_ptr<int64_t>(), s,
                    static_cast<float>(eps), static_cast<float>(scale), normed);
}

}  // namespace dspark
