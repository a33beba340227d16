// Block-quantised linear layers: GGUF's Q4_0/Q4_1/Q4_K/Q5_*/Q6_K/Q8_0 (and our own int8/int4),
// served from their quantised blocks, never from a float copy of the weight.
//
// Every format is repacked once at load (tokenmill/quant/packed.py) into one of two layouts:
//   - 4-bit: values 0..15 in groups of 32, one float32 scale and one float32 min per group
//     (w = scale * q + min). A row is stored in chunks of 64 values (32 bytes = eight 32-bit
//     words); word l of a chunk holds value 8i + l in bits 4i..4i+3, so that "shift right by
//     4i, and 0xF" yields 8 consecutive values in the 8 lanes of an AVX2 register with no
//     shuffle (AVX-512 takes a chunk and its 4-bit shift as one 16-lane register).
//   - 8-bit: signed values in groups of 16 or 32, a float32 scale per group and an optional
//     float32 min (w = scale * q [+ min]).
// (GGUF's float16 scales and K-quants' 6-bit sub-scales become float32 products exactly.)
//
// The arithmetic is "exact mode": weights are converted to float in registers and multiplied
// with float activations, y = sum_g scale_g * (q_g . x_g) + sum_g min_g * sum(x_g); the same
// numbers as the dequantised reference up to float32 summation order.
//
// Batch-1 decode is a pass over the weights: threads split the output rows, each tile of four
// rows is read once and reused for every activation row (up to four at a time), and the next
// tile is prefetched. Batches past a few dozen rows dequantise the weight for the call with
// quant_dequantize and multiply it in PyTorch's GEMM (see QuantLinear).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TM_AVX512 1
#endif

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t Q4_CHUNK = 64;  // values per 32-byte chunk of the 4-bit layout
constexpr int NR = 4;             // weight rows per tile

#ifdef TM_AVX2
#endif

// ------------------------------------------------------------------ 4-bit tiles

