// GGUF's quantised weights in their own blocks, with llama.cpp's integer arithmetic ("int8" mode).
//
// quant_ops.cpp widens every block type at load into one of two float-scaled layouts and multiplies
// in float (exact mode): a Q4_K weight (0.5625 bytes in the file) is read as 0.75 bytes a weight,
// a Q6_K one (0.82) as 1.25. Here a weight stays the bytes of its file, row after row of blocks
// (block_linear's `blocks`: [n, bytes per row] uint8), and a step's activations are quantised once
// per call to signed 8-bit blocks, so each dot product is integer multiply-adds (AVX2 maddubs/madd,
// or VNNI's vpdpbusd/vpdpwssd where the build has AVX512_VNNI or AVX-VNNI) with one float multiply
// per block:
//   - Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32): activations in blocks of 32 with a float scale d
//     (and, for the mins and offsets, d times the block's sum);
//   - Q4_K, Q5_K, Q6_K (super-blocks of 256): activations in blocks of 256 with a float scale and
//     the int16 sums of each 16 (for the K-quants' mins).
// An activation block's scale is its largest magnitude / 127 and its values are x / scale rounded
// half to even (quant/blocks.py's reference rounds the same way, in torch). The products of the
// integers are exact; only the float scaling is rounded, so the kernel and the reference agree to
// float32 rounding.
//
// Every call runs the integer dots, threads splitting the output rows, activation rows in chunks
// of INT8_MAX_ROWS; an output depends on its own activation row alone, so a request's tokens are
// the same whatever it is batched with or however its prompt is chunked. One exception, where
// the machine measured it faster (kernels/gemm_choice.py's block_gemm_rows, passed as gemm_rows):
// a bfloat16 call of gemm_rows rows or more (a prefill) dequantises the weight, a slab of rows at
// a time, into PyTorch's bfloat16 GEMM with the activations rounded to the same 8-bit grid
// (on_int8_grid): the same numbers to bfloat16 rounding, as the float arithmetic's bfloat16 is.
// (On a Zen 4 EPYC the integer dots win at every batch to 512 rows, Q6_K's since its band
// kernel, ggml_bands.cpp: the dequantisation costs more than the bfloat16 GEMM saves.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "ggml_common.h"
#include "ops.h"

// ------------------------------------------------------------------ activations

namespace tokenmill::ggml {

Act quantise(const float* x, int64_t rows, int64_t k, int64_t block, bool sums) {
  Act a;
  quantise_into(a, x, rows, k, block, sums);
  return a;
}

// Row m of x into a (its buffers sized for all the rows).
static void quantise_row(Act& a, const float* x, int64_t m, int64_t k, int64_t block, bool sums) {
  const float* xr = x + m * k;
  int8_t* qr = a.q.data() + m * k;
  for (int64_t b = 0; b < k / block; ++b) {
    const float* xb = xr + b * block;
    float amax = 0.f;
    for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int8_t* qb = qr + b * block;
    for (int64_t i = 0; i < block; ++i) {
      const float v = std::nearbyint(xb[i] * id);  // half to even (the default rounding mode)
      qb[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, v)));
    }
    a.d[m * (k / block) + b] = d;
  }
  if (sums)
    for (int64_t b = 0; b < k / QK; ++b) {
      int sum = 0;
      for (int64_t i = 0; i < QK; ++i) sum += qr[b * QK + i];
      a.s[m * (k / QK) + b] = a.d[m * (k / block) + b] * static_cast<float>(sum);
    }
  if (block == QK_K)
    for (int64_t b = 0; b < k / 16; ++b) {
      int sum = 0;
      for (int64_t i = 0; i < 16; ++i) sum += qr[b * 16 + i];
      a.bsums[m * (k / 16) + b] = static_cast<int16_t>(sum);
    }
}

void quantise_into(Act& a, const float* x, int64_t rows, int64_t k, int64_t block, bool sums) {
  a.k = k;
  a.block = block;
  a.q.resize(rows * k);
  a.d.resize(rows * (k / block));
  if (sums) a.s.resize(rows * (k / QK));
  if (block == QK_K) a.bsums.resize(rows * (k / 16));
  // rows apart on the threads (a prefill's 512 rows of 8192: 3.1 ms on one core of a Zen 4 EPYC,
  // 1.6-2.4 on two, beside 40-50 ms for the product with a 1B model's down projection);
  // inside a parallel region (the decode loop's team) this runs on the calling thread alone
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) quantise_row(a, x, m, k, block, sums);
  });
}

}  // namespace tokenmill::ggml

