// What the kernel sources share: the kernels one C++ caller (decode_loop.cpp) runs directly,
// without the dispatcher (the functions torch.ops.tokenmill exposes, defined in cpu_ops.cpp and
// quant_ops.cpp), and the SIMD helpers more than one of them uses.
#pragma once

#include <ATen/ATen.h>

#include <memory>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tokenmill {

#if defined(__AVX2__)
// The sum of an AVX2 register's 8 floats.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sums of four registers' lanes, side by side (a quarter of four hsum8s' work).
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif
#if defined(__AVX512F__)
inline __m256 fold16(__m512 v) {  // the two halves added
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) { return hsum4(fold16(a), fold16(b), fold16(c), fold16(d)); }
#endif

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps);
void add_rms_norm_out(at::Tensor y, at::Tensor x, at::Tensor residual, at::Tensor w, double eps);  // into y
void rotary_write_kv(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                     at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale, at::Tensor block_tables,
                     at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor seq_ids, double scale,
                     int64_t partition_size, int64_t window, double softcap);
at::Tensor small_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> scale, bool one_stream = true);
// Rows [4 * u0, 4 * u1) of a float32, bfloat16 or float16 weight w [n, k] (contiguous) times x [rows, k]
// (float32, or bfloat16 where x_bf16), on the calling thread: small_linear's sums to the bit, in
// float32, into y (rows ldy apart). No checks: decode_loop.cpp's team checks the weights once.
void small_linear_units(const at::Tensor& w, const void* x, bool x_bf16, float* y, int64_t ldy, int64_t rows,
                        int64_t u0, int64_t u1, bool one_stream);
at::Tensor quant_linear(at::Tensor x, at::Tensor qs, at::Tensor scale, c10::optional<at::Tensor> minv, int64_t bits,
                        int64_t group, bool bf16);
at::Tensor block_linear(at::Tensor x, at::Tensor blocks, int64_t type, int64_t gemm_rows = 0);

// paged_attention for one step's sequences, planned once (its splits, their order, the scratch) and
// run for every layer of the step by one team of threads (decode_loop.cpp): restart() on one
// thread, a barrier, work() on every thread (items handed out as threads free up), a barrier, then
// each thread's share of merge(). The arithmetic is paged_attention's, to the bit. Unquantised
// caches, no window, no soft cap (the plain Llama layer).
class AttentionStep {
 public:
  AttentionStep(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                const at::Tensor& seq_ids, double scale, int64_t partition_size);
  ~AttentionStep();
  void restart();
  void work(const void* q, const void* k_cache, const void* v_cache);
  void merge(void* out, int64_t thread, int64_t threads);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tokenmill