// Dot products of `nr` weight rows (4-bit layout, `row_bytes` apart) with MR activation rows
// of `x` (`k` apart), scales applied per group; the min terms are added by the caller.
template <int MR>
inline void q4_tile(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, const float* scale,
                    int64_t groups, int nr, float out[NR][4]) {
  const int64_t chunks = (k + Q4_CHUNK - 1) / Q4_CHUNK;
#if defined(TM_AVX512)
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi32(0xF);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t base = c * Q4_CHUNK;
    const bool second = base + 32 < k;  // a row whose length is 32 mod 64 ends in a half chunk
    if constexpr (MR == 1) {  // batch 1: the chunk's activations loaded once for the 4 rows
      const __m512 x0 = _mm512_loadu_ps(x + base), x1 = _mm512_loadu_ps(x + base + 16);
      const __m512 x2 = second ? _mm512_loadu_ps(x + base + 32) : _mm512_setzero_ps();
      const __m512 x3 = second ? _mm512_loadu_ps(x + base + 48) : _mm512_setzero_ps();
      for (int r = 0; r < NR; ++r) {
        if (r >= nr) break;
        const uint8_t* wr = w + r * row_bytes + c * 32;
        _mm_prefetch(reinterpret_cast<const char*>(wr + NR * row_bytes), _MM_HINT_T0);
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr));
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi32(raw, 4), 1);
        const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(z, low4));
        const __m512 q1 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(z, 8), low4));
        const __m512 t0 = _mm512_fmadd_ps(q1, x1, _mm512_mul_ps(q0, x0));
        acc[r][0] = _mm512_fmadd_ps(t0, _mm512_set1_ps(scale[r * groups + 2 * c]), acc[r][0]);
        if (second) {
          const __m512 q2 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(z, 16), low4));
          const __m512 q3 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(z, 24), low4));
          const __m512 t1 = _mm512_fmadd_ps(q3, x3, _mm512_mul_ps(q2, x2));
          acc[r][0] = _mm512_fmadd_ps(t1, _mm512_set1_ps(scale[r * groups + 2 * c + 1]), acc[r][0]);
        }
      }
      continue;
    }
    for (int r = 0; r < NR; ++r) {
      if (r >= nr) break;
      const uint8_t* wr = w + r * row_bytes + c * 32;
      _mm_prefetch(reinterpret_cast<const char*>(wr + NR * row_bytes), _MM_HINT_T0);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr));
      const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi32(raw, 4), 1);
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(z, low4));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(z, 8), low4));
      const __m512 s0 = _mm512_set1_ps(scale[r * groups + 2 * c]);
      for (int m = 0; m < MR; ++m) {
        const float* xm = x + m * k + base;
        __m512 t = _mm512_mul_ps(q0, _mm512_loadu_ps(xm));
        t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xm + 16), t);
        acc[r][m] = _mm512_fmadd_ps(t, s0, acc[r][m]);
      }
      if (second) {
        const __m512 q2 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(z, 16), low4));
        const __m512 q3 = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(z, 24), low4));
        const __m512 s1 = _mm512_set1_ps(scale[r * groups + 2 * c + 1]);
        for (int m = 0; m < MR; ++m) {
          const float* xm = x + m * k + base + 32;
          __m512 t = _mm512_mul_ps(q2, _mm512_loadu_ps(xm));
          t = _mm512_fmadd_ps(q3, _mm512_loadu_ps(xm + 16), t);
          acc[r][m] = _mm512_fmadd_ps(t, s1, acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) out[r][m] = r < nr ? _mm512_reduce_add_ps(acc[r][m]) : 0.f;
#elif defined(TM_AVX2)
  __m256 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(0xF);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t base = c * Q4_CHUNK;
    const int halves = base + 32 < k ? 2 : 1;
    if constexpr (MR == 1) {
      // batch 1: the chunk's activations loaded once for the 4 rows, and each group's
      // products summed as two independent pairs (a shorter dependency chain)
      __m256 xv[8];
      for (int j = 0; j < 4 * halves; ++j) xv[j] = _mm256_loadu_ps(x + base + 8 * j);
      for (int r = 0; r < NR; ++r) {
        if (r >= nr) break;
        const uint8_t* wr = w + r * row_bytes + c * 32;
        _mm_prefetch(reinterpret_cast<const char*>(wr + NR * row_bytes), _MM_HINT_T0);
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr));
        for (int h = 0; h < halves; ++h) {
          const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 16 * h), low4));
          const __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 16 * h + 4), low4));
          const __m256 q2 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 16 * h + 8), low4));
          const __m256 q3 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 16 * h + 12), low4));
          const __m256 ta = _mm256_fmadd_ps(q2, xv[4 * h + 2], _mm256_mul_ps(q0, xv[4 * h]));
          const __m256 tb = _mm256_fmadd_ps(q3, xv[4 * h + 3], _mm256_mul_ps(q1, xv[4 * h + 1]));
          acc[r][0] = _mm256_fmadd_ps(_mm256_add_ps(ta, tb), _mm256_set1_ps(scale[r * groups + 2 * c + h]), acc[r][0]);
        }
      }
      continue;
    }
    for (int r = 0; r < NR; ++r) {
      if (r >= nr) break;
      const uint8_t* wr = w + r * row_bytes + c * 32;
      _mm_prefetch(reinterpret_cast<const char*>(wr + NR * row_bytes), _MM_HINT_T0);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr));
      for (int h = 0; h < halves; ++h) {
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 16 * h), low4));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 16 * h + 4), low4));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 16 * h + 8), low4));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(raw, 16 * h + 12), low4));
        const __m256 s = _mm256_set1_ps(scale[r * groups + 2 * c + h]);
        for (int m = 0; m < MR; ++m) {
          const float* xm = x + m * k + base + 32 * h;
          __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xm));
          t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xm + 8), t);
          t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xm + 16), t);
          t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xm + 24), t);
          acc[r][m] = _mm256_fmadd_ps(t, s, acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) out[r][m] = r < nr ? tokenmill::hsum8(acc[r][m]) : 0.f;
#else
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      float total = 0.f;
      if (r < nr) {
        const uint8_t* wr = w + r * row_bytes;
        for (int64_t g = 0; g < k / 32; ++g) {
          const uint32_t* words = reinterpret_cast<const uint32_t*>(wr + (g / 2) * 32);
          float dot = 0.f;
          for (int64_t j = 0; j < 32; ++j) {
            const int64_t v = (g % 2) * 32 + j;  // index within the chunk: nibble v / 8 of word v % 8
            dot += static_cast<float>((words[v % 8] >> (4 * (v / 8))) & 0xF) * x[m * k + g * 32 + j];
          }
          total += scale[r * groups + g] * dot;
        }
      }
      out[r][m] = total;
    }