namespace {

using at::Tensor;
using namespace tokenmill::ggml;

// The K-quants' 6-bit scales and mins of sub-block j (0..7), as llama.cpp packs them in 12 bytes.
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// ------------------------------------------------------------------ dot products

// Each kernel multiplies one weight row by MR (1..4) activation rows from m0, writing out[0..MR):
// the weight's blocks are unpacked once for all of them.

#if defined(TM_AVX2)

// Bit j of 4 bytes as byte j's 0x10 (the fifth bits of Q5_0 and Q5_1, value j's at bit j):
// each byte of the word copied to eight lanes, every bit but its own set in each lane, and the
// lanes that are then all ones are those whose bit was set.
inline __m256i fifth_bits32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  // lane i of 8: every bit but bit i
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the block's 32 weights as bytes (signed only for
// Q8_0). Q4_0's and Q5_0's are unsigned (their nibbles, and Q5's fifth bits): the -8 or -16 is
// taken off once per block, as -8 (-16) d times the activations' block sum (Act::s), so that
// the dot is the unsigned one (one vpdpbusd with VNNI); Q4_1's and Q5_1's min likewise, added.
template <int64_t TYPE>
inline __m256i weights32(const uint8_t* blk) {
  if constexpr (TYPE == Q4_0) return nibbles32(blk + 2);
  if constexpr (TYPE == Q4_1) return nibbles32(blk + 4);
  if constexpr (TYPE == Q5_0) return _mm256_or_si256(nibbles32(blk + 6), fifth_bits32(blk + 2));
  if constexpr (TYPE == Q5_1) return _mm256_or_si256(nibbles32(blk + 8), fifth_bits32(blk + 4));
  return load32(blk + 2);
}

template <int64_t TYPE>
constexpr int64_t bytes32() {  // a block's bytes, for the blocks of 32
  return TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : TYPE == Q5_0 ? 22 : TYPE == Q5_1 ? 24 : 34;
}

template <int64_t TYPE, int MR>
void dot_32(const uint8_t* w, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = bytes32<TYPE>();
  const int64_t nb = a.k / QK;
  __m256 acc[MR];
  float mins[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps(), mins[m] = 0.f;
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    const __m256i qw = weights32<TYPE>(w);
    const float dw = f16(w);
    for (int m = 0; m < MR; ++m) {
      const __m256i qx = load32(a.qrow(m0 + m) + b * QK);
      const __m256i p = TYPE == Q8_0 ? dot_ss(qw, qx) : dot_us(qw, qx);
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.drow(m0 + m)[b]), _mm256_cvtepi32_ps(p), acc[m]);
      if constexpr (TYPE == Q4_1 || TYPE == Q5_1) mins[m] += f16(w + 2) * a.srow(m0 + m)[b];
      if constexpr (TYPE == Q4_0) mins[m] -= 8.f * dw * a.srow(m0 + m)[b];
      if constexpr (TYPE == Q5_0) mins[m] -= 16.f * dw * a.srow(m0 + m)[b];
    }
  }
  for (int m = 0; m < MR; ++m) out[m] = tokenmill::hsum8(acc[m]) + mins[m];
}

// The K-quants' 8 scales and 8 mins of a super-block, unpacked from their 12 bytes into
// bytes 0..7 (scales) and 8..15 (mins) of `u` (llama.cpp's bit shuffle).
inline void scales_mins_k4(const uint8_t* packed, uint32_t u[4]) {
  constexpr uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  std::memcpy(u, packed, 12);
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t mins_lo = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = mins_lo;
  u[0] &= m1;
}

// vpshufb masks broadcasting int16 lane i (of 8) of a register to all 16 lanes: one shuffle per
// sub-block's scale instead of a scalar load and a broadcast.
alignas(32) constexpr uint8_t SCALE_PICK[8][32] = {
#define TM_PICK(i) {2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, \
                    2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, \
                    2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1, 2 * i, 2 * i + 1}
    TM_PICK(0), TM_PICK(1), TM_PICK(2), TM_PICK(3), TM_PICK(4), TM_PICK(5), TM_PICK(6), TM_PICK(7)};
#undef TM_PICK

// Q4_K and Q5_K: super-blocks of 8 sub-blocks of 32, each with a 6-bit scale and min;
// w = d * sc * q - dmin * mn. `FIVE`: Q5_K's fifth bits (qh) come before the nibbles.
template <bool FIVE, int MR>
void dot_q45_k(const uint8_t* w, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = FIVE ? 176 : 144;
  const int64_t nb = a.k / QK_K;
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  __m256 acc[MR];
  __m128 accm[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps(), accm[m] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += bytes) {
    uint32_t u[4];
    scales_mins_k4(w + 4, u);
    const __m128i sc16 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, static_cast<int>(u[1]), static_cast<int>(u[0])));
    const __m256i scales = _mm256_set_m128i(sc16, sc16);  // the 8 scales as int16, in both halves
    const __m128i mins = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, static_cast<int>(u[3]), static_cast<int>(u[2])));
    const float d = f16(w), dmin = f16(w + 2);
    const uint8_t* qs = w + (FIVE ? 48 : 16);
    const __m256i hbits = FIVE ? load32(w + 16) : _mm256_setzero_si256();
    __m256i sumi[MR], sumh[MR];  // two chains of additions (low and high nibbles), not one
    for (int m = 0; m < MR; ++m) sumi[m] = sumh[m] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i bits = load32(qs + 32 * j);
      __m256i lo = _mm256_and_si256(bits, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
      if constexpr (FIVE) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), one), 4));
      }
      const __m256i slo = _mm256_shuffle_epi8(scales, load32(SCALE_PICK[2 * j]));
      const __m256i shi = _mm256_shuffle_epi8(scales, load32(SCALE_PICK[2 * j + 1]));
      for (int m = 0; m < MR; ++m) {
        const int8_t* q = a.qrow(m0 + m) + b * QK_K + 64 * j;
        sumi[m] = dpwssd(sumi[m], _mm256_maddubs_epi16(lo, load32(q)), slo);
        sumh[m] = dpwssd(sumh[m], _mm256_maddubs_epi16(hi, load32(q + 32)), shi);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const float dx = a.drow(m0 + m)[b];
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(_mm256_add_epi32(sumi[m], sumh[m])), acc[m]);
      const __m128i bs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bsrow(m0 + m) + 16 * b));
      const __m128i bs2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bsrow(m0 + m) + 16 * b + 8));
      const __m128i prod = _mm_madd_epi16(mins, _mm_hadd_epi16(bs, bs2));  // sums of 32, times the mins
      accm[m] = _mm_fmadd_ps(_mm_set1_ps(dmin * dx), _mm_cvtepi32_ps(prod), accm[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    __m128 s = accm[m];
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[m] = tokenmill::hsum8(acc[m]) - _mm_cvtss_f32(s);
  }
}

