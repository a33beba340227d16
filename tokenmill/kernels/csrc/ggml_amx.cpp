// GGUF blocks (Q4_0, Q4_1, Q8_0; Q4_K, Q5_K) times sixteen activation rows on AMX tiles.
//
// On a CPU with AMX (Intel Sapphire Rapids and later), one TDPBSUD/TDPBSSD multiplies a
// 16 x 32 tile of int8 activations by a 32 x 16 tile of weights into 16 x 16 int32 sums: the
// integer dots of a block for sixteen activation rows and sixteen weight rows at once, where
// the zmm pair kernels (ggml_groups.cpp) spend eight vpdpbusd and sixteen
// broadcasts on four activation rows. The weight tile is the pair kernel's two groups of eight
// rows (the X8 layout), their nibbles unpacked into the tile's VNNI order (row w of the tile:
// four consecutive weights of each of the sixteen rows), once per block for all sixteen
// activation rows.
//
// The outputs are the pair kernel's bits: each block's integer sum is the same integer (exact
// arithmetic, whatever instruction adds it), and the float operations that scale and add it
// are the pair kernel's, in its order. So a batch may take this path for its whole tiles of
// sixteen rows and the pair kernel for the rest, and every output is the same as the pair
// kernel's alone: batch invariance holds across the switch (tests/model/test_gguf_int8.py).
//
// Linux hands a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM);
// where it refuses, or TOKENMILL_AMX=0 is set, or the build has no AMX, amx_pair is
// nullptr and nothing changes.

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <torch/library.h>

#include "ggml_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define TM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tokenmill::ggml {

#if defined(TM_AMX)
namespace {

constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

// Tiles: 0 and 1 activations, 2 and 3 weights, 4 to 7 their sums (macros: the tile
// intrinsics paste their register numbers into assembly text)
#define A0 0
#define A1 1
#define B0 2
#define B1 3
#define C0 4
#define C1 5
#define C2 6
#define C3 7

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig tile_config() {
  TileConfig c;
  for (int t : {A0, A1}) c.rows[t] = 16, c.colsb[t] = QK;       // 16 rows x one block of int8
  for (int t : {B0, B1}) c.rows[t] = QK / 4, c.colsb[t] = 64;   // 8 rows x (16 weight rows x 4 bytes)
  for (int t : {C0, C1, C2, C3}) c.rows[t] = 16, c.colsb[t] = 64;  // 16 x 16 int32
  return c;
}

// The weight tile of one block of two groups (g, and h = g + next), in VNNI order: tile row w
// holds weights 4w..4w+3 of each of the 16 rows (the group layout's unit w, both groups joined).
template <int64_t TYPE>
inline void weight_tile(const uint8_t* g, const uint8_t* h, uint8_t* tile) {
  constexpr int64_t head = TYPE == Q4_1 ? 4 : 2;
  const uint8_t *qs = g + 8 * head, *qh = h + 8 * head;
  if constexpr (TYPE == Q8_0) {
    for (int w = 0; w < 8; ++w) _mm512_store_si512(tile + 64 * w, join(qs + 32 * w, qh + 32 * w));
  } else {  // byte i of a block: weight i in its low nibble, weight 16 + i in its high one
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int w = 0; w < 4; ++w) {
      const __m512i bits = join(qs + 32 * w, qh + 32 * w);
      _mm512_store_si512(tile + 64 * w, _mm512_and_si512(bits, low4));
      _mm512_store_si512(tile + 64 * (4 + w), _mm512_and_si512(_mm512_srli_epi16(bits, 4), low4));
    }
  }
}

