// What ggml_ops.cpp (one weight row at a time) and ggml_groups.cpp (eight rows interleaved) share:
// GGML's block formats, the activations quantised to 8-bit blocks, and the integer dot helpers.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define TM_AVX2 1
#endif

namespace tokenmill::ggml {

// GGML's type codes.
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14;
constexpr int64_t QK = 32, QK_K = 256;
constexpr int64_t INT8_MAX_ROWS = 32;  // activation rows per pass over the weight

struct Format {
  int64_t elems;  // weights per block
  int64_t bytes;  // bytes per block
};

constexpr int64_t X8 = 256;  // the flag of a weight whose rows are interleaved eight by eight (below)

inline Format format_of(int64_t type) {  // (the same for a type's interleaved form)
  switch (type & ~X8) {
    case Q4_0: return {QK, 18};
    case Q4_1: return {QK, 20};
    case Q5_0: return {QK, 22};
    case Q5_1: return {QK, 24};
    case Q8_0: return {QK, 34};
    case Q4_K: return {QK_K, 144};
    case Q5_K: return {QK_K, 176};
    case Q6_K: return {QK_K, 210};
    default: TORCH_CHECK(false, "block_linear: GGML type ", type, " is not served in its own blocks");
  }
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Rows of activations quantised for one weight type: q [rows, k] int8; d [rows, k / block];
// s [rows, k / 32] (d times the block's sum: Q4_1's and Q5_1's min, Q4_0's -8, Q5_0's -16); bsums [rows, k / 16]
// (K-quants' mins).
struct Act {
  int64_t k = 0, block = 0;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> bsums;
  const int8_t* qrow(int64_t m) const { return q.data() + m * k; }
  const float* drow(int64_t m) const { return d.data() + m * (k / block); }
  const float* srow(int64_t m) const { return s.data() + m * (k / QK); }
  const int16_t* bsrow(int64_t m) const { return bsums.data() + m * (k / 16); }
};

Act quantise(const float* x, int64_t rows, int64_t k, int64_t block, bool sums);
// The same into `a`, its buffers reused (no allocation once they are big enough).
void quantise_into(Act& a, const float* x, int64_t rows, int64_t k, int64_t block, bool sums);

// A kernel: weight rows (one, or a group of eight) times MR activation rows from m0.
using DotFn = void (*)(const uint8_t*, const Act&, int64_t, float*);
// Two groups of eight rows (the second `next` bytes after the first) times MR activation rows.
using WideDotFn = void (*)(const uint8_t*, int64_t, const Act&, int64_t, float*);

// ------------------------------------------------------------------ AMX tiles (ggml_amx.cpp)

// Two groups of eight rows (the second `next` bytes after the first) times 16 activation rows
// from m0, on AMX tiles: out[m * 16 + r], the same bits as the zmm pair kernel's. Between
// amx_begin() and amx_end() on the calling thread.
using AmxPairFn = void (*)(const uint8_t*, int64_t, const Act&, int64_t, float*);
// The kernel for `type` (plain; Q4_0, Q4_1, Q8_0, Q4_K, Q5_K), or nullptr: no AMX in the build or the CPU,
// the OS refused the tile state, or TOKENMILL_AMX=0.
AmxPairFn amx_pair(int64_t type);
void amx_begin();  // the tile configuration, on this thread
void amx_end();    // the tiles released

// ------------------------------------------------------------------ Q6_K in bands (ggml_bands.cpp)

// A batch's activation rows (quantised for a K-quant) in bands of BAND rows, each band's values
// transposed so that one 64-byte load holds the same 4 values of its 16 rows (the last band's
// missing rows zero).
constexpr int64_t BAND = 16;
struct Bands {
  int64_t k = 0, count = 0;
  std::vector<int8_t> q;       // band c's word w (values 4w..4w+3) of its row i at c * BAND * k + 64 * w + 4 * i
  // (AVX2 builds store each value plus 128, as unsigned bytes, and no bsums)
  std::vector<int32_t> bsums;  // (c * (k / 16) + j) * BAND + i: row i's sum of its values 16j..16j+15
  std::vector<float> d;        // (c * (k / 256) + b) * BAND + i: row i's scale of super-block b
};
// Whether this build has a band kernel (AVX-512 with VNNI, or AVX2).
bool has_bands();
void make_bands(Bands& bands, const Act& a, int64_t rows);
// Q6_K weight rows [0, nr) (plain rows of row_bytes) times the bands' activation rows [m0, m1)
// (m0 a multiple of BAND): out[m * ld + r]. The same bits as the row kernel's, output by output.
void q6_k_bands(const uint8_t* w, int64_t row_bytes, int64_t nr, const Bands& bands, int64_t m0, int64_t m1, float* out,
                int64_t ld);

// A block weight [n, k] times a few activation rows, as units of work that threads share: the
// weight's groups of eight interleaved rows, then its single rows. block_linear hands the units
// to at::parallel_for; the decode loop (decode_loop.cpp) to the threads of its one team.
class BlockProduct {
 public:
  BlockProduct(const at::Tensor& blocks, int64_t type, int64_t k);  // (checks the blocks)
  // The activations x [rows, k] quantised for this weight's type, once per product.
  void quantise(const float* x, int64_t rows);
  int64_t units() const { return groups_ + n_ - 8 * groups_; }
  int64_t grain() const { return groups_ > 0 ? 2 : 16; }
  int64_t n() const { return n_; }
  // Units [u0, u1) times activation rows [m0, m1): out[m * ld + r] for each weight row r.
  void run(float* out, int64_t ld, int64_t m0, int64_t m1, int64_t u0, int64_t u1) const;

 private:
  const uint8_t* w_;
  int64_t type_, n_, k_, row_bytes_, groups_;
  DotFn dots_[4] = {}, group_dots_[4] = {};
  WideDotFn wide_dots_[4] = {};
  AmxPairFn amx_ = nullptr;  // 16 activation rows of two groups at a time, where the CPU has AMX
  Act act_;
  Bands bands_;  // Q6_K batches on builds with the band kernel (bands_.count == 0: none)
};

// ------------------------------------------------------------------ eight rows interleaved (ggml_groups.cpp)

// A weight of type `type | X8` holds its first n / 8 * 8 rows in interleaved groups of eight (the
// same bytes as the rows, ggml_groups.cpp says how); the remaining n % 8 rows follow as they are.

// Whether `type` (a plain GGML type) has group kernels (and so an X8 layout).
bool has_groups(int64_t type);
// The kernel for one group of `type` (plain) times MR (1..4) activation rows: out[m * 8 + r].
DotFn group_dot(int64_t type, int mr);
// Two groups at once (AVX-512 builds with VNNI; every grouped type): the second group
// `group_bytes` after the first, out[m * 16 + r] (r < 8: the first group's rows). Each lane's
// arithmetic is group_dot's, so the outputs are the same bits; nullptr where there is none.
WideDotFn wide_group_dot(int64_t type, int mr);
// Row r of a weight of `type` (X8 or not) as plain blocks: a pointer into the weight, or `scratch`
// (row_bytes) holding the row taken out of its group.
const uint8_t* plain_row(const uint8_t* w, int64_t type, int64_t n, int64_t row_bytes, int64_t r, uint8_t* scratch);

// ------------------------------------------------------------------ integer dot helpers

#if defined(TM_AVX2)
inline __m256i nibbles32(const uint8_t* p) {  // 16 bytes -> 32 values: low nibbles, then high nibbles
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// acc + the products of unsigned bytes u and signed bytes s, four at a time, to 8 int32; and
// acc + the products of int16 pairs. With VNNI (AVX512_VNNI + VL, or AVX-VNNI) each is one
// instruction (vpdpbusd, vpdpwssd); on plain AVX2, maddubs + madd + add. Every use here keeps
// maddubs's int16 pair sums below saturation (|u| < 128, |s| <= 127: 2 * 127 * 127 < 32768),
// so both give the same integers.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TM_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#elif defined(__AVXVNNI__)
#define TM_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#else
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline __m256i dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif

// Pairwise products of unsigned a (< 128) and signed b, summed to 8 int32.
inline __m256i dot_us(__m256i a, __m256i b) { return dpbusd(_mm256_setzero_si256(), a, b); }
// The same for signed a (> -128 or = -128) and signed b (> -128): |a| times b with a's sign on b.
inline __m256i dot_ss(__m256i a, __m256i b) { return dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)); }

// Q6_K: one half (128 values) of a super-block as four registers of 32 values (0..63) in order,
// value 32s + l from the low 4 bits in ql's byte 32 (s % 2) + l (l0: bytes 0-31, l1: 32-63; the
// low nibble for s < 2, the high one after) and the top 2 in qh's byte l (hb) at bit 2s.
inline void q6_k_half(__m256i l0, __m256i l1, __m256i hb, __m256i v[4]) {
  // Each value's two high bits moved to bits 4-5 of its byte by one 16-bit shift and a 0x30 mask
  // (bits shifted in from the neighbouring byte land outside the mask): 7 operations for the four
  // where shifting down, masking with 3 and shifting up took 11 (Zen 1 runs each 256-bit op as two)
  const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
  v[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), high2));
  v[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), high2));
  v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(hb, high2));
  v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                         _mm256_and_si256(_mm256_srli_epi16(hb, 2), high2));
}

