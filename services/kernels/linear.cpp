// y[M, N] = x[M, K] · W[N, K]ᵀ (+ b) for the CPU serving path (services/cpu_kernels.py).
//
// Why a kernel of our own: a decode or verify step has 1-16 rows, so a linear is a matrix-vector product that
// streams its weight from memory once. oneDNN's GEMM reaches about 9 GB/s on such calls on this project's
// 2-vCPU VMs (its per-call set-up and blocking are made for larger M); a loop that reads each weight row once
// and keeps the rows of x in L1 reaches the memory's 20 GB/s.
//
// Exactness: every y[m, n] is one dot product over k in a fixed order (32- or 8-wide lanes, k ascending; bf16 on
// AVX512-BF16 in two accumulators of alternate 32-chunks, added; then a fixed lane reduction), the same whatever M is and whichever thread computes it, so a row's bits never depend
// on the other rows of the step (the batch invariance greedy speculation relies on).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "ops.h"
#include "simd.h"

namespace dspark {
namespace {

// A weight row is read once and dotted with tiles of 4, 2, 1 rows of x held in registers. One weight stream per
// thread reads fastest here: tiles of four weight rows ran 2x slower at one row, tiles of 8 rows of x no faster
// at 8-64 rows. A tile's size never changes an output's sum (each has its own accumulator, k in the same
// order), so a row's bits do not depend on M. (bf16; the AVX2 loop tiles weight rows too from 8 rows on: avx2_outputs.)

// Rows m..m+T-1 of x against weight row n. K is covered by full 32-wide chunks, then one masked chunk.
template <int T>
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"))) inline void bf16_tile(
    const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t K, int64_t N, int64_t m,
    int64_t n) {
  const uint16_t* wr = w + n * K;
  // Two accumulators per row, even and odd chunks of 32, so that consecutive dpbf16s do not wait on each other
  // (at one row a single chain is latency-bound where the weights sit in cache); summed in a fixed order.
  __m512 acc[T], odd[T];
#pragma GCC unroll 4
  for (int i = 0; i < T; ++i) acc[i] = _mm512_setzero_ps(), odd[i] = _mm512_setzero_ps();
  const int64_t full = K - K % 32, pairs = K - K % 64;
  for (int64_t k = 0; k < pairs; k += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
#pragma GCC unroll 4
    for (int i = 0; i < T; ++i) {
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(x + (m + i) * K + k), w0);
      odd[i] = _mm512_dpbf16_ps(odd[i], (__m512bh)_mm512_loadu_si512(x + (m + i) * K + k + 32), w1);
    }
  }
  if (pairs < full) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + pairs);
#pragma GCC unroll 4
    for (int i = 0; i < T; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(x + (m + i) * K + pairs), wv);
  }
  if (full < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ULL << (K - full)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + full);
#pragma GCC unroll 4
    for (int i = 0; i < T; ++i)
      odd[i] = _mm512_dpbf16_ps(odd[i], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m + i) * K + full), wv);
  }
#pragma GCC unroll 4
  for (int i = 0; i < T; ++i) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], odd[i]));
    if (bias) s += bias[n];
    y[(m + i) * N + n] = to_bf16(s);
  }
}

__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
void bf16_outputs(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t M, int64_t K,
                  int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) bf16_tile<4>(x, w, bias, y, K, N, m, n);
    if (m + 2 <= M) bf16_tile<2>(x, w, bias, y, K, N, m, n), m += 2;
    if (m < M) bf16_tile<1>(x, w, bias, y, K, N, m, n);
  }
}

// T rows of x against R weight rows n..n+R-1, each output in its own accumulator (k ascending, 8 lanes, then
// the masked tail, then hsum8): the same operations in the same order whatever T and R are, so the tiling
// never changes a bit. R = 1 streams one weight row at a time (best from 1 to a few rows); R = 3 with T = 4
// holds 12 accumulators and loads 7 vectors for 12 FMAs instead of 5 for 4, for the many rows of a prefill or
// a wide verify (see avx2_outputs). S is the storage: fp32, or bf16 on a CPU without AVX512-BF16, whose values
// widen exactly to fp32 (a shift), so a bf16 linear there is the fp32 loop over half the bytes.
template <class S>
__attribute__((target("avx2,fma"))) inline __m256 load8(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
}

template <class S>  // the last K % 8 values, zeros after
__attribute__((target("avx2,fma"))) inline __m256 load_tail(const S* p, int64_t count, __m256i tail_mask) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm256_maskload_ps(p, tail_mask);
  } else {
    alignas(16) uint16_t buf[8] = {};
    std::memcpy(buf, p, count * sizeof(uint16_t));
    return load8(buf);
  }
}

