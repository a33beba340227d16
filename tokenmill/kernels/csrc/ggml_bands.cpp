// Q6_K in batches: sixteen activation rows in one zmm register (AVX-512 builds with VNNI), or
// eight in one ymm register (AVX2 builds: the second kernel below).
//
// The row kernel (ggml_ops.cpp's dot_q6_k) spends two instructions on every 32 products of an
// activation row (vpmaddubsw, then vpdpwssd for the per-16 scales): 140-190 GOP/s on a Zen 4 EPYC
// where the grouped 4-bit kernels reach 540, and Q6_K has no group kernel (one was slower from
// memory at decode). Here the roles of the two sides turn, as in llama.cpp's "tiled" kernels (our
// own code): the activation rows of a batch are laid out once per product in bands of sixteen, 4
// bytes of each row in each 32-bit lane; a weight row's super-block is unpacked to one byte per
// 6-bit value; and each vpdpbusd multiplies 4 values of one weight row (broadcast) with those of
// 16 activation rows: 64 products an instruction. Each sub-block's exact integer sums take its
// scale (vpmulld) after the -32 comes off (32 times the activations' sums of 16, as the row kernel
// takes it), so each output's integer sum per super-block is the row kernel's, and both then take
// the same float steps (acc = fma(d * dx, sum, acc), super-block after super-block): an output is
// the same bits whichever kernel ran it, and a request's tokens do not depend on its batch.

#include <ATen/Parallel.h>

#include <algorithm>

#include "ggml_common.h"

