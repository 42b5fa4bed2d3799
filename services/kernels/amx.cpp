// y[M, N] = x[M, K] · Wᵀ (+ b) in bf16 on AMX tiles, for a weight packed once (services/cpu_kernels.py).
//
// Why: linear.cpp's AVX512-BF16 loop is bound by its dot products from a few rows on (a verify of 8 rows costs
// 2.7x one row); an AMX tile multiply covers 16 rows × 16 outputs × 32 k per instruction, so up to 16 rows a
// linear costs what streaming its weight costs. Target v2's 65 linears on the 2-vCPU Xeon (bf16, 2 threads):
// 1 row 2.3 → 1.4 ms, 8 rows 4.8 → 1.5 ms, 32 rows 15 → 2.2 ms.
//
// Layout: the weight [N, K] is packed as [N/16, K/32, 16, 16, 2] (`pack_amx`): block (n, k) is the B tile of
// outputs 16n..16n+15 and inputs 32k..32k+31 in the pair-interleaved (VNNI) order tdpbf16ps reads.
//
// Exactness: an output's fp32 sum runs over the k blocks in ascending order, one tdpbf16ps each, and a tile
// row's arithmetic does not depend on the tile's other rows; so a row's bits never depend on M, on which rows
// share its tile or on the thread (the batch invariance greedy speculation relies on). They differ from
// linear.cpp's, so a machine serves a weight on one path for all its steps (`amx_usable` decides once).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ops.h"

namespace dspark {
namespace {

constexpr int64_t kTileRows = 16, kTileK = 32, kBlock = kTileRows * kTileK;  // a B tile: 512 bf16 = 1 KB

struct alignas(64) TileConfig {  // palette 1's layout of `ldtilecfg`
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: accumulators C (rows × 16 fp32), 4: rows of x (rows × 32 bf16), 5-7: weight blocks.
__attribute__((target("amx-tile,amx-bf16"))) void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) cfg.rows[t] = rows, cfg.colsb[t] = 64;
  for (int t = 5; t < 8; ++t) cfg.rows[t] = kTileRows, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC 12 does not see ldtilecfg read cfg and drops the stores
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void release() { _tile_release(); }

// Four column blocks (64 outputs) from column block nb on, for the rows x points at: c [rows, 64] fp32.
__attribute__((target("amx-tile,amx-bf16"))) void four_blocks(const uint16_t* x, const uint16_t* w, int64_t K,
                                                               int64_t nb, float* c) {
  const int64_t KB = K / kTileK;
  const uint16_t* b = w + nb * KB * kBlock;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(4, x + kb * kTileK, K * 2);
    _tile_loadd(5, b + kb * kBlock, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + (KB + kb) * kBlock, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + (2 * KB + kb) * kBlock, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + (3 * KB + kb) * kBlock, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, c, 256);
  _tile_stored(1, c + 16, 256);
  _tile_stored(2, c + 32, 256);
  _tile_stored(3, c + 48, 256);
}

// One column block (16 outputs), the same sums: for N not a multiple of 64.
__attribute__((target("amx-tile,amx-bf16"))) void one_block(const uint16_t* x, const uint16_t* w, int64_t K,
                                                             int64_t nb, float* c) {
  const int64_t KB = K / kTileK;
  const uint16_t* b = w + nb * KB * kBlock;
  _tile_zero(0);
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(4, x + kb * kTileK, K * 2);
    _tile_loadd(5, b + kb * kBlock, 64);
    _tile_dpbf16ps(0, 4, 5);
  }
  _tile_stored(0, c, 256);
}

void store(const float* c, const float* bias, uint16_t* y, int64_t rows, int64_t N, int64_t n0, int64_t width) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; ++j) y[r * N + n0 + j] = to_bf16(c[r * 64 + j] + (bias ? bias[n0 + j] : 0.f));
}

}  // namespace

bool amx_usable() {
  static const bool usable = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

torch::Tensor pack_amx(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack_amx: a bf16 weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kTileRows == 0 && K % kTileK == 0, "pack_amx: N a multiple of 16, K of 32");
  return w.contiguous().view({N / 16, 16, K / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

torch::Tensor linear_amx(torch::Tensor x, torch::Tensor w, const float* bias) {
  TORCH_CHECK(amx_usable(), "linear: a packed weight needs AMX");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(),
              "linear: a packed weight runs bf16 rows");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * kTileRows;
  TORCH_CHECK(w.size(1) * kTileK == K && w.size(2) == 16 && w.size(3) == 16 && w.size(4) == 2,
              "linear: x [M, K] and a weight packed [N/16, K/32, 16, 16, 2]");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const auto yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t blocks = N / kTileRows, groups = (blocks + 3) / 4;  // a group: 4 column blocks, 64 outputs
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float c[kTileRows * 64];
    int configured = -1;  // tile configuration is per thread
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {  // the group's weight stays in cache across row tiles
        const int rows = static_cast<int>(std::min(kTileRows, M - m0));
        if (rows != configured) configure(rows), configured = rows;
        const int64_t nb = g * 4, width = std::min<int64_t>(4, blocks - nb);
        if (width == 4) {
          four_blocks(xp + m0 * K, wp, K, nb, c);
        } else {
          for (int64_t i = 0; i < width; ++i) one_block(xp + m0 * K, wp, K, nb + i, c + 16 * i);
        }
        store(c, bias, yp + m0 * N, rows, N, nb * kTileRows, width * kTileRows);
      }
    }
    if (configured >= 0) release();
  });
  return y;
}

}  // namespace dspark