#endif
}

// ------------------------------------------------------------------ 8-bit tiles

template <int MR, int G>
inline void q8_tile(const float* x, int64_t k, const int8_t* w, const float* scale, int64_t groups, int nr,
                    float out[NR][4]) {
#if defined(TM_AVX512)
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t base = g * G;
    for (int r = 0; r < NR; ++r) {
      if (r >= nr) break;
      const int8_t* wr = w + r * k + base;
      _mm_prefetch(reinterpret_cast<const char*>(wr + NR * k), _MM_HINT_T0);
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr))));
      const __m512 s = _mm512_set1_ps(scale[r * groups + g]);
      if constexpr (G == 32) {
        const __m512 q1 =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 16))));
        for (int m = 0; m < MR; ++m) {
          const float* xm = x + m * k + base;
          __m512 t = _mm512_mul_ps(q0, _mm512_loadu_ps(xm));
          t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xm + 16), t);
          acc[r][m] = _mm512_fmadd_ps(t, s, acc[r][m]);
        }
      } else {
        for (int m = 0; m < MR; ++m)
          acc[r][m] = _mm512_fmadd_ps(_mm512_mul_ps(q0, _mm512_loadu_ps(x + m * k + base)), s, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) out[r][m] = r < nr ? _mm512_reduce_add_ps(acc[r][m]) : 0.f;
#elif defined(TM_AVX2)
  __m256 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t base = g * G;
    for (int r = 0; r < NR; ++r) {
      if (r >= nr) break;
      const int8_t* wr = w + r * k + base;
      _mm_prefetch(reinterpret_cast<const char*>(wr + NR * k), _MM_HINT_T0);
      __m256 q[G / 8];
      for (int j = 0; j < G / 8; ++j)
        q[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + 8 * j))));
      const __m256 s = _mm256_set1_ps(scale[r * groups + g]);
      for (int m = 0; m < MR; ++m) {
        const float* xm = x + m * k + base;
        __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xm));
        for (int j = 1; j < G / 8; ++j) t = _mm256_fmadd_ps(q[j], _mm256_loadu_ps(xm + 8 * j), t);
        acc[r][m] = _mm256_fmadd_ps(t, s, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) out[r][m] = r < nr ? tokenmill::hsum8(acc[r][m]) : 0.f;
#else
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      float total = 0.f;
      if (r < nr)
        for (int64_t g = 0; g < groups; ++g) {
          float dot = 0.f;
          for (int64_t j = 0; j < G; ++j) dot += static_cast<float>(w[r * k + g * G + j]) * x[m * k + g * G + j];
          total += scale[r * groups + g] * dot;
        }
      out[r][m] = total;
    }
#endif
}

struct Packed {
  const uint8_t* qs;
  const float* scale;
  const float* minv;  // nullptr: no min term
  int64_t bits, group, k, n, row_bytes, groups;
};

Packed check_packed(const Tensor& qs, const Tensor& scale, const c10::optional<Tensor>& minv, int64_t bits,
                    int64_t group, int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(bits == 4 ? group == 32 : (group == 16 || group == 32),
              "quant_linear: groups are 32 values (4-bit) or 16/32 values (8-bit), got ", group);
  TORCH_CHECK(k % group == 0, "quant_linear: ", k, " input features are not a whole number of groups of ", group);
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && (qs.scalar_type() == at::kByte || qs.scalar_type() == at::kChar),
              "quant_linear: packed values must be a contiguous [n, bytes] uint8/int8 tensor");
  const int64_t n = qs.size(0), groups = k / group;
  const int64_t row_bytes = bits == 4 ? (k + Q4_CHUNK - 1) / Q4_CHUNK * 32 : k;
  TORCH_CHECK(qs.size(1) == row_bytes, "quant_linear: expected ", row_bytes, " bytes per row for ", k,
              " inputs, got ", qs.size(1));
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n * groups,
              "quant_linear: scales must be contiguous float32 [n, k / group]");
  if (minv.has_value())
    TORCH_CHECK(minv->scalar_type() == at::kFloat && minv->is_contiguous() && minv->numel() == n * groups,
                "quant_linear: mins must be contiguous float32 [n, k / group]");
  return {reinterpret_cast<const uint8_t*>(qs.data_ptr()), scale.data_ptr<float>(),
          minv.has_value() ? minv->data_ptr<float>() : nullptr, bits, group, k, n, row_bytes, groups};
}

