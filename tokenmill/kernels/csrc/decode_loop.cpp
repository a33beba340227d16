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
//
// Where every linear is in GGUF blocks (the int8 arithmetic's decode), or every one a float weight
// (float32, bfloat16 or float16 files), on float32 or bfloat16 activations, the whole step runs in
// one OpenMP team instead (team_layers): the separate calls cost
// a fork and join each (~6 per layer), ATen's allocations and dispatch between them, and the
// second thread idled through all of it (38% of a bundled-file step on a 2-core AVX2 EPYC,
// bench/RESULTS.md). In the team each linear's units are split between the threads, attention's
// work items handed out as threads free up, and the small ops between them run on the calling
// thread (thread 0, where ATen's thread-local state is) while the others wait at a barrier. Same
// kernels, same splits of the arithmetic: the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#include <torch/custom_class.h>
#include <torch/library.h>

#include <atomic>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "ggml_common.h"
#include "ops.h"

namespace {

using at::Tensor;

constexpr int64_t PER_LAYER = 14;

Tensor run_linear(const Tensor& x, const std::vector<Tensor>& w, int64_t at, int64_t bits, int64_t group) {
  if (bits == 0) return tokenmill::small_linear(x, w[at], c10::nullopt, group == 0);  // group 1: tiles at one row
  if (bits < 0) {  // GGUF blocks: -bits is the type; group, when not 0, a second part's type (its blocks at at + 1)
    const Tensor first = tokenmill::block_linear(x, w[at], -bits);
    return group == 0 ? first : at::cat({first, tokenmill::block_linear(x, w[at + 1], group)}, 1);
  }
  const Tensor& minv = w[at + 2];
  return tokenmill::quant_linear(x, w[at], w[at + 1], minv.numel() ? c10::optional<Tensor>(minv) : c10::nullopt,
                                 bits, group, false);  // (steps here are within EXACT_BF16_ROWS)
}

// A linear as the team runs it: one or two block weights (a second part's outputs after the
// first's), each part its BlockProduct over its own columns of the output; or a float weight
// (float32, bfloat16 or float16) on small_linear's kernel, in blocks of four rows.
struct TeamLinear {
  std::vector<std::unique_ptr<tokenmill::ggml::BlockProduct>> parts;
  std::vector<int64_t> cols;  // each part's first output column
  int64_t n = 0;              // outputs in all
  Tensor dense;               // the float weight (parts empty)
  bool one_stream = true;     // the float weight's choice at one row (small_linear's)
  const void* x = nullptr;    // the float weight's activations, set by quantise
  bool x_bf16 = false;

  TeamLinear(const std::vector<Tensor>& w, int64_t at, int64_t bits, int64_t group, int64_t k) {
    if (bits == 0) {
      dense = w[at];
      one_stream = group == 0;
      n = dense.size(0);
      const auto wt = dense.scalar_type();
      TORCH_CHECK(dense.dim() == 2 && dense.size(1) == k && dense.is_contiguous() &&
                      (wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf),
                  "decode_layers: a float weight must be a contiguous [n, ", k, "] float32, bfloat16 or float16");
      return;
    }
    add(w[at], -bits, k);
    if (group != 0) add(w[at + 1], group, k);
  }
  void add(const Tensor& blocks, int64_t type, int64_t k) {
    parts.push_back(std::make_unique<tokenmill::ggml::BlockProduct>(blocks, type, k));
    cols.push_back(n);
    n += parts.back()->n();
  }
  // (one thread) The activations [rows, k] in float32, and as they came where they are bfloat16
  // (narrow, else nullptr): blocks quantise the float32; a float weight reads them as they came,
  // as small_linear does.
  void quantise(const float* xf, const void* narrow, int64_t rows) {
    if (dense.defined()) {
      x = narrow ? narrow : xf;
      x_bf16 = narrow != nullptr;
      return;
    }
    for (auto& p : parts) p->quantise(xf, rows);
  }
  // This thread's share of every part's units, for all `rows` activation rows, into out [rows, n].
  void run(float* out, int64_t rows, int64_t thread, int64_t threads) const {
    if (dense.defined()) {
      const int64_t units = (n + 3) / 4;
      tokenmill::small_linear_units(dense, x, x_bf16, out, n, rows, units * thread / threads,
                                    units * (thread + 1) / threads, one_stream);
      return;
    }
    for (size_t i = 0; i < parts.size(); ++i) {
      const auto& p = *parts[i];
      const int64_t units = p.units();
      for (int64_t m0 = 0; m0 < rows; m0 += tokenmill::ggml::INT8_MAX_ROWS)
        p.run(out + cols[i], n, m0, std::min(rows, m0 + tokenmill::ggml::INT8_MAX_ROWS), units * thread / threads,
              units * (thread + 1) / threads);
    }
  }
};

// A barrier for the team's threads that spins (a few hundred nanoseconds where OpenMP's own took
// ~1.2 us on a 2-core EPYC, ten times a layer), yielding the core after a while in case the
// machine has more threads than cores.
class TeamBarrier {
 public:
  void resize(int64_t threads) { threads_ = threads; }  // (before any thread waits)
  void wait() {
    const int64_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins >= SPINS) std::this_thread::yield();
#if defined(__SSE2__)
      else _mm_pause();
#endif
    }
  }

 private:
  static constexpr int64_t SPINS = 1 << 12;  // ~0.1 ms: past any wait inside a step (a few us)
  int64_t threads_ = 1;
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
};

