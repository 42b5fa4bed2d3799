// What the project's CPU kernels share: the bf16 rounding torch uses and the entry points bindings.cpp exports.
#pragma once
#include <torch/extension.h>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace dspark {

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch does
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float from_bf16(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> bias);

bool amx_usable();  // amx.cpp: the CPU has AMX-BF16 and the OS lets this process use its tiles
torch::Tensor pack_amx(torch::Tensor w);  // [N, K] → [N/16, K/32, 16, 16, 2]
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor w, const float* bias);

torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor ln1, torch::Tensor qkv_w, std::optional<torch::Tensor> qkv_b,
                            torch::Tensor o_w, std::optional<torch::Tensor> o_b, torch::Tensor ln2,
                            torch::Tensor gate_up_w, std::optional<torch::Tensor> gate_up_b, torch::Tensor down_w,
                            std::optional<torch::Tensor> down_b, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor pos,
                            std::optional<torch::Tensor> visible, std::optional<torch::Tensor> normed,
                            int64_t n_heads, int64_t n_kv, double eps, double scale);

// decoder.cpp: RMSNorm of rows x [N, d] with weight w [d], rounded as the decoder layer's
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);

// decoder.cpp: context rows x [P, d] → their keys (rotated) and values at positions start.. of a cache slot
void context_rows(torch::Tensor x, torch::Tensor kv_w, std::optional<torch::Tensor> kv_b, torch::Tensor cos,
                  torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache, int64_t slot, int64_t start);

// heads.cpp: a block of DSpark's Markov head → tokens [A, γ], peaks [A, γ], confidence logits [A | 0, γ], and
// where sampled the q' of every step: ids [A, γ, K], probs [A, γ, K]
std::vector<torch::Tensor> markov_block(torch::Tensor U, torch::Tensor h, torch::Tensor anchors, torch::Tensor W1,
                                        torch::Tensor W2, std::optional<torch::Tensor> conf_w, double conf_b,
                                        std::optional<torch::Tensor> temperature, std::optional<torch::Tensor> top_k,
                                        std::optional<torch::Tensor> top_p, std::optional<torch::Tensor> uniform,
                                        int64_t max_q);

}  // namespace dspark
