// GGUF blocks eight weight rows at a time: the rows interleaved at load, the same bytes.
//
// ggml_ops.cpp's kernels take one weight row at a time: each of its blocks unpacks its scales
// (scalar code for the K-quants' 6-bit ones), and each row ends in a horizontal sum. At the sizes
// that stream from DRAM that overhead, not the memory, bounded a Q4_K weight (23 GB/s read where
// the machine streams 44). Here eight rows are interleaved, field by field (llama.cpp's "repack"
// idea, our own layout): one 32-byte register holds 4 weights of each of the 8 rows, an
// activation's 4 bytes are broadcast against it, and the 8 int32 lanes of the sums are the 8 rows.
// Scales unpack once per group in vector code; no horizontal sum remains.
//
// The layout (a weight of type T | X8): its first n / 8 * 8 rows in groups of eight rows, each
// group its rows' blocks one block index after another; within a block index the block's fields
// (Field: offset in the row's block, size, unit) in the order fields_of lists them (the ones read
// first, first: the scales before the weights), and within a field the eight rows' copies
// interleaved in units: unit e of row r at 8 * (the sizes of the fields before it) + (8 * e + r) *
// unit. The rest of the rows (n % 8) follow as they are. The integers each output sums are those
// of the row-at-a-time kernels; only the order of the float additions differs (each output's own,
// whatever the batch). On AVX-512 builds with VNNI every grouped type takes two groups at
// a time, one in each half of a zmm register (wide_dot_32: the same arithmetic per lane in half
// the instructions; 1.2-1.3x at 32-512 rows in cache on a Zen 4 EPYC; batches of 16 rows or more). Q6_K has no group kernel: one (6-bit values from a nibble plane and a 2-bit
// plane) was no faster in cache and slower from DRAM (bench/RESULTS.md).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ggml_common.h"

namespace tokenmill::ggml {

namespace {

struct Field {
  int64_t offset, size, unit;  // in the row's block
  int64_t at = 0;              // in the group's block index: 8 * (the sizes of the fields before it)
};

// A block's fields in their order in a group, for the types with group kernels.
std::vector<Field> fields_of(int64_t type) {
  std::vector<Field> f;
  switch (type) {
    case Q4_0: f = {{0, 2, 2}, {2, 16, 4}}; break;             // d, 16 bytes of nibbles
    case Q4_1: f = {{0, 2, 2}, {2, 2, 2}, {4, 16, 4}}; break;  // d, min, nibbles
    case Q5_0: f = {{0, 2, 2}, {2, 4, 4}, {6, 16, 4}}; break;             // d, fifth bits, nibbles
    case Q5_1: f = {{0, 2, 2}, {2, 2, 2}, {4, 4, 4}, {8, 16, 4}}; break;  // d, min, fifth bits, nibbles
    case Q8_0: f = {{0, 2, 2}, {2, 32, 4}}; break;             // d, 32 bytes
    case Q4_K: f = {{0, 2, 2}, {2, 2, 2}, {4, 12, 1}, {16, 128, 4}}; break;  // d, dmin, 6-bit scales and mins, nibbles
    case Q5_K: f = {{0, 2, 2}, {2, 2, 2}, {4, 12, 1}, {16, 32, 4}, {48, 128, 4}}; break;  // the same and fifth bits
    default: return f;
  }
  for (size_t i = 1; i < f.size(); ++i) f[i].at = f[i - 1].at + 8 * f[i - 1].size;
  return f;
}

inline void copy_unit(uint8_t* dst, const uint8_t* src, int64_t unit) {  // (sizes the compiler inlines)
  switch (unit) {
    case 1: *dst = *src; break;
    case 2: std::memcpy(dst, src, 2); break;
    default: std::memcpy(dst, src, 4);
  }
}

// Move one group's bytes between its eight rows (rows[r]: row r's blocks) and the group.
template <bool TO_GROUP>
void move_group(uint8_t* group, uint8_t* const rows[8], int64_t type, int64_t row_bytes) {
  const Format f = format_of(type);
  const std::vector<Field> fields = fields_of(type);
  for (int64_t b = 0; b < row_bytes / f.bytes; ++b) {
    uint8_t* g = group + 8 * b * f.bytes;
    for (const Field& fd : fields)
      for (int64_t e = 0; e < fd.size / fd.unit; ++e)
        for (int r = 0; r < 8; ++r) {
          uint8_t* in_group = g + fd.at + (8 * e + r) * fd.unit;
          uint8_t* in_row = rows[r] + b * f.bytes + fd.offset + e * fd.unit;
          if (TO_GROUP) copy_unit(in_group, in_row, fd.unit);
          else copy_unit(in_row, in_group, fd.unit);
        }
  }
}

void check_rows(const at::Tensor& blocks, int64_t type, int64_t row_bytes) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "block_interleave: blocks must be contiguous uint8 [n, bytes per row]");
  TORCH_CHECK(blocks.size(1) == row_bytes && row_bytes % format_of(type).bytes == 0, "block_interleave: rows of ",
              blocks.size(1), " bytes are not whole blocks of GGML type ", type, " of one width");
}