namespace tokenmill::ggml {

#if defined(TM_AVX2)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TM_ZMM_BANDS 1
constexpr bool BIASED = false;  // vpdpbusd: the weights unsigned (0..63), the activations as they are
#else
constexpr bool BIASED = true;  // vpmaddubsw: the activations unsigned (plus 128), the weights q - 32
#endif

bool has_bands() { return true; }

void make_bands(Bands& bands, const Act& a, int64_t rows) {
  const int64_t k = a.k, nb = k / QK_K, count = (rows + BAND - 1) / BAND;
  bands.k = k;
  bands.count = count;
  bands.q.assign(count * BAND * k, 0);  // (a last band's missing rows: zeros, their outputs dropped)
  bands.bsums.assign(BIASED ? 0 : count * BAND * (k / 16), 0);
  bands.d.assign(count * BAND * nb, 0.f);
  at::parallel_for(0, rows, BAND, [&](int64_t r0, int64_t r1) {  // (the calling thread alone in a team)
    for (int64_t m = r0; m < r1; ++m) {
      const int64_t c = m / BAND, i = m % BAND;
      const int8_t* x = a.qrow(m);
      int8_t* q = bands.q.data() + c * BAND * k + 4 * i;
      if constexpr (BIASED) {
        uint32_t word;
        for (int64_t w = 0; w < k / 4; ++w) {
          std::memcpy(&word, x + 4 * w, 4);
          word ^= 0x80808080u;  // each byte plus 128, as unsigned
          std::memcpy(q + 4 * BAND * w, &word, 4);
        }
      } else {
        for (int64_t w = 0; w < k / 4; ++w) std::memcpy(q + 4 * BAND * w, x + 4 * w, 4);
        const int16_t* bs = a.bsrow(m);
        int32_t* bsums = bands.bsums.data() + c * BAND * (k / 16) + i;
        for (int64_t j = 0; j < k / 16; ++j) bsums[BAND * j] = bs[j];
      }
      const float* d = a.drow(m);
      float* dd = bands.d.data() + c * BAND * nb + i;
      for (int64_t b = 0; b < nb; ++b) dd[BAND * b] = d[b];
    }
  });
}

#if defined(TM_ZMM_BANDS)
namespace {

constexpr int ROWS = 8;            // weight rows a pass (their sums in 8 + 8 zmm registers)
constexpr int64_t MAX_BANDS = 2;   // bands a pass (their float sums kept in memory)

// One row's super-block of Q6_K: its 256 values (0..63) one byte each in order (q6_k_half for each
// half), its 16 scales as int32 and its d.
inline void unpack_super_block(const uint8_t* blk, uint8_t* q, int32_t* sc, float& d) {
  for (int h = 0; h < 2; ++h) {
    __m256i v[4];
    q6_k_half(load32(blk + 64 * h), load32(blk + 64 * h + 32), load32(blk + 128 + 32 * h), v);
    for (int s = 0; s < 4; ++s) _mm256_store_si256(reinterpret_cast<__m256i*>(q + 128 * h + 32 * s), v[s]);
  }
  _mm512_store_si512(sc, _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
  d = f16(blk + 208);
}

inline __m512i bcast_word(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Weight rows [0, nr) (nr <= ROWS, rows of row_bytes) times the activation rows of bands
// [c0, c0 + nc) (nc <= MAX_BANDS): acc[c][t] lane i, weight row t times the band's row i.
void bands_pass(const uint8_t* w, int64_t row_bytes, int64_t nr, const Bands& bands, int64_t c0, int64_t nc,
                __m512 (*acc)[ROWS]) {
  const int64_t k = bands.k, nb = k / QK_K;
  alignas(64) uint8_t q[ROWS][QK_K];
  alignas(64) int32_t sc[ROWS][16];
  float dw[ROWS];
  for (int64_t c = 0; c < nc; ++c)
    for (int t = 0; t < ROWS; ++t) acc[c][t] = _mm512_setzero_ps();
  for (int t = static_cast<int>(nr); t < ROWS; ++t) {  // rows past the weight's: zeros (outputs dropped)
    std::memset(q[t], 0, QK_K);
    std::memset(sc[t], 0, sizeof sc[t]);
    dw[t] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    for (int t = 0; t < nr; ++t) unpack_super_block(w + t * row_bytes + b * 210, q[t], sc[t], dw[t]);
    for (int64_t c = 0; c < nc; ++c) {
      const int8_t* x = bands.q.data() + (c0 + c) * BAND * k + b * QK_K * BAND;  // word e at 64 e
      const int32_t* bs = bands.bsums.data() + (c0 + c) * BAND * (k / 16) + b * 16 * BAND;
      __m512i tot[ROWS];
      for (int t = 0; t < ROWS; ++t) tot[t] = _mm512_setzero_si512();
      for (int j = 0; j < 16; ++j) {  // sub-blocks of 16 values: 4 words
        __m512i s[ROWS];
        for (int t = 0; t < ROWS; ++t) s[t] = _mm512_setzero_si512();
        for (int e = 0; e < 4; ++e) {
          const __m512i xs = _mm512_loadu_si512(x + 64 * (4 * j + e));
          for (int t = 0; t < ROWS; ++t) s[t] = _mm512_dpbusd_epi32(s[t], bcast_word(q[t] + 16 * j + 4 * e), xs);
        }
        const __m512i bias = _mm512_slli_epi32(_mm512_loadu_si512(bs + BAND * j), 5);  // 32 * the sums of 16
        for (int t = 0; t < ROWS; ++t)
          tot[t] = _mm512_add_epi32(tot[t], _mm512_mullo_epi32(_mm512_sub_epi32(s[t], bias), _mm512_set1_epi32(sc[t][j])));
      }
      const __m512 dx = _mm512_loadu_ps(bands.d.data() + ((c0 + c) * nb + b) * BAND);
      for (int t = 0; t < ROWS; ++t)
        acc[c][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dw[t]), dx), _mm512_cvtepi32_ps(tot[t]), acc[c][t]);
    }
  }
}

}  // namespace

void q6_k_bands(const uint8_t* w, int64_t row_bytes, int64_t nr, const Bands& bands, int64_t m0, int64_t m1, float* out,
                int64_t ld) {
  TORCH_CHECK(m0 % BAND == 0 && m1 <= bands.count * BAND, "q6_k_bands: rows out of the bands");
  __m512 acc[MAX_BANDS][ROWS];
  alignas(64) float lanes[ROWS][BAND];
  for (int64_t r = 0; r < nr; r += ROWS) {
    const int64_t rows = std::min<int64_t>(ROWS, nr - r);
    for (int64_t c0 = m0 / BAND; c0 * BAND < m1; c0 += MAX_BANDS) {
      const int64_t nc = std::min<int64_t>(MAX_BANDS, (m1 - c0 * BAND + BAND - 1) / BAND);
      bands_pass(w + r * row_bytes, row_bytes, rows, bands, c0, nc, acc);
      for (int64_t c = 0; c < nc; ++c) {
        for (int t = 0; t < ROWS; ++t) _mm512_store_ps(lanes[t], acc[c][t]);
        const int64_t first = (c0 + c) * BAND, last = std::min(m1, first + BAND);
        for (int64_t m = first; m < last; ++m)
          for (int64_t t = 0; t < rows; ++t) out[m * ld + r + t] = lanes[t][m - first];
      }
    }
  }
}

#else  // AVX2: eight activation rows to a ymm register

// vpmaddubsw multiplies an unsigned byte by a signed one and adds pairs into int16: with the
// activations stored plus 128 (1..255) and the weights as q - 32 (-32..31), two such pairs' sums
// added stay within int16 (|.| <= 4 * 255 * 32 = 32640), so each sub-block of 16 values takes
// four vpmaddubsw, two vpaddw and two vpmaddwd (the scale) for eight activation rows: six
// multiplies for 128 products where the row kernel (ggml_ops.cpp's dot_q6_k) spends eight. The
// +128 comes off once per weight row and super-block: 128 * sum_j sc_j * sum(q - 32 of sub-block j).
// Each output's integer sum per super-block is the row kernel's; the float steps are its own.
namespace {

constexpr int ROWS = 8;            // weight rows a pass (their sums in 8 ymm registers a half band)
constexpr int64_t MAX_BANDS = 2;   // bands a pass (their float sums kept in memory)

// One row's super-block of Q6_K: its 256 values as q - 32 (signed) in order, its 16 scales as int16,
// the correction for the activations' +128 and its d.
inline void unpack_super_block(const uint8_t* blk, int8_t* q, int16_t* sc, int32_t& bias, float& d) {
  const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  const __m256i m32 = _mm256_set1_epi8(32), ones = _mm256_set1_epi8(1);
  __m256i tot = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    __m256i v[4];
    q6_k_half(load32(blk + 64 * h), load32(blk + 64 * h + 32), load32(blk + 128 + 32 * h), v);
    const __m256i half_sc = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(h ? _mm_unpackhi_epi64(sc8, sc8) : sc8));
    for (int g = 0; g < 4; ++g) {  // 32 values: sub-blocks 8h + 2g and 8h + 2g + 1
      const __m256i s = _mm256_sub_epi8(v[g], m32);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 128 * h + 32 * g), s);
      const __m256i pairs = _mm256_maddubs_epi16(ones, s);
      tot = _mm256_add_epi32(tot, _mm256_madd_epi16(pairs, _mm256_shuffle_epi8(half_sc, load32(Q6_PICK[g]))));
    }
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(sc), _mm256_cvtepi8_epi16(sc8));
  bias = 128 * hsum_i32(tot);
  d = f16(blk + 208);
}