template <int MR>
inline void any_tile(const Packed& p, const float* x, int64_t n0, int nr, float out[NR][4]) {
  const float* sc = p.scale + n0 * p.groups;
  if (p.bits == 4) {
    q4_tile<MR>(x, p.k, p.qs + n0 * p.row_bytes, p.row_bytes, sc, p.groups, nr, out);
  } else {
    const int8_t* w = reinterpret_cast<const int8_t*>(p.qs) + n0 * p.k;
    if (p.group == 32) q8_tile<MR, 32>(x, p.k, w, sc, p.groups, nr, out);
    else q8_tile<MR, 16>(x, p.k, w, sc, p.groups, nr, out);
  }
}

template <typename Y>
void quant_linear_impl(const Packed& p, const float* x, const float* xsum, Y* y, int64_t rows) {
  const int64_t tiles = (p.n + NR - 1) / NR;
  at::parallel_for(0, tiles, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t n0 = t * NR;
      const int nr = static_cast<int>(std::min<int64_t>(NR, p.n - n0));
      for (int64_t m0 = 0; m0 < rows; m0 += 4) {
        const int mr = static_cast<int>(std::min<int64_t>(4, rows - m0));
        const float* xs = x + m0 * p.k;
        float out[NR][4];
        switch (mr) {
          case 1: any_tile<1>(p, xs, n0, nr, out); break;
          case 2: any_tile<2>(p, xs, n0, nr, out); break;
          case 3: any_tile<3>(p, xs, n0, nr, out); break;
          default: any_tile<4>(p, xs, n0, nr, out); break;
        }
        for (int r = 0; r < nr; ++r)
          for (int m = 0; m < mr; ++m) {
            float v = out[r][m];
            if (p.minv) {
              const float* mn = p.minv + (n0 + r) * p.groups;
              const float* xsm = xsum + (m0 + m) * p.groups;
              float extra = 0.f;
#pragma omp simd reduction(+ : extra)
              for (int64_t g = 0; g < p.groups; ++g) extra += mn[g] * xsm[g];
              v += extra;
            }
            y[(m0 + m) * p.n + n0 + r] = static_cast<Y>(v);
          }
      }
    }
  });
}

// The GEMV tiles over xf [rows, k] (float32) into y [rows, n] (float32 or bfloat16).
void gemv_tiles(const Packed& p, const Tensor& xf, Tensor& y) {
  const int64_t rows = xf.size(0), group = p.group;
  std::vector<float> xsum;  // per-group sums of x, for the mins (a plain loop: no op dispatch at batch 1)
  if (p.minv) {
    const float* xp = xf.data_ptr<float>();
    xsum.resize(rows * p.groups);
    for (int64_t i = 0; i < rows * p.groups; ++i) {
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t j = 0; j < group; ++j) total += xp[i * group + j];
      xsum[i] = total;
    }
  }
  const float* xsp = p.minv ? xsum.data() : nullptr;
  if (y.scalar_type() == at::kFloat) quant_linear_impl<float>(p, xf.data_ptr<float>(), xsp, y.data_ptr<float>(), rows);
  else quant_linear_impl<c10::BFloat16>(p, xf.data_ptr<float>(), xsp, y.data_ptr<c10::BFloat16>(), rows);
}

#if defined(TM_AVX2)
// 8 floats -> 8 bfloat16, round to nearest even (as c10::BFloat16 and .to(bfloat16) round finite values).
inline void store8(c10::BFloat16* dst, __m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);  // qwords 0 and 2
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}
inline void store8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }
#endif
#if defined(TM_AVX512)
inline void store16(c10::BFloat16* dst, __m512 v) {  // the same rounding as store8, 16 wide
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(b));
}
inline void store16(float* dst, __m512 v) { _mm512_storeu_ps(dst, v); }
#endif

