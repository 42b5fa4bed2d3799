// DSpark's Markov head drafting a block, its γ sequential steps in one call (services/cpu_kernels.py
// `markov_block`; drafter_worker/heads.py has the head's definition), greedy or sampled.
//
// Why one call: a step is an embedding lookup, an r → V product, an add, a softmax peak and an argmax, about
// a dozen aten calls; at one to a few rows seven steps cost more in dispatch than the backbone's kernel layers.
// Step k of every row: e = W1[x_{k−1}], B = W2 e (linear.cpp's GEMM, rounded to the dtype as the module's
// output is), logits U_k + B, x_k their argmax (the first of equal maxima, as torch's) with the peak
// max softmax = 1 / Σ exp(l − max), or drawn from the truncated q' (`draw`) with the peak q'[0]; and the
// confidence logit z_k = w · [h_k; e] + b, rounded to the dtype.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace dspark {
namespace {

template <class T>
float ld(T v) { return DtypeOf<T>::ld(v); }
template <class T>
float rounded(float f) { return DtypeOf<T>::ld(DtypeOf<T>::st(f)); }  // f rounded to T and back

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

// Sampled blocks: per row its temperature (> 0), top-k (0 = off), top-p (1 = off), one uniform a step, and the
// truncated q' it sends (`ids`, `probs` [A, γ, K]).
struct Sampling {
  const float* temp;
  const int64_t* top_k;
  const float* top_p;
  const double* uniform;
  int64_t K;
  int64_t* ids;
  float* probs;
};

// The `n` largest of l[0..V) as (value, id), most likely first: a min-heap of n, so most values cost one compare.
std::vector<std::pair<float, int32_t>> largest(const float* l, int64_t V, int64_t n) {
  std::vector<std::pair<float, int32_t>> heap;
  heap.reserve(n + 1);
  const auto greater = [](const auto& a, const auto& b) { return a.first > b.first; };
  for (int64_t v = 0; v < V; ++v) {
    if (static_cast<int64_t>(heap.size()) < n) {
      heap.emplace_back(l[v], static_cast<int32_t>(v));
      std::push_heap(heap.begin(), heap.end(), greater);
    } else if (l[v] > heap.front().first) {
      std::pop_heap(heap.begin(), heap.end(), greater);
      heap.back() = {l[v], static_cast<int32_t>(v)};
      std::push_heap(heap.begin(), heap.end(), greater);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), greater);  // descending
  return heap;
}

// l = (u + b) · inv over V (8 at a time), and Σ exp(l − top) over V (l padded to 8 with −inf).
template <class T>
__attribute__((target("avx2,fma"))) void scaled(const float* u, const T* b, float inv, float* l, int64_t V) {
  const int64_t full = V - V % 8;
  const __m256 s = _mm256_set1_ps(inv);
  for (int64_t v = 0; v < full; v += 8)
    _mm256_storeu_ps(l + v, _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(u + v), load8(b + v)), s));
  for (int64_t v = full; v < V; ++v) l[v] = (u[v] + ld<T>(b[v])) * inv;
  for (int64_t v = V; v < (V + 7) / 8 * 8; ++v) l[v] = -std::numeric_limits<float>::infinity();
}

__attribute__((target("avx2,fma"))) double exp_sum(const float* l, int64_t V, float top) {
  const __m256 m = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t v = 0; v < (V + 7) / 8 * 8; v += 8) total = _mm256_add_ps(total, exp8(_mm256_sub_ps(_mm256_loadu_ps(l + v), m)));
  return hsum8(total);
}

// One row's step: l = (u + b) / T, then as services/sampling.py's `logits_to_probs` + `truncate_to_sparse`: top-k,
// top-p over what top-k keeps, the K most likely of the rest renormalised into q' (ids distinct; those past the
// kept carry 0), the token drawn by inverting q''s CDF at the row's uniform → (token, q'[0]).
template <class T>
std::pair<int64_t, float> draw(const float* u, const T* b, float* l, int64_t V, float temp, int64_t top_k, float top_p,
                               double uniform, int64_t K, int64_t* ids, float* probs) {
  scaled<T>(u, b, 1.f / temp, l, V);
  const int64_t kk = top_k > 0 ? std::min<int64_t>(top_k, V) : V, support = K;
  const auto best = largest(l, V, support);
  const float top = best[0].first;
  double total = 0.0;  // the normaliser of what top-k keeps
  if (kk <= support) {
    for (int64_t i = 0; i < kk; ++i) total += std::exp(static_cast<double>(best[i].first - top));
  } else if (kk == V) {
    total = exp_sum(l, V, top);
  } else {
    std::vector<float> copy(l, l + V);
    std::nth_element(copy.begin(), copy.begin() + (kk - 1), copy.end(), std::greater<float>());
    for (int64_t i = 0; i < kk; ++i) total += std::exp(static_cast<double>(copy[i] - top));
  }
  const int64_t limit = std::min(kk, support);
  int64_t kept = 0;
  double before = 0.0, mass = 0.0;
  for (; kept < limit; ++kept) {  // top-p: a token stays while the mass more likely than it is below top_p
    if (kept > 0 && before >= top_p) break;
    const double p = std::exp(static_cast<double>(best[kept].first - top));
    before += p / total, mass += p;
  }
  double cdf = 0.0, pick = uniform * mass;
  int64_t token = best[0].second;
  bool drawn = false;
  for (int64_t i = 0; i < K; ++i) {
    const double p = i < kept ? std::exp(static_cast<double>(best[i].first - top)) : 0.0;
    ids[i] = best[i].second;  // K ≤ V (`markov_block`): distinct ids
    probs[i] = static_cast<float>(p / mass);
    cdf += p;
    if (!drawn && i < kept && cdf > pick) token = best[i].second, drawn = true;
  }
  if (!drawn) token = best[kept - 1].second;  // rounding left u at the very top: the last kept token
  return {token, probs[0]};
}