// Q6_K: super-blocks of 16 sub-blocks of 16, signed 8-bit scales; w = d * sc * (q - 32). The
// unsigned q (0..63) multiply the activations; the -32 is one correction per super-block,
// 32 * sum(sc * the activations' sums of 16), as llama.cpp takes it from the bsums. Each
// super-block's integer sum is exact, then one float step: acc = fma(d * dx, sum, acc).
//
// One super-block's exact integer sums for activation rows m0.. m0 + MR - 1, each as 8 int32 lanes.
template <int MR>
inline void q6_k_sums(const uint8_t* w, const Act& a, int64_t m0, int64_t b, __m256i tot[MR]) {
  const uint8_t *ql = w, *qh = w + 128;
  const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192));
  const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);  // the 16 scales as int16
  __m256i sumi[2][MR];  // a chain of additions per half
  for (int m = 0; m < MR; ++m) {  // the -32: -32 * sum(scale * the activations' sum of its 16)
    sumi[0][m] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                  _mm256_slli_epi32(_mm256_madd_epi16(sc16, load32(a.bsrow(m0 + m) + 16 * b)), 5));
    sumi[1][m] = _mm256_setzero_si256();
  }
  for (int h = 0; h < 2; ++h) {  // two halves of 128
    const __m256i l0 = load32(ql + 64 * h), l1 = load32(ql + 64 * h + 32), hb = load32(qh + 32 * h);
    const __m256i half_sc = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(h ? _mm_unpackhi_epi64(sc8, sc8) : sc8));
    __m256i v[4];
    q6_k_half(l0, l1, hb, v);
    for (int g = 0; g < 4; ++g) {  // 32 values: sub-blocks 8h + 2g and 8h + 2g + 1
      const __m256i s = _mm256_shuffle_epi8(half_sc, load32(Q6_PICK[g]));
      for (int m = 0; m < MR; ++m) {
        const __m256i x = load32(a.qrow(m0 + m) + b * QK_K + 128 * h + 32 * g);
        sumi[h][m] = dpwssd(sumi[h][m], _mm256_maddubs_epi16(v[g], x), s);
      }
    }
  }
  for (int m = 0; m < MR; ++m) tot[m] = _mm256_add_epi32(sumi[0][m], sumi[1][m]);
}

// Four int32 vectors' lane sums, as floats (exact integers converted once, as the band kernel's).
inline __m128 sum4(const __m256i t[4]) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
  return _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

// How far ahead a row alone asks for its weight's bytes: a Zen 1 EPYC's hardware prefetcher left the
// one-row kernel waiting on memory (14 GOP/s a thread from memory where it ran 18 in cache; 1, 2 and
// 4 KiB ahead measured, 4 the best).
constexpr int64_t Q6_PREFETCH = 4096;

template <int MR>
void dot_q6_k(const uint8_t* w, const Act& a, int64_t m0, float* out) {
  const int64_t nb = a.k / QK_K;
  if constexpr (MR == 1) {
    // One row: four super-blocks' sums reduced together, their float steps in order after. The
    // accumulator's chain (one fma a super-block) stays in a register, apart from the integer work
    // (reduced one super-block at a time, its hsum and the chain through memory held a Zen 1 back).
    const float* dx = a.drow(m0);
    float acc = 0.f;
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
      const char* ahead = reinterpret_cast<const char*>(w + 210 * b) + Q6_PREFETCH;
      for (int line = 0; line < 840; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      __m256i tot[4];
      for (int i = 0; i < 4; ++i) q6_k_sums<1>(w + 210 * (b + i), a, m0, b + i, &tot[i]);
      __m128 sums = sum4(tot);
      for (int i = 0; i < 4; ++i) {
        acc = std::fma(f16(w + 210 * (b + i) + 208) * dx[b + i], _mm_cvtss_f32(sums), acc);
        sums = _mm_shuffle_ps(sums, sums, _MM_SHUFFLE(0, 3, 2, 1));
      }
    }
    for (; b < nb; ++b) {
      __m256i tot;
      q6_k_sums<1>(w + 210 * b, a, m0, b, &tot);
      acc = std::fma(f16(w + 210 * b + 208) * dx[b], static_cast<float>(hsum_i32(tot)), acc);
    }
    out[0] = acc;
  } else {
    // each row's exact sum (four rows' at once), then the band kernel's float step: the same bits
    float acc[MR] = {};
    for (int64_t b = 0; b < nb; ++b, w += 210) {
      __m256i tot[4];
      q6_k_sums<MR>(w, a, m0, b, tot);
      for (int m = MR; m < 4; ++m) tot[m] = _mm256_setzero_si256();
      alignas(16) float sums[4];
      _mm_store_ps(sums, sum4(tot));
      const float d = f16(w + 208);
      for (int m = 0; m < MR; ++m) acc[m] = std::fma(d * a.drow(m0 + m)[b], sums[m], acc[m]);
    }
    for (int m = 0; m < MR; ++m) out[m] = acc[m];
  }
}

#else  // no AVX2: the same integer sums, one activation row at a time