// vpshufb masks for Q6_K's 32 values of group g (0..3) of a half: the int16 scale of sub-block
// 2g in the low 128 bits' lanes, of 2g + 1 in the high ones (from the half's 8 scales, in both).
alignas(32) inline constexpr uint8_t Q6_PICK[4][32] = {
#define TM_PAIR8(i) 2 * (i), 2 * (i) + 1, 2 * (i), 2 * (i) + 1, 2 * (i), 2 * (i) + 1, 2 * (i), 2 * (i) + 1, \
                    2 * (i), 2 * (i) + 1, 2 * (i), 2 * (i) + 1, 2 * (i), 2 * (i) + 1, 2 * (i), 2 * (i) + 1
    {TM_PAIR8(0), TM_PAIR8(1)}, {TM_PAIR8(2), TM_PAIR8(3)}, {TM_PAIR8(4), TM_PAIR8(5)}, {TM_PAIR8(6), TM_PAIR8(7)}};
#undef TM_PAIR8

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// ------------------------------------------------------------------ two groups of eight rows at once
// (ggml_groups.cpp's zmm pair kernels and ggml_amx.cpp's tiles)

// The K-quants' 8 scales and 8 mins of each of a group's rows, unpacked from the group's 96
// bytes (group_dot_q45_k's shuffle): sub-block j's scale (min) of row r at sc[8j + r] (mn[8j + r]).
inline void scales_mins_group(const uint8_t* g, uint8_t* sc, uint8_t* mn) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), low6 = _mm256_set1_epi8(0x3F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i t0 = load32(g + 32), t4 = load32(g + 64), t8 = load32(g + 96);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc), _mm256_and_si256(t0, low6));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(sc + 32),
                      _mm256_or_si256(_mm256_and_si256(t8, low4), _mm256_and_si256(_mm256_srli_epi16(t0, 2), bits45)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(mn), _mm256_and_si256(t4, low6));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(mn + 32),
                      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(t8, 4), low4), _mm256_and_si256(_mm256_srli_epi16(t4, 2), bits45)));
}
inline __m128i pick8(const uint8_t* a, const uint8_t* b) {  // 8 bytes of each group
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i join(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(a)), load32(b), 1);
}
inline __m512 halves16(const uint8_t* a, const uint8_t* b) {  // 8 float16 of each group -> 16 float32
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a))));
}
// Q4_K/Q5_K weights of both groups' sub-blocks 2c (l) and 2c + 1 (hb): their unit w (four weights
// of each of the 16 rows, VNNI order), the fifth bit added for Q5_K.
template <bool FIVE>
inline void q45_k_units16(const uint8_t* qs0, const uint8_t* qs1, const uint8_t* qh0, const uint8_t* qh1, int c, int w,
                          __m512i& l, __m512i& hb) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
  const __m512i bits = join(qs0 + 32 * (8 * c + w), qs1 + 32 * (8 * c + w));
  l = _mm512_and_si512(bits, low4), hb = _mm512_and_si512(_mm512_srli_epi16(bits, 4), low4);
  if constexpr (FIVE) {
    const __m512i fifth = join(qh0 + 32 * w, qh1 + 32 * w);
    l = _mm512_or_si512(l, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(fifth, 2 * c), one), 4));
    hb = _mm512_or_si512(hb, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(fifth, 2 * c + 1), one), 4));
  }
}
// The K-quants' mins of both groups (scales_mins_group's mn of each) as int16 pairs: mpair[i]
// holds sub-blocks 2i and 2i + 1 of each of the 16 rows.
inline void min_pairs16(const uint8_t* mn0, const uint8_t* mn1, __m512i* mpair) {
  for (int i = 0; i < 4; ++i) {
    const __m256i p0 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn0 + 16 * i)),
                                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn0 + 16 * i + 8))));
    const __m256i p1 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn1 + 16 * i)),
                                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn1 + 16 * i + 8))));
    mpair[i] = _mm512_inserti64x4(_mm512_castsi256_si512(p0), p1, 1);
  }
}
// One activation row's mins term for the 16 rows: the sum over sub-blocks j of mn[j] times the
// row's sum over sub-block j (its int16 sums of 16, bs: 16 of them for a super-block).
inline __m512i row_mins16(const __m512i* mpair, const int16_t* bs) {
  const __m128i s32 = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bs)),
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(bs + 8)));
  __m512i mins = _mm512_madd_epi16(mpair[0], _mm512_broadcastd_epi32(s32));
  mins = _mm512_add_epi32(mins, _mm512_madd_epi16(mpair[1], _mm512_broadcastd_epi32(_mm_shuffle_epi32(s32, 1))));
  mins = _mm512_add_epi32(mins, _mm512_madd_epi16(mpair[2], _mm512_broadcastd_epi32(_mm_shuffle_epi32(s32, 2))));
  return _mm512_add_epi32(mins, _mm512_madd_epi16(mpair[3], _mm512_broadcastd_epi32(_mm_shuffle_epi32(s32, 3))));
}
#endif
#endif  // TM_AVX2

}  // namespace tokenmill::ggml
