// What the kernel sources share: the kernels one C++ caller (decode_loop.cpp) runs directly,
// without the dispatcher (the functions torch.ops.tokenmill exposes, defined in cpu_ops.cpp and
// quant_ops.cpp), and the SIMD helpers more than one of them uses.
#pragma once

#include <ATen/ATen.h>

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
#endif

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps);
void rotary_write_kv(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                     at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale, at::Tensor block_tables,
                     at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor seq_ids, double scale,
                     int64_t partition_size, int64_t window, double softcap);
at::Tensor small_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> scale);
at::Tensor quant_linear(at::Tensor x, at::Tensor qs, at::Tensor scale, c10::optional<at::Tensor> minv, int64_t bits,
                        int64_t group, bool bf16);

}  // namespace tokenmill