template <int64_t TYPE, int MR>
void dot_32(const uint8_t* w0, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : TYPE == Q5_0 ? 22 : TYPE == Q5_1 ? 24 : 34;
  for (int m = 0; m < MR; ++m) {
    const int8_t* q = a.qrow(m0 + m);
    const float* d = a.drow(m0 + m);
    float sum = 0.f;
    const uint8_t* w = w0;
    for (int64_t b = 0; b < a.k / QK; ++b, w += bytes) {
      int t = 0;
      for (int i = 0; i < 16; ++i) {
        int lo, hi;
        if constexpr (TYPE == Q8_0) lo = static_cast<int8_t>(w[2 + i]), hi = static_cast<int8_t>(w[18 + i]);
        else if constexpr (TYPE == Q4_0) lo = (w[2 + i] & 0xF) - 8, hi = (w[2 + i] >> 4) - 8;
        else if constexpr (TYPE == Q4_1) lo = w[4 + i] & 0xF, hi = w[4 + i] >> 4;
        else {  // Q5_0 (values - 16) and Q5_1: the fifth bits in the 4 bytes before the nibbles
          const int64_t at = TYPE == Q5_0 ? 2 : 4;
          uint32_t qh;
          std::memcpy(&qh, w + at, 4);
          lo = (w[at + 4 + i] & 0xF) | (((qh >> i) & 1) << 4);
          hi = (w[at + 4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
          if constexpr (TYPE == Q5_0) lo -= 16, hi -= 16;
        }
        t += lo * q[b * QK + i] + hi * q[b * QK + 16 + i];
      }
      sum += f16(w) * d[b] * static_cast<float>(t);
      if constexpr (TYPE == Q4_1 || TYPE == Q5_1) sum += f16(w + 2) * a.srow(m0 + m)[b];
    }
    out[m] = sum;
  }
}

template <bool FIVE, int MR>
void dot_q45_k(const uint8_t* w0, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = FIVE ? 176 : 144;
  for (int m = 0; m < MR; ++m) {
    const int8_t* q = a.qrow(m0 + m);
    const float* d = a.drow(m0 + m);
    const int16_t* bs = a.bsrow(m0 + m);
    float sum = 0.f;
    const uint8_t* w = w0;
    for (int64_t b = 0; b < a.k / QK_K; ++b, w += bytes, q += QK_K, bs += 16) {
      int sc[8], mn[8], t = 0, summ = 0;
      for (int j = 0; j < 8; ++j) scale_min_k4(j, w + 4, sc[j], mn[j]);
      for (int j = 0; j < 8; ++j) summ += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
      const uint8_t* qs = w + (FIVE ? 48 : 16);
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
          if constexpr (FIVE) {
            lo |= ((w[16 + l] >> (2 * j)) & 1) << 4;
            hi |= ((w[16 + l] >> (2 * j + 1)) & 1) << 4;
          }
          t += sc[2 * j] * lo * q[64 * j + l] + sc[2 * j + 1] * hi * q[64 * j + 32 + l];
        }
      sum += f16(w) * d[b] * static_cast<float>(t) - f16(w + 2) * d[b] * static_cast<float>(summ);
    }
    out[m] = sum;
  }
}

template <int MR>
void dot_q6_k(const uint8_t* w0, const Act& a, int64_t m0, float* out) {
  for (int m = 0; m < MR; ++m) {
    const int8_t* q = a.qrow(m0 + m);
    const float* d = a.drow(m0 + m);
    float sum = 0.f;
    const uint8_t* w = w0;
    for (int64_t b = 0; b < a.k / QK_K; ++b, w += 210, q += QK_K) {
      const uint8_t *ql = w, *qh = w + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      int t = 0;
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const uint8_t L0 = ql[64 * h + l], L1 = ql[64 * h + 32 + l], H = qh[32 * h + l];
          const int v0 = ((L0 & 0xF) | ((H & 3) << 4)) - 32, v1 = ((L1 & 0xF) | (((H >> 2) & 3) << 4)) - 32;
          const int v2 = ((L0 >> 4) | (((H >> 4) & 3) << 4)) - 32, v3 = ((L1 >> 4) | (((H >> 6) & 3) << 4)) - 32;
          const int is = 8 * h + l / 16;
          t += sc[is] * v0 * q[128 * h + l] + sc[is + 2] * v1 * q[128 * h + 32 + l] +
               sc[is + 4] * v2 * q[128 * h + 64 + l] + sc[is + 6] * v3 * q[128 * h + 96 + l];
        }
      sum = std::fma(f16(w + 208) * d[b], static_cast<float>(t), sum);  // (the AVX2 kernel's steps)
    }
    out[m] = sum;
  }
}
#endif

using DotFn = void (*)(const uint8_t*, const Act&, int64_t, float*);

template <int MR>
DotFn dot_of(int64_t type) {
  switch (type) {
    case Q4_0: return dot_32<Q4_0, MR>;
    case Q4_1: return dot_32<Q4_1, MR>;
    case Q5_0: return dot_32<Q5_0, MR>;
    case Q5_1: return dot_32<Q5_1, MR>;
    case Q8_0: return dot_32<Q8_0, MR>;
    case Q4_K: return dot_q45_k<false, MR>;
    case Q5_K: return dot_q45_k<true, MR>;
    default: return dot_q6_k<MR>;
  }
}

int64_t check_blocks(const Tensor& blocks, int64_t type, int64_t k);

}  // namespace