template <class S, int T, int R>
__attribute__((target("avx2,fma"))) inline void avx2_tile(const S* x, const S* w, const float* bias, S* y,
                                                           int64_t K, int64_t N, int64_t m, int64_t n,
                                                           __m256i tail_mask) {
  __m256 acc[T][R];
#pragma GCC unroll 4
  for (int i = 0; i < T; ++i)
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t full = K - K % 8;
  for (int64_t k = 0; k < full; k += 8) {
    __m256 wv[R];
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) wv[r] = load8(w + (n + r) * K + k);
#pragma GCC unroll 4
    for (int i = 0; i < T; ++i) {
      const __m256 xv = load8(x + (m + i) * K + k);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(xv, wv[r], acc[i][r]);
    }
  }
  if (full < K) {
    __m256 wv[R];
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) wv[r] = load_tail(w + (n + r) * K + full, K - full, tail_mask);
#pragma GCC unroll 4
    for (int i = 0; i < T; ++i) {
      const __m256 xv = load_tail(x + (m + i) * K + full, K - full, tail_mask);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) acc[i][r] = _mm256_fmadd_ps(xv, wv[r], acc[i][r]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < T; ++i)
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r)
      y[(m + i) * N + n + r] = DtypeOf<S>::st(hsum8(acc[i][r]) + (bias ? bias[n + r] : 0.f));
}

template <class S, int R>
__attribute__((target("avx2,fma"))) inline void avx2_rows(const S* x, const S* w, const float* bias, S* y,
                                                           int64_t K, int64_t N, int64_t m0, int64_t m1,
                                                           int64_t n, __m256i tail_mask) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) avx2_tile<S, 4, R>(x, w, bias, y, K, N, m, n, tail_mask);
  if (m + 2 <= m1) avx2_tile<S, 2, R>(x, w, bias, y, K, N, m, n, tail_mask), m += 2;
  if (m < m1) avx2_tile<S, 1, R>(x, w, bias, y, K, N, m, n, tail_mask);
}

// From WIDE rows on, weight rows go three at a time, over chunks of CHUNK rows of x: a chunk (160 KB at K = 640)
// stays in L2 while the block's weight rows pass over it. Gemma's LM head (262,144 x 640, fp32, 2-vCPU EPYC):
// 8 rows 51 -> 46 ms, 64 rows 421 -> 251 ms, 512 rows 3.75 -> 1.81 s (oneDNN: 2.08 s), where streaming all
// of x past every weight row had run at half oneDNN's speed from 256 rows. Below WIDE, one weight row at a
// time (the memory-bound decode).
constexpr int64_t WIDE = 8, CHUNK = 64;

template <class S>
__attribute__((target("avx2,fma")))
void avx2_outputs(const S* x, const S* w, const float* bias, S* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                  int64_t n1) {
  alignas(32) int32_t lanes[8];
  for (int l = 0; l < 8; ++l) lanes[l] = l < K % 8 ? -1 : 0;
  const __m256i tail_mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  if (M < WIDE) {
    for (int64_t n = n0; n < n1; ++n) avx2_rows<S, 1>(x, w, bias, y, K, N, 0, M, n, tail_mask);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
    const int64_t m1 = std::min(M, m0 + CHUNK);
    int64_t n = n0;
    for (; n + 3 <= n1; n += 3) avx2_rows<S, 3>(x, w, bias, y, K, N, m0, m1, n, tail_mask);
    for (; n < n1; ++n) avx2_rows<S, 1>(x, w, bias, y, K, N, m0, m1, n, tail_mask);
  }
}

// Threads split the outputs in whole blocks; a block is computed the same way by any thread.
template <typename F>
void over_outputs(int64_t N, F&& fn) {
  constexpr int64_t block = 32;
  const int64_t blocks = (N + block - 1) / block;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { fn(b0 * block, std::min(N, b1 * block)); });
}

}  // namespace

torch::Tensor linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && (w.dim() == 2 || w.dim() == 5), "linear: x [M, K], w [N, K] or packed by pack_amx");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: x and w of one dtype");
  x = x.contiguous();
  torch::Tensor b32;
  if (bias && bias->defined()) b32 = bias->to(torch::kFloat).contiguous();
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  if (w.dim() == 5) return linear_amx(x, w, bp);  // amx.cpp
  TORCH_CHECK(x.size(1) == w.size(1), "linear: x [M, K], w [N, K]");
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (x.scalar_type() == torch::kBFloat16) {
    auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
    auto yp = reinterpret_cast<uint16_t*>(y.data_ptr());
    static const bool dpbf16 = __builtin_cpu_supports("avx512bf16");
    over_outputs(N, [&](int64_t n0, int64_t n1) {
      if (dpbf16) bf16_outputs(xp, wp, bp, yp, M, K, N, n0, n1);
      else avx2_outputs(xp, wp, bp, yp, M, K, N, n0, n1);
    });
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat, "linear: bf16 or fp32");
    auto xp = x.data_ptr<float>();
    auto wp = w.data_ptr<float>();
    auto yp = y.data_ptr<float>();
    over_outputs(N, [&](int64_t n0, int64_t n1) {
      avx2_outputs(xp, wp, bp, yp, M, K, N, n0, n1);
    });
  }
  return y;
}

}  // namespace dspark