// Transparent huge pages for a large weight, before its pages are first touched (where the kernel
// has them on "madvise"): a decode step streams every weight, and 2 MB pages spare it the TLB miss
// every 4 KB. A hint: where it is refused, 4 KB pages serve.
void ask_for_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t huge = 2u << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr()), end = begin + t.nbytes();
  const uintptr_t first = (begin + huge - 1) & ~(huge - 1), last = end & ~(huge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
}

// The rows of `parts` one after another ([n, row_bytes] each, n summed), the first n / 8 * 8 in
// groups: one copy, however many parts (q, k and v become one weight).
at::Tensor block_interleave(std::vector<at::Tensor> parts, int64_t type) {
  TORCH_CHECK(has_groups(type), "block_interleave: GGML type ", type, " has no eight-row layout");
  TORCH_CHECK(!parts.empty(), "block_interleave: no blocks");
  const int64_t row_bytes = parts[0].size(1);
  std::vector<const uint8_t*> row;  // every row's address, in order
  for (const at::Tensor& p : parts) {
    check_rows(p, type, row_bytes);
    for (int64_t i = 0; i < p.size(0); ++i) row.push_back(p.data_ptr<uint8_t>() + i * row_bytes);
  }
  const int64_t n = static_cast<int64_t>(row.size()), groups = n / 8, group_bytes = 8 * row_bytes;
  at::Tensor out = at::empty({n, row_bytes}, parts[0].options());
  ask_for_huge_pages(out);
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = const_cast<uint8_t*>(row[8 * g + r]);
      move_group<true>(dst + g * group_bytes, rows, type, row_bytes);
    }
  });
  for (int64_t i = 8 * groups; i < n; ++i) std::memcpy(dst + i * row_bytes, row[i], row_bytes);
  return out;
}

// A grouped weight's rows as they were (the file's blocks, row after row).
at::Tensor block_deinterleave(at::Tensor blocks, int64_t type) {
  TORCH_CHECK(has_groups(type), "block_interleave: GGML type ", type, " has no eight-row layout");
  const int64_t n = blocks.size(0), row_bytes = blocks.size(1), groups = n / 8, group_bytes = 8 * row_bytes;
  check_rows(blocks, type, row_bytes);
  at::Tensor out = at::empty_like(blocks);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = dst + (8 * g + r) * row_bytes;
      move_group<false>(const_cast<uint8_t*>(src) + g * group_bytes, rows, type, row_bytes);
    }
  });
  std::memcpy(dst + groups * group_bytes, src + groups * group_bytes, (n - 8 * groups) * row_bytes);
  return out;
}

// ------------------------------------------------------------------ group kernels

#if defined(TM_AVX2)

inline __m256i bcast4(const int8_t* x) {  // 4 activation bytes in every 32-bit lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}
inline __m256 halves8(const uint8_t* p) {  // 8 float16 -> float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i srli8(__m256i v, int n) { return _mm256_srli_epi16(v, n); }  // (callers mask what crosses bytes)

// Sums of products of unsigned weights (4 bits: < 16) and signed activations, four to an int32
// lane, over a run of at most 8 registers (4 of 5-bit weights): with VNNI each is one vpdpbusd into
// int32; on plain AVX2 one maddubs into int16 lanes (8 * 2 * 15 * 127 < 32768: no saturation),
// widened once at the end.
struct Nibble4Sums {
  __m256i s = _mm256_setzero_si256();
#if defined(TM_VNNI)
  void add(__m256i u, __m256i x) { s = dpbusd(s, u, x); }
  __m256i sum() const { return s; }
#else
  void add(__m256i u, __m256i x) { s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u, x)); }
  __m256i sum() const { return _mm256_madd_epi16(s, _mm256_set1_epi16(1)); }
#endif
};