namespace tokenmill::ggml {

BlockProduct::BlockProduct(const Tensor& blocks, int64_t type, int64_t k)
    : w_(nullptr), type_(type), n_(check_blocks(blocks, type, k)), k_(k), row_bytes_(blocks.size(1)) {
  w_ = blocks.data_ptr<uint8_t>();
  const int64_t plain = type & ~X8;
  groups_ = type & X8 ? n_ / 8 : 0;  // groups of eight rows, then single rows
  dots_[0] = dot_of<1>(plain), dots_[1] = dot_of<2>(plain), dots_[2] = dot_of<3>(plain), dots_[3] = dot_of<4>(plain);
  if (groups_ > 0)
    for (int mr = 1; mr <= 4; ++mr) {
      group_dots_[mr - 1] = group_dot(plain, mr);
      wide_dots_[mr - 1] = wide_group_dot(plain, mr);  // (none on AVX2 builds)
    }
  if (groups_ > 0 && wide_dots_[0] != nullptr) amx_ = amx_pair(plain);
}

// Q6_K chunks of at least this many activation rows take the band kernel (ggml_bands.cpp), a last
// band with fewer left to the row kernel: the same bits either way.
constexpr int64_t BAND_MIN_ROWS = 8;

void BlockProduct::quantise(const float* x, int64_t rows) {
  const int64_t plain = type_ & ~X8;
  quantise_into(act_, x, rows, k_, format_of(type_).elems, plain == Q4_1 || plain == Q4_0 || plain == Q5_0 || plain == Q5_1);
  bands_.count = 0;
  if (type_ == Q6_K && rows >= BAND_MIN_ROWS && has_bands()) make_bands(bands_, act_, rows);
}

constexpr int64_t WIDE_MIN_ROWS = 16;

void BlockProduct::run(float* out, int64_t ld, int64_t m0, int64_t m1, int64_t u0, int64_t u1) const {
  if (bands_.count > 0 && m0 % BAND == 0 && u1 > u0) {  // (Q6_K: its units are its rows)
    const int64_t whole = m0 + (m1 - m0) / BAND * BAND, banded = m1 - whole >= BAND_MIN_ROWS ? m1 : whole;
    if (banded > m0) q6_k_bands(w_ + u0 * row_bytes_, row_bytes_, u1 - u0, bands_, m0, banded, out + u0, ld);
    m0 = banded;
  }
  float part[4 * 16];
  // whole tiles of 16 activation rows on AMX where the CPU has it (the pair kernel's bits)
  const bool tiles = amx_ != nullptr && m1 - m0 >= 16;
  alignas(64) float tile_part[16 * 16];
  if (tiles) amx_begin();
  for (int64_t u = u0; u < u1; ++u) {
    // two groups in one pass, for batches: at decode's few rows a pass reads two streams of
    // the weight where one group reads one, and from memory that ran slower (Zen 4 EPYC, a
    // Q4_1 weight set of 90 MB: 4 rows 8-13 GB/s against 11-17); from 16 rows the arithmetic
    // is what limits, and the pair does it in half the instructions
    if (m1 - m0 >= WIDE_MIN_ROWS && u + 1 < groups_ && u + 1 < u1 && wide_dots_[0] != nullptr) {
      const uint8_t* wg = w_ + u * 8 * row_bytes_;
      int64_t m = m0;
      for (; tiles && m + 16 <= m1; m += 16) {
        amx_(wg, 8 * row_bytes_, act_, m, tile_part);
        for (int i = 0; i < 16; ++i)
          std::memcpy(out + (m + i) * ld + 8 * u, tile_part + 16 * i, 16 * sizeof(float));
      }
      for (; m < m1; m += 4) {
        const int mr = static_cast<int>(std::min<int64_t>(4, m1 - m));
        wide_dots_[mr - 1](wg, 8 * row_bytes_, act_, m, part);
        for (int i = 0; i < mr; ++i) std::memcpy(out + (m + i) * ld + 8 * u, part + 16 * i, 16 * sizeof(float));
      }
      ++u;
      continue;
    }
    if (u < groups_) {
      const uint8_t* wg = w_ + u * 8 * row_bytes_;
      for (int64_t m = m0; m < m1; m += 4) {
        const int mr = static_cast<int>(std::min<int64_t>(4, m1 - m));
        group_dots_[mr - 1](wg, act_, m, part);
        for (int i = 0; i < mr; ++i) std::memcpy(out + (m + i) * ld + 8 * u, part + 8 * i, 8 * sizeof(float));
      }
      continue;
    }
    const int64_t r = 8 * groups_ + (u - groups_);
    const uint8_t* wr = w_ + r * row_bytes_;
    for (int64_t m = m0; m < m1; m += 4) {
      const int mr = static_cast<int>(std::min<int64_t>(4, m1 - m));
      dots_[mr - 1](wr, act_, m, part);
      for (int i = 0; i < mr; ++i) out[(m + i) * ld + r] = part[i];
    }
  }
  if (tiles) amx_end();
}

}  // namespace tokenmill::ggml

namespace {


// ------------------------------------------------------------------ dequantisation, one row

template <typename Out>
void dequantize_row(const uint8_t* w, int64_t type, int64_t k, Out* y) {
  const int64_t nb = k / format_of(type).elems;
  for (int64_t b = 0; b < nb; ++b) {
    if (type == Q4_0 || type == Q4_1) {
      const bool one = type == Q4_1;
      const uint8_t* blk = w + b * (one ? 20 : 18);
      const float d = f16(blk), mn = one ? f16(blk + 2) : -8.f * d;
      const uint8_t* qs = blk + (one ? 4 : 2);
      for (int i = 0; i < 16; ++i) {
        y[b * QK + i] = static_cast<Out>(d * (qs[i] & 0xF) + mn);
        y[b * QK + 16 + i] = static_cast<Out>(d * (qs[i] >> 4) + mn);
      }
    } else if (type == Q5_0 || type == Q5_1) {
      const bool one = type == Q5_1;
      const uint8_t* blk = w + b * (one ? 24 : 22);
      const float d = f16(blk), mn = one ? f16(blk + 2) : -16.f * d;
      uint32_t qh;
      std::memcpy(&qh, blk + (one ? 4 : 2), 4);
      const uint8_t* qs = blk + (one ? 8 : 6);
      for (int i = 0; i < 16; ++i) {
        y[b * QK + i] = static_cast<Out>(d * ((qs[i] & 0xF) | (((qh >> i) & 1) << 4)) + mn);
        y[b * QK + 16 + i] = static_cast<Out>(d * ((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) + mn);
      }
    } else if (type == Q8_0) {
      const uint8_t* blk = w + b * 34;
      const float d = f16(blk);
      for (int i = 0; i < QK; ++i) y[b * QK + i] = static_cast<Out>(d * static_cast<int8_t>(blk[2 + i]));
    } else if (type == Q4_K || type == Q5_K) {
      const bool five = type == Q5_K;
      const uint8_t* blk = w + b * (five ? 176 : 144);
      const float d = f16(blk), dmin = f16(blk + 2);
      const uint8_t* qs = blk + (five ? 48 : 16);
      Out* yb = y + b * QK_K;
      for (int j = 0; j < 4; ++j) {
        int sc0, mn0, sc1, mn1;
        scale_min_k4(2 * j, blk + 4, sc0, mn0);
        scale_min_k4(2 * j + 1, blk + 4, sc1, mn1);
        const float d0 = d * sc0, m0 = dmin * mn0, d1 = d * sc1, m1 = dmin * mn1;
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
          if (five) {
            lo |= ((blk[16 + l] >> (2 * j)) & 1) << 4;
            hi |= ((blk[16 + l] >> (2 * j + 1)) & 1) << 4;
          }
          yb[64 * j + l] = static_cast<Out>(d0 * lo - m0);
          yb[64 * j + 32 + l] = static_cast<Out>(d1 * hi - m1);
        }
      }
    } else {  // Q6_K
      const uint8_t* blk = w + b * 210;
      const uint8_t *ql = blk, *qh = blk + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float d = f16(blk + 208);
      Out* yb = y + b * QK_K;
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const uint8_t L0 = ql[64 * h + l], L1 = ql[64 * h + 32 + l], H = qh[32 * h + l];
          const int is = 8 * h + l / 16;
          yb[128 * h + l] = static_cast<Out>(d * sc[is] * (((L0 & 0xF) | ((H & 3) << 4)) - 32));
          yb[128 * h + 32 + l] = static_cast<Out>(d * sc[is + 2] * (((L1 & 0xF) | (((H >> 2) & 3) << 4)) - 32));
          yb[128 * h + 64 + l] = static_cast<Out>(d * sc[is + 4] * (((L0 >> 4) | (((H >> 4) & 3) << 4)) - 32));
          yb[128 * h + 96 + l] = static_cast<Out>(d * sc[is + 6] * (((L1 >> 4) | (((H >> 6) & 3) << 4)) - 32));
        }
    }
  }
}

