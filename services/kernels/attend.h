// The attention of one row over the keys 0..p of its cache slot, for one key head and its query heads
// (decoder.cpp's layers). A row's scores, softmax and weighted sum touch only its own query and its slot, in an
// order fixed by the key index: the bits do not depend on the step's other rows.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace dspark {

// Scores s[0..n) (n padded to 8 with −inf by the caller) → weights exp(s − max) in place; → their sum.
__attribute__((target("avx2,fma"))) inline float softmax_weights(float* s, int64_t padded) {
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

// fp32: the dot product of a query and a key of Dh values, and acc += w · v over Dh.
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
// fp32 (AVX2 machines), one head at a time. No target of its own: always inlined into `attend_fp32`, whose
// target lets `dot` and `axpy` inline into it.
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

// 16 vectors → one whose lane k is the sum of v[k]'s 16 lanes, by a fixed tree of halving adds (lane k's order
// depends on k alone): 15 adds where 16 horizontal reductions take 64.
__attribute__((target("avx512f"))) inline __m512 sum16(__m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // a[i]: 128-bit quarters [k 2i: 2 parts, k 2i+1: 2 parts]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // b[i]: quarter m holds 4 partial sums of key 4i + m
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // c[i]: quarter m holds 2 partials of key 8i + m, then 2 of key 8i + 4 + m
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  // lane 4m + r: key 4r + m, summed; put key k in lane k
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, d);
}

// bf16, one query head at a time with its query in registers. Scores: 16 keys at a time, each key's dot product
// in dpbf16 over Dh, the 16 reduced together (`sum16`). Weighted sum: as flash attention's P · V, the softmax
// weights rounded to bf16 and the value rows taken in pairs (j, j + 1), interleaved, so one dpbf16 adds both
// (w_j v_j + w_j+1 v_j+1); the denominator is summed from the fp32 weights. Pairs and blocks are fixed by the
// key index, so a row's bits depend on its query and its slot alone.
template <int DH>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,avx2,fma"))) inline void attend_bf16_dh(
    const uint16_t* q_row, const uint16_t* keys, const uint16_t* values, int64_t p, float scale, const Shape& s,
    int64_t g, uint16_t* out_row) {
  constexpr int C = DH / 32;  // 32-wide chunks of a head
  const int64_t group = s.heads / s.kv_heads, n = p + 1, padded = (n + 15) / 16 * 16;
  std::vector<float> score(padded);
  alignas(64) float lo_out[16], hi_out[16];
  for (int64_t t = 0; t < group; ++t) {
    const int64_t h = g * group + t;
    __m512bh qv[C];
    for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q_row + h * DH + 32 * c);
    for (int64_t j0 = 0; j0 < padded; j0 += 16) {
      __m512 part[16];
      for (int i = 0; i < 16; ++i) {
        const uint16_t* k = keys + std::min(j0 + i, p) * DH;  // past the last key: read it again, masked below
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c) a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
        part[i] = a;
      }
      _mm512_storeu_ps(score.data() + j0, _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale)));
    }
    std::fill(score.begin() + n, score.end(), -std::numeric_limits<float>::infinity());
    const float inv = 1.f / softmax_weights(score.data(), padded);
    __m512 lo[C], hi[C];
    for (int c = 0; c < C; ++c) lo[c] = _mm512_setzero_ps(), hi[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 2) {
      const int64_t j1 = std::min(j + 1, p);  // an odd count: the last key again, at weight 0
      const uint32_t pair = to_bf16(score[j]) | static_cast<uint32_t>(j + 1 < n ? to_bf16(score[j + 1]) : 0) << 16;
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < C; ++c) {
        const __m512i a = _mm512_loadu_si512(values + j * DH + 32 * c), b = _mm512_loadu_si512(values + j1 * DH + 32 * c);
        lo[c] = _mm512_dpbf16_ps(lo[c], (__m512bh)_mm512_unpacklo_epi16(a, b), w);  // dims 8L + 0..3 of lane L
        hi[c] = _mm512_dpbf16_ps(hi[c], (__m512bh)_mm512_unpackhi_epi16(a, b), w);  // dims 8L + 4..7
      }
    }
    for (int c = 0; c < C; ++c) {
      _mm512_store_ps(lo_out, lo[c]);
      _mm512_store_ps(hi_out, hi[c]);
      uint16_t* o = out_row + h * DH + 32 * c;
      for (int L = 0; L < 4; ++L)
        for (int m = 0; m < 4; ++m) {
          o[8 * L + m] = to_bf16(lo_out[4 * L + m] * inv);
          o[8 * L + 4 + m] = to_bf16(hi_out[4 * L + m] * inv);
        }
    }
  }
}

// The head sizes the bf16 attention is compiled for (services/fused_decoder.py serves no other).
inline void attend_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t p, float scale, const Shape& s,
                        int64_t g, uint16_t* out) {
  switch (s.dh) {
    case 32: return attend_bf16_dh<32>(q, k, v, p, scale, s, g, out);
    case 64: return attend_bf16_dh<64>(q, k, v, p, scale, s, g, out);
    case 96: return attend_bf16_dh<96>(q, k, v, p, scale, s, g, out);
    case 128: return attend_bf16_dh<128>(q, k, v, p, scale, s, g, out);
    case 160: return attend_bf16_dh<160>(q, k, v, p, scale, s, g, out);
    case 192: return attend_bf16_dh<192>(q, k, v, p, scale, s, g, out);
    case 224: return attend_bf16_dh<224>(q, k, v, p, scale, s, g, out);
    case 256: return attend_bf16_dh<256>(q, k, v, p, scale, s, g, out);
    default: TORCH_CHECK(false, "decoder_layer: bf16 head_dim a multiple of 32 up to 256");
  }
}

__attribute__((target("avx2,fma"))) inline void attend_fp32(const float* q_row, const float* keys, const float* values,
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


}  // namespace dspark
