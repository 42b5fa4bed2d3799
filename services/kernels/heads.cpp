// DSpark's Markov head drafting a greedy block, its γ sequential steps in one call (services/cpu_kernels.py
// `markov_greedy`; drafter_worker/heads.py has the head's definition).
//
// Why one call: a step is an embedding lookup, an r → V product, an add, a softmax peak and an argmax, about
// a dozen aten calls; at one to a few rows seven steps cost more in dispatch than the backbone's kernel layers.
// Step k of every row: e = W1[x_{k−1}], B = W2 e (linear.cpp's GEMM, rounded to the dtype as the module's
// output is), logits U_k + B, x_k their argmax (the first of equal maxima, as torch's), the peak
// max softmax = 1 / Σ exp(l − max), and the confidence logit z_k = w · [h_k; e] + b, rounded to the dtype.
#include <ATen/Parallel.h>

#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace dspark {
namespace {

template <class T>
float ld(T v);
template <>
float ld<uint16_t>(uint16_t v) { return from_bf16(v); }
template <>
float ld<float>(float v) { return v; }
template <class T>
float rounded(float f);  // f rounded to T and back
template <>
float rounded<uint16_t>(float f) { return from_bf16(to_bf16(f)); }
template <>
float rounded<float>(float f) { return f; }

// 8 values of b from v on as fp32.
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* b) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* b) { return _mm256_loadu_ps(b); }

// One row's logits l = u + b over V → (argmax, 1 / Σ exp(l − max)); `l` is scratch of V rounded up to 8.
template <class T>
__attribute__((target("avx2,fma"))) std::pair<int64_t, float> peak(const float* u, const T* b, float* l, int64_t V) {
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t full = V - V % 8, padded = (V + 7) / 8 * 8;
  __m256 top8 = _mm256_set1_ps(-inf);
  for (int64_t v = 0; v < full; v += 8) {
    const __m256 x = _mm256_add_ps(_mm256_loadu_ps(u + v), load8(b + v));
    _mm256_storeu_ps(l + v, x);
    top8 = _mm256_max_ps(top8, x);
  }
  for (int64_t v = full; v < padded; ++v) l[v] = v < V ? u[v] + ld<T>(b[v]) : -inf;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = -inf;
  for (int i = 0; i < 8; ++i) top = std::max(top, lanes[i]);
  for (int64_t v = full; v < V; ++v) top = std::max(top, l[v]);
  int64_t arg = 0;
  while (arg < V - 1 && l[arg] != top) ++arg;  // the first maximum (a NaN row: the last)
  const __m256 m = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t v = 0; v < padded; v += 8) total = _mm256_add_ps(total, exp8(_mm256_sub_ps(_mm256_loadu_ps(l + v), m)));
  return {arg, 1.f / hsum8(total)};
}

template <class T>
void run(const torch::Tensor& U, const torch::Tensor& h, const torch::Tensor& anchors, const torch::Tensor& W1,
         const torch::Tensor& W2, const float* conf_w, float conf_b,
         torch::Tensor& tokens, torch::Tensor& peaks, torch::Tensor& conf) {
  const int64_t A = U.size(0), G = U.size(1), V = U.size(2), d = h.size(2), r = W1.size(1);
  const T* w1 = reinterpret_cast<const T*>(W1.data_ptr());
  const T* hp = reinterpret_cast<const T*>(h.data_ptr());
  const float* up = U.data_ptr<float>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* pk = peaks.data_ptr<float>();
  float* z = conf_w ? conf.data_ptr<float>() : nullptr;
  std::vector<int64_t> prev(anchors.data_ptr<int64_t>(), anchors.data_ptr<int64_t>() + A);
  auto e = torch::empty({A, r}, h.options());
  T* ep = reinterpret_cast<T*>(e.data_ptr());
  for (int64_t k = 0; k < G; ++k) {
    for (int64_t a = 0; a < A; ++a) {
      TORCH_CHECK(prev[a] >= 0 && prev[a] < W1.size(0), "markov_greedy: a token beyond the vocabulary");
      std::memcpy(ep + a * r, w1 + prev[a] * r, r * sizeof(T));
    }
    auto B = dspark::linear(e, W2, std::nullopt);  // [A, V] in the dtype
    const T* bp = reinterpret_cast<const T*>(B.data_ptr());
    at::parallel_for(0, A, 1, [&](int64_t first, int64_t last) {
      std::vector<float> scratch((V + 7) / 8 * 8);
      for (int64_t a = first; a < last; ++a) {
        const auto [arg, p] = peak<T>(up + (a * G + k) * V, bp + a * V, scratch.data(), V);
        tok[a * G + k] = arg, pk[a * G + k] = p;
        if (z) {
          const T* hk = hp + (a * G + k) * d;
          float acc = 0.f;
          for (int64_t i = 0; i < d; ++i) acc += conf_w[i] * ld<T>(hk[i]);
          for (int64_t i = 0; i < r; ++i) acc += conf_w[d + i] * ld<T>(ep[a * r + i]);
          z[a * G + k] = rounded<T>(acc + conf_b);
        }
      }
    });
    for (int64_t a = 0; a < A; ++a) prev[a] = tok[a * G + k];
  }
}

}  // namespace

std::vector<torch::Tensor> markov_greedy(torch::Tensor U, torch::Tensor h, torch::Tensor anchors, torch::Tensor W1,
                                         torch::Tensor W2, std::optional<torch::Tensor> conf_w, double conf_b) {
  TORCH_CHECK(U.dim() == 3 && U.scalar_type() == torch::kFloat && U.is_contiguous(), "markov_greedy: U [A, γ, V] fp32");
  TORCH_CHECK(h.dim() == 3 && h.size(0) == U.size(0) && h.size(1) == U.size(1) && h.is_contiguous(),
              "markov_greedy: h [A, γ, d]");
  TORCH_CHECK(W1.dim() == 2 && W1.is_contiguous() && W1.scalar_type() == h.scalar_type(), "markov_greedy: W1 [V, r]");
  TORCH_CHECK(anchors.dim() == 1 && anchors.size(0) == U.size(0) && anchors.scalar_type() == torch::kLong,
              "markov_greedy: anchors [A] int64");
  auto a = anchors.contiguous();
  auto tokens = torch::empty({U.size(0), U.size(1)}, a.options());
  auto peaks = torch::empty({U.size(0), U.size(1)}, U.options());
  auto conf = torch::empty({conf_w.has_value() ? U.size(0) : 0, U.size(1)}, U.options());
  torch::Tensor cw;
  if (conf_w.has_value()) {
    cw = conf_w->to(torch::kFloat).contiguous();
    TORCH_CHECK(cw.numel() == h.size(2) + W1.size(1), "markov_greedy: confidence weight of d + r");
  }
  const float* cwp = conf_w.has_value() ? cw.data_ptr<float>() : nullptr;
  if (h.scalar_type() == torch::kBFloat16)
    run<uint16_t>(U, h, a, W1, W2, cwp, static_cast<float>(conf_b), tokens, peaks, conf);
  else {
    TORCH_CHECK(h.scalar_type() == torch::kFloat, "markov_greedy: bf16 or fp32");
    run<float>(U, h, a, W1, W2, cwp, static_cast<float>(conf_b), tokens, peaks, conf);
  }
  return {tokens, peaks, conf};
}

}  // namespace dspark