int64_t check_blocks(const Tensor& blocks, int64_t type, int64_t k) {
  const Format f = format_of(type);
  TORCH_CHECK(!(type & X8) || has_groups(type & ~X8), "block_linear: GGML type ", type & ~X8,
              " has no eight-row layout");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "block_linear: blocks must be contiguous uint8 [n, bytes per row]");
  TORCH_CHECK(k % f.elems == 0 && blocks.size(1) == k / f.elems * f.bytes, "block_linear: a row of ", k,
              " weights of GGML type ", type, " is ", k / f.elems * f.bytes, " bytes, not ", blocks.size(1));
  return blocks.size(0);
}

// Grouped rows [r0, r1) (whole groups of eight) of a Q4_0, Q4_1 or Q8_0 weight as bfloat16, out
// [r1 - r0, k]: dequantize_row's numbers for the GEMM of long prefills, sixteen at a time
// (each row's block bytes gathered from its group's units). The scalar path took 36 ms for a
// 1B model's 8192 x 2048 MLP weight on a Sapphire Rapids class Xeon, longer than the bfloat16
// GEMM it feeds (24 ms at 512 rows); this one a few.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool FAST_GROUP_DEQUANT = true;
#define TM_Q4K_SCALE(d, q, m) _mm512_fmsub_ps(d, q, m)  // (the scalar d * q - m, contracted by the compiler)
inline __m128i unit_gather4(const uint8_t* field, int64_t r, int64_t e0) {  // units e0..e0+3 of row r
  int32_t u[4];
  for (int e = 0; e < 4; ++e) std::memcpy(&u[e], field + (8 * (e0 + e) + r) * 4, 4);
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
}
inline void store16_bf16(c10::BFloat16* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
}
void dequantize_groups_bf16(const uint8_t* w, int64_t type, int64_t row_bytes, int64_t r0, int64_t r1, int64_t k,
                            c10::BFloat16* out) {
  const Format f = format_of(type);
  const int64_t nb = k / QK, head = type == Q4_1 ? 4 : 2;
  at::parallel_for(r0 / 8, r1 / 8, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + g * 8 * row_bytes + 8 * b * f.bytes;  // block b of the group's eight rows
        for (int64_t r = 0; r < 8; ++r) {
          c10::BFloat16* y = out + (8 * g + r - r0) * k + b * QK;
          const __m512 d = _mm512_set1_ps(f16(blk + 2 * r));
          if (type == Q8_0) {
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(unit_gather4(blk + 8 * head, r, 0)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(unit_gather4(blk + 8 * head, r, 4)));
            store16_bf16(y, _mm512_mul_ps(d, lo));
            store16_bf16(y + 16, _mm512_mul_ps(d, hi));
          } else {
            const __m512 mn = type == Q4_1 ? _mm512_set1_ps(f16(blk + 16 + 2 * r)) : _mm512_mul_ps(_mm512_set1_ps(-8.f), d);
            const __m128i bytes = unit_gather4(blk + 8 * head, r, 0);
            const __m128i low4 = _mm_set1_epi8(0x0F);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
            store16_bf16(y, _mm512_fmadd_ps(d, lo, mn));
            store16_bf16(y + 16, _mm512_fmadd_ps(d, hi, mn));
          }
        }
      }
  });
}

// The same for grouped Q4_K rows: each row's 12 scale bytes and 128 nibble bytes gathered from
// the group's fields (d, dmin, scales in units of 1, nibbles in units of 4), dequantize_row's
// operations on sixteen values at a time.
void dequantize_groups_q4_k_bf16(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t k,
                                 c10::BFloat16* out) {
  const int64_t nb = k / QK_K;
  at::parallel_for(r0 / 8, r1 / 8, 1, [&](int64_t g0, int64_t g1) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + g * 8 * row_bytes + 8 * b * 144;
        for (int64_t r = 0; r < 8; ++r) {
          c10::BFloat16* y = out + (8 * g + r - r0) * k + b * QK_K;
          const float d = f16(blk + 2 * r), dmin = f16(blk + 16 + 2 * r);
          uint8_t scales[12];
          for (int e = 0; e < 12; ++e) scales[e] = blk[32 + 8 * e + r];
          for (int j = 0; j < 4; ++j) {
            int sc0, mn0, sc1, mn1;
            scale_min_k4(2 * j, scales, sc0, mn0);
            scale_min_k4(2 * j + 1, scales, sc1, mn1);
            const __m512 d0 = _mm512_set1_ps(d * sc0), m0 = _mm512_set1_ps(dmin * mn0);
            const __m512 d1 = _mm512_set1_ps(d * sc1), m1 = _mm512_set1_ps(dmin * mn1);
            for (int h = 0; h < 2; ++h) {  // bytes 32j + 16h .. + 15: units 8j + 4h .. + 3
              const __m128i bytes = unit_gather4(blk + 128, r, 8 * j + 4 * h);
              const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4)));
              const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4)));
              store16_bf16(y + 64 * j + 16 * h, TM_Q4K_SCALE(d0, lo, m0));
              store16_bf16(y + 64 * j + 32 + 16 * h, TM_Q4K_SCALE(d1, hi, m1));
            }
          }
        }
      }
  });
}

