// tokenmill's CPU kernels: paged attention read in place from the KV blocks, and the
// small per-layer ops fused (RMSNorm with the residual add, RoPE with the cache write).
//
// Built by torch.utils.cpp_extension on the machine that runs it, with -march=native,
// under a name that carries the CPU's ISA level: that is the runtime dispatch (an
// AVX2-only machine and an AVX-512 one each get their own build, never the other's).
// Every op has a pure-torch twin in tokenmill/kernels/reference.py; the tests hold
// each kernel to it.
//
// Rounding follows the reference: where PyTorch rounds an intermediate to the
// activation dtype (bfloat16), so do we, so that bfloat16 outputs match the torch
// path to the last bit in most elements and float32 ones up to summation order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TOKENMILL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TOKENMILL_AVX2 1
#endif

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using at::Tensor;

// ---------------------------------------------------------------- conversions

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }

// exp(x) that vectorises (std::exp does not without -ffast-math): 2^(x log2 e) split into
// an integer power (added to the exponent bits) and 2^f, |f| <= 1/2, by its degree-6
// Taylor series (relative error ~1e-7, float32's own rounding). exp(-inf) = 0.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  x = std::min(x, 88.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.693147180559945309f;
  float p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720))))));
  const int32_t bits = __builtin_bit_cast(int32_t, p) + (static_cast<int32_t>(n) << 23);
  return __builtin_bit_cast(float, bits);
}

// Round a float the way a tensor of dtype T would store it.
template <typename T>
inline float round_as(float x) { return static_cast<float>(static_cast<T>(x)); }
template <>
inline float round_as<float>(float x) { return x; }

// A run of D stored values (one token's K or V for one head) -> float, times `scale`
// for quantised storage. fp8 goes through a 256-entry table.
template <typename C>
struct KVReader {
  static constexpr bool quantised = false;
  const float* lut = nullptr;
  inline void read(const C* src, float* dst, int64_t d, float /*scale*/) const {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = to_f(src[i]);
  }
};

template <>
struct KVReader<int8_t> {
  static constexpr bool quantised = true;
  const float* lut = nullptr;
  inline void read(const int8_t* src, float* dst, int64_t d, float scale) const {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * scale;
  }
};

template <>
struct KVReader<uint8_t> {  // float8 e4m3fn, viewed as bytes
  static constexpr bool quantised = true;
  const float* lut = nullptr;
  inline void read(const uint8_t* src, float* dst, int64_t d, float scale) const {
    for (int64_t i = 0; i < d; ++i) dst[i] = lut[src[i]] * scale;
  }
};

std::vector<float> fp8_table() {
  std::vector<float> t(256);
  for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  return t;
}

#ifdef TOKENMILL_AVX512
// 16 weights (float32, bfloat16 or int8; `left` < 16 masks a tail) -> 16 floats.
inline __m512 load16(const float* p, int64_t left) {
  return left >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1), p);
}
inline __m512 load16(const c10::BFloat16* p, int64_t left) {
  const __m256i raw = left >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                 : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << left) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p, int64_t left) {
  const __m256i raw = left >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                 : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << left) - 1), p);
  return _mm512_cvtph_ps(raw);
}
inline __m512 load16(const int8_t* p, int64_t left) {
  const __m128i raw = left >= 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))
                                 : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << left) - 1), p);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
}
#endif

#ifdef TOKENMILL_AVX2
// 8 stored values (float32, bfloat16 by a shift, float16 through F16C, or int8) -> 8 floats:
// K/V for attention, weights for the small-batch linear.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// ---------------------------------------------------------------- paged attention

#ifdef TOKENMILL_AVX512
// s[t] = the sum of a[t]'s 16 lanes, t = 0..15: a chunk of 16 keys' dot products as one vector
// (a transposing add tree: 14 adds and 28 shuffles where 16 horizontal sums take ~130 ops).
inline __m512 sum16x16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // each 128-bit quarter: the quarter's sums of a[4j .. 4j+3]
    const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

// fast_exp on 16 lanes (the same series; lanes the caller masks off may hold anything).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
  return _mm512_castsi512_ps(bits);
}

// The online softmax's step over a chunk of 16 scores, keys [lo, visible) valid: Gemma 2's soft
// cap lane by lane, the running max `m` raised to the chunk's (the running sum `l` scaled by the
// returned `correction`, which the caller's accumulators take too; 1 where the max stays), and the
// chunk's weights exp(s - m), zero outside the valid keys.
inline __m512 softmax_step16(__m512 s, int64_t lo, int64_t visible, float softcap, float& m, float& l,
                             float& correction) {
  const __mmask16 valid = static_cast<__mmask16>(((1u << visible) - 1) & ~((1u << lo) - 1));
  if (softcap > 0.f) {
    alignas(64) float s16[16];
    _mm512_store_ps(s16, s);
    for (int64_t t = lo; t < visible; ++t) s16[t] = softcap * std::tanh(s16[t] / softcap);
    s = _mm512_load_ps(s16);
  }
  const float new_max = std::max(m, _mm512_mask_reduce_max_ps(valid, s));
  correction = 1.f;
  if (new_max > m) {
    correction = std::exp(m - new_max);  // exp(-inf) = 0 on the first keys
    l *= correction;
    m = new_max;
  }
  return _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
}

// One query row against the keys [lo, visible) of a block (float rows `stride` apart), 16 keys
// at a time: the 16 dot products summed as one vector, the online softmax on 16 lanes, the
// row's accumulator (`ar`, with its running max `m` and sum `l`) in registers across the block.
// The same arithmetic for a row whatever the other rows of its step (batch invariance).
template <int HD>
inline void attend_row16(const float* qr, const float* kbase, const float* vbase, int64_t stride, int64_t lo,
                         int64_t visible, float softcap, float* ar, float& m, float& l) {
  constexpr int C = HD / 16;
  alignas(64) static const float zeros[HD] = {};
  alignas(64) float p16[16];
  __m512 qv[C], accv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qr + 16 * c), accv[c] = _mm512_loadu_ps(ar + 16 * c);
  for (int64_t c0 = lo / 16 * 16; c0 < visible; c0 += 16) {
    __m512 dots[16];
    for (int t = 0; t < 16; ++t) {
      const float* kr = c0 + t < visible ? kbase + (c0 + t) * stride : zeros;
      __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc);
      dots[t] = acc;
    }
    const int64_t t_lo = std::max<int64_t>(lo - c0, 0), t_hi = std::min<int64_t>(visible - c0, 16);
    float correction;
    const __m512 p = softmax_step16(sum16x16(dots), t_lo, t_hi, softcap, m, l, correction);
    if (correction != 1.f) {
      const __m512 cv = _mm512_set1_ps(correction);
      for (int c = 0; c < C; ++c) accv[c] = _mm512_mul_ps(accv[c], cv);
    }
    l += _mm512_reduce_add_ps(p);
    _mm512_store_ps(p16, p);
    for (int64_t t = t_lo; t < t_hi; ++t) {
      const __m512 pt = _mm512_set1_ps(p16[t]);
      const float* vr = vbase + (c0 + t) * stride;
      for (int c = 0; c < C; ++c) accv[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vr + 16 * c), accv[c]);
    }
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(ar + 16 * c, accv[c]);
}
#endif

#if defined(TOKENMILL_AVX512) && defined(__AVX512BF16__)
#define TOKENMILL_ATTN_BF16 1
// bfloat16 queries over a bfloat16 cache on the CPU's bfloat16 dot products (vdpbf16ps: two
// exact products added to a float32 lane, each addition rounded). The float path widens every
// block's K and V to float32 (~40 ops a key) and sums each key's dot products with a transposing
// add tree; here a chunk of 16 keys is turned once (a 16x16 transpose of 32-bit words: lane t of
// kt[i] holds key t's values 2i, 2i+1) so that a query row's 16 scores come out in 16 lanes of
// HD / 2 dot-product steps, and V's values are paired across keys (vp[j]: keys 2j and 2j+1 side
// by side, an unpack of their rows) so that the softmax weights, rounded to bfloat16 as GPU flash
// attention rounds them, multiply V two keys an instruction. Every row of every item runs the
// same steps in the same order whatever else the step holds: a query's output is the same bits
// alone or in a chunk (the float path's promise, kept).

// r[t] = row t of a 16x16 matrix of 32-bit words -> r[i] = its column i (lane t = row t's word i).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
  }
}

// The accumulators' lanes: vp[j][2w] (an unpacklo of two rows' values 32w..32w+31) holds values
// 32w + {0-3, 8-11, 16-19, 24-27}, vp[j][2w + 1] the others; lane x of accumulator c is value
// paired_dim(c, x). attend_chunk_bf16's callers put the row back in order at the end.
inline int paired_dim(int c, int x) { return 32 * (c / 2) + 8 * (x / 4) + 4 * (c % 2) + x % 4; }

