// The decoder's layers for a decode-sized step, looped in C++.
//
// At batch 1 a token's layers are ~300 kernel calls of a few microseconds each; from
// Python each costs as much again in dispatch (module calls, argument checks, the op
// registry): 2.5-3 ms of an 8 ms step on SmolLM2 (bench/RESULTS.md). For the plain Llama
// layer (pre-norm attention and SwiGLU MLP, no biases, no q/k norms, no windows, an
// unquantised cache) this runs the very same kernels, in the same order, as
// LlamaDecoderLayer.forward with NativeOps: the outputs are bit-identical (tested), only
// the dispatch is gone. Anything else takes the Python path.
//
// Per layer, `weights` holds 14 tensors: the post-attention norm, the next norm (the next
// layer's input norm, or the final norm), then 3 per linear (qkv, o, gate_up, down): a
// packed weight's (qs, scale, min or an empty tensor), or a float weight and two empty
// tensors. `kinds` holds (bits, group) per linear: bits 0 for a float weight; for a weight in its
// GGUF blocks (ggml_ops.cpp) minus its GGML type, and in group 0 or the type of a second part whose
// outputs follow the first's (a Q4_K_M file's qkv: q and k in Q4_K, v in Q6_K), its blocks in the
// scale's place.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"

namespace {

using at::Tensor;

constexpr int64_t PER_LAYER = 14;

Tensor run_linear(const Tensor& x, const std::vector<Tensor>& w, int64_t at, int64_t bits, int64_t group) {
  if (bits == 0) return tokenmill::small_linear(x, w[at], c10::nullopt);
  if (bits < 0) {  // GGUF blocks: -bits is the type; group, when not 0, a second part's type (its blocks at at + 1)
    const Tensor first = tokenmill::block_linear(x, w[at], -bits);
    return group == 0 ? first : at::cat({first, tokenmill::block_linear(x, w[at + 1], group)}, 1);
  }
  const Tensor& minv = w[at + 2];
  return tokenmill::quant_linear(x, w[at], w[at + 1], minv.numel() ? c10::optional<Tensor>(minv) : c10::nullopt,
                                 bits, group, false);  // (steps here are within EXACT_BF16_ROWS)
}

// x: the residual stream [n, hidden] (updated in place); h: the first layer's normed input.
// Returns the last norm's output, as the Python loop does.
Tensor decode_layers(Tensor x, Tensor h, std::vector<Tensor> weights, std::vector<int64_t> kinds, Tensor positions,
                     Tensor cos, Tensor sin, std::vector<Tensor> k_caches, std::vector<Tensor> v_caches, Tensor slots,
                     Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, Tensor seq_ids, double scale,
                     double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t partition) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * PER_LAYER &&
                  static_cast<int64_t>(kinds.size()) == layers * 8 && static_cast<int64_t>(v_caches.size()) == layers,
              "decode_layers: expects ", PER_LAYER, " weights and 8 kinds per layer");
  const int64_t n = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t w0 = i * PER_LAYER;
    const int64_t* kind = kinds.data() + i * 8;
    const Tensor qkv = run_linear(h, weights, w0 + 2, kind[0], kind[1]);
    Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads, head_dim});
    Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, head_dim});
    Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, head_dim});
    tokenmill::rotary_write_kv(q, k, v, positions, cos, sin, k_caches[i], v_caches[i], slots);
    const Tensor qc = q.contiguous();
    Tensor attn = at::empty_like(qc);
    tokenmill::paged_attention(attn, qc, k_caches[i], v_caches[i], c10::nullopt, c10::nullopt, block_tables,
                               query_start_loc, seq_lens, seq_ids, scale, partition, 0, 0.0);  // plain Llama: no window, no cap
    const Tensor o = run_linear(attn.view({n, q_size}), weights, w0 + 5, kind[2], kind[3]);
    h = tokenmill::add_rms_norm(o, x, weights[w0], eps);
    const Tensor gate_up = run_linear(h, weights, w0 + 8, kind[4], kind[5]);
    const auto halves = gate_up.chunk(2, -1);  // SiLU(gate) * up, as TorchOps.silu_mul computes it
    const Tensor down = run_linear(at::mul(at::silu(halves[0]), halves[1]), weights, w0 + 11, kind[6], kind[7]);
    h = tokenmill::add_rms_norm(down, x, weights[w0 + 1], eps);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor h, Tensor[] weights, int[] kinds, Tensor positions, Tensor cos, "
        "Tensor sin, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor slots, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor seq_ids, float scale, float eps, int num_heads, "
        "int num_kv_heads, int head_dim, int partition) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("decode_layers", &decode_layers); }