// Blocks of 32 (Q4_0, Q4_1, Q8_0): a group's block index is d[8] (and Q4_1's m[8]) as float16,
// then the weights, 4 bytes of each row at a time.
template <int64_t TYPE, int MR>
void group_dot_32(const uint8_t* g, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : 34, head = TYPE == Q4_1 ? 4 : 2;
  const int64_t nb = a.k / QK;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, g += 8 * bytes) {
    const __m256 d = halves8(g);
    const uint8_t* qs = g + 8 * head;
    __m256i sum[MR];
    if constexpr (TYPE == Q8_0) {
      for (int m = 0; m < MR; ++m) sum[m] = _mm256_setzero_si256();
      for (int w = 0; w < 8; ++w) {  // signed weights: |w| times x with w's sign
        const __m256i qw = load32(qs + 32 * w), uw = _mm256_sign_epi8(qw, qw);
        for (int m = 0; m < MR; ++m)
          sum[m] = dpbusd(sum[m], uw, _mm256_sign_epi8(bcast4(a.qrow(m0 + m) + b * QK + 4 * w), qw));
      }
    } else {
      // one run of 8 registers a row, low and high nibbles into the same sums (exact: the int32
      // totals are those of two runs of 4 added; on plain AVX2, one widening a block and a row
      // where two took the multiply port, and MR registers of sums where 2 MR spilled on AVX2)
      Nibble4Sums sums[MR];
      for (int w = 0; w < 4; ++w) {  // bytes 4w..4w+3: values 4w.. (low nibbles) and 16 + 4w.. (high)
        const __m256i bits = load32(qs + 32 * w);
        const __m256i l = _mm256_and_si256(bits, low4), h = _mm256_and_si256(srli8(bits, 4), low4);
        for (int m = 0; m < MR; ++m) {
          const int8_t* x = a.qrow(m0 + m) + b * QK + 4 * w;
          sums[m].add(l, bcast4(x));
          sums[m].add(h, bcast4(x + 16));
        }
      }
      for (int m = 0; m < MR; ++m) sum[m] = sums[m].sum();
    }
    for (int m = 0; m < MR; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.drow(m0 + m)[b])), _mm256_cvtepi32_ps(sum[m]), acc[m]);
      if constexpr (TYPE == Q4_1) acc[m] = _mm256_fmadd_ps(halves8(g + 16), _mm256_set1_ps(a.srow(m0 + m)[b]), acc[m]);
      if constexpr (TYPE == Q4_0) acc[m] = _mm256_fmadd_ps(d, _mm256_set1_ps(-8.f * a.srow(m0 + m)[b]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out + 8 * m, acc[m]);
}

