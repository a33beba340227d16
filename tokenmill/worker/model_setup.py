"""A loaded model made ready to run on its device: the one recipe that the one-process
engine (``factory.build_engine``) and every distributed worker (``distributed/rank_process.py``)
share, so the two cannot drift: which per-layer ops run, whether the native kernels do
(and so whether a GGUF's blocks are kept and int8/int4 are packed), the quantisation, and
a rank's shard cut from the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.configuration.config import LoadConfig, ModelConfig
from tokenmill.configuration.memory import keep_freed_memory
from tokenmill.errors import TokenmillError
from tokenmill.kernels.gemm_choice import block_gemm_rows, f16_split_rows, one_row_stream, prepacked, upcast_rows
from tokenmill.kernels.linear import use_native_linears
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.ops import NativeOps, select_ops
from tokenmill.model.shard_plan import ModelShard
from tokenmill.model.shard_weights import shard_model
from tokenmill.quant.blocks import BlockWeight
from tokenmill.quant.weights import quantize_model


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TokenmillError(f"device {device!r} requested but CUDA is not available on this machine")
    return dev


def native_kernels_run(load: LoadConfig, device: torch.device) -> bool:
    """Whether the native CPU kernels will run this model (the rule select_ops follows): then
    a GGUF's blocks are kept and int8/int4 go to the packed kernels."""
    if load.kernels == "torch" or device.type != "cpu":
        return False
    from tokenmill.kernels.native import load_native

    return load_native()


@dataclass(frozen=True)
class LoadPlan:
    """How one process loads and runs its models, decided once (``decide``: by
    factory.build_engine, or a rank's process) and passed down to every load: ``native``, the
    native CPU kernels run them (then int8/int4 weights go to the packed kernels); ``keep_blocks``,
    a GGUF's quantised weights stay in their blocks (one process on the CPU, ``quantization``
    auto); ``int8_blocks``, in the integer arithmetic."""

    native: bool
    keep_blocks: bool
    int8_blocks: bool

    @classmethod
    def decide(cls, load: LoadConfig, device: torch.device, world_size: int) -> LoadPlan:
        native = native_kernels_run(load, device)
        keep = load.quantization == "auto" and world_size == 1 and native
        return cls(native, keep, keep and load.quant_arithmetic == "int8")

    def checkpoint_options(self) -> dict[str, bool]:
        """load_checkpoint's keywords: which quantised GGUF weights stay in blocks, and which blocks."""
        return {"keep_quantized": self.keep_blocks, "int8_blocks": self.int8_blocks}


def prepare_model(
    model: LlamaForCausalLM, device: torch.device, load: LoadConfig, plan: LoadPlan, quantize: bool = True
) -> LlamaForCausalLM:
    """A loaded model (target or draft) made ready to run: its per-layer ops chosen, its
    weights quantised (unless a shard was cut from quantised weights already), and, with
    native ops, its linears swapped for the small-batch kernel."""
    try:
        # batch-invariant attention where the int8 arithmetic runs (its rounding would amplify the rest)
        int8_blocks = any(isinstance(m, BlockWeight) for m in model.modules())
        model.ops = select_ops(device, load.kernels, batch_invariant=int8_blocks)
    except RuntimeError as e:  # kernels="native" without a working build
        raise TokenmillError(str(e)) from None
    try:
        if quantize:
            quantize_model(model, load.quantization, load.quantization_group_size, packed=plan.native)
    except ValueError as e:  # e.g. a group size that does not divide a layer's width
        raise TokenmillError(str(e)) from None
    if isinstance(model.ops, NativeOps):
        # how bfloat16 batches multiply fastest (upcast from how many rows, packed weights, GGUF
        # blocks dequantised from how many rows): this machine's answers
        sixteen = any(p.dtype == torch.bfloat16 for p in model.parameters())
        types = {m.source for m in model.modules() if isinstance(m, BlockWeight)} if sixteen else set()
        gemm_rows = {t: block_gemm_rows(t) for t in sorted(types)}
        # a file's float16 weights under bfloat16: from how many rows they multiply in the bfloat16 GEMM
        halves = sixteen and any(p.dtype == torch.float16 for p in model.parameters())
        # how one row (a decode at batch 1) reads the float weights: the dtype holding most of them
        weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
        by_dtype: dict[torch.dtype, int] = {}
        for w in weights:
            by_dtype[w.dtype] = by_dtype.get(w.dtype, 0) + w.numel()
        act = torch.bfloat16 if sixteen else torch.float32
        one_stream = one_row_stream(max(by_dtype, key=by_dtype.get), act) if by_dtype else True
        use_native_linears(
            model,
            upcast_rows() if sixteen else None,
            prepacked() if sixteen else False,
            gemm_rows,
            f16_split_rows() if halves else (None, None),
            one_stream,
        )
        # prompt chunks of that many tokens multiply some blocks in the dequantised GEMM: their
        # numbers are their own already, so their fresh prefills' attention may take SDPA too
        # (every shorter sequence keeps the invariant arithmetic, whatever its step holds)
        model.ops.invariant_below = min((r for r in gemm_rows.values() if r is not None), default=None)
        keep_freed_memory()  # this process runs CPU steps: no page faults for their activations
    return model


def load_shard(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    shard: ModelShard,
    load: LoadConfig,
    device: torch.device,
    plan: LoadPlan,
) -> LlamaForCausalLM:
    """This rank's part of the model, cut from the whole (quantised whole, then cut)."""
    full = LlamaForCausalLM.from_weights(config, weights, "cpu")
    try:
        model = shard_model(
            full, shard, load.quantization, load.quantization_group_size, packed=plan.native
        )  # as quantize_model does in one process
    except ValueError as e:
        raise TokenmillError(str(e)) from None
    return prepare_model(model.to(device), device, load, plan, quantize=False)