inline __m256i bcast_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Weight rows [0, nr) (nr <= ROWS) times the activation rows of bands [c0, c0 + nc) (nc <= MAX_BANDS)
// below row m1: acc[((c * 2 + half) * ROWS + t) * 8 + i], weight row t times the band's row 8 * half + i
// (a half band wholly past m1 is skipped: a batch of 8 to 15 rows costs half a band, not a band).
void bands_pass(const uint8_t* w, int64_t row_bytes, int64_t nr, const Bands& bands, int64_t c0, int64_t nc,
                int64_t m1, float* acc) {
  const int64_t k = bands.k, nb = k / QK_K;
  alignas(32) int8_t q[ROWS][QK_K];
  alignas(32) int16_t sc[ROWS][16];
  int32_t bias[ROWS];
  float dw[ROWS];
  std::fill(acc, acc + nc * 2 * ROWS * 8, 0.f);
  for (int t = static_cast<int>(nr); t < ROWS; ++t) {  // rows past the weight's: zeros (outputs dropped)
    std::memset(q[t], 0, QK_K);
    std::memset(sc[t], 0, sizeof sc[t]);
    bias[t] = 0;
    dw[t] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    for (int t = 0; t < nr; ++t) unpack_super_block(w + t * row_bytes + b * 210, q[t], sc[t], bias[t], dw[t]);
    for (int64_t c = 0; c < nc; ++c) {
      const int8_t* xb = bands.q.data() + (c0 + c) * BAND * k + b * QK_K * BAND;  // word e at 64 e
      const float* dx = bands.d.data() + ((c0 + c) * nb + b) * BAND;
      const int64_t halves = std::min<int64_t>(2, (m1 - (c0 + c) * BAND + 7) / 8);
      for (int half = 0; half < halves; ++half) {
        const int8_t* x = xb + 32 * half;
        __m256i tot[ROWS];
        for (int t = 0; t < ROWS; ++t) tot[t] = _mm256_setzero_si256();
        for (int j = 0; j < 16; ++j) {  // sub-blocks of 16 values: 4 words
          const __m256i x0 = load32(x + 64 * (4 * j)), x1 = load32(x + 64 * (4 * j + 1));
          const __m256i x2 = load32(x + 64 * (4 * j + 2)), x3 = load32(x + 64 * (4 * j + 3));
          for (int t = 0; t < ROWS; ++t) {
            const int8_t* qt = q[t] + 16 * j;
            const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(x0, bcast_word(qt)),
                                                 _mm256_maddubs_epi16(x1, bcast_word(qt + 4)));
            const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(x2, bcast_word(qt + 8)),
                                                 _mm256_maddubs_epi16(x3, bcast_word(qt + 12)));
            const __m256i s = _mm256_set1_epi16(sc[t][j]);
            tot[t] = _mm256_add_epi32(tot[t], _mm256_add_epi32(_mm256_madd_epi16(p01, s), _mm256_madd_epi16(p23, s)));
          }
        }
        const __m256 d8 = _mm256_loadu_ps(dx + 8 * half);
        for (int t = 0; t < ROWS; ++t) {
          float* a = acc + ((c * 2 + half) * ROWS + t) * 8;
          const __m256 sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(tot[t], _mm256_set1_epi32(bias[t])));
          _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(dw[t]), d8), sum, _mm256_loadu_ps(a)));
        }
      }
    }
  }
}

}  // namespace