// A chunk of n <= 16 keys (rows `stride` apart; missing ones zeros) laid out for the dot products.
template <int HD>
inline void load_chunk_bf16(const c10::BFloat16* kb, const c10::BFloat16* vb, int64_t stride, int64_t n,
                            __m512i* kt, __m512i (*vp)[HD / 16]) {
  for (int w = 0; w < HD / 32; ++w) {
    __m512i r[16];
    for (int t = 0; t < 16; ++t) r[t] = t < n ? _mm512_loadu_si512(kb + t * stride + 32 * w) : _mm512_setzero_si512();
    transpose16(r);
    for (int i = 0; i < 16; ++i) kt[16 * w + i] = r[i];
  }
  for (int j = 0; j < 8; ++j)
    for (int w = 0; w < HD / 32; ++w) {
      const __m512i a = 2 * j < n ? _mm512_loadu_si512(vb + 2 * j * stride + 32 * w) : _mm512_setzero_si512();
      const __m512i b = 2 * j + 1 < n ? _mm512_loadu_si512(vb + (2 * j + 1) * stride + 32 * w) : _mm512_setzero_si512();
      vp[j][2 * w] = _mm512_unpacklo_epi16(a, b);
      vp[j][2 * w + 1] = _mm512_unpackhi_epi16(a, b);
    }
}

// R query rows (bfloat16, HD values each; R <= 4 side by side, their latency chains overlapping)
// against the chunk's keys [lo[r], visible[r]): a row's scores in four chains of dot-product
// steps (words i = 4u + c), added (0 + 1) + (2 + 3) and scaled; the online softmax on 16 lanes as
// attend_row16's; the weights rounded to bfloat16 (the row's sum `l` is the sum of the rounded
// ones) times V into the row's accumulator (lanes in paired_dim's order). Each row's steps are
// its own: the same bits whichever rows share the call.
template <int HD, int R>
inline void attend_chunk_bf16(const c10::BFloat16* const* q, float scale, const __m512i* kt,
                              const __m512i (*vp)[HD / 16], const int64_t* lo, const int64_t* visible, float softcap,
                              float* const* ar, float* const* m, float* const* l) {
  __m512 s4[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) s4[r][c] = _mm512_setzero_ps();
  for (int i = 0; i < HD / 2; i += 4)
    for (int c = 0; c < 4; ++c) {
      const __m512bh k = (__m512bh)kt[i + c];
      for (int r = 0; r < R; ++r) {
        const int32_t* qw = reinterpret_cast<const int32_t*>(q[r]);
        s4[r][c] = _mm512_dpbf16_ps(s4[r][c], (__m512bh)_mm512_set1_epi32(qw[i + c]), k);
      }
    }
  alignas(32) int32_t pw[R][8];
  float correction[R];
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_mul_ps(
        _mm512_add_ps(_mm512_add_ps(s4[r][0], s4[r][1]), _mm512_add_ps(s4[r][2], s4[r][3])), _mm512_set1_ps(scale));
    const __m512 p = softmax_step16(s, lo[r], visible[r], softcap, *m[r], *l[r], correction[r]);
    const __m256bh pb = _mm512_cvtneps_pbh(p);
    *l[r] += _mm512_reduce_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)pb), 16)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pw[r]), (__m256i)pb);
  }
  // V into the accumulators, G rows at a time side by side (G * HD / 16 = 16 registers): their
  // dot-product chains overlap where one row's alone wait on each other. The rows share the key
  // pairs [jlo, jhi); a pair outside a row's own keys has its weights rounded from the softmax's
  // zeros, and adds exact zeros (a key's V is finite), so each row's sums are its own alone.
  constexpr int G = HD == 64 ? 4 : 2;
  for (int r0 = 0; r0 < R; r0 += G) {
    constexpr int RG = R < G ? R : G;
    const int n = std::min(G, R - r0);
    __m512 acc[RG][HD / 16];
    int64_t jlo = 8, jhi = 0;
    for (int g = 0; g < RG; ++g) {
      if (g >= n) break;
      const int r = r0 + g;
      const __m512 cv = _mm512_set1_ps(correction[r]);  // (1: the same bits)
      for (int c = 0; c < HD / 16; ++c) acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(ar[r] + 16 * c), cv);
      jlo = std::min<int64_t>(jlo, lo[r] / 2), jhi = std::max<int64_t>(jhi, (visible[r] + 1) / 2);
    }
    for (int64_t j = jlo; j < jhi; ++j)
      for (int g = 0; g < RG; ++g) {
        if (g >= n) break;
        const __m512bh pj = (__m512bh)_mm512_set1_epi32(pw[r0 + g][j]);
        for (int c = 0; c < HD / 16; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pj, (__m512bh)vp[j][c]);
      }
    for (int g = 0; g < RG; ++g) {
      if (g >= n) break;
      for (int c = 0; c < HD / 16; ++c) _mm512_storeu_ps(ar[r0 + g] + 16 * c, acc[g][c]);
    }
  }
}
#endif

// One unit of work: queries [q_begin, q_end) of sequence `seq`, the rows of them that share KV
// head `head`, against the keys [key_begin, key_end) of its context (a FlashDecoding split).
struct WorkItem {
  int64_t seq, q_begin, q_end, head, key_begin, key_end, partial;  // partial: index of its scratch slot
  int64_t cost;
};

// A sequence's queries [q_begin, q_end), its keys split into num_parts partitions.
struct SeqSplit {
  int64_t seq, q_begin, q_end, num_parts, first_partial;
};

// A long query chunk (a prefill continuing over a cached context) is cut into runs of this many
// queries: work for every thread, and each run's accumulators (queries x group x head_dim
// floats) stay in L1 while the keys stream past.
constexpr int64_t QUERY_RUN = 32;

// A step's attention, planned once (its FlashDecoding splits, the order of the work, the scratch):
// paged_attention plans, then runs it across at::parallel_for; the decode loop runs one plan for
// every layer of a step, in its own team of threads.
struct AttnPlan {
  int64_t num_heads, kv_heads, groups, d, block_size, table_stride, tok_stride, blk_stride, window;
  float scale, softcap;
  const int64_t *qsl, *lens, *tables;
  std::vector<SeqSplit> splits;
  std::vector<WorkItem> items;
  std::vector<int64_t> partial_offset, order;  // row offset of each partial's scratch; items biggest first
  std::vector<float> acc, row_max, row_sum;    // per partial, rows x (d accumulators + max + sum)
  std::vector<float> lut;                      // fp8 caches' table
  std::atomic<int64_t> next{0};                // the next item of `order` to hand out
  int64_t merges() const { return static_cast<int64_t>(splits.size()) * kv_heads; }
};

// Split each sequence's context into partitions (multiples of the block size).
void plan_attention(AttnPlan& p, const Tensor& q, const Tensor& k_cache, const Tensor& block_tables,
                    const Tensor& query_start_loc, const Tensor& seq_lens, const Tensor& seq_ids, double scale,
                    int64_t partition_size, int64_t window, double softcap) {
  p.num_heads = q.size(1);
  p.d = q.size(2);
  p.block_size = k_cache.size(1), p.kv_heads = k_cache.size(2);
  p.groups = p.num_heads / p.kv_heads;
  p.scale = static_cast<float>(scale), p.softcap = static_cast<float>(softcap), p.window = window;
  p.qsl = query_start_loc.data_ptr<int64_t>();
  p.lens = seq_lens.data_ptr<int64_t>();
  p.tables = block_tables.data_ptr<int64_t>();
  p.table_stride = block_tables.size(1);
  p.tok_stride = p.kv_heads * p.d, p.blk_stride = p.block_size * p.tok_stride;  // cache strides
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn || k_cache.scalar_type() == at::kByte) p.lut = fp8_table();
  const int64_t* ids = seq_ids.data_ptr<int64_t>();
  const int64_t block_size = p.block_size, groups = p.groups;
  int64_t num_partials = 0, partial_rows = 0;
  for (int64_t i = 0; i < seq_ids.numel(); ++i) {
    const int64_t s = ids[i], nq = p.qsl[s + 1] - p.qsl[s], len = p.lens[s];
    for (int64_t jb = 0; jb < nq; jb += QUERY_RUN) {
      const int64_t je = std::min(nq, jb + QUERY_RUN), rows = (je - jb) * groups;
      const int64_t keys = len - nq + je;  // the run's last query sees keys [.., keys)
      // with a sliding window, its first query sees keys from (its position - window + 1):
      // whole blocks before that are skipped
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, len - nq + jb - window + 1) / block_size * block_size : 0;
      int64_t part = std::max<int64_t>(std::abs(partition_size), 1);
      if (rows > 64 && partition_size > 0) part = std::max<int64_t>(part, 1024);  // many rows: fewer, bigger splits
      part = (part + block_size - 1) / block_size * block_size;
      const int64_t num_parts = (keys - first_key + part - 1) / part;
      p.splits.push_back({s, jb, je, num_parts, num_partials});
      // partial (h, j) at num_partials + h * num_parts + j; the items of one partition's heads
      // next to each other: run one after another (the order below keeps equal costs in this
      // order), they read the same blocks' token rows while those are in the caches
      for (int64_t x = 0; x < p.kv_heads * num_parts; ++x) {
        p.partial_offset.push_back(partial_rows);
        partial_rows += rows;
      }
      for (int64_t j = 0; j < num_parts; ++j) {
        const int64_t kb = first_key + j * part, ke = std::min(keys, kb + part);
        for (int64_t h = 0; h < p.kv_heads; ++h)
          p.items.push_back({s, jb, je, h, kb, ke, num_partials + h * num_parts + j, (ke - kb) * rows});
      }
      num_partials += p.kv_heads * num_parts;
    }
  }
  p.acc.resize(partial_rows * p.d), p.row_max.resize(partial_rows), p.row_sum.resize(partial_rows);
  // Biggest first, handed out dynamically: partitions differ in length.
  p.order.resize(p.items.size());
  for (size_t i = 0; i < p.order.size(); ++i) p.order[i] = static_cast<int64_t>(i);
  std::stable_sort(p.order.begin(), p.order.end(),
                   [&](int64_t a, int64_t b) { return p.items[a].cost > p.items[b].cost; });
}