// Q5_0 and Q5_1: a group's block index is d[8] (and Q5_1's m[8]) as float16, the eight rows' 32
// fifth bits (lane r of one register: row r's), then the nibbles as Q4_0's. Bit 16 * HALF + 4 * W + j
// of a row (the fifth bit of value 16 * HALF + 4 * W + j) as byte j's 0x10 in the row's lane: its
// byte of the word copied to the lane's four bytes, each tested for its own bit.
template <int W, int HALF>
inline __m256i fifth_bits_group(__m256i hq) {
  constexpr char B = 2 * HALF + W / 2, S = 4 * (W % 2);
  const __m256i pick = _mm256_setr_epi8(B, B, B, B, 4 + B, 4 + B, 4 + B, 4 + B, 8 + B, 8 + B, 8 + B, 8 + B, 12 + B, 12 + B,
                                        12 + B, 12 + B, B, B, B, B, 4 + B, 4 + B, 4 + B, 4 + B, 8 + B, 8 + B, 8 + B, 8 + B,
                                        12 + B, 12 + B, 12 + B, 12 + B);
  const __m256i bit = _mm256_set1_epi32(static_cast<int>((1u << S) | (2u << S) << 8 | (4u << S) << 16 | (8u << S) << 24));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(hq, pick), bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

template <int64_t TYPE, int MR>
void group_dot_5(const uint8_t* g, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = TYPE == Q5_0 ? 22 : 24, head = TYPE == Q5_0 ? 2 : 4;
  const int64_t nb = a.k / QK;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, g += 8 * bytes) {
    const __m256 d = halves8(g);
    const __m256i hq = load32(g + 8 * head);
    const uint8_t* qs = g + 8 * (head + 4);
    Nibble4Sums lo[MR], hi[MR];  // (four registers of 5-bit weights: no int16 saturation on plain AVX2)
    auto step = [&](auto w_const) {
      constexpr int w = decltype(w_const)::value;
      const __m256i bits = load32(qs + 32 * w);
      const __m256i l = _mm256_or_si256(_mm256_and_si256(bits, low4), fifth_bits_group<w, 0>(hq));
      const __m256i h = _mm256_or_si256(_mm256_and_si256(srli8(bits, 4), low4), fifth_bits_group<w, 1>(hq));
      for (int m = 0; m < MR; ++m) {
        const int8_t* x = a.qrow(m0 + m) + b * QK + 4 * w;
        lo[m].add(l, bcast4(x));
        hi[m].add(h, bcast4(x + 16));
      }
    };
    step(std::integral_constant<int, 0>{});
    step(std::integral_constant<int, 1>{});
    step(std::integral_constant<int, 2>{});
    step(std::integral_constant<int, 3>{});
    for (int m = 0; m < MR; ++m) {
      const __m256i sum = _mm256_add_epi32(lo[m].sum(), hi[m].sum());
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.drow(m0 + m)[b])), _mm256_cvtepi32_ps(sum), acc[m]);
      if constexpr (TYPE == Q5_1) acc[m] = _mm256_fmadd_ps(halves8(g + 16), _mm256_set1_ps(a.srow(m0 + m)[b]), acc[m]);
      if constexpr (TYPE == Q5_0) acc[m] = _mm256_fmadd_ps(d, _mm256_set1_ps(-16.f * a.srow(m0 + m)[b]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out + 8 * m, acc[m]);
}

