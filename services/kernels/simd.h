// What the kernels share (decoder.cpp, heads.cpp, linear.cpp): the two dtypes, and SIMD reductions in a fixed
// order, so a result does not depend on which thread or call computes it.
#pragma once
#include <immintrin.h>

#include <type_traits>

#include "ops.h"

namespace dspark {

// The kernels' two dtypes: loading a value as fp32, storing fp32 rounded to the dtype (bf16: as torch rounds).
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

template <class T>  // the dtype of a storage type
using DtypeOf = std::conditional_t<std::is_same_v<T, uint16_t>, Bf16, F32>;

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {  // fixed order: halves, then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// exp of 8 floats: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial), ~1 ulp.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace dspark