#ifdef TOKENMILL_ATTN_BF16
// One work item (attention_work's) on the bfloat16 dot products: each chunk of 16 keys laid out
// once (load_chunk_bf16) for all of the item's rows, then each row that sees some of it.
template <int HD>
void attend_item_bf16(const AttnPlan& plan, const WorkItem& it, const c10::BFloat16* qp, const c10::BFloat16* kp,
                      const c10::BFloat16* vp, float* a, float* m, float* l, int64_t first_j) {
  const int64_t s = it.seq, h = it.head, q0 = plan.qsl[s], nq = plan.qsl[s + 1] - q0, len = plan.lens[s];
  const int64_t groups = plan.groups, block_size = plan.block_size, window = plan.window, stride = plan.tok_stride;
  const int64_t* table = plan.tables + s * plan.table_stride;
  __m512i kt[HD / 2];
  __m512i pairs[8][HD / 16];
  for (int64_t t0 = it.key_begin; t0 < it.key_end; t0 += block_size) {
    const int64_t blk = table[t0 / block_size], n = std::min(block_size, it.key_end - t0);
    const c10::BFloat16* kb = kp + blk * plan.blk_stride + h * HD;
    const c10::BFloat16* vb = vp + blk * plan.blk_stride + h * HD;
    // the block three ahead on its way from memory (a decode step reads each layer's KV once, from
    // DRAM: 4-6% off the decode steps' attention in the mixed workload, bench/RESULTS.md)
    if (t0 + 3 * block_size < it.key_end) {
      const int64_t next = table[t0 / block_size + 3];
      const c10::BFloat16* kn = kp + next * plan.blk_stride + h * HD;
      const c10::BFloat16* vn = vp + next * plan.blk_stride + h * HD;
      for (int64_t t = 0; t < block_size; ++t)
        for (int64_t x = 0; x < HD; x += 32) {
          _mm_prefetch(reinterpret_cast<const char*>(kn + t * stride + x), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vn + t * stride + x), _MM_HINT_T0);
        }
    }
    for (int64_t c0 = 0; c0 < n; c0 += 16) {
      const int64_t k0 = t0 + c0, nc = std::min<int64_t>(16, n - c0);
      if (len - nq + it.q_end - 1 < k0) break;  // past the item's last query (causal): nothing sees these keys
      load_chunk_bf16<HD>(kb + c0 * stride, vb + c0 * stride, stride, nc, kt, pairs);
      // the rows that see some of these keys, four at a time
      const c10::BFloat16* q[4];
      int64_t lo[4], visible[4];
      float *ar[4], *mr[4], *lr[4];
      int n_rows = 0;
      auto flush = [&]() {
        switch (n_rows) {
          case 4: attend_chunk_bf16<HD, 4>(q, plan.scale, kt, pairs, lo, visible, plan.softcap, ar, mr, lr); break;
          case 3: attend_chunk_bf16<HD, 3>(q, plan.scale, kt, pairs, lo, visible, plan.softcap, ar, mr, lr); break;
          case 2: attend_chunk_bf16<HD, 2>(q, plan.scale, kt, pairs, lo, visible, plan.softcap, ar, mr, lr); break;
          case 1: attend_chunk_bf16<HD, 1>(q, plan.scale, kt, pairs, lo, visible, plan.softcap, ar, mr, lr); break;
          default: break;
        }
        n_rows = 0;
      };
      for (int64_t j = first_j; j < it.q_end; ++j) {
        // keys [lo, visible) of this chunk: up to the query's position, and within its window
        const int64_t vis = std::min(nc, len - nq + j - k0 + 1);
        const int64_t low = window > 0 ? std::max<int64_t>(0, len - nq + j - window + 1 - k0) : 0;
        if (vis <= low) continue;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = (j - it.q_begin) * groups + g;
          q[n_rows] = qp + ((q0 + j) * plan.num_heads + h * groups + g) * HD;
          lo[n_rows] = low, visible[n_rows] = vis;
          ar[n_rows] = a + r * HD, mr[n_rows] = m + r, lr[n_rows] = l + r;
          if (++n_rows == 4) flush();
        }
      }
      flush();
    }
  }
  float ordered[HD];  // the accumulators' lanes back in the values' order
  for (int64_t r = (first_j - it.q_begin) * groups; r < (it.q_end - it.q_begin) * groups; ++r) {
    float* ar = a + r * HD;
    for (int c = 0; c < HD / 16; ++c)
      for (int x = 0; x < 16; ++x) ordered[paired_dim(c, x)] = ar[16 * c + x];
    std::copy(ordered, ordered + HD, ar);
  }
}
#endif

#ifdef TOKENMILL_AVX2
// fast_exp on 8 lanes (exp16's series and steps). Its first step, x log2(e) split into an integer n
// and a fraction f, is written out both ways GCC compiled it before (`FUSED`: x log2(e) + 1/2 and
// x log2(e) - n each one FMA, as in the out-of-line copy the two-row path called; else the product
// rounded first, as in the single-row path's inlined copy): the two differ in the last bits, and
// each query head keeps its own (attend_rows8), whatever the compiler makes of the code around it.
template <bool FUSED>
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), half = _mm256_set1_ps(0.5f);
  __m256 n, f;
  if constexpr (FUSED) {
    n = _mm256_round_ps(_mm256_fmadd_ps(x, log2e, half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    f = _mm256_mul_ps(_mm256_fmsub_ps(x, log2e, n), _mm256_set1_ps(0.693147180559945309f));
  } else {
    __m256 t = _mm256_mul_ps(x, log2e);
    asm("" : "+x"(t));  // t rounded to float here: no FMA contraction into the add or the subtraction
    n = _mm256_round_ps(_mm256_add_ps(t, half), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
  }
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  return _mm256_castsi256_ps(bits);
}

// A block's scores [lo, visible) made their softmax weights exp(s - new_max), 8 at a time, and
// their sum (one register's lanes added, then hsum8). `s` has 8 floats of room past the block:
// the lanes past `visible` are written zeros. (The compiler left the scalar fast_exp loop scalar:
// ~20 instructions a score, a third of a long chunk's time.)
template <bool FUSED>
inline float exp_scores8(float* s, int64_t lo, int64_t visible, float new_max) {
  alignas(32) static constexpr int32_t LANES[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  const __m256 mx = _mm256_set1_ps(new_max);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = lo; k < visible; k += 8) {
    __m256 e = exp8<FUSED>(_mm256_sub_ps(_mm256_loadu_ps(s + k), mx));
    const int64_t left = visible - k;
    if (left < 8)
      e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(LANES + 8 - left))));
    _mm256_storeu_ps(s + k, e);
    acc = _mm256_add_ps(acc, e);
  }
  return tokenmill::hsum8(acc);
}