// One packed row -> k values (w = scale * q [+ min]) in float32 or rounded to bfloat16, vectorised:
// batches past the kernel call this for every weight row of every layer. Multiply, then add: the
// reference's two roundings, not one fused.
template <typename Out>
void dequantize_row(const Packed& p, int64_t row, Out* dst) {
  const int64_t k = p.k;
  const float* sc = p.scale + row * p.groups;
  const float* mn = p.minv ? p.minv + row * p.groups : nullptr;
  if (p.bits == 4) {
    const uint8_t* w = p.qs + row * p.row_bytes;
    for (int64_t g = 0; g < p.groups; ++g) {  // group g: half g % 2 of chunk g / 2
      const uint8_t* chunk = w + (g / 2) * 32;
      const int shift = 16 * static_cast<int>(g % 2);
      Out* out = dst + g * 32;
      const float s = sc[g], m = mn ? mn[g] : 0.f;
#if defined(TM_AVX512)
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
      const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi32(raw, 4), 1);
      const __m512 sv = _mm512_set1_ps(s), mv = _mm512_set1_ps(m);
      const __m512i low4 = _mm512_set1_epi32(0xF);
      for (int i = 0; i < 2; ++i) {  // values 16 i .. 16 i + 15 of the group: nibbles 2 i, 2 i + 1 (+ 4 for the half)
        const __m512i q = _mm512_and_si512(_mm512_srl_epi32(z, _mm_cvtsi32_si128(shift + 8 * i)), low4);
        store16(out + 16 * i, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), sv), mv));
      }
#elif defined(TM_AVX2)
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
      const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
      const __m256i low4 = _mm256_set1_epi32(0xF);
      for (int i = 0; i < 4; ++i) {
        const __m256i q = _mm256_and_si256(_mm256_srl_epi32(raw, _mm_cvtsi32_si128(shift + 4 * i)), low4);
        store8(out + 8 * i, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), sv), mv));
      }
#else
      const uint32_t* words = reinterpret_cast<const uint32_t*>(chunk);
      for (int j = 0; j < 32; ++j)
        out[j] = static_cast<Out>(static_cast<float>((words[j % 8] >> (shift + 4 * (j / 8))) & 0xF) * s + m);
#endif
    }
  } else {
    const int8_t* w = reinterpret_cast<const int8_t*>(p.qs) + row * k;
    for (int64_t g = 0; g < p.groups; ++g) {
      const float s = sc[g], m = mn ? mn[g] : 0.f;
      const int8_t* src = w + g * p.group;
      Out* out = dst + g * p.group;
#if defined(TM_AVX512)
      const __m512 sv = _mm512_set1_ps(s), mv = _mm512_set1_ps(m);
      for (int64_t j = 0; j < p.group; j += 16) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
        store16(out + j, _mm512_add_ps(_mm512_mul_ps(q, sv), mv));
      }
#elif defined(TM_AVX2)
      const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
      for (int64_t j = 0; j < p.group; j += 8) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j))));
        store8(out + j, _mm256_add_ps(_mm256_mul_ps(q, sv), mv));
      }
#else
      for (int64_t j = 0; j < p.group; ++j) out[j] = static_cast<Out>(static_cast<float>(src[j]) * s + m);
#endif
    }
  }
}

// ------------------------------------------------------------------ batches: tiles unpacked into L1
//
// Decode batches of a dozen to a hundred rows: the GEMV tiles above would unpack every weight
// tile again for each 4 activation rows, and dequantising the whole weight for PyTorch's GEMM
// writes (and reads back) a float copy of it in memory on every call. Here each thread unpacks
// a few weight rows at a time into a buffer that stays in L1/L2 and multiplies every
// activation row with it before unpacking the next: the weight is read from memory once per
// call, as 4 bits, and never written.
//
// bf16: activations in bfloat16 times the weight rounded to bfloat16 (what the dequantised
// bfloat16 model multiplies), products summed in float32 on AVX512_BF16 dot products; otherwise
// float32 activations and weights.