// Q6_K rows [r0, r1) (plain rows: its weights are not grouped) as bfloat16, dequantize_row's
// operations (d * sc, then times q - 32) on sixteen values at a time: the scalar loop made the
// bfloat16 GEMM lose to the integer dots below 512 rows (a 1B model's 2048 x 8192 down
// projection: 5.5 ms at 128 rows against 2.5).
void dequantize_rows_q6_k_bf16(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t k,
                               c10::BFloat16* out) {
  const int64_t nb = k / QK_K;
  at::parallel_for(r0, r1, 4, [&](int64_t b0, int64_t b1) {
    const __m128i low4 = _mm_set1_epi8(0x0F), low2 = _mm_set1_epi8(0x03);
    const __m512i bias = _mm512_set1_epi32(32);
    auto put = [&](c10::BFloat16* y, float ds, __m128i q) {  // y[0..15] = ds * (q - 32)
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(q), bias));
      store16_bf16(y, _mm512_mul_ps(_mm512_set1_ps(ds), v));
    };
    for (int64_t r = b0; r < b1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + r * row_bytes + b * 210;
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = f16(blk + 208);
        c10::BFloat16* yb = out + (r - r0) * k + b * QK_K;
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < 2; ++c) {  // l = 16c .. 16c + 15
            const __m128i L0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 64 * h + 16 * c));
            const __m128i L1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 64 * h + 32 + 16 * c));
            const __m128i H = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + 32 * h + 16 * c));
            const int is = 8 * h + c;
            const __m128i h0 = _mm_slli_epi16(_mm_and_si128(H, low2), 4);
            const __m128i h1 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(H, 2), low2), 4);
            const __m128i h2 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(H, 4), low2), 4);
            const __m128i h3 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(H, 6), low2), 4);
            c10::BFloat16* y = yb + 128 * h + 16 * c;
            put(y, d * sc[is], _mm_or_si128(_mm_and_si128(L0, low4), h0));
            put(y + 32, d * sc[is + 2], _mm_or_si128(_mm_and_si128(L1, low4), h1));
            put(y + 64, d * sc[is + 4], _mm_or_si128(_mm_and_si128(_mm_srli_epi16(L0, 4), low4), h2));
            put(y + 96, d * sc[is + 6], _mm_or_si128(_mm_and_si128(_mm_srli_epi16(L1, 4), low4), h3));
          }
      }
  });
}
#else
constexpr bool FAST_GROUP_DEQUANT = false;
void dequantize_groups_bf16(const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, c10::BFloat16*) {}
void dequantize_groups_q4_k_bf16(const uint8_t*, int64_t, int64_t, int64_t, int64_t, c10::BFloat16*) {}
void dequantize_rows_q6_k_bf16(const uint8_t*, int64_t, int64_t, int64_t, int64_t, c10::BFloat16*) {}
#endif

// Rows `ids` (all when absent) of a block weight [n, k] as float32, or bfloat16 when `bf16`.
Tensor block_dequantize(Tensor blocks, int64_t type, int64_t k, c10::optional<Tensor> ids, bool bf16) {
  const int64_t n = check_blocks(blocks, type, k);
  Tensor idc;
  const int64_t* id = nullptr;
  int64_t rows = n;
  if (ids.has_value()) {
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->dim() == 1, "block_dequantize: ids must be int64 [rows]");
    idc = ids->contiguous();
    id = idc.data_ptr<int64_t>();
    rows = idc.numel();
    for (int64_t i = 0; i < rows; ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < n, "block_dequantize: row ", id[i], " out of range [0, ", n, ")");
  }
  Tensor out = at::empty({rows, k}, blocks.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1), plain = type & ~X8;
  int64_t first = 0;  // the rows before it dequantised group by group, where that is fast
  if (FAST_GROUP_DEQUANT && bf16 && id == nullptr && (type & X8) && (plain == Q4_0 || plain == Q4_1 || plain == Q8_0)) {
    first = n / 8 * 8;
    dequantize_groups_bf16(w, plain, row_bytes, 0, first, k, out.data_ptr<c10::BFloat16>());
  } else if (FAST_GROUP_DEQUANT && bf16 && id == nullptr && type == (Q4_K | X8)) {
    first = n / 8 * 8;
    dequantize_groups_q4_k_bf16(w, row_bytes, 0, first, k, out.data_ptr<c10::BFloat16>());
  } else if (FAST_GROUP_DEQUANT && bf16 && id == nullptr && type == Q6_K) {
    first = n;
    dequantize_rows_q6_k_bf16(w, row_bytes, 0, n, k, out.data_ptr<c10::BFloat16>());
  }
  at::parallel_for(first, rows, 4, [&](int64_t b, int64_t e) {
    std::vector<uint8_t> scratch(row_bytes);  // a row taken out of its group of eight
    for (int64_t i = b; i < e; ++i) {
      const uint8_t* src = plain_row(w, type, n, row_bytes, id ? id[i] : i, scratch.data());
      if (bf16) dequantize_row(src, type & ~X8, k, out.data_ptr<c10::BFloat16>() + i * k);
      else dequantize_row(src, type & ~X8, k, out.data_ptr<float>() + i * k);
    }
  });
  return out;
}