// A model's layers as decode_layers reads them, with its caches, held on the C++ side from one step
// to the next: passed as lists, their ~500 tensors were boxed one by one through the dispatcher on
// every call (~0.45 ms a step of the bundled file, 6%). Where every linear is in blocks it also
// holds them as the team's products (checked once, their activation buffers reused every step).
struct LayerStack : torch::CustomClassHolder {
  std::vector<Tensor> weights, k_caches, v_caches;
  std::vector<int64_t> kinds;
  // Every linear in GGUF blocks, or every one a float weight, and an unquantised cache: the team can run it.
  bool team = true;
  std::vector<TeamLinear> linears;  // the team's, four a layer; made by the first step the team takes

  LayerStack(std::vector<Tensor> weights_, std::vector<int64_t> kinds_, std::vector<Tensor> k_caches_,
             std::vector<Tensor> v_caches_)
      : weights(std::move(weights_)), k_caches(std::move(k_caches_)), v_caches(std::move(v_caches_)),
        kinds(std::move(kinds_)) {
    const int64_t layers = static_cast<int64_t>(k_caches.size());
    TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * PER_LAYER &&
                    static_cast<int64_t>(kinds.size()) == layers * 8 &&
                    static_cast<int64_t>(v_caches.size()) == layers,
                "LayerStack: expects ", PER_LAYER, " weights, 8 kinds and a K and a V cache per layer");
    bool blocks = true, floats = true;  // (else a weight widened from packed bits: quant_linear)
    for (size_t i = 0; i < kinds.size(); i += 2) {
      blocks &= kinds[i] < 0;
      floats &= kinds[i] == 0;
    }
    const auto ct = k_caches[0].scalar_type();
    team = (blocks || floats) && (ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf);
  }

  // The team's linears for these shapes, every weight and cache checked (nothing in the team throws).
  std::vector<TeamLinear>& team_linears(int64_t hidden, int64_t q_size, int64_t kv_size) {
    if (!linears.empty()) {
      TORCH_CHECK(linears[0].n == q_size + 2 * kv_size && linears[1].n == hidden,
                  "decode_layers: the step's shapes are not the model's");
      return linears;
    }
    const int64_t layers = static_cast<int64_t>(k_caches.size());
    std::vector<TeamLinear> made;
    made.reserve(layers * 4);
    for (int64_t i = 0; i < layers; ++i) {
      const int64_t w0 = i * PER_LAYER;
      const int64_t* kind = kinds.data() + i * 8;
      made.emplace_back(weights, w0 + 2, kind[0], kind[1], hidden);
      made.emplace_back(weights, w0 + 5, kind[2], kind[3], q_size);
      made.emplace_back(weights, w0 + 8, kind[4], kind[5], hidden);
      const int64_t inter_i = made.back().n / 2;  // gate_up's halves
      made.emplace_back(weights, w0 + 11, kind[6], kind[7], inter_i);
      TORCH_CHECK(made[4 * i].n == q_size + 2 * kv_size && made[4 * i + 1].n == hidden && made[4 * i + 3].n == hidden &&
                      inter_i == made[2].n / 2,
                  "decode_layers: layer ", i, "'s weights do not match the model's shapes");
      for (const Tensor* c : {&k_caches[i], &v_caches[i]})
        TORCH_CHECK(c->sizes() == k_caches[0].sizes() && c->scalar_type() == k_caches[0].scalar_type() &&
                        c->is_contiguous(),
                    "decode_layers: layer ", i, "'s caches do not match the first layer's");
    }
    linears = std::move(made);
    return linears;
  }
};