// R rows of one query (R <= 3 query heads that share a KV head: the same keys [lo, visible)) against a
// block of keys, sharing every key's and value's load between them where one row alone loads its
// query chunk beside each key chunk (one load an FMA: this path's bound on a core with one 256-bit
// load a cycle). Each row's arithmetic is one row's (attention_work's AVX2 path: the same chains of
// FMAs, hsum4's lanes, the same softmax and V sums, in the same order), and a row always takes the
// same path (the rows are fixed by the model's heads: rows_at), so no row's bits depend on its step.
// HD a multiple of 32 (the V sums four registers a row at a time); q, a: R rows of HD floats one
// after the other; m, l: the R rows' running max and sum; s: R score rows `s_stride` apart, each with
// 8 floats of room past the block (exp_scores8); the first `fused_rows` rows take exp8<true> (rows_at).
template <int HD, int R>
void attend_rows8(const float* q, const float* kbase, const float* vbase, int64_t kv_stride, int64_t lo,
                  int64_t visible, float softcap, float* a, float* m, float* l, float* s, int64_t s_stride,
                  int fused_rows) {
  static_assert(R >= 1 && R <= 3, "up to 3 rows: their 4 keys' accumulators in 12 of 16 registers");
  float bmax[R];
  for (int r = 0; r < R; ++r) bmax[r] = -std::numeric_limits<float>::infinity();
  auto keep = [&](int r, int64_t key, float dot) {
    if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);  // Gemma 2's soft cap
    s[r * s_stride + key] = dot;
    bmax[r] = std::max(bmax[r], dot);
  };
  const __m256 zero = _mm256_setzero_ps();
  alignas(16) float d[4];
  int64_t t = lo;
  for (; t + 4 <= visible; t += 4) {
    __m256 acc[R][4];
    for (int u = 0; u < 4; ++u) {
      const __m256 k = _mm256_loadu_ps(kbase + (t + u) * kv_stride);
      for (int r = 0; r < R; ++r) acc[r][u] = _mm256_mul_ps(_mm256_loadu_ps(q + r * HD), k);
    }
    for (int c = 1; c < HD / 8; ++c)
      for (int u = 0; u < 4; ++u) {
        const __m256 k = _mm256_loadu_ps(kbase + (t + u) * kv_stride + 8 * c);
        for (int r = 0; r < R; ++r) acc[r][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * HD + 8 * c), k, acc[r][u]);
      }
    for (int r = 0; r < R; ++r) {
      _mm_store_ps(d, tokenmill::hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
      for (int u = 0; u < 4; ++u) keep(r, t + u, d[u]);
    }
  }
  for (; t < visible; ++t) {
    const float* kr = kbase + t * kv_stride;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_mul_ps(_mm256_loadu_ps(q + r * HD), _mm256_loadu_ps(kr));
    for (int c = 1; c < HD / 8; ++c) {
      const __m256 k = _mm256_loadu_ps(kr + 8 * c);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * HD + 8 * c), k, acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      _mm_store_ps(d, tokenmill::hsum4(acc[r], zero, zero, zero));
      keep(r, t, d[0]);
    }
  }
  // the online softmax, row by row, as one row's
  float sum[R];
  for (int r = 0; r < R; ++r) {
    float* ar = a + r * HD;
    const float new_max = std::max(m[r], bmax[r]);
    if (new_max > m[r]) {
      const float correction = std::exp(m[r] - new_max);  // exp(-inf) = 0 on the first block
      l[r] *= correction;
#pragma omp simd
      for (int64_t x = 0; x < HD; ++x) ar[x] *= correction;
      m[r] = new_max;
    }
    sum[r] = r < fused_rows ? exp_scores8<true>(s + r * s_stride, lo, visible, new_max)
                            : exp_scores8<false>(s + r * s_stride, lo, visible, new_max);
  }
  for (int c0 = 0; c0 < HD / 8; c0 += 4) {  // V, four registers a row at a time
    __m256 x[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) x[r][c] = _mm256_loadu_ps(a + r * HD + 8 * (c0 + c));
    for (int64_t k = lo; k < visible; ++k) {
      __m256 p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_set1_ps(s[r * s_stride + k]);
      const float* vr = vbase + k * kv_stride + 8 * c0;
      for (int c = 0; c < 4; ++c) {
        const __m256 v = _mm256_loadu_ps(vr + 8 * c);
        for (int r = 0; r < R; ++r) x[r][c] = _mm256_fmadd_ps(p[r], v, x[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(a + r * HD + 8 * (c0 + c), x[r][c]);
  }
  for (int r = 0; r < R; ++r) l[r] += sum[r];
}

// How many of a KV head's query rows share attend_rows8's call from row g on (`groups` rows a KV
// head): threes, and twos where a one would be left (4 = 2 + 2, 7 = 3 + 2 + 2); a one alone takes
// the single-row path. Fixed by the model's heads, never by the step. Each row keeps the bits it
// had when rows went in pairs and an odd last one alone (exp8's FUSED: the paired rows' exp), so
// threes change no output: a row in a three reads its keys once for three (~15% off the paged
// kernel's float32 steps on a Zen 1, bench/paged_attention.py), a lone row read them once for one.
inline int rows_at(int64_t g, int64_t groups) {
  const int64_t left = groups - g;
  return left == 4 || left == 2 ? 2 : left >= 3 ? 3 : static_cast<int>(left);
}
inline int64_t paired_rows(int64_t groups) { return groups - groups % 2; }  // rows [0, this): exp8<true>
#endif

// One thread's part of a plan's work: items taken from p.next until none is left.
// HD: the head dimension when known at compile time (64, 128; 0 = read at run time), so
// the per-key dot products and V accumulations unroll into a few full vector ops.
template <typename Q, typename C, int HD>
void attention_work(AttnPlan& plan, const void* q, const void* k_cache, const void* v_cache,
                    const c10::BFloat16* ksp, const c10::BFloat16* vsp) {
  constexpr bool fixed_d = HD > 0;
  const int64_t d = fixed_d ? HD : plan.d;
  const int64_t num_heads = plan.num_heads, block_size = plan.block_size, kv_heads = plan.kv_heads, groups = plan.groups;
  const int64_t tok_stride = plan.tok_stride, blk_stride = plan.blk_stride, table_stride = plan.table_stride;
  const int64_t window = plan.window;
  const float scale = plan.scale, softcap = plan.softcap;
  const int64_t *qsl = plan.qsl, *lens = plan.lens, *tables = plan.tables;
  const Q* qp = static_cast<const Q*>(q);
  const C* kp = static_cast<const C*>(k_cache);
  const C* vp = static_cast<const C*>(v_cache);
  KVReader<C> reader;
  reader.lut = plan.lut.data();
  const int64_t n_items = static_cast<int64_t>(plan.items.size());
  std::vector<float> qf, kf(block_size * d), vf(block_size * d), scores(block_size + 8), row_scores(3 * (block_size + 8));
  for (int64_t w = plan.next++; w < n_items; w = plan.next++) {
    const WorkItem& it = plan.items[plan.order[w]];
    const int64_t s = it.seq, h = it.head, q0 = qsl[s], nq = qsl[s + 1] - q0, len = lens[s];
    const int64_t jb = it.q_begin, je = it.q_end, rows = (je - jb) * groups;
    float* a = plan.acc.data() + plan.partial_offset[it.partial] * d;
    float* m = plan.row_max.data() + plan.partial_offset[it.partial];
    float* l = plan.row_sum.data() + plan.partial_offset[it.partial];
    std::fill(a, a + rows * d, 0.f);
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.f);
    // Query j sits at position len - nq + j and sees keys up to it; rows whose
    // position is before this partition see none of it.
    const int64_t first_j = std::max<int64_t>(jb, it.key_begin - (len - nq));
    if (first_j >= je) continue;
#ifdef TOKENMILL_ATTN_BF16
    if constexpr (std::is_same_v<Q, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> && (HD == 64 || HD == 128)) {
      attend_item_bf16<HD>(plan, it, qp, kp, vp, a, m, l, first_j);
      continue;
    }
#endif
    qf.resize(rows * d);
    for (int64_t j = first_j; j < je; ++j)
      for (int64_t g = 0; g < groups; ++g) {
        const Q* src = qp + ((q0 + j) * num_heads + h * groups + g) * d;
        float* dst = qf.data() + ((j - jb) * groups + g) * d;
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) dst[x] = to_f(src[x]) * scale;
      }
    const int64_t* table = tables + s * table_stride;
    for (int64_t t0 = it.key_begin; t0 < it.key_end; t0 += block_size) {
      const int64_t blk = table[t0 / block_size];
      const int64_t n = std::min(block_size, it.key_end - t0);
      const C* kb = kp + blk * blk_stride + h * d;
      const C* vb = vp + blk * blk_stride + h * d;
      // A float32 cache is read where it lies; any other is converted (and scaled) into kf/vf first.
      constexpr bool in_place = std::is_same_v<C, float>;
      const float* kbase = kf.data();
      const float* vbase = vf.data();
      int64_t kv_stride = d;
      if constexpr (in_place) {
        kbase = kb, vbase = vb;
        kv_stride = tok_stride;
      }
      for (int64_t t = 0; t < (in_place ? 0 : n); ++t) {
        float ks = 1.f, vs = 1.f;
        if constexpr (KVReader<C>::quantised) {
          const int64_t si = (blk * block_size + t) * kv_heads + h;
          ks = static_cast<float>(ksp[si]);
          vs = static_cast<float>(vsp[si]);
        }
#ifdef TOKENMILL_AVX512
        if constexpr (fixed_d && HD % 16 == 0 && !std::is_same_v<C, uint8_t> && !std::is_same_v<C, c10::Half>) {
          const __m512 ksv = _mm512_set1_ps(ks), vsv = _mm512_set1_ps(vs);
          for (int c = 0; c < HD / 16; ++c) {
            _mm512_storeu_ps(kf.data() + t * HD + 16 * c, _mm512_mul_ps(load16(kb + t * tok_stride + 16 * c, 16), ksv));
            _mm512_storeu_ps(vf.data() + t * HD + 16 * c, _mm512_mul_ps(load16(vb + t * tok_stride + 16 * c, 16), vsv));
          }
        } else
#elif defined(TOKENMILL_AVX2)
        if constexpr (fixed_d && HD % 8 == 0 && !std::is_same_v<C, uint8_t>) {
          const __m256 ksv = _mm256_set1_ps(ks), vsv = _mm256_set1_ps(vs);
          for (int c = 0; c < HD / 8; ++c) {
            _mm256_storeu_ps(kf.data() + t * HD + 8 * c, _mm256_mul_ps(load8(kb + t * tok_stride + 8 * c), ksv));
            _mm256_storeu_ps(vf.data() + t * HD + 8 * c, _mm256_mul_ps(load8(vb + t * tok_stride + 8 * c), vsv));
          }
        } else
#endif
        {
          reader.read(kb + t * tok_stride, kf.data() + t * d, d, ks);
          reader.read(vb + t * tok_stride, vf.data() + t * d, d, vs);
        }
      }
      for (int64_t j = first_j; j < je; ++j) {
        // keys [lo, visible) of this block: up to the query's position, and within its window
        const int64_t visible = std::min(n, len - nq + j - t0 + 1);
        const int64_t lo = window > 0 ? std::max<int64_t>(0, len - nq + j - window + 1 - t0) : 0;
        if (visible <= lo) continue;
#ifdef TOKENMILL_AVX512
        if constexpr (fixed_d && HD % 16 == 0) {
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t r = (j - jb) * groups + g;
            attend_row16<HD>(qf.data() + r * d, kbase, vbase, kv_stride, lo, visible, softcap, a + r * d, m[r], l[r]);
          }
          continue;
        }
#endif
        int64_t g_first = 0;
#ifdef TOKENMILL_AVX2
        if constexpr (fixed_d && HD % 32 == 0) {  // rows of one KV head share the keys' and values' loads
          for (int rows_now; g_first < groups && (rows_now = rows_at(g_first, groups)) > 1; g_first += rows_now) {
            const int64_t r = (j - jb) * groups + g_first;
            auto run = [&](auto rows) {
              attend_rows8<HD, decltype(rows)::value>(qf.data() + r * d, kbase, vbase, kv_stride, lo, visible,
                                                      softcap, a + r * d, m + r, l + r, row_scores.data(),
                                                      block_size + 8, static_cast<int>(paired_rows(groups) - g_first));
            };
            if (rows_now == 3)
              run(std::integral_constant<int, 3>{});
            else
              run(std::integral_constant<int, 2>{});
          }
        }
#endif
        for (int64_t g = g_first; g < groups; ++g) {
          const int64_t r = (j - jb) * groups + g;
          const float* qr = qf.data() + r * d;
          float block_max = -std::numeric_limits<float>::infinity();
          int64_t t = lo;
#ifdef TOKENMILL_AVX2  // (the AVX-512 build scores 64- and 128-wide heads in attend_row16 above)
          if constexpr (fixed_d && HD % 8 == 0) {
            // Four keys at a time: four independent chains of FMAs (one chain's latency bound the
            // loop: 8 dependent FMAs a key at HD 64), reduced together. Every key's dot is
            // hsum4's lane, alone or in a four (zeros beside it): the same bits however the
            // keys fall into fours, so a row's scores do not depend on its step.
            const __m256 zero = _mm256_setzero_ps();
            auto chain = [&](int64_t key) {  // one key's products, a chain of FMAs
              const float* kr = kbase + key * kv_stride;
              __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qr), _mm256_loadu_ps(kr));
              for (int c = 1; c < HD / 8; ++c)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * c), _mm256_loadu_ps(kr + 8 * c), acc);
              return acc;
            };
            auto keep = [&](int64_t key, float dot) {
              if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);  // Gemma 2's soft cap
              scores[key] = dot;
              block_max = std::max(block_max, dot);
            };
            alignas(16) float dots[4];
            for (; t + 4 <= visible; t += 4) {
              _mm_store_ps(dots, tokenmill::hsum4(chain(t), chain(t + 1), chain(t + 2), chain(t + 3)));
              for (int u = 0; u < 4; ++u) keep(t + u, dots[u]);
            }
            for (; t < visible; ++t) {
              _mm_store_ps(dots, tokenmill::hsum4(chain(t), zero, zero, zero));
              keep(t, dots[0]);
            }
          }