// Micro-tiles: NR weight rows x MR activation rows of dot products along k, NR * MR accumulator
// registers plus NR + MR for the operands (16 registers on AVX2, 32 on AVX-512). Measured
// (3072x576, 48 rows, ms): AVX2 2x6 0.94-1.00, 3x3 1.01, 4x3 0.92-1.65 (spills); AVX-512 4x4
// 0.55-0.68, 4x5 1.11 (spills).
#if defined(TM_AVX512)
constexpr int GEMM_NR = 4, GEMM_MR = 4;
#elif defined(TM_AVX2)
constexpr int GEMM_NR = 2, GEMM_MR = 6;
#else
constexpr int GEMM_NR = 4, GEMM_MR = 4;
#endif
constexpr int64_t GEMM_NB = 8;  // weight rows unpacked per block (18 KiB of float32 at 576 inputs)

// out[r * MR + m] = the lanes of acc[r][m] summed (acc: NR x MR registers, flattened).
template <typename V>
inline void reduce_tile(V* acc, int count, float* out) {
  int i = 0;
#if defined(TM_AVX512)
  if constexpr (sizeof(V) == 64) {
    for (; i + 4 <= count; i += 4)
      _mm_storeu_ps(out + i, tokenmill::hsum4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
    for (; i < count; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
    return;
  }
#endif
#if defined(TM_AVX2)
  if constexpr (sizeof(V) == 32) {
    for (; i + 4 <= count; i += 4) _mm_storeu_ps(out + i, tokenmill::hsum4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
    for (; i < count; ++i) out[i] = tokenmill::hsum8(acc[i]);
    return;
  }
#endif
  if constexpr (sizeof(V) == sizeof(float))
    for (; i < count; ++i) out[i] = acc[i];
}

// float32: NR weight rows (`k` apart) x MR activation rows (`ldx` apart), k a multiple of the
// register width (8; 16 on AVX-512: groups are 16 or 32 values).
template <int NR, int MR>
inline void gemm_tile_f32(const float* x, int64_t ldx, const float* w, int64_t k, float* out) {
#if defined(TM_AVX512)
  __m512 acc[NR * MR];
  for (int i = 0; i < NR * MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) {
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm512_loadu_ps(w + r * k + j);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + j);
      for (int r = 0; r < NR; ++r) acc[r * MR + m] = _mm512_fmadd_ps(wv[r], xv, acc[r * MR + m]);
    }
  }
#elif defined(TM_AVX2)
  __m256 acc[NR * MR];
  for (int i = 0; i < NR * MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 8) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = _mm256_loadu_ps(w + r * k + j);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + j);
      for (int r = 0; r < NR; ++r) acc[r * MR + m] = _mm256_fmadd_ps(wv[r], xv, acc[r * MR + m]);
    }
  }
#else
  float acc[NR * MR] = {};
  for (int64_t j = 0; j < k; ++j)
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MR; ++m) acc[r * MR + m] += w[r * k + j] * x[m * ldx + j];
#endif
  reduce_tile(acc, NR * MR, out);
}

#if defined(TM_AVX512) && defined(__AVX512BF16__)
#define TM_BF16_DOT 1
// bfloat16 pairs, 32 values per dot-product instruction; a trailing 16 (k = 16 mod 32) through
// a masked load.
template <int NR, int MR>
inline void gemm_tile_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t k, float* out) {
  __m512 acc[NR * MR];
  for (int i = 0; i < NR * MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += 32) {
    const __mmask32 mask = j + 32 <= k ? 0xFFFFFFFFu : 0xFFFFu;
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * k + j);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + j);
      for (int r = 0; r < NR; ++r) acc[r * MR + m] = _mm512_dpbf16_ps(acc[r * MR + m], wv[r], xv);
    }
  }
  reduce_tile(acc, NR * MR, out);
}
#endif

// A tile of GEMM_NR weight rows x `mr` (<= GEMM_MR) activation rows: the tile for that many rows.
template <typename X, typename Tile, int MR = GEMM_MR>
inline void tile_rows(const X* x, int64_t k, const X* w, int mr, float* out, Tile tile) {
  if constexpr (MR > 1) {
    if (mr < MR) return tile_rows<X, Tile, MR - 1>(x, k, w, mr, out, tile);
  }
  tile.template operator()<MR>(x, k, w, out);
}