void q6_k_bands(const uint8_t* w, int64_t row_bytes, int64_t nr, const Bands& bands, int64_t m0, int64_t m1, float* out,
                int64_t ld) {
  TORCH_CHECK(m0 % BAND == 0 && m1 <= bands.count * BAND, "q6_k_bands: rows out of the bands");
  alignas(32) float acc[MAX_BANDS * 2 * ROWS * 8];
  for (int64_t r = 0; r < nr; r += ROWS) {
    const int64_t rows = std::min<int64_t>(ROWS, nr - r);
    for (int64_t c0 = m0 / BAND; c0 * BAND < m1; c0 += MAX_BANDS) {
      const int64_t nc = std::min<int64_t>(MAX_BANDS, (m1 - c0 * BAND + BAND - 1) / BAND);
      bands_pass(w + r * row_bytes, row_bytes, rows, bands, c0, nc, m1, acc);
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t first = (c0 + c) * BAND, last = std::min(m1, first + BAND);
        for (int64_t m = first; m < last; ++m) {
          const int64_t half = (m - first) / 8, i = (m - first) % 8;
          for (int64_t t = 0; t < rows; ++t) out[m * ld + r + t] = acc[((c * 2 + half) * ROWS + t) * 8 + i];
        }
      }
    }
  }
}

#endif  // TM_ZMM_BANDS

#else  // no band kernel: BlockProduct keeps the row kernel

bool has_bands() { return false; }
void make_bands(Bands&, const Act&, int64_t) { TORCH_CHECK(false, "make_bands: this build has no band kernel"); }
void q6_k_bands(const uint8_t*, int64_t, int64_t, const Bands&, int64_t, int64_t, float*, int64_t) {
  TORCH_CHECK(false, "q6_k_bands: this build has no band kernel");
}

#endif

}  // namespace tokenmill::ggml
