// Prefill's float GEMM: x [m, k] float32 times a weight [n, k] stored as float32, float16 or
// bfloat16, in float32: the layout of BLIS and of every tuned GEMM.
//
// Why our own: PyTorch's float32 GEMM reached 130-165 GFLOP/s on a 2-core AVX2 EPYC (Zen 3),
// where llama.cpp's own AVX2 tiles ran a 16-bit file's prefill at ~177 (of a ~195 FMA peak), and
// a 16-bit weight had to be upcast into a float32 copy first (kernels/linear.py's slabs). Here a 16-bit weight
// is converted while it is packed, once per call, and never stored as float32 whole.
//
// The shape: x is packed once into tiles of MR = 6 rows, k-major ([k][6]: a step of the inner
// loop reads 6 consecutive floats); the weight, NR = 16 output columns at a time, into panels of
// KC = 256 k-steps, k-major too ([kc][16], converted to float32: 16 KB, L1-resident while every
// row tile passes). The 6 x 16 register tile (12 accumulators, 2 weight vectors, 1 broadcast:
// 15 of the 16 AVX2 registers) does 12 FMAs per 8 loads. Threads split the output columns, a
// block of 4 panels (64 columns) at a time.
//
// Every output element is summed in the same order whatever the call: a chain of FMAs over each
// panel of k (equal panels of at most KC), the panels' sums added in order. Its value depends on
// its own row of x and column of the weight alone, never on the batch it came in or the threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENMILL_GEMM_AVX2 1
#endif

namespace {

using at::Tensor;

constexpr int64_t MR = 6, NR = 16, KC = 256, PANELS = 4;  // a thread's block: PANELS * NR columns
// x's row tiles a pass over a block's panels: 16 x 6 rows x KC k-steps of float32 = 96 KB, which stay in
// L2 while the block's PANELS panels (64 KB) take them in turn (all of x's rows, 512 KB of a 512-token
// prompt, did not: each panel read them again from L3).
constexpr int64_t MT = 8;

// x [m, k] -> ceil(m / MR) tiles of [k][MR] (rows past m zero).
void pack_x(const float* x, int64_t m, int64_t k, float* xp) {
  const int64_t tiles = (m + MR - 1) / MR;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* dst = xp + t * k * MR;
      const int64_t rows = std::min(MR, m - t * MR);
      for (int64_t r = 0; r < MR; ++r) {
        if (r >= rows) {
          for (int64_t i = 0; i < k; ++i) dst[i * MR + r] = 0.f;
          continue;
        }
        const float* src = x + (t * MR + r) * k;
        for (int64_t i = 0; i < k; ++i) dst[i * MR + r] = src[i];
      }
    }
  });
}

inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