// Threads take blocks of GEMM_NB weight rows; each block is unpacked (`unpack(row, dst)`) into
// the thread's buffer, then multiplied with every activation row, GEMM_NR x GEMM_MR at a time.
template <typename X, typename Y, typename Unpack, typename Tile>
void gemm_blocks(const Packed& p, const X* x, Y* y, int64_t rows, Unpack unpack, Tile tile) {
  const int64_t k = p.k, blocks = (p.n + GEMM_NB - 1) / GEMM_NB;
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    std::vector<X> buf(GEMM_NB * k);  // this thread's unpacked rows (past a short last block: unused)
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t n0 = blk * GEMM_NB, nb = std::min(GEMM_NB, p.n - n0);
      for (int64_t r = 0; r < nb; ++r) unpack(n0 + r, buf.data() + r * k);
      for (int64_t r0 = 0; r0 < nb; r0 += GEMM_NR) {
        const int nr = static_cast<int>(std::min<int64_t>(GEMM_NR, nb - r0));
        for (int64_t m0 = 0; m0 < rows; m0 += GEMM_MR) {
          const int mr = static_cast<int>(std::min<int64_t>(GEMM_MR, rows - m0));
          float out[GEMM_NR * GEMM_MR];
          tile_rows(x + m0 * k, k, buf.data() + r0 * k, mr, out, tile);
          for (int r = 0; r < nr; ++r)
            for (int m = 0; m < mr; ++m) y[(m0 + m) * p.n + n0 + r0 + r] = static_cast<Y>(out[r * mr + m]);
        }
      }
    }
  });
}

struct F32Tile {
  template <int MR>
  void operator()(const float* x, int64_t k, const float* w, float* out) const {
    gemm_tile_f32<GEMM_NR, MR>(x, k, w, k, out);
  }
};
#if defined(TM_BF16_DOT)
struct BF16Tile {
  template <int MR>
  void operator()(const c10::BFloat16* x, int64_t k, const c10::BFloat16* w, float* out) const {
    gemm_tile_bf16<GEMM_NR, MR>(x, k, w, k, out);
  }
};
#endif

// The blocked kernel: x float32 (bf16, builds with bfloat16 dot products only: x bfloat16) into y.
void gemm(const Packed& p, const Tensor& x, Tensor& y, bool bf16) {
  const int64_t rows = x.size(0);
#if defined(TM_BF16_DOT)
  if (bf16) {
    using B = c10::BFloat16;
    gemm_blocks(p, x.data_ptr<B>(), y.data_ptr<B>(), rows, [&](int64_t row, B* dst) { dequantize_row(p, row, dst); },
                BF16Tile{});
    return;
  }
#endif
  auto unpack = [&](int64_t row, float* dst) { dequantize_row(p, row, dst); };
  if (y.scalar_type() == at::kFloat) gemm_blocks(p, x.data_ptr<float>(), y.data_ptr<float>(), rows, unpack, F32Tile{});
  else gemm_blocks(p, x.data_ptr<float>(), y.data_ptr<c10::BFloat16>(), rows, unpack, F32Tile{});
}

// Rows `ids` (all rows when absent) of the packed weight as float32 [rows, k], or rounded to
// bfloat16 (as .to(bfloat16) rounds) when `bf16`: embedding lookups, and the weights that
// batches past the GEMV kernel multiply in PyTorch's GEMM.
Tensor quant_dequantize(Tensor qs, Tensor scale, c10::optional<Tensor> minv, int64_t bits, int64_t group, int64_t k,
                        c10::optional<Tensor> ids, bool bf16) {
  const Packed p = check_packed(qs, scale, minv, bits, group, k);
  Tensor idc;
  const int64_t* id = nullptr;
  int64_t rows = p.n;
  if (ids.has_value()) {
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->dim() == 1, "quant_dequantize: ids must be int64 [rows]");
    idc = ids->contiguous();
    id = idc.data_ptr<int64_t>();
    rows = idc.numel();
    for (int64_t i = 0; i < rows; ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < p.n, "quant_dequantize: row ", id[i], " out of range [0, ", p.n, ")");
  }
  Tensor out = at::empty({rows, k}, scale.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t row = id ? id[i] : i;
      if (bf16) dequantize_row(p, row, out.data_ptr<c10::BFloat16>() + i * k);
      else dequantize_row(p, row, out.data_ptr<float>() + i * k);
    }
  });
  return out;
}

