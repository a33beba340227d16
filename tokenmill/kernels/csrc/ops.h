// The kernels one C++ caller (decode_loop.cpp) runs directly, without the dispatcher: the
// same functions torch.ops.tokenmill exposes, defined in cpu_ops.cpp and quant_ops.cpp.
#pragma once

#include <ATen/ATen.h>

namespace tokenmill {

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps);
void rotary_write_kv(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                     at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                     c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale, at::Tensor block_tables,
                     at::Tensor query_start_loc, at::Tensor seq_lens, at::Tensor seq_ids, double scale,
                     int64_t partition_size);
at::Tensor small_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> scale);
at::Tensor quant_linear(at::Tensor x, at::Tensor qs, at::Tensor scale, c10::optional<at::Tensor> minv, int64_t bits,
                        int64_t group);

}  // namespace tokenmill