#ifdef TOKENMILL_GEMM_AVX2
inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8f(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 registers, one a row, -> 8 registers, one a column (the classic unpack / shuffle / permute).
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

// Weight rows n0 .. n0 + cols (cols <= NR), k-steps k0 .. k0 + kc -> a panel [kc][NR] of float32
// (columns past cols zero).
template <typename W>
void pack_w(const W* w, int64_t k, int64_t n0, int64_t cols, int64_t k0, int64_t kc, float* wp) {
#ifdef TOKENMILL_GEMM_AVX2
  if (cols == NR) {
    int64_t i = 0;
    for (; i + 8 <= kc; i += 8)
      for (int64_t h = 0; h < NR; h += 8) {  // an 8 x 8 square: 8 rows' 8 k-steps
        __m256 r[8];
        for (int j = 0; j < 8; ++j) r[j] = load8f(w + (n0 + h + j) * k + k0 + i);
        transpose8(r);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(wp + (i + j) * NR + h, r[j]);
      }
    for (; i < kc; ++i)
      for (int64_t j = 0; j < NR; ++j) wp[i * NR + j] = to_float(w[(n0 + j) * k + k0 + i]);
    return;
  }
#endif
  for (int64_t i = 0; i < kc; ++i)
    for (int64_t j = 0; j < NR; ++j) wp[i * NR + j] = j < cols ? to_float(w[(n0 + j) * k + k0 + i]) : 0.f;
}

// c[6][16] (row stride ldc) = (FIRST ? 0 : c) + xp[kc][6] * wp[kc][16]: each element's kc products
// summed in one FMA chain from zero, then added to c (a panel's chain, not the whole k's: closer
// to the exact sum, as close as MKL's at k = 2048).
// (Twelve named accumulators: held in an array, GCC spilled them to the stack every step.)
template <bool FIRST>
void tile_6x16(const float* xp, const float* wp, int64_t kc, float* c, int64_t ldc, const float* next) {
#ifdef TOKENMILL_GEMM_AVX2
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#pragma GCC unroll 4
  for (int64_t i = 0; i < kc; ++i, xp += MR, wp += NR) {
    _mm_prefetch(reinterpret_cast<const char*>(next + i * MR), _MM_HINT_T0);  // the next tile's x
    const __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8);
    __m256 a = _mm256_broadcast_ss(xp);
    c00 = _mm256_fmadd_ps(a, w0, c00), c01 = _mm256_fmadd_ps(a, w1, c01);
    a = _mm256_broadcast_ss(xp + 1);
    c10 = _mm256_fmadd_ps(a, w0, c10), c11 = _mm256_fmadd_ps(a, w1, c11);
    a = _mm256_broadcast_ss(xp + 2);
    c20 = _mm256_fmadd_ps(a, w0, c20), c21 = _mm256_fmadd_ps(a, w1, c21);
    a = _mm256_broadcast_ss(xp + 3);
    c30 = _mm256_fmadd_ps(a, w0, c30), c31 = _mm256_fmadd_ps(a, w1, c31);
    a = _mm256_broadcast_ss(xp + 4);
    c40 = _mm256_fmadd_ps(a, w0, c40), c41 = _mm256_fmadd_ps(a, w1, c41);
    a = _mm256_broadcast_ss(xp + 5);
    c50 = _mm256_fmadd_ps(a, w0, c50), c51 = _mm256_fmadd_ps(a, w1, c51);
  }
  const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) {
      float* out = c + r * ldc + 8 * h;
      _mm256_storeu_ps(out, FIRST ? acc[r][h] : _mm256_add_ps(_mm256_loadu_ps(out), acc[r][h]));
    }
#else
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float s = 0.f;
      for (int64_t i = 0; i < kc; ++i) s = std::fma(xp[i * MR + r], wp[i * NR + j], s);
      c[r * ldc + j] = FIRST ? s : c[r * ldc + j] + s;
    }
#endif
}

inline void tile_6x16(const float* xp, const float* wp, int64_t kc, float* c, int64_t ldc, bool first,
                      const float* next) {
  if (first) tile_6x16<true>(xp, wp, kc, c, ldc, next);
  else tile_6x16<false>(xp, wp, kc, c, ldc, next);
}

// Panels a thread takes at a time: PANELS (x is read once per block), fewer where blocks of PANELS
// would leave a thread idle for more than 5% of the call (SmolLM2's 576 columns: 36 panels, 9
// blocks of 4 on 2 threads: 5 against 4).
int64_t panels_per_block(int64_t panels, int64_t threads) {
  for (int64_t per = PANELS; per > 1; per /= 2) {
    const int64_t blocks = (panels + per - 1) / per, rounds = (blocks + threads - 1) / threads;
    if (panels >= 0.95 * static_cast<double>(rounds * threads * per)) return per;
  }
  return 1;
}