// ------------------------------------------------------------------ the op

// Which kernel multiplies how many rows, per build; measured on a 3072x576 Q4_1 weight, 2 cores
// of an AMD EPYC with AVX-512 + AVX512_BF16, ms per call (bench/quant_linear.py; the AVX2 build
// on the same CPU):
//   float32, AVX-512 build: 2 rows GEMV 0.063 / blocks 0.093; 4 rows 0.116 / 0.090;
//     48 rows blocks 0.55 / dequantise + GEMM 1.04; 256 rows 3.3 / 4.4; 512 rows 12.0 / 10.1.
//   float32, AVX2 build: 8 rows GEMV 0.21 / blocks 0.23; 16 rows 0.42 / 0.37;
//     48 rows blocks 0.93 / dequantise + GEMM 1.02; 128 rows 2.6 / 2.3.
//   bfloat16 weights (AVX512_BF16): 16 rows blocks 0.16 / dequantise + GEMM 0.19; 32 rows
//     0.27 / 0.26; 48 rows 0.37 / 0.30.
#if defined(TM_AVX512)
constexpr int64_t GEMV_MAX_ROWS = 3, BLOCKS_MAX_ROWS = 256;
#else
constexpr int64_t GEMV_MAX_ROWS = 8, BLOCKS_MAX_ROWS = 64;
#endif
constexpr int64_t EXACT_BF16_ROWS = 8;    // bfloat16 batches up to this many rows: float32 weights
constexpr int64_t BF16_BLOCKS_MAX_ROWS = 32;

// x [rows, k] (float32 or bfloat16) @ W^T for a packed W [n, k] -> [rows, n] in x's dtype.
// Float32 weights times float32 activations (exact mode), except `bf16`: bfloat16 batches of more
// than EXACT_BF16_ROWS rows multiply the weight rounded to bfloat16 (what the dequantised
// bfloat16 model multiplies), for the CPU's bfloat16 dot products. The kernel is chosen by rows:
// the GEMV tiles, the blocked kernel, or (prefill) the weight dequantised for the call into
// PyTorch's GEMM, whose packing and cache blocking win once a weight serves hundreds of rows.
Tensor quant_linear(Tensor x, Tensor qs, Tensor scale, c10::optional<Tensor> minv, int64_t bits, int64_t group,
                    bool bf16) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be [rows, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16");
  const Packed p = check_packed(qs, scale, minv, bits, group, x.size(1));
  const int64_t rows = x.size(0);
  if (rows == 0 || p.n == 0) return at::empty({rows, p.n}, x.options());
  const bool bf16_weight = bf16 && x.scalar_type() == at::kBFloat16 && rows > EXACT_BF16_ROWS;
  const Tensor xs = bf16_weight ? x.contiguous() : x.contiguous().to(at::kFloat);
#if defined(TM_BF16_DOT)
  const int64_t blocks_max = bf16_weight ? BF16_BLOCKS_MAX_ROWS : BLOCKS_MAX_ROWS;
#else
  const int64_t blocks_max = bf16_weight ? 0 : BLOCKS_MAX_ROWS;  // no bfloat16 dot products here: the GEMM
#endif
  if (rows > blocks_max)  // the weight dequantised for the call, the output in x's dtype
    return at::linear(xs, quant_dequantize(qs, scale, minv, bits, group, p.k, c10::nullopt, bf16_weight))
        .to(x.scalar_type());
  Tensor y = at::empty({rows, p.n}, x.options());
  if (!bf16_weight && rows <= GEMV_MAX_ROWS) gemv_tiles(p, xs, y);
  else gemm(p, xs, y, bf16_weight);
  return y;
}

}  // namespace

at::Tensor tokenmill::quant_linear(at::Tensor x, at::Tensor qs, at::Tensor scale, c10::optional<at::Tensor> minv,
                                   int64_t bits, int64_t group, bool bf16) {
  return ::quant_linear(x, qs, scale, minv, bits, group, bf16);
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("quant_linear(Tensor x, Tensor qs, Tensor scale, Tensor? minv, int bits, int group, bool bf16=False) -> Tensor");
  m.def("quant_dequantize(Tensor qs, Tensor scale, Tensor? minv, int bits, int group, int k, Tensor? ids, "
        "bool bf16=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