#endif
          for (; t < visible; ++t) {
            const float* kr = kbase + t * kv_stride;
            float dot = 0.f;
            {
#pragma omp simd reduction(+ : dot)
              for (int64_t x = 0; x < d; ++x) dot += qr[x] * kr[x];
            }
            if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);  // Gemma 2's soft cap
            scores[t] = dot;
            block_max = std::max(block_max, dot);
          }
          float* ar = a + r * d;
          const float new_max = std::max(m[r], block_max);
          if (new_max > m[r]) {
            const float correction = std::exp(m[r] - new_max);  // exp(-inf) = 0 on the first block
            l[r] *= correction;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) ar[x] *= correction;
            m[r] = new_max;
          }
          float sum = 0.f;
#ifdef TOKENMILL_AVX2
          if constexpr (fixed_d && HD % 8 == 0) {
            sum = exp_scores8<false>(scores.data(), lo, visible, new_max);
          } else
#endif
          {
#pragma omp simd reduction(+ : sum)
            for (int64_t t = lo; t < visible; ++t) {
              scores[t] = fast_exp(scores[t] - new_max);
              sum += scores[t];
            }
          }
#ifdef TOKENMILL_AVX2
          if constexpr (fixed_d && HD % 8 == 0) {
            // the row's accumulator in registers across the block's keys, 64 values at a time
            constexpr int CH = HD / 8 < 8 ? HD / 8 : 8;
            for (int c0 = 0; c0 < HD / 8; c0 += CH) {
              __m256 accv[CH];
              for (int c = 0; c < CH; ++c) accv[c] = _mm256_loadu_ps(ar + 8 * (c0 + c));
              for (int64_t t = lo; t < visible; ++t) {
                const __m256 p = _mm256_set1_ps(scores[t]);
                const float* vr = vbase + t * kv_stride + 8 * c0;
                for (int c = 0; c < CH; ++c) accv[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), accv[c]);
              }
              for (int c = 0; c < CH; ++c) _mm256_storeu_ps(ar + 8 * (c0 + c), accv[c]);
            }
          } else
#endif
          {
            for (int64_t t = lo; t < visible; ++t) {
              const float p = scores[t];
              const float* vr = vbase + t * kv_stride;
#pragma omp simd
              for (int64_t x = 0; x < d; ++x) ar[x] += p * vr[x];
            }
          }
          l[r] += sum;
        }
      }
    }
  }
}

// Merge each query run's partitions (online-softmax rescaling) into the output: merges [begin, end).
template <typename Q>
void attention_merge(AttnPlan& plan, void* out, int64_t begin, int64_t end) {
  const int64_t d = plan.d, kv_heads = plan.kv_heads, groups = plan.groups, num_heads = plan.num_heads;
  const int64_t* qsl = plan.qsl;
  Q* op = static_cast<Q*>(out);
  std::vector<float> merged(d);
  for (int64_t w = begin; w < end; ++w) {
    const SeqSplit& sp = plan.splits[w / kv_heads];
    const int64_t h = w % kv_heads, s = sp.seq, q0 = qsl[s];
    const int64_t rows = (sp.q_end - sp.q_begin) * groups;
    const int64_t first = sp.first_partial + h * sp.num_parts;
    for (int64_t r = 0; r < rows; ++r) {
      float gmax = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < sp.num_parts; ++p) gmax = std::max(gmax, plan.row_max[plan.partial_offset[first + p] + r]);
      std::fill(merged.begin(), merged.end(), 0.f);
      float total = 0.f;
      for (int64_t p = 0; p < sp.num_parts; ++p) {
        const int64_t off = plan.partial_offset[first + p] + r;
        if (plan.row_sum[off] == 0.f) continue;
        const float w_p = std::exp(plan.row_max[off] - gmax);
        total += w_p * plan.row_sum[off];
        const float* ap = plan.acc.data() + off * d;
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) merged[x] += w_p * ap[x];
      }
      const float inv = 1.f / total;
      const int64_t j = sp.q_begin + r / groups, g = r % groups;
      Q* dst = op + ((q0 + j) * num_heads + h * groups + g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<Q>(merged[x] * inv);
    }
  }
}

using AttnWorkFn = void (*)(AttnPlan&, const void*, const void*, const void*, const c10::BFloat16*,
                            const c10::BFloat16*);

template <typename Q, typename C>
AttnWorkFn work_for_head_dim(int64_t d) {
  if (d == 64) return attention_work<Q, C, 64>;
  if (d == 128) return attention_work<Q, C, 128>;
  return attention_work<Q, C, 0>;
}

template <typename Q>
AttnWorkFn work_for_cache(at::ScalarType cache, int64_t d) {
  switch (cache) {
    case at::kFloat: return work_for_head_dim<Q, float>(d);
    case at::kBFloat16: return work_for_head_dim<Q, c10::BFloat16>(d);
    case at::kHalf: return work_for_head_dim<Q, c10::Half>(d);
    case at::kChar: return work_for_head_dim<Q, int8_t>(d);
    case at::kFloat8_e4m3fn:
    case at::kByte: return work_for_head_dim<Q, uint8_t>(d);
    default: TORCH_CHECK(false, "paged_attention: unsupported KV cache dtype ", cache);
  }
}

AttnWorkFn attention_work_fn(const Tensor& q, const Tensor& k_cache) {
  if (q.scalar_type() == at::kFloat) return work_for_cache<float>(k_cache.scalar_type(), q.size(2));
  if (q.scalar_type() == at::kBFloat16) return work_for_cache<c10::BFloat16>(k_cache.scalar_type(), q.size(2));
  TORCH_CHECK(false, "paged_attention: unsupported query dtype ", q.scalar_type());
}