// Q4_K and Q5_K: a group's super-block index is d[8], dmin[8] (float16), the 12 scale bytes of the
// 8 rows (byte t of row r at 8t + r: one 32-byte load unpacks four sub-blocks' scales or mins of
// all rows), Q5_K's fifth bits (32 bytes a row, 4 at a time: bit j of byte l is value l's of
// sub-block j), then the nibbles: 4 bytes of each row at a time, byte l of a row's 32-byte chunk c
// holding value l of sub-block 2c (low nibble) and of 2c + 1 (high).
template <bool FIVE, int MR>
void group_dot_q45_k(const uint8_t* g, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = FIVE ? 176 : 144;
  const int64_t nb = a.k / QK_K;
  const __m256i low4 = _mm256_set1_epi8(0x0F), low6 = _mm256_set1_epi8(0x3F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i one = _mm256_set1_epi8(1);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  alignas(32) uint8_t sc[64], mn[64];  // sub-block j's scale (min) of row r at 8j + r
  for (int64_t b = 0; b < nb; ++b, g += 8 * bytes) {
    const __m256 d = halves8(g), dmin = halves8(g + 16);
    const __m256i t0 = load32(g + 32), t4 = load32(g + 64), t8 = load32(g + 96);  // bytes 0-3, 4-7, 8-11
    // llama.cpp's packing: j < 4: sc = q[j] & 63, mn = q[j + 4] & 63; j >= 4: the low 4 bits in
    // q[j + 4] (scale low nibble, min high), the top 2 in q[j - 4] and q[j] bits 6-7
    _mm256_store_si256(reinterpret_cast<__m256i*>(sc), _mm256_and_si256(t0, low6));
    _mm256_store_si256(reinterpret_cast<__m256i*>(sc + 32),
                       _mm256_or_si256(_mm256_and_si256(t8, low4), _mm256_and_si256(srli8(t0, 2), bits45)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(mn), _mm256_and_si256(t4, low6));
    _mm256_store_si256(reinterpret_cast<__m256i*>(mn + 32),
                       _mm256_or_si256(_mm256_and_si256(srli8(t8, 4), low4), _mm256_and_si256(srli8(t4, 2), bits45)));
    const uint8_t *qh = g + 8 * 16, *qs = g + 8 * (FIVE ? 48 : 16);
    __m256i tot[MR];
    for (int m = 0; m < MR; ++m) tot[m] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      Nibble4Sums lo[MR], hi[MR];
      __m256i lo4[MR], hi4[MR];  // Q5_K: the first four registers' sums, widened (values < 32)
      for (int w = 0; w < 8; ++w) {
        const __m256i bits = load32(qs + 32 * (8 * c + w));
        __m256i l = _mm256_and_si256(bits, low4), h = _mm256_and_si256(srli8(bits, 4), low4);
        if constexpr (FIVE) {
          const __m256i hb = load32(qh + 32 * w);
          l = _mm256_or_si256(l, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4));
          h = _mm256_or_si256(h, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4));
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* x = a.qrow(m0 + m) + b * QK_K + 64 * c + 4 * w;
          lo[m].add(l, bcast4(x));
          hi[m].add(h, bcast4(x + 32));
        }
        if (FIVE && w == 3)
          for (int m = 0; m < MR; ++m) lo4[m] = lo[m].sum(), hi4[m] = hi[m].sum(), lo[m] = hi[m] = Nibble4Sums();
      }
      const __m256i s0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16 * c)));
      const __m256i s1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16 * c + 8)));
      for (int m = 0; m < MR; ++m) {
        const __m256i ls = FIVE ? _mm256_add_epi32(lo4[m], lo[m].sum()) : lo[m].sum();
        const __m256i hs = FIVE ? _mm256_add_epi32(hi4[m], hi[m].sum()) : hi[m].sum();
        tot[m] = _mm256_add_epi32(tot[m], _mm256_add_epi32(_mm256_mullo_epi32(ls, s0), _mm256_mullo_epi32(hs, s1)));
      }
    }
    // the mins: sum over j of mn[j] * (the activations' sum over sub-block j), two j at a time
    __m256i mpair[4];
    for (int i = 0; i < 4; ++i)
      mpair[i] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + 16 * i)),
                                                        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + 16 * i + 8))));
    for (int m = 0; m < MR; ++m) {
      const int16_t* bs = a.bsrow(m0 + m) + 16 * b;
      const __m128i s32 = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bs)),
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(bs + 8)));
      __m256i mins = _mm256_madd_epi16(mpair[0], _mm256_broadcastd_epi32(s32));
      mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mpair[1], _mm256_broadcastd_epi32(_mm_shuffle_epi32(s32, 1))));
      mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mpair[2], _mm256_broadcastd_epi32(_mm_shuffle_epi32(s32, 2))));
      mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mpair[3], _mm256_broadcastd_epi32(_mm_shuffle_epi32(s32, 3))));
      const __m256 dx = _mm256_set1_ps(a.drow(m0 + m)[b]);
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(tot[m]), acc[m]);
      acc[m] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(mins), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out + 8 * m, acc[m]);
}

template <int MR>
DotFn group_dot_of(int64_t type) {
  switch (type) {
    case Q4_0: return group_dot_32<Q4_0, MR>;
    case Q4_1: return group_dot_32<Q4_1, MR>;
    case Q5_0: return group_dot_5<Q5_0, MR>;
    case Q5_1: return group_dot_5<Q5_1, MR>;
    case Q8_0: return group_dot_32<Q8_0, MR>;
    case Q4_K: return group_dot_q45_k<false, MR>;
    default: return group_dot_q45_k<true, MR>;
  }
}

#endif  // TM_AVX2