template <class T>
void run(const torch::Tensor& U, const torch::Tensor& h, const torch::Tensor& anchors, const torch::Tensor& W1,
         const torch::Tensor& W2, const float* conf_w, float conf_b, const Sampling* sampling,
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
      TORCH_CHECK(prev[a] >= 0 && prev[a] < W1.size(0), "markov_block: a token beyond the vocabulary");
      std::memcpy(ep + a * r, w1 + prev[a] * r, r * sizeof(T));
    }
    auto B = dspark::linear(e, W2, std::nullopt);  // [A, V] in the dtype
    const T* bp = reinterpret_cast<const T*>(B.data_ptr());
    at::parallel_for(0, A, 1, [&](int64_t first, int64_t last) {
      std::vector<float> scratch((V + 7) / 8 * 8);
      for (int64_t a = first; a < last; ++a) {
        const int64_t at = a * G + k;
        const auto [arg, p] = !sampling ? peak<T>(up + at * V, bp + a * V, scratch.data(), V)
                                        : draw<T>(up + at * V, bp + a * V, scratch.data(), V, sampling->temp[a],
                                                  sampling->top_k[a], sampling->top_p[a], sampling->uniform[at],
                                                  sampling->K, sampling->ids + at * sampling->K,
                                                  sampling->probs + at * sampling->K);
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

std::vector<torch::Tensor> markov_block(torch::Tensor U, torch::Tensor h, torch::Tensor anchors, torch::Tensor W1,
                                        torch::Tensor W2, std::optional<torch::Tensor> conf_w, double conf_b,
                                        std::optional<torch::Tensor> temperature, std::optional<torch::Tensor> top_k,
                                        std::optional<torch::Tensor> top_p, std::optional<torch::Tensor> uniform,
                                        int64_t max_q) {
  TORCH_CHECK(U.dim() == 3 && U.scalar_type() == torch::kFloat && U.is_contiguous(), "markov_block: U [A, γ, V] fp32");
  TORCH_CHECK(h.dim() == 3 && h.size(0) == U.size(0) && h.size(1) == U.size(1) && h.is_contiguous(),
              "markov_block: h [A, γ, d]");
  TORCH_CHECK(W1.dim() == 2 && W1.is_contiguous() && W1.scalar_type() == h.scalar_type(), "markov_block: W1 [V, r]");
  TORCH_CHECK(anchors.dim() == 1 && anchors.size(0) == U.size(0) && anchors.scalar_type() == torch::kLong,
              "markov_block: anchors [A] int64");
  const int64_t A = U.size(0), G = U.size(1);
  auto a = anchors.contiguous();
  auto tokens = torch::empty({A, G}, a.options());
  auto peaks = torch::empty({A, G}, U.options());
  auto conf = torch::empty({conf_w.has_value() ? A : 0, G}, U.options());
  torch::Tensor cw;
  if (conf_w.has_value()) {
    cw = conf_w->to(torch::kFloat).contiguous();
    TORCH_CHECK(cw.numel() == h.size(2) + W1.size(1), "markov_block: confidence weight of d + r");
  }
  const float* cwp = conf_w.has_value() ? cw.data_ptr<float>() : nullptr;
  // Sampled: every row's knobs and a uniform a step; the q' each step drew from comes back with the tokens.
  const bool sampled = temperature.has_value();
  torch::Tensor t, k, p, u, ids, probs;
  Sampling sampling{};
  if (sampled) {
    TORCH_CHECK(top_k.has_value() && top_p.has_value() && uniform.has_value() && max_q > 0,
                "markov_block: sampling needs top_k, top_p, uniforms and max_q");
    t = temperature->to(torch::kFloat).contiguous(), k = top_k->to(torch::kLong).contiguous();
    p = top_p->to(torch::kFloat).contiguous(), u = uniform->to(torch::kDouble).contiguous();
    TORCH_CHECK(t.numel() == A && k.numel() == A && p.numel() == A && u.numel() == A * G,
                "markov_block: knobs [A], uniforms [A, γ]");
    TORCH_CHECK((t > 0).all().item<bool>(), "markov_block: a sampled row's temperature is > 0");
    // K = min(max_q, V), as `truncate_to_sparse`: past V a column could only repeat an id, and verification's
    // dense q (`densify`) must see every id once.
    const int64_t K = std::min<int64_t>(max_q, U.size(2));
    ids = torch::empty({A, G, K}, a.options()), probs = torch::empty({A, G, K}, U.options());
    sampling = {t.data_ptr<float>(), k.data_ptr<int64_t>(), p.data_ptr<float>(), u.data_ptr<double>(), K,
                ids.data_ptr<int64_t>(), probs.data_ptr<float>()};
  }
  const Sampling* sp = sampled ? &sampling : nullptr;
  if (h.scalar_type() == torch::kBFloat16)
    run<uint16_t>(U, h, a, W1, W2, cwp, static_cast<float>(conf_b), sp, tokens, peaks, conf);
  else {
    TORCH_CHECK(h.scalar_type() == torch::kFloat, "markov_block: bf16 or fp32");
    run<float>(U, h, a, W1, W2, cwp, static_cast<float>(conf_b), sp, tokens, peaks, conf);
  }
  if (sampled) return {tokens, peaks, conf, ids, probs};
  return {tokens, peaks, conf};
}

}  // namespace dspark