void check_attention(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const c10::optional<Tensor>& k_scale, const c10::optional<Tensor>& v_scale,
                     const Tensor& block_tables, const Tensor& query_start_loc, const Tensor& seq_lens,
                     const Tensor& seq_ids, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_attention: window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes() &&
                  out.scalar_type() == q.scalar_type(),
              "paged_attention: q and out must be contiguous [tokens, heads, head_dim] of one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention: caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "paged_attention: head_dim or head counts do not match the cache");
  for (const Tensor* t : {&block_tables, &query_start_loc, &seq_lens, &seq_ids})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "paged_attention: index tensors must be contiguous int64 on the CPU");
  const bool quantised = k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn ||
                         k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(!quantised || (k_scale.has_value() && v_scale.has_value() &&
                             k_scale->scalar_type() == at::kBFloat16 && k_scale->is_contiguous() &&
                             v_scale->is_contiguous()),
              "paged_attention: a quantised cache needs contiguous bfloat16 scales");
}

using AttnMergeFn = void (*)(AttnPlan&, void*, int64_t, int64_t);

AttnMergeFn attention_merge_fn(const Tensor& q) {
  return q.scalar_type() == at::kFloat ? attention_merge<float> : attention_merge<c10::BFloat16>;
}

// out[query_start_loc[s]:query_start_loc[s+1]] for every s in seq_ids: attention of those
// query tokens over the sequence's seq_lens[s] cached tokens (the new ones included,
// already written), causal within the new tokens. K/V are read where they lie. Each run of
// queries splits its keys into partitions of partition_size (FlashDecoding), merged in order;
// runs of many rows take bigger ones (1024), unless partition_size is negative: then every
// run's are exactly -partition_size, so a query's arithmetic does not depend on how many
// queries share its step (batch-invariant: the int8 arithmetic asks for it).
void paged_attention(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache, c10::optional<Tensor> k_scale,
                     c10::optional<Tensor> v_scale, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens,
                     Tensor seq_ids, double scale, int64_t partition_size, int64_t window, double softcap) {
  check_attention(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start_loc, seq_lens, seq_ids,
                  window, softcap);
  const AttnWorkFn work = attention_work_fn(q, k_cache);
  const auto merge = attention_merge_fn(q);
  AttnPlan p;
  plan_attention(p, q, k_cache, block_tables, query_start_loc, seq_lens, seq_ids, scale, partition_size, window, softcap);
  const bool quantised = !p.lut.empty() || k_cache.scalar_type() == at::kChar;
  const c10::BFloat16* ksp = quantised ? k_scale->data_ptr<c10::BFloat16>() : nullptr;
  const c10::BFloat16* vsp = quantised ? v_scale->data_ptr<c10::BFloat16>() : nullptr;
  const void *qp = q.data_ptr(), *kp = k_cache.data_ptr(), *vp = v_cache.data_ptr();
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(p.items.size(), 1));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { work(p, qp, kp, vp, ksp, vsp); });
  void* op = out.data_ptr();
  at::parallel_for(0, p.merges(), 1, [&](int64_t begin, int64_t end) { merge(p, op, begin, end); });
}

// ---------------------------------------------------------------- RMSNorm, fused add

// y = w * round(x * rsqrt(mean(x^2) + eps)), the statistics in float32 (Hugging Face's Llama).
template <typename T>
inline void rms_row(const T* x, const T* w, T* y, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<T>(to_f(w[i]) * round_as<T>(to_f(x[i]) * r));
}

template <typename T>
void rms_norm_impl(const Tensor& x, const Tensor& w, Tensor& y, double eps, Tensor* residual) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      if (rp) {  // residual += x, rounded to the residual's dtype, then normalised
        T* ri = rp + i * n;
        const T* xi = xp + i * n;
        for (int64_t c = 0; c < n; ++c) ri[c] = static_cast<T>(to_f(ri[c]) + to_f(xi[c]));
        rms_row(ri, wp, yp + i * n, n, static_cast<float>(eps));
      } else {
        rms_row(xp + i * n, wp, yp + i * n, n, static_cast<float>(eps));
      }
    }
  });
}

void check_rows(const Tensor& x, const Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1) &&
                  w.scalar_type() == x.scalar_type(),
              op, ": expects contiguous [rows, hidden] input and a [hidden] weight of the same dtype");
}

Tensor rms_norm(Tensor x, Tensor w, double eps) {
  check_rows(x, w, "rms_norm");
  Tensor y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, w, y, eps, nullptr);
  else if (x.scalar_type() == at::kBFloat16) rms_norm_impl<c10::BFloat16>(x, w, y, eps, nullptr);
  else TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  return y;
}

// residual += x (in place); y = rms_norm(residual).
void add_rms_norm_out(Tensor y, Tensor x, Tensor residual, Tensor w, double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x");
  TORCH_CHECK(y.sizes() == x.sizes() && y.is_contiguous() && y.scalar_type() == x.scalar_type(),
              "add_rms_norm: the output must match x");
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, w, y, eps, &residual);
  else if (x.scalar_type() == at::kBFloat16) rms_norm_impl<c10::BFloat16>(x, w, y, eps, &residual);
  else TORCH_CHECK(false, "add_rms_norm: unsupported dtype ", x.scalar_type());
}

// residual += x (in place); returns rms_norm(residual).
Tensor add_rms_norm(Tensor x, Tensor residual, Tensor w, double eps) {
  Tensor y = at::empty_like(x);
  add_rms_norm_out(y, x, residual, w, eps);
  return y;
}

// ---------------------------------------------------------------- RoPE (+ cache write)

// x * cos + rotate_half(x) * sin, rotate-half layout, with cos/sin rounded to x's
// dtype and each product rounded as the torch expression rounds it.
template <typename T>
inline void rope_row(T* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  T tmp[512];
  for (int64_t i = 0; i < d; ++i) tmp[i] = x[i];
  for (int64_t i = 0; i < d; ++i) {
    const float rot = i < half ? -to_f(tmp[i + half]) : to_f(tmp[i - half]);
    const float a = round_as<T>(to_f(tmp[i]) * round_as<T>(cos[i]));
    const float b = round_as<T>(round_as<T>(rot) * round_as<T>(sin[i]));
    x[i] = static_cast<T>(a + b);
  }
}

template <typename T, typename C>
void rope_impl(Tensor& q, Tensor& k, const Tensor& v, const Tensor& positions, const Tensor& cos, const Tensor& sin,
               Tensor* k_cache, Tensor* v_cache, const Tensor* slots) {
  const int64_t n = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slot = slots ? slots->data_ptr<int64_t>() : nullptr;
  C* kc = k_cache ? reinterpret_cast<C*>(k_cache->data_ptr()) : nullptr;
  C* vc = v_cache ? reinterpret_cast<C*>(v_cache->data_ptr()) : nullptr;
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0), v_stride = v.stride(0);
  at::parallel_for(0, n, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pos[t] * d;
      const float* s = sp + pos[t] * d;
      for (int64_t h = 0; h < hq; ++h) rope_row(qp + t * q_stride + h * d, c, s, d);
      for (int64_t h = 0; h < hk; ++h) rope_row(kp + t * k_stride + h * d, c, s, d);
      if (kc) {
        C* kd = kc + slot[t] * hk * d;
        C* vd = vc + slot[t] * hk * d;
        const T* ks = kp + t * k_stride;
        const T* vs = vp + t * v_stride;
        for (int64_t h = 0; h < hk; ++h)
          for (int64_t x = 0; x < d; ++x) {
            kd[h * d + x] = static_cast<C>(to_f(ks[h * d + x]));
            vd[h * d + x] = static_cast<C>(to_f(vs[h * d + x]));
          }
      }
    }
  });
}

void check_rope(const Tensor& q, const Tensor& k, const Tensor& positions, const Tensor& cos, const Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
                  k.stride(1) == k.size(2) && q.size(2) == k.size(2) && q.size(2) <= 512 &&
                  q.scalar_type() == k.scalar_type(),
              "rotary: q and k must be [tokens, heads, head_dim] with contiguous heads, head_dim <= 512");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == q.size(2),
              "rotary: positions must be int64 and cos/sin float32 [positions, head_dim]");
}

// q, k rotated in place.
void rotary(Tensor q, Tensor k, Tensor positions, Tensor cos, Tensor sin) {
  check_rope(q, k, positions, cos, sin);
  if (q.scalar_type() == at::kFloat) rope_impl<float, float>(q, k, k, positions, cos, sin, nullptr, nullptr, nullptr);
  else if (q.scalar_type() == at::kBFloat16)
    rope_impl<c10::BFloat16, c10::BFloat16>(q, k, k, positions, cos, sin, nullptr, nullptr, nullptr);
  else TORCH_CHECK(false, "rotary: unsupported dtype ", q.scalar_type());
}