// decode_layers for block weights or float ones (float32 or bfloat16 activations), in one team of threads.
Tensor team_layers(Tensor x, Tensor h, LayerStack& stack, const Tensor& positions, const Tensor& cos,
                   const Tensor& sin, const Tensor& slots, const Tensor& block_tables, const Tensor& query_start_loc,
                   const Tensor& seq_lens, const Tensor& seq_ids, double scale, double eps, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t partition) {
  const std::vector<Tensor>& weights = stack.weights;
  const std::vector<Tensor>& k_caches = stack.k_caches;
  const std::vector<Tensor>& v_caches = stack.v_caches;
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  const int64_t n = x.size(0), hidden = x.size(1), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(x.is_contiguous() && h.is_contiguous() && h.sizes() == x.sizes() && h.scalar_type() == x.scalar_type(),
              "decode_layers: x and h must be contiguous [n, hidden] of one dtype");
  // Every weight checked (once, by the stack) and every buffer allocated here, before the team.
  std::vector<TeamLinear>& linears = stack.team_linears(hidden, q_size, kv_size);
  const int64_t inter = linears[2].n / 2;
  // The linears take and give float32. With bfloat16 activations each output is rounded to them
  // (block_linear's `.to`) and each input widened (exactly) before it is quantised, as the
  // separate calls do: `narrow` tensors beside their float32 twins; with float32 one tensor each.
  const bool narrow = x.scalar_type() == at::kBFloat16;
  const auto opts = x.options(), fopts = opts.dtype(at::kFloat);
  auto twin = [&](const Tensor& t) { return narrow ? at::empty(t.sizes(), fopts) : t; };
  Tensor qkv = at::empty({n, q_size + 2 * kv_size}, opts), attn = at::empty({n, num_heads, head_dim}, opts);
  Tensor o = at::empty({n, hidden}, opts), gate_up = at::empty({n, 2 * inter}, opts);
  Tensor act = at::empty({n, inter}, opts), down = at::empty({n, hidden}, opts), hn = h.clone();
  Tensor qkv_f = twin(qkv), attn_f = twin(attn), o_f = twin(o), gu_f = twin(gate_up), act_f = twin(act);
  Tensor down_f = twin(down), hn_f = twin(hn);
  auto rounded = [&](Tensor& t, const Tensor& f) {  // (thread 0) a linear's output in the activations' dtype
    if (narrow) t.copy_(f);
  };
  auto widened = [&](Tensor& f, const Tensor& t) {  // (thread 0) a linear's input in float32
    if (narrow) f.copy_(t);
  };
  auto as_came = [&](const Tensor& t) -> const void* { return narrow ? t.data_ptr() : nullptr; };
  Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads, head_dim});
  Tensor k = qkv.narrow(1, q_size, kv_size).view({n, num_kv_heads, head_dim});
  Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads, head_dim});
  const Tensor gate = gate_up.narrow(1, 0, inter), up = gate_up.narrow(1, inter, inter);
  Tensor qc = n == 1 ? q : at::empty({n, num_heads, head_dim}, opts);  // attention reads q contiguous
  tokenmill::AttentionStep attention(attn, qc, k_caches[0], v_caches[0], block_tables, query_start_loc, seq_lens,
                                     seq_ids, scale, partition);
  float *qkv_p = qkv_f.data_ptr<float>(), *attn_p = attn_f.data_ptr<float>(), *o_p = o_f.data_ptr<float>();
  float *gu_p = gu_f.data_ptr<float>(), *act_p = act_f.data_ptr<float>(), *down_p = down_f.data_ptr<float>();
  float* hn_p = hn_f.data_ptr<float>();
  void* attn_out = attn.data_ptr();
  const void* qc_p = qc.data_ptr();
  const int64_t team = std::max<int64_t>(1, at::get_num_threads());

  // Thread 0's ATen calls could throw (they check their arguments): the error stops every thread
  // at the next barrier and is raised after the team.
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto first = [&](int64_t t, auto&& f) {
    if (t != 0) return;
    try {
      f();
    } catch (...) {
      error = std::current_exception();
      failed = true;
    }
  };

  TeamBarrier barrier;
  first(0, [&] {
    widened(hn_f, hn);
    linears[0].quantise(hn_p, as_came(hn), n);
  });