#if defined(TM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TM_WIDE 1
// Two groups in one zmm register: lanes 0-7 the first group's rows, 8-15 the second's. Every
// lane does what group_dot_32 does to it (the same integer sums, the same float operations in
// the same order), in half the instructions: a 32-byte load of each group joined, the
// activations' 4 bytes broadcast to all 16 lanes.
inline __m512i bcast4w(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

template <int64_t TYPE, int MR>
void wide_dot_32(const uint8_t* g, int64_t next, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : 34, head = TYPE == Q4_1 ? 4 : 2;
  const int64_t nb = a.k / QK;
  const __m512i low4 = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, g += 8 * bytes) {
    const uint8_t* h = g + next;
    const __m512 d = halves16(g, h);
    const uint8_t *qs = g + 8 * head, *qh = h + 8 * head;
    __m512i sum[MR];
    if constexpr (TYPE == Q8_0) {
      for (int m = 0; m < MR; ++m) sum[m] = _mm512_setzero_si512();
      for (int w = 0; w < 8; ++w) {  // signed weights: |w| times x with w's sign (and 0 where w is)
        const __m512i qw = join(qs + 32 * w, qh + 32 * w), uw = _mm512_abs_epi8(qw);
        const __mmask64 neg = _mm512_movepi8_mask(qw);
        for (int m = 0; m < MR; ++m) {
          const __m512i x = bcast4w(a.qrow(m0 + m) + b * QK + 4 * w);
          sum[m] = _mm512_dpbusd_epi32(sum[m], uw, _mm512_mask_sub_epi8(x, neg, zero, x));
        }
      }
    } else {
      __m512i lo[MR], hi[MR];
      for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
      for (int w = 0; w < 4; ++w) {
        const __m512i bits = join(qs + 32 * w, qh + 32 * w);
        const __m512i l = _mm512_and_si512(bits, low4), hb = _mm512_and_si512(_mm512_srli_epi16(bits, 4), low4);
        for (int m = 0; m < MR; ++m) {
          const int8_t* x = a.qrow(m0 + m) + b * QK + 4 * w;
          lo[m] = _mm512_dpbusd_epi32(lo[m], l, bcast4w(x));
          hi[m] = _mm512_dpbusd_epi32(hi[m], hb, bcast4w(x + 16));
        }
      }
      for (int m = 0; m < MR; ++m) sum[m] = _mm512_add_epi32(lo[m], hi[m]);
    }
    for (int m = 0; m < MR; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.drow(m0 + m)[b])), _mm512_cvtepi32_ps(sum[m]), acc[m]);
      if constexpr (TYPE == Q4_1)
        acc[m] = _mm512_fmadd_ps(halves16(g + 16, h + 16), _mm512_set1_ps(a.srow(m0 + m)[b]), acc[m]);
      if constexpr (TYPE == Q4_0) acc[m] = _mm512_fmadd_ps(d, _mm512_set1_ps(-8.f * a.srow(m0 + m)[b]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}



// Q4_K and Q5_K, two groups at once: group_dot_q45_k's integer sums (with VNNI, every chain in
// int32) and its float operations, lane by lane.
template <bool FIVE, int MR>
void wide_dot_q45_k(const uint8_t* g, int64_t next, const Act& a, int64_t m0, float* out) {
  constexpr int64_t bytes = FIVE ? 176 : 144;
  const int64_t nb = a.k / QK_K;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  alignas(32) uint8_t sc[2][64], mn[2][64];
  for (int64_t b = 0; b < nb; ++b, g += 8 * bytes) {
    const uint8_t* h = g + next;
    const __m512 d = halves16(g, h), dmin = halves16(g + 16, h + 16);
    scales_mins_group(g, sc[0], mn[0]);
    scales_mins_group(h, sc[1], mn[1]);
    const uint8_t *qh0 = g + 8 * 16, *qh1 = h + 8 * 16;
    const uint8_t *qs0 = g + 8 * (FIVE ? 48 : 16), *qs1 = h + 8 * (FIVE ? 48 : 16);
    __m512i tot[MR];
    for (int m = 0; m < MR; ++m) tot[m] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m512i lo[MR], hi[MR];
      for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
      for (int w = 0; w < 8; ++w) {
        __m512i l, hb;
        q45_k_units16<FIVE>(qs0, qs1, qh0, qh1, c, w, l, hb);
        for (int m = 0; m < MR; ++m) {
          const int8_t* x = a.qrow(m0 + m) + b * QK_K + 64 * c + 4 * w;
          lo[m] = _mm512_dpbusd_epi32(lo[m], l, bcast4w(x));
          hi[m] = _mm512_dpbusd_epi32(hi[m], hb, bcast4w(x + 32));
        }
      }
      const __m512i s0 = _mm512_cvtepu8_epi32(pick8(sc[0] + 16 * c, sc[1] + 16 * c));
      const __m512i s1 = _mm512_cvtepu8_epi32(pick8(sc[0] + 16 * c + 8, sc[1] + 16 * c + 8));
      for (int m = 0; m < MR; ++m)
        tot[m] = _mm512_add_epi32(tot[m], _mm512_add_epi32(_mm512_mullo_epi32(lo[m], s0), _mm512_mullo_epi32(hi[m], s1)));
    }
    __m512i mpair[4];  // (sub-blocks 2i, 2i + 1) of each row's mins, as int16 pairs, both groups
    min_pairs16(mn[0], mn[1], mpair);
    for (int m = 0; m < MR; ++m) {
      const __m512i mins = row_mins16(mpair, a.bsrow(m0 + m) + 16 * b);
      const __m512 dx = _mm512_set1_ps(a.drow(m0 + m)[b]);
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(tot[m]), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(mins), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

template <int MR>
WideDotFn wide_dot_of(int64_t type) {
  switch (type) {
    case Q4_0: return wide_dot_32<Q4_0, MR>;
    case Q4_1: return wide_dot_32<Q4_1, MR>;
    case Q8_0: return wide_dot_32<Q8_0, MR>;
    case Q4_K: return wide_dot_q45_k<false, MR>;
    case Q5_K: return wide_dot_q45_k<true, MR>;
    default: return nullptr;
  }
}
#endif  // TM_WIDE

}  // namespace

#if defined(TM_WIDE)
WideDotFn wide_group_dot(int64_t type, int mr) {
  switch (mr) {
    case 1: return wide_dot_of<1>(type);
    case 2: return wide_dot_of<2>(type);
    case 3: return wide_dot_of<3>(type);
    default: return wide_dot_of<4>(type);
  }
}
#else
WideDotFn wide_group_dot(int64_t, int) { return nullptr; }
#endif

#if defined(TM_AVX2)
bool has_groups(int64_t type) { return !fields_of(type).empty(); }

DotFn group_dot(int64_t type, int mr) {
  switch (mr) {
    case 1: return group_dot_of<1>(type);
    case 2: return group_dot_of<2>(type);
    case 3: return group_dot_of<3>(type);
    default: return group_dot_of<4>(type);
  }
}
#else  // without AVX2 the rows stay as they are (the row-at-a-time kernels' scalar code)
bool has_groups(int64_t) { return false; }
DotFn group_dot(int64_t, int) { return nullptr; }
#endif

const uint8_t* plain_row(const uint8_t* w, int64_t type, int64_t n, int64_t row_bytes, int64_t r, uint8_t* scratch) {
  if (!(type & X8) || r >= n / 8 * 8) return w + r * row_bytes;
  const int64_t plain = type & ~X8, f_bytes = format_of(plain).bytes;
  const uint8_t* g = w + (r / 8) * 8 * row_bytes;
  const int lane = static_cast<int>(r % 8);
  for (int64_t b = 0; b < row_bytes / f_bytes; ++b)
    for (const Field& fd : fields_of(plain))
      for (int64_t e = 0; e < fd.size / fd.unit; ++e)
        copy_unit(scratch + b * f_bytes + fd.offset + e * fd.unit, g + 8 * b * f_bytes + fd.at + (8 * e + lane) * fd.unit,
                  fd.unit);
  return scratch;
}

}  // namespace tokenmill::ggml

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("block_interleave(Tensor[] parts, int type) -> Tensor");
  m.def("block_deinterleave(Tensor blocks, int type) -> Tensor");
  m.def("block_has_groups(int type) -> bool", &tokenmill::ggml::has_groups);
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("block_interleave", &tokenmill::ggml::block_interleave);
  m.impl("block_deinterleave", &tokenmill::ggml::block_deinterleave);
}