// q, k rotated in place, then k and v written to their cache slots (unquantised caches).
void rotary_write_kv(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos, Tensor sin, Tensor k_cache,
                     Tensor v_cache, Tensor slots) {
  check_rope(q, k, positions, cos, sin);
  TORCH_CHECK(v.sizes() == k.sizes() && v.stride(2) == 1 && v.stride(1) == v.size(2) && v.scalar_type() == k.scalar_type(),
              "rotary_write_kv: v must be shaped like k");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "rotary_write_kv: caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "rotary_write_kv: one int64 slot per token");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  if (qt == at::kFloat && ct == at::kFloat)
    rope_impl<float, float>(q, k, v, positions, cos, sin, &k_cache, &v_cache, &slots);
  else if (qt == at::kFloat && ct == at::kBFloat16)
    rope_impl<float, c10::BFloat16>(q, k, v, positions, cos, sin, &k_cache, &v_cache, &slots);
  else if (qt == at::kBFloat16 && ct == at::kBFloat16)
    rope_impl<c10::BFloat16, c10::BFloat16>(q, k, v, positions, cos, sin, &k_cache, &v_cache, &slots);
  else if (qt == at::kBFloat16 && ct == at::kFloat)
    rope_impl<c10::BFloat16, float>(q, k, v, positions, cos, sin, &k_cache, &v_cache, &slots);
  else TORCH_CHECK(false, "rotary_write_kv: unsupported dtypes ", qt, " / ", ct);
}

// ---------------------------------------------------------------- small-batch linear

// y[m, n] = sum_k x[m, k] * w[n, k] (* scale[n] for int8 weights), for a few rows m:
// the decode-time shape, where a linear layer is a pass over its weights and should
// run at memory bandwidth. Each weight row is read from memory once and reused from
// L1 for every row of x; threads split the output features.
#ifdef TOKENMILL_AVX512
// 4 weight rows x up to 4 activation rows per pass: 16 independent accumulators keep the
// FMA pipes busy while the weights stream in once. The weight rows (NR) and activation rows
// (MR) are template arguments, and the 16-wide steps run unmasked with one masked tail: with
// a run-time row count the accumulators went through the stack (a 576x1536 bfloat16 weight in
// L3 ran at 36 GB/s, 2.4 weights a cycle). PF: prefetch the next tile's rows (see
// small_linear_impl for when a single stream runs faster without).
template <typename W, int MR, int NR, bool PF = true, typename X = float>
inline void tile_n(const X* x, const W* w, int64_t k, float out[4][4]) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  auto step = [&](int64_t i, int64_t left) {
    __m512 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load16(x + m * k + i, left);
    for (int r = 0; r < NR; ++r) {
      // a few streams per thread are too few for the hardware prefetcher to reach full
      // bandwidth: ask for the weights 4 rows (this thread's next tile) ahead
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(w + (r + 4) * k + i), _MM_HINT_T0);
      const __m512 wv = load16(w + r * k + i, left);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_fmadd_ps(xv[m], wv, acc[r][m]);
    }
  };
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) step(i, 16);
  if (i < k) step(i, k - i);
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MR; ++m) out[r][m] = r < NR ? _mm512_reduce_add_ps(acc[r][m]) : 0.f;
}

#if defined(__AVX512BF16__)
#define TOKENMILL_DPBF16 1
inline __m512bh load32bh(const c10::BFloat16* p, int64_t left) {
  return (__m512bh)(left >= 32 ? _mm512_loadu_si512(p)
                               : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << left) - 1), p));
}

// bfloat16 activations times bfloat16 weights on the CPU's bfloat16 dot products: vdpbf16ps adds
// to each float32 lane two products of bfloat16 pairs, one after the other, each exact in float32
// and rounded once as it is added (an FMA's arithmetic), 32 weights an instruction where the
// float32 tile widens 16 and multiplies them in one. A single row's dot is one chain of additions
// whichever tile runs it, so one row streams its weight at twice the chain's pace (a decode's
// 2048x8192 bfloat16 weight from memory: see bench/RESULTS.md), and every tile shape (one row
// alone or batched) gives the same bits. Zeros pad the tail (a masked load).
template <int MR, int NR, bool PF = true>
inline void tile_bf16(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k, float out[4][4]) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  auto step = [&](int64_t i, int64_t left) {
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load32bh(x + m * k + i, left);
    for (int r = 0; r < NR; ++r) {
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(w + (r + 4) * k + i), _MM_HINT_T0);
      const __m512bh wv = load32bh(w + r * k + i, left);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv[m], wv);
    }
  };
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) step(i, 32);
  if (i < k) step(i, k - i);
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MR; ++m) out[r][m] = r < NR ? _mm512_reduce_add_ps(acc[r][m]) : 0.f;
}
#endif

#endif

#ifdef TOKENMILL_AVX2
// The AVX2 twin of the tile above (8 lanes; float16 weights through F16C, bfloat16 by a
// shift): what most laptops and cloud VMs run. k must be a multiple of 8 (small_linear
// takes the portable loop otherwise). (load8: above, with attention's.)

template <typename W, int MR, int NR, bool PF = true, typename X = float>
inline void tile_n(const X* x, const W* w, int64_t k, float out[4][4]) {
  __m256 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load8(x + m * k + i);
    for (int r = 0; r < NR; ++r) {
      if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(w + (r + 4) * k + i), _MM_HINT_T0);
      const __m256 wv = load8(w + r * k + i);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_fmadd_ps(xv[m], wv, acc[r][m]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MR; ++m) out[r][m] = r < NR ? tokenmill::hsum8(acc[r][m]) : 0.f;
}

#endif

#if defined(TOKENMILL_AVX512) || defined(TOKENMILL_AVX2)
// NR (1..4) weight rows times MR activation rows: bfloat16 times bfloat16 on the bfloat16 dot
// products where the build has them, else widened to float32 (x's widening is exact: a bfloat16
// row gives the same sums as its float32 copy, from half the bytes).
template <typename W, int MR, int NR, bool PF = true, typename X>
inline void tile_of(const X* x, const W* w, int64_t k, float out[4][4]) {
#if defined(TOKENMILL_DPBF16)
  if constexpr (std::is_same_v<W, c10::BFloat16> && std::is_same_v<X, c10::BFloat16>)
    return tile_bf16<MR, NR, PF>(x, w, k, out);
#endif
  tile_n<W, MR, NR, PF, X>(x, w, k, out);
}

// A tile of nr (1..4) weight rows: the row count as a template argument.
template <typename W, int MR, typename X>
inline void tile(const X* x, const W* w, int64_t k, int64_t nr, float out[4][4]) {
  switch (nr) {
    case 1: tile_of<W, MR, 1>(x, w, k, out); break;
    case 2: tile_of<W, MR, 2>(x, w, k, out); break;
    case 3: tile_of<W, MR, 3>(x, w, k, out); break;
    default: tile_of<W, MR, 4>(x, w, k, out); break;
  }
}
#endif

template <typename W, typename X>
inline void portable_tile(const X* x, const W* w, int64_t k, int64_t nr, int64_t mr, float out[4][4]) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t m = 0; m < mr; ++m) {
      const X* xr = x + m * k;
      const W* wr = w + r * k;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < k; ++i) acc += static_cast<float>(xr[i]) * static_cast<float>(wr[i]);
      out[r][m] = acc;
    }
}

// Whether one activation row takes single_row (below) on this build.
inline bool single_row_path(int64_t rows, int64_t k) {
#if defined(TOKENMILL_AVX512)
  return rows == 1;
#elif defined(TOKENMILL_AVX2)
  return rows == 1 && k % 8 == 0;
#else
  return false;
#endif
}

// One activation row (a decode at batch 1): the weight rows one after another, one stream per
// thread, no software prefetch. Four rows read side by side (the tiles below, which share each
// activation load among them) held a Zen 4 EPYC's bfloat16 decode to 17-21 GB/s where one stream
// reads 30-34 (a 49152x576 weight, 2 threads). The same sums in the same order as the tiles', so
// a row's outputs do not depend on the batch. (Two rows side by side, for a second chain of
// additions, read slower: 16-20 against 17-37 GB/s.)
template <typename W, typename X, typename Y>
void single_row_part(const X* x, const W* w, const float* scale, Y* y, int64_t k, int64_t b, int64_t e) {
#if defined(TOKENMILL_AVX512) || defined(TOKENMILL_AVX2)
  for (int64_t r = b; r < e; ++r) {
    float out[4][4];
    tile_of<W, 1, 1, false>(x, w + r * k, k, out);
    y[r] = static_cast<Y>(scale ? out[0][0] * scale[r] : out[0][0]);
  }
#endif
}

template <typename W, typename X, typename Y>
void single_row(const X* x, const W* w, const float* scale, Y* y, int64_t n_out, int64_t k) {
  at::parallel_for(0, n_out, 64, [&](int64_t b, int64_t e) { single_row_part<W, X, Y>(x, w, scale, y, k, b, e); });
}