// The activations the integer dots multiply, as floats: each block's values rounded to the 8-bit
// grid of its scale (q * d, quantise's q and d, in torch ops), for the bfloat16 GEMM of long
// prefills to multiply the numbers the integer dots would.
Tensor on_int8_grid(const Tensor& xf, int64_t block) {
  const int64_t rows = xf.size(0), k = xf.size(1);
  const Tensor xb = xf.view({rows, k / block, block});
  const Tensor d = xb.abs().amax(-1, true) / 127;
  const Tensor inv = at::where(d != 0, d.reciprocal(), at::zeros_like(d));
  return (at::round(xb * inv).clamp(-127, 127) * d).view({rows, k});
}

// on_int8_grid of x [rows, k] (float32 or bfloat16) as bfloat16, for blocks of 32: the same
// operations (IEEE division, multiplication, rounding half to even, clamp), sixteen lanes at a
// time where the build has AVX-512 (seven passes of torch ops took 0.8 ms on 512 x 576, as
// long as the GEMM after them).
Tensor int8_grid_bf16(const Tensor& x, int64_t block) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (block == QK) {
    const Tensor xf = x.contiguous().to(at::kFloat);
    const int64_t rows = xf.size(0), k = xf.size(1);
    Tensor out = at::empty({rows, k}, xf.options().dtype(at::kBFloat16));
    const float* src = xf.data_ptr<float>();
    c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
    at::parallel_for(0, rows * (k / QK), 64, [&](int64_t b0, int64_t b1) {
      const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
      for (int64_t b = b0; b < b1; ++b) {
        const __m512 v0 = _mm512_loadu_ps(src + b * QK), v1 = _mm512_loadu_ps(src + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
        const __m512 vd = _mm512_set1_ps(d), vi = _mm512_set1_ps(inv);
        for (int h = 0; h < 2; ++h) {
          const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(h ? v1 : v0, vi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          const __m512 g = _mm512_mul_ps(_mm512_min_ps(_mm512_max_ps(q, lo), hi), vd);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * QK + 16 * h), (__m256i)_mm512_cvtneps_pbh(g));
        }
      }
    });
    return out;
  }
#endif
  return on_int8_grid(x.contiguous().to(at::kFloat), block).to(at::kBFloat16);
}

// x [rows, k] (float32 or bfloat16) @ W^T for a block weight W [n, k] -> [rows, n] in x's dtype;
// gemm_rows > 0: bfloat16 calls of that many rows or more dequantise into a GEMM (above).
Tensor block_linear(Tensor x, Tensor blocks, int64_t type, int64_t gemm_rows) {
  TORCH_CHECK(x.dim() == 2, "block_linear: x must be [rows, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "block_linear: x must be float32 or bfloat16");
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t n = check_blocks(blocks, type, k);
  if (rows == 0 || n == 0) return at::empty({rows, n}, x.options());
  const Format f = format_of(type);
  if (gemm_rows > 0 && rows >= gemm_rows && x.scalar_type() == at::kBFloat16) {
    // a bfloat16 model's prefill: slabs of weight rows dequantised to bfloat16 into PyTorch's GEMM
    // (twice the integer dots' speed where the CPU multiplies bfloat16), the activations on the grid
    // slabs of about 4 MB of bfloat16 weight (a small weight in one GEMM, a big one without a
    // second copy of itself), of whole groups of eight rows
    const int64_t slab = std::max<int64_t>(256, (int64_t{1} << 21) / k / 8 * 8);
    const Tensor xc = int8_grid_bf16(x, f.elems);
    if (slab >= n) return at::mm(xc, block_dequantize(blocks, type, k, c10::nullopt, true).t());
    Tensor y = at::empty({rows, n}, xc.options());
    for (int64_t r0 = 0; r0 < n; r0 += slab) {
      const int64_t r1 = std::min(n, r0 + slab);
      const Tensor w = block_dequantize(blocks.narrow(0, r0, r1 - r0), type, k, c10::nullopt, true);
      y.narrow(1, r0, r1 - r0).copy_(at::mm(xc, w.t()));
    }
    return y;
  }
  const Tensor xf = x.contiguous().to(at::kFloat);
  BlockProduct product(blocks, type, k);
  product.quantise(xf.data_ptr<float>(), rows);
  Tensor y = at::empty({rows, n}, xf.options());
  float* out = y.data_ptr<float>();
  // Activation rows in chunks of INT8_MAX_ROWS (their 8-bit values stay in L2 while every weight
  // row passes), each output a function of its own row alone: the same bits in any batch.
  for (int64_t m0 = 0; m0 < rows; m0 += INT8_MAX_ROWS) {
    const int64_t m1 = std::min(rows, m0 + INT8_MAX_ROWS);
    at::parallel_for(0, product.units(), product.grain(),
                     [&](int64_t b, int64_t e) { product.run(out, n, m0, m1, b, e); });
  }
  return y.to(x.scalar_type());
}

}  // namespace

at::Tensor tokenmill::block_linear(at::Tensor x, at::Tensor blocks, int64_t type, int64_t gemm_rows) {
  return ::block_linear(x, blocks, type, gemm_rows);
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("block_linear(Tensor x, Tensor blocks, int type, int gemm_rows=0) -> Tensor");
  m.def("block_dequantize(Tensor blocks, int type, int k, Tensor? ids, bool bf16=False) -> Tensor");
  m.def("block_int8_grid(Tensor x, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("block_linear", &block_linear);
  m.impl("block_dequantize", &block_dequantize);
  m.impl("block_int8_grid", &int8_grid_bf16);
}