template <typename W>
void gemm(const float* xp, const W* w, float* y, int64_t m, int64_t n, int64_t k) {
  const int64_t tiles = (m + MR - 1) / MR, panels = (n + NR - 1) / NR;
  const int64_t per = panels_per_block(panels, at::get_num_threads());
  const int64_t blocks = (panels + per - 1) / per;
  const int64_t step = (k + (k + KC - 1) / KC - 1) / ((k + KC - 1) / KC);  // k in equal panels of <= KC
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> wp(PANELS * KC * NR);
    float edge[MR * NR];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p0 = b * per, p1 = std::min(panels, p0 + per);
      for (int64_t k0 = 0; k0 < k; k0 += step) {
        const int64_t kc = std::min(step, k - k0);
        for (int64_t p = p0; p < p1; ++p)
          pack_w(w, k, p * NR, std::min(NR, n - p * NR), k0, kc, wp.data() + (p - p0) * KC * NR);
        for (int64_t t0 = 0; t0 < tiles; t0 += MT) {  // x's rows a block at a time: L2-resident past the first panel
          for (int64_t p = p0; p < p1; ++p) {
            const int64_t n0 = p * NR, cols = std::min(NR, n - n0);
            const float* panel = wp.data() + (p - p0) * KC * NR;
            for (int64_t t = t0; t < std::min(tiles, t0 + MT); ++t) {
              const int64_t m0 = t * MR, rows = std::min(MR, m - m0);
              const float* xt = xp + t * k * MR + k0 * MR;
              if (rows == MR && cols == NR) {
                tile_6x16(xt, panel, kc, y + m0 * n + n0, n, k0 == 0, xt + k * MR);
                continue;
              }
              for (int64_t r = 0; r < rows; ++r)  // an edge tile, through a full-size scratch one
                std::memcpy(edge + r * NR, y + (m0 + r) * n + n0, cols * sizeof(float));
              tile_6x16(xt, panel, kc, edge, NR, k0 == 0, xt);
              for (int64_t r = 0; r < rows; ++r)
                std::memcpy(y + (m0 + r) * n + n0, edge + r * NR, cols * sizeof(float));
            }
          }
        }
      }
    }
  });
}

// x [m, k] float32 (or bfloat16, widened) @ w[n, k]^T -> [m, n] float32; w float32, float16 or
// bfloat16, contiguous.
Tensor tile_gemm(Tensor x, Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "tile_gemm: expects x [m, k] and w [n, k]");
  TORCH_CHECK(w.is_contiguous(), "tile_gemm: the weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "tile_gemm: x must be float32 or bfloat16");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return y;
  if (k == 0) return y.zero_();
  const Tensor xf = x.contiguous().to(at::kFloat);
  Tensor xp = at::empty({(m + MR - 1) / MR * MR * k}, xf.options());
  pack_x(xf.data_ptr<float>(), m, k, xp.data_ptr<float>());
  float* out = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: gemm(xp.data_ptr<float>(), w.data_ptr<float>(), out, m, n, k); break;
    case at::kHalf: gemm(xp.data_ptr<float>(), w.data_ptr<c10::Half>(), out, m, n, k); break;
    case at::kBFloat16: gemm(xp.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), out, m, n, k); break;
    default: TORCH_CHECK(false, "tile_gemm: the weight must be float32, float16 or bfloat16, not ", w.scalar_type());
  }
  return y;
}

// A float16 weight w [n, k] as bfloat16 [n, 2k]: each row's values rounded to the nearest
// bfloat16, then what that leaves over (exact: float16's 11 significant bits are bfloat16's 8 and a
// remainder of at most 4), kernels/linear.py's split_float16 in one pass, for weights whose halves
// are made per call (a 1B model's do not fit beside it): sixteen values at a time on AVX-512 with
// bfloat16 conversions (the same rounding to nearest even as torch's), one at a time elsewhere.
Tensor float16_halves(Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kHalf && w.is_contiguous(),
              "float16_halves: w must be a contiguous float16 [n, k]");
  const int64_t n = w.size(0), k = w.size(1);
  Tensor out = at::empty({n, 2 * k}, w.options().dtype(at::kBFloat16));
  const c10::Half* src = w.data_ptr<c10::Half>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const c10::Half* a = src + r * k;
      c10::BFloat16 *hi = dst + r * 2 * k, *lo = hi + k;
      int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      for (; i + 16 <= k; i += 16) {
        const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i)));
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
        const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hv)));
      }
#endif
      for (; i < k; ++i) {
        const float v = static_cast<float>(a[i]);
        hi[i] = c10::BFloat16(v);
        lo[i] = c10::BFloat16(v - static_cast<float>(hi[i]));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("tile_gemm(Tensor x, Tensor w) -> Tensor");
  m.def("float16_halves(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("tile_gemm", &tile_gemm);
  m.impl("float16_halves", &float16_halves);
}