// Weight rows [4 * b, 4 * e) (the tiles' blocks of four) times every activation row, into y (rows
// ldy apart), on the calling thread: small_linear_impl's work for one thread, and decode_loop.cpp's
// share of a linear in its team. An output's sum does not depend on which block or thread takes it.
template <typename W, typename X, typename Y>
void small_linear_part(const X* x, const W* w, const float* scale, Y* y, int64_t ldy, int64_t rows, int64_t n_out,
                       int64_t k, int64_t b, int64_t e) {
  for (int64_t blk = b; blk < e; ++blk) {
    const int64_t n0 = blk * 4, nr = std::min<int64_t>(4, n_out - n0);
    for (int64_t m0 = 0; m0 < rows; m0 += 4) {
      const int64_t mr = std::min<int64_t>(4, rows - m0);
      float out[4][4];
#if defined(TOKENMILL_AVX512) || defined(TOKENMILL_AVX2)
#ifdef TOKENMILL_AVX2
      if (k % 8 == 0) {
#else
      {
#endif
        const X* xs = x + m0 * k;
        const W* ws = w + n0 * k;
        switch (mr) {
          case 1: tile<W, 1>(xs, ws, k, nr, out); break;
          case 2: tile<W, 2>(xs, ws, k, nr, out); break;
          case 3: tile<W, 3>(xs, ws, k, nr, out); break;
          default: tile<W, 4>(xs, ws, k, nr, out); break;
        }
      }
#ifdef TOKENMILL_AVX2
      else
        portable_tile(x + m0 * k, w + n0 * k, k, nr, mr, out);
#endif
#else
      portable_tile(x + m0 * k, w + n0 * k, k, nr, mr, out);
#endif
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t m = 0; m < mr; ++m) {
          const float v = out[r][m];
          y[(m0 + m) * ldy + n0 + r] = static_cast<Y>(scale ? v * scale[n0 + r] : v);
        }
    }
  }
}

// X: the activations as they came, float32 or bfloat16 (read as they are: widened exactly, or
// multiplied on the bfloat16 dot products; a bfloat16 row of 8192 stays in a 32 KB L1 beside the
// weight's stream where its float32 copy did not). one_stream: one activation row takes
// single_row; else the tiles, four weight rows side by side (the same sums: a machine's choice,
// kernels/gemm_choice.py; on an AMX Xeon the tiles streamed a bfloat16 decoder's weights 1.5x
// faster, float16 ones 1.7x, where a Zen 4 EPYC's single stream was the faster).
template <typename W, typename X, typename Y>
void small_linear_impl(const X* x, const W* w, const float* scale, Y* y, int64_t rows, int64_t n_out, int64_t k,
                       bool one_stream) {
  if (one_stream && single_row_path(rows, k)) return single_row<W, X, Y>(x, w, scale, y, n_out, k);
  at::parallel_for(0, (n_out + 3) / 4, 16, [&](int64_t b, int64_t e) {
    small_linear_part<W, X, Y>(x, w, scale, y, n_out, rows, n_out, k, b, e);
  });
}

template <typename W>
void small_linear_out(const Tensor& x, const W* w, const float* scale, Tensor& y, int64_t rows, int64_t n_out,
                      int64_t k, bool one_stream) {
  if (x.scalar_type() == at::kFloat)
    small_linear_impl<W, float, float>(x.data_ptr<float>(), w, scale, y.data_ptr<float>(), rows, n_out, k,
                                       one_stream);
  else
    small_linear_impl<W, c10::BFloat16, c10::BFloat16>(x.data_ptr<c10::BFloat16>(), w, scale,
                                                       y.data_ptr<c10::BFloat16>(), rows, n_out, k, one_stream);
}

// x [rows, k] (float32 or bfloat16) @ w[n, k]^T -> [rows, n] in x's dtype. w: float32,
// bfloat16, float16, or int8 with a float32 per-output-channel scale. one_stream: see
// small_linear_impl (the same outputs either way).
Tensor small_linear(Tensor x, Tensor w, c10::optional<Tensor> scale, bool one_stream) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.is_contiguous(),
              "small_linear: expects x [rows, k] and a contiguous weight [n, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "small_linear: x must be float32 or bfloat16");
  const int64_t rows = x.size(0), k = x.size(1), n_out = w.size(0);
  const Tensor xc = x.contiguous();
  Tensor y = at::empty({rows, n_out}, x.options());
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.has_value() && scale->numel() == n_out && scale->scalar_type() == at::kFloat &&
                    scale->is_contiguous(),
                "small_linear: int8 weights need one float32 scale per output");
    small_linear_out<int8_t>(xc, w.data_ptr<int8_t>(), scale->data_ptr<float>(), y, rows, n_out, k, one_stream);
  } else if (w.scalar_type() == at::kBFloat16) {
    small_linear_out<c10::BFloat16>(xc, w.data_ptr<c10::BFloat16>(), nullptr, y, rows, n_out, k, one_stream);
  } else if (w.scalar_type() == at::kHalf) {
    small_linear_out<c10::Half>(xc, w.data_ptr<c10::Half>(), nullptr, y, rows, n_out, k, one_stream);
  } else if (w.scalar_type() == at::kFloat) {
    small_linear_out<float>(xc, w.data_ptr<float>(), nullptr, y, rows, n_out, k, one_stream);
  } else {
    TORCH_CHECK(false, "small_linear: unsupported weight dtype ", w.scalar_type());
  }
  return y;
}

// Weight rows [4 * u0, 4 * u1) of small_linear(x, w, None, one_stream) on the calling thread, in
// float32 (the same sums; a bfloat16 output is this rounded).
template <typename W, typename X>
void small_linear_units_of(const X* x, const W* w, float* y, int64_t ldy, int64_t rows, int64_t n_out, int64_t k,
                           int64_t u0, int64_t u1, bool one_stream) {
  if (one_stream && single_row_path(rows, k))
    return single_row_part<W, X, float>(x, w, nullptr, y, k, 4 * u0, std::min(n_out, 4 * u1));
  small_linear_part<W, X, float>(x, w, nullptr, y, ldy, rows, n_out, k, u0, u1);
}

template <typename W>
void small_linear_units_w(const at::Tensor& w, const void* x, bool x_bf16, float* y, int64_t ldy, int64_t rows,
                          int64_t u0, int64_t u1, bool one_stream) {
  const W* wp = w.data_ptr<W>();
  const int64_t n_out = w.size(0), k = w.size(1);
  if (x_bf16)
    small_linear_units_of<W, c10::BFloat16>(static_cast<const c10::BFloat16*>(x), wp, y, ldy, rows, n_out, k, u0, u1,
                                            one_stream);
  else
    small_linear_units_of<W, float>(static_cast<const float*>(x), wp, y, ldy, rows, n_out, k, u0, u1, one_stream);
}

}  // namespace

namespace tokenmill {  // external names for decode_loop.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) { return ::rms_norm(x, w, eps); }
at::Tensor add_rms_norm(at::Tensor x, at::Tensor r, at::Tensor w, double eps) { return ::add_rms_norm(x, r, w, eps); }
void add_rms_norm_out(at::Tensor y, at::Tensor x, at::Tensor r, at::Tensor w, double eps) {
  ::add_rms_norm_out(y, x, r, w, eps);
}

struct AttentionStep::Impl {
  AttnPlan plan;
  AttnWorkFn work;
  AttnMergeFn merge;
};

AttentionStep::AttentionStep(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& seq_ids,
                             double scale, int64_t partition_size)
    : impl_(std::make_unique<Impl>()) {
  check_attention(out, q, k_cache, v_cache, c10::nullopt, c10::nullopt, block_tables, query_start_loc, seq_lens,
                  seq_ids, 0, 0.0);
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf, "AttentionStep: an unquantised cache only");
  impl_->work = attention_work_fn(q, k_cache);
  impl_->merge = attention_merge_fn(q);
  plan_attention(impl_->plan, q, k_cache, block_tables, query_start_loc, seq_lens, seq_ids, scale, partition_size, 0, 0.0);
}

AttentionStep::~AttentionStep() = default;

void AttentionStep::restart() { impl_->plan.next = 0; }

void AttentionStep::work(const void* q, const void* k_cache, const void* v_cache) {
  impl_->work(impl_->plan, q, k_cache, v_cache, nullptr, nullptr);
}

void AttentionStep::merge(void* out, int64_t thread, int64_t threads) {
  const int64_t merges = impl_->plan.merges();
  impl_->merge(impl_->plan, out, merges * thread / threads, merges * (thread + 1) / threads);
}
void rotary_write_kv(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                     at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots) {
  ::rotary_write_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots);
}
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale, at::Tensor block_tables,
                     at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor seq_ids, double scale,
                     int64_t partition_size, int64_t window, double softcap) {
  ::paged_attention(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start_loc, seq_lens, seq_ids,
                    scale, partition_size, window, softcap);
}
at::Tensor small_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> scale, bool one_stream) {
  return ::small_linear(x, w, scale, one_stream);
}
void small_linear_units(const at::Tensor& w, const void* x, bool x_bf16, float* y, int64_t ldy, int64_t rows,
                        int64_t u0, int64_t u1, bool one_stream) {
  switch (w.scalar_type()) {
    case at::kBFloat16: return small_linear_units_w<c10::BFloat16>(w, x, x_bf16, y, ldy, rows, u0, u1, one_stream);
    case at::kHalf: return small_linear_units_w<c10::Half>(w, x, x_bf16, y, ldy, rows, u0, u1, one_stream);
    default: return small_linear_units_w<float>(w, x, x_bf16, y, ldy, rows, u0, u1, one_stream);
  }
}
}  // namespace tokenmill

TORCH_LIBRARY(tokenmill, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, Tensor seq_ids, float scale, "
        "int partition_size, int window=0, float softcap=0.) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("small_linear(Tensor x, Tensor w, Tensor? scale, bool one_stream=True) -> Tensor");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("rotary_write_kv(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("small_linear", &small_linear);
  m.impl("rotary", &rotary);
  m.impl("rotary_write_kv", &rotary_write_kv);
}