#pragma omp parallel num_threads(team)
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#pragma omp single
    barrier.resize(threads);  // (OpenMP may give fewer threads than asked; the single's end is a barrier)
    for (int64_t i = 0; i < layers && !failed; ++i) {
      const int64_t w0 = i * PER_LAYER;
      TeamLinear& qkv_l = linears[4 * i];
      TeamLinear& o_l = linears[4 * i + 1];
      TeamLinear& gate_up_l = linears[4 * i + 2];
      TeamLinear& down_l = linears[4 * i + 3];
      qkv_l.run(qkv_p, n, t, threads);  // (its activations quantised at the end of the last layer)
      barrier.wait();
      first(t, [&] {
        rounded(qkv, qkv_f);
        tokenmill::rotary_write_kv(q, k, v, positions, cos, sin, k_caches[i], v_caches[i], slots);
        if (n > 1) qc.copy_(q);
        attention.restart();
      });
      barrier.wait();
      if (failed) break;
      attention.work(qc_p, k_caches[i].data_ptr(), v_caches[i].data_ptr());
      barrier.wait();
      first(t, [&] {
        attention.merge(attn_out, 0, 1);
        widened(attn_f, attn);
        o_l.quantise(attn_p, as_came(attn), n);
      });
      barrier.wait();
      o_l.run(o_p, n, t, threads);
      barrier.wait();
      first(t, [&] {
        rounded(o, o_f);
        tokenmill::add_rms_norm_out(hn, o, x, weights[w0], eps);
        widened(hn_f, hn);
        gate_up_l.quantise(hn_p, as_came(hn), n);
      });
      barrier.wait();
      if (failed) break;
      gate_up_l.run(gu_p, n, t, threads);
      barrier.wait();
      first(t, [&] {  // SiLU(gate) * up, as TorchOps.silu_mul computes it
        rounded(gate_up, gu_f);
        at::silu_out(act, gate);
        act.mul_(up);
        widened(act_f, act);
        down_l.quantise(act_p, as_came(act), n);
      });
      barrier.wait();
      if (failed) break;
      down_l.run(down_p, n, t, threads);
      barrier.wait();
      first(t, [&] {
        rounded(down, down_f);
        tokenmill::add_rms_norm_out(hn, down, x, weights[w0 + 1], eps);
        if (i + 1 < layers) {
          widened(hn_f, hn);
          linears[4 * (i + 1)].quantise(hn_p, as_came(hn), n);
        }
      });
      barrier.wait();
    }
  }
  if (error) std::rethrow_exception(error);
  return hn;
}


// x: the residual stream [n, hidden] (updated in place); h: the first layer's normed input.
// Returns the last norm's output, as the Python loop does.
Tensor decode_layers(Tensor x, Tensor h, const c10::intrusive_ptr<LayerStack>& stack, Tensor positions, Tensor cos,
                     Tensor sin, Tensor slots, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens,
                     Tensor seq_ids, double scale, double eps, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t partition) {
  const std::vector<Tensor>& weights = stack->weights;
  const std::vector<int64_t>& kinds = stack->kinds;
  const std::vector<Tensor>& k_caches = stack->k_caches;
  const std::vector<Tensor>& v_caches = stack->v_caches;
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  if (stack->team && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
      x.size(0) <= tokenmill::ggml::INT8_MAX_ROWS)
    return team_layers(x, h, *stack, positions, cos, sin, slots, block_tables, query_start_loc, seq_lens, seq_ids,
                       scale, eps, num_heads, num_kv_heads, head_dim, partition);
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
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<std::vector<Tensor>, std::vector<int64_t>, std::vector<Tensor>, std::vector<Tensor>>());
  m.def("decode_layers(Tensor(a!) x, Tensor h, __torch__.torch.classes.tokenmill.LayerStack stack, Tensor positions, "
        "Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor seq_ids, float scale, float eps, int num_heads, int num_kv_heads, int head_dim, int partition) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("decode_layers", &decode_layers); }