// What wide_dot_32 does with a block's integer sums (c: 16 rows x 16 int32), in its order.
template <int64_t TYPE>
inline void scale_block(const uint8_t* g, const uint8_t* h, const int32_t* c, const Act& a, int64_t m0, int64_t b,
                        __m512* acc) {
  const __m512 d = halves16(g, h), mn = TYPE == Q4_1 ? halves16(g + 16, h + 16) : d;
  for (int m = 0; m < 16; ++m) {
    const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * m));
    acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.drow(m0 + m)[b])), sum, acc[m]);
    if constexpr (TYPE == Q4_1) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.srow(m0 + m)[b]), acc[m]);
    if constexpr (TYPE == Q4_0) acc[m] = _mm512_fmadd_ps(d, _mm512_set1_ps(-8.f * a.srow(m0 + m)[b]), acc[m]);
  }
}

// Blocks of tile products run ahead of the float work that scales them: a tile register is
// not renamed, so a product whose sums are read back at once waits on its own store; CHUNK
// blocks' products (rotating over four sum tiles) go first, their sums to a buffer in L1, then
// the float work over the chunk.
constexpr int64_t CHUNK = 8;

// The integer sums of blocks [b0, b0 + nb) of two groups times the 16 activation rows at x (row
// stride `stride`): c[(b - b0) * 256 + m * 16 + r]. `wt` holds the blocks' weight tiles.
template <bool SIGNED>
inline void block_sums(const int8_t* x, int64_t stride, const uint8_t* wt, int64_t nb, int32_t* c) {
#define TM_TILE_BLOCK(j, A, B, C)                                   \
  _tile_loadd(A, x + (j) * QK, stride);                             \
  _tile_loadd(B, wt + (j) * 512, 64);                               \
  _tile_zero(C);                                                    \
  if constexpr (SIGNED) _tile_dpbssd(C, A, B); else _tile_dpbsud(C, A, B); \
  _tile_stored(C, c + (j) * 256, 64);
  int64_t j = 0;
  for (; j + 4 <= nb; j += 4) {
    TM_TILE_BLOCK(j, A0, B0, C0)
    TM_TILE_BLOCK(j + 1, A1, B1, C1)
    TM_TILE_BLOCK(j + 2, A0, B0, C2)
    TM_TILE_BLOCK(j + 3, A1, B1, C3)
  }
  for (; j < nb; ++j) { TM_TILE_BLOCK(j, A0, B0, C0) }
#undef TM_TILE_BLOCK
}

// Two groups (g, g + next) times activation rows m0..m0+15: out[m * 16 + r], r < 8 the first
// group's rows. The tiles must be configured (amx_begin).
template <int64_t TYPE>
void pair_32(const uint8_t* g, int64_t next, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : 34;
  const int64_t nb = a.k / QK;
  const int8_t* x = a.qrow(m0);
  alignas(64) uint8_t wt[CHUNK * 512];
  alignas(64) int32_t c[CHUNK * 256];
  __m512 acc[16];
  for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += CHUNK) {
    const int64_t n = std::min(CHUNK, nb - b0);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* gb = g + 8 * (b0 + j) * bytes;
      weight_tile<TYPE>(gb, gb + next, wt + j * 512);
    }
    block_sums<TYPE == Q8_0>(x + b0 * QK, a.k, wt, n, c);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* gb = g + 8 * (b0 + j) * bytes;
      scale_block<TYPE>(gb, gb + next, c + j * 256, a, m0, b0 + j, acc);
    }
  }
  for (int m = 0; m < 16; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

// Q4_K and Q5_K: a super-block's eight sub-blocks of 32 each a tile product; their integer sums
// scaled by the 6-bit scales in int32 and the mins from the activations' sums, as
// wide_dot_q45_k does (the same integers), then its float operations in its order.
template <bool FIVE>
void pair_q45_k(const uint8_t* g, int64_t next, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = FIVE ? 176 : 144;
  const int64_t nb = a.k / QK_K, stride = a.k;
  const int8_t* x = a.qrow(m0);
  alignas(64) uint8_t wt[2][8 * 64];
  alignas(64) int32_t c[2][16 * 16];
  alignas(32) uint8_t sc[2][64], mn[2][64];
  __m512 acc[16];
  for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, g += 8 * bytes) {
    const uint8_t* h = g + next;
    const __m512 d = halves16(g, h), dmin = halves16(g + 16, h + 16);
    scales_mins_group(g, sc[0], mn[0]);
    scales_mins_group(h, sc[1], mn[1]);
    const uint8_t *qh0 = g + 8 * 16, *qh1 = h + 8 * 16;
    const uint8_t *qs0 = g + 8 * (FIVE ? 48 : 16), *qs1 = h + 8 * (FIVE ? 48 : 16);
    __m512i tot[16];
    for (int m = 0; m < 16; ++m) tot[m] = _mm512_setzero_si512();
    for (int q = 0; q < 4; ++q) {  // sub-blocks 2q (the low nibbles) and 2q + 1 (the high ones)
      for (int w = 0; w < 8; ++w) {
        __m512i l, hb;
        q45_k_units16<FIVE>(qs0, qs1, qh0, qh1, q, w, l, hb);
        _mm512_store_si512(wt[0] + 64 * w, l);
        _mm512_store_si512(wt[1] + 64 * w, hb);
      }
      _tile_loadd(A0, x + b * QK_K + 64 * q, stride);
      _tile_loadd(A1, x + b * QK_K + 64 * q + 32, stride);
      _tile_loadd(B0, wt[0], 64);
      _tile_loadd(B1, wt[1], 64);
      _tile_zero(C0);
      _tile_zero(C1);
      _tile_dpbsud(C0, A0, B0);
      _tile_dpbsud(C1, A1, B1);
      _tile_stored(C0, c[0], 64);
      _tile_stored(C1, c[1], 64);
      const __m512i s0 = _mm512_cvtepu8_epi32(pick8(sc[0] + 16 * q, sc[1] + 16 * q));
      const __m512i s1 = _mm512_cvtepu8_epi32(pick8(sc[0] + 16 * q + 8, sc[1] + 16 * q + 8));
      for (int m = 0; m < 16; ++m)
        tot[m] = _mm512_add_epi32(tot[m], _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(c[0] + 16 * m), s0),
                                                           _mm512_mullo_epi32(_mm512_load_si512(c[1] + 16 * m), s1)));
    }
    __m512i mpair[4];  // (sub-blocks 2i, 2i + 1) of each row's mins, as int16 pairs, both groups
    min_pairs16(mn[0], mn[1], mpair);
    for (int m = 0; m < 16; ++m) {
      const __m512i mins = row_mins16(mpair, a.bsrow(m0 + m) + 16 * b);
      const __m512 dx = _mm512_set1_ps(a.drow(m0 + m)[b]);
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(tot[m]), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(mins), acc[m]);
    }
  }
  for (int m = 0; m < 16; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

bool permitted() {  // the tile state, asked of Linux once per process
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

}  // namespace

AmxPairFn amx_pair(int64_t type) {
  const char* off = std::getenv("TOKENMILL_AMX");  // (read at each product: a test compares both paths)
  if ((off != nullptr && std::strcmp(off, "0") == 0) || !permitted()) return nullptr;
  switch (type) {
    case Q4_0: return pair_32<Q4_0>;
    case Q4_1: return pair_32<Q4_1>;
    case Q8_0: return pair_32<Q8_0>;
    case Q4_K: return pair_q45_k<false>;
    case Q5_K: return pair_q45_k<true>;
    default: return nullptr;
  }
}

void amx_begin() {
  static const TileConfig config = tile_config();
  _tile_loadconfig(&config);
}

void amx_end() { _tile_release(); }

#else

AmxPairFn amx_pair(int64_t) { return nullptr; }
void amx_begin() {}
void amx_end() {}

#endif

}  // namespace tokenmill::ggml

namespace {
// Whether batches of `type` (plain) take the AMX tiles here (this build, this CPU, this process).
bool block_has_tiles(int64_t type) { return tokenmill::ggml::amx_pair(type) != nullptr; }
}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) { m.def("block_has_tiles(int type) -> bool", &block_has_tiles); }
