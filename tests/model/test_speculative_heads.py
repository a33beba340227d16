"""EAGLE and Medusa heads on tiny random models: published layouts load, the serving
head computes what the reference computes, drafting follows the true history through
chunked prefill, prefix sharing and preemption, and speculation stays lossless
(greedy token-identical, sampling distribution-identical)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import (
    ToyTokenizer,
    all_logits,
    chi_square_pvalue,
    exact_first_tokens,
    run_to_completion,
    seq,
    tiny_model,
)
from tokenmill.configuration.config import SpeculativeConfig
from tokenmill.engine.core.scheduler import SchedulerConfig
from tokenmill.engine.engine import Engine, EngineConfig
from tokenmill.errors import ModelLoadError
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.head_proposer import EagleProposer, MedusaProposer
from tokenmill.speculative.heads import eagle_config, load_eagle, load_medusa
from tokenmill.speculative.training.data import target_features
from tokenmill.speculative.training.train import EagleReference
from tokenmill.worker.kv_allocation import allocate_kv_cache
from tokenmill.worker.model_runner import ModelRunner

CPU = torch.device("cpu")
BLOCK = 4


def write_eagle(path, target, seed=0, draft_ids=None, std=0.3):
    """An EAGLE-1 head folder as the EAGLE repository writes one: a Llama config.json of one
    layer, separate q/k/v and gate/up, ``fc`` with a bias, no input norm on the layer, and
    the embedding table it was trained with; with ``draft_ids``, EAGLE-3's draft LM head and
    d2t offsets."""
    cfg = target.config
    h, g = cfg.hidden_size, torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    w = {
        "fc.weight": rand(h, 2 * h),
        "fc.bias": rand(h),
        "embed_tokens.weight": target.embed_tokens.weight.detach().clone(),
        "layers.0.post_attention_layernorm.weight": 1 + rand(h),
    }
    for n, rows in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
        w[f"layers.0.self_attn.{n}_proj.weight"] = rand(rows * cfg.head_dim, h)
    w["layers.0.self_attn.o_proj.weight"] = rand(h, cfg.num_heads * cfg.head_dim)
    w["layers.0.mlp.gate_proj.weight"] = rand(cfg.intermediate_size, h)
    w["layers.0.mlp.up_proj.weight"] = rand(cfg.intermediate_size, h)
    w["layers.0.mlp.down_proj.weight"] = rand(h, cfg.intermediate_size)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bias": True,
        "hidden_size": h,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
    }
    if draft_ids is not None:
        ids = torch.tensor(draft_ids)
        w["lm_head.weight"] = rand(len(ids), h) * 3
        w["d2t"] = ids - torch.arange(len(ids))
        config["draft_vocab_size"] = len(ids)
    path.mkdir(parents=True, exist_ok=True)
    save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return w


def write_medusa(path, target, heads=3, seed=0):
    """A Medusa folder as the Medusa repository writes one (``medusa_lm_head.safetensors``)."""
    cfg, g = target.config, torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    w = {}
    for i in range(heads):
        w[f"{i}.0.linear.weight"] = torch.randn(h, h, generator=g) * 0.3
        w[f"{i}.0.linear.bias"] = torch.randn(h, generator=g) * 0.1
        w[f"{i}.1.weight"] = torch.randn(cfg.vocab_size, h, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(w, str(path / "medusa_lm_head.safetensors"))
    (path / "config.json").write_text(
        json.dumps({"medusa_num_heads": heads, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"})
    )
    return w


def reference_from(path, target) -> EagleReference:
    cfg, raw = eagle_config(path, target.config)
    from safetensors.torch import load_file

    w = load_file(str(path / "model.safetensors"))
    d2t = w.pop("d2t", None)
    w.pop("embed_tokens.weight")
    ids = None if d2t is None else torch.arange(len(d2t)) + d2t
    ref = EagleReference(cfg.layer, ids, fc_bias=True)
    ref.load_state_dict(w)
    return ref.eval()


def engine_with(target, proposer, method, k=3, num_blocks=64, caching=True, max_num_seqs=64, budget=64, kv="auto"):
    caches = allocate_kv_cache(target.config, num_blocks, BLOCK, torch.float32, CPU, kv)
    spec = SpeculativeConfig(method, num_speculative_tokens=k, draft_model="tiny", disable_batch_size=10_000)
    runner = ModelRunner(target, caches, BLOCK, CPU, proposer)
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_model_len=200,
        enable_prefix_caching=caching,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        speculative=spec,
    )
    return Engine.create(runner, ToyTokenizer(target.config.vocab_size), config)


def eagle_engine(target, path, num_blocks=64, min_confidence=0.0, width=1, **kw):
    head = load_eagle(path, target)
    cache = allocate_kv_cache(head.config.layer, num_blocks, BLOCK, torch.float32, CPU, kw.get("kv", "auto"))[0]
    proposer = EagleProposer(target, head, cache, BLOCK, CPU, min_confidence, width)
    return engine_with(target, proposer, "eagle", num_blocks=num_blocks, **kw)


def medusa_engine(target, path, num_blocks=64, width=1, **kw):
    proposer = MedusaProposer(target, load_medusa(path, target), tree_width=width)
    return engine_with(target, proposer, "medusa", num_blocks=num_blocks, **kw)


def run(engine, prompts, params):
    done = run_to_completion(engine, prompts, params)
    assert engine.core.block_pool.num_free == engine.core.block_pool.num_blocks, "KV blocks leaked"
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}


def workload(vocab):
    """Shared prefixes (prefix-cache hits), prompts longer than the step budget (chunked
    prefill), varied lengths, penalties and stop tokens on some."""
    shared = [(3 * i) % vocab for i in range(13)]
    prompts, params = [], []
    for i in range(10):
        tail = [(i * 7 + j * 5) % vocab for j in range(3 + 2 * i)]
        prompts.append(shared + tail if i % 2 else tail + [i % vocab] * (1 + i))
        stop = (i % vocab,) if i % 4 == 3 else ()
        penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.3} if i % 3 == 1 else {}
        params.append(SamplingParams(temperature=0, max_tokens=8 + 5 * i, stop_token_ids=stop, **penalties))
    return prompts, params


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, vocab=16)


def test_the_serving_eagle_head_computes_what_the_reference_computes(target, tmp_path):
    """The published layout (separate q/k/v, fc bias, no input norm, an embedding table that is
    the target's) loaded into our fused paged layer gives the reference's features."""
    write_eagle(tmp_path, target)
    head, ref = load_eagle(tmp_path, target), reference_from(tmp_path, target)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    feats = target_features(target, [tokens], BLOCK)[0]
    cache = allocate_kv_cache(head.config.layer, 8, BLOCK, torch.float32, CPU)[0]
    from tokenmill.worker.inputs import prepare_inputs

    ids, positions, meta, _ = prepare_inputs([seq(tokens[1:], list(range(8)))], BLOCK, CPU)
    with torch.inference_mode():
        ours = head(target, feats[:-1], ids, positions, cache, meta)
        embeds = target._embed(torch.tensor(tokens[1:])).float()[None]
        theirs = ref.unroll(feats[None, :-1], embeds, torch.tensor([len(tokens) - 1]), target.rotary, 1)[0][0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


class Recording(EagleProposer):
    """Keeps, for every draft, the sequence's known tokens when it was drafted."""

    log: list[tuple[list[int], list[int]]]

    def propose(self, seqs, new_tokens, generator_for, hidden=None):
        drafts = super().propose(seqs, new_tokens, generator_for, hidden)
        for s in seqs:
            if s.request_id in drafts:
                known = s.prompt_ids + s.output_ids + new_tokens[s.request_id]
                self.log.append((known, drafts[s.request_id].token_ids))
        return drafts


class Alternating:
    """A pay-or-pause policy that turns drafting off and on every few decode steps."""

    def __init__(self) -> None:
        self.steps = 0
        self.drafting = True

    def record(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.drafting = self.steps % 6 < 3


@pytest.mark.parametrize(
    "draft_vocab,paused",
    [(None, False), ([0, 2, 3, 5, 7, 8, 11, 13, 14], False), (None, True)],
    ids=["target-head", "draft-vocab", "paused-now-and-then"],
)
def test_eagle_drafts_follow_the_whole_history_through_chunks_sharing_and_preemption(
    target, tmp_path, draft_vocab, paused
):
    """Every draft equals the reference head's greedy drafts run over the sequence's whole
    history with the target's features computed afresh: the head's cache caught up on
    every kept position (prompt chunks, accepted drafts, steps it did not draft in and
    caught up on later), whatever the schedule."""
    write_eagle(tmp_path, target, draft_ids=draft_vocab)
    head, ref = load_eagle(tmp_path, target), reference_from(tmp_path, target)
    cache = allocate_kv_cache(head.config.layer, 24, BLOCK, torch.float32, CPU)[0]
    proposer = Recording(target, head, cache, BLOCK, CPU)
    proposer.log = []
    engine = engine_with(target, proposer, "eagle", num_blocks=24, budget=16)  # too few blocks: preemption
    if paused:
        engine.core.runner.pause = Alternating()
    prompts, params = workload(16)
    run(engine, prompts, [SamplingParams(temperature=0, max_tokens=p.max_tokens) for p in params])
    assert engine.core.scheduler.num_preemptions > 0 and engine.core.kv.stats.hits > 0
    assert len(proposer.log) > 30
    checked = 0
    for known, drafts in proposer.log[::3]:
        feats = target_features(target, [known[:-1]], BLOCK)[0]
        n = len(known) - 1
        tokens = torch.tensor(known[1:] + drafts[:-1])
        with torch.inference_mode():
            outs = ref.unroll(
                feats[None], target._embed(tokens).float()[None], torch.tensor([n]), target.rotary, len(drafts)
            )
            expected = []
            for out in outs:
                h = out[0, n - 1 : n]
                if ref.lm_head is None:
                    expected.append(int(target.compute_logits(h).argmax()))
                else:
                    expected.append(int(ref.draft_to_target[ref.lm_head(h).argmax()]))
        assert drafts == expected
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("method", ["eagle", "eagle-draft-vocab", "medusa"])
def test_greedy_output_is_identical_with_a_head(target, tmp_path, method):
    prompts, params = workload(16)
    expected = run(engine_with(target, None, "ngram"), prompts, params)
    if method == "medusa":
        write_medusa(tmp_path, target)
        engine = medusa_engine(target, tmp_path, num_blocks=24, budget=16)
    else:
        write_eagle(tmp_path, target, draft_ids=[1, 2, 4, 8, 9, 15] if method == "eagle-draft-vocab" else None)
        engine = eagle_engine(target, tmp_path, num_blocks=24, budget=16)
    assert run(engine, prompts, params) == expected
    assert engine.core.scheduler.num_preemptions > 0
    assert engine.core.spec_decode_stats.num_drafts > 0


def test_an_eagle_head_spends_no_forward_on_requests_that_evict_kv(target, tmp_path):
    """An evicting request never drafts and shares no block: the head catching up on its
    features would be work nobody reads."""
    from tokenmill.sampling_params import KVEviction

    ev = KVEviction(window=16, sinks=4)
    prompt, params = [5, 7, 9] * 10, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_eviction=ev)
    expected = run(engine_with(target, None, "ngram"), [prompt], params)
    write_eagle(tmp_path, target)
    engine = eagle_engine(target, tmp_path)
    seen = []
    hook = engine.core.runner.proposer.head.register_forward_pre_hook(lambda _m, args: seen.append(1))
    try:
        assert run(engine, [prompt], params) == expected
    finally:
        hook.remove()
    assert seen == [], "the head read an evicting request's features"


def test_a_confidence_floor_drafts_less_and_changes_no_output(target, tmp_path):
    """With ``draft_confidence`` a sequence stops drafting once the head is unsure of its
    drafts so far: fewer tokens to verify, the same output."""
    prompts, params = workload(16)
    write_eagle(tmp_path, target, std=0.05)  # small features: a head often unsure of its token
    expected = run(eagle_engine(target, tmp_path), prompts, params)
    always, picky = eagle_engine(target, tmp_path), eagle_engine(target, tmp_path, min_confidence=0.3)
    assert run(always, prompts, params) == expected == run(picky, prompts, params)
    per_draft = [
        e.core.spec_decode_stats.num_draft_tokens / e.core.spec_decode_stats.num_drafts for e in (always, picky)
    ]
    assert per_draft[0] > 2.5 and per_draft[1] < per_draft[0] - 0.5


@pytest.mark.parametrize(
    "method,width",
    [("eagle-draft-vocab", 1), ("medusa", 1), ("eagle-draft-vocab", 2), ("medusa", 2)],
    ids=["eagle", "medusa", "eagle-tree-engine", "medusa-tree-engine"],
)
def test_sampling_with_a_head_reproduces_the_targets_distribution(tmp_path, method, width):
    """Sampled requests draft chains (trees are verified greedily, so an engine drafting
    trees gives sampled requests chains): speculative sampling reproduces the target."""
    vocab, draws = 8, 3000
    target = tiny_model(2, vocab=vocab)
    if method == "medusa":
        write_medusa(tmp_path, target, heads=2, seed=4)
        engine = medusa_engine(target, tmp_path, num_blocks=2000, k=2, max_num_seqs=256, width=width)
    else:  # a draft vocabulary without token 6: its q is zero there, the residual must restore it
        write_eagle(tmp_path, target, seed=4, draft_ids=[0, 1, 2, 3, 4, 5, 7], std=0.5)
        engine = eagle_engine(target, tmp_path, num_blocks=2000, k=2, max_num_seqs=256, width=width)
    prompt = list(range(vocab)) * 2
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True) for s in range(draws)]
    outputs = run(engine, [prompt] * draws, params).values()
    stats = engine.core.spec_decode_stats
    assert stats.num_drafts >= draws
    assert 0 < stats.acceptance_rate < 1
    p1, p23 = exact_first_tokens(target, prompt, 1.0)
    assert chi_square_pvalue(Counter(o[0] for o in outputs), p1) > 1e-3
    assert chi_square_pvalue(Counter(o[1] * vocab + o[2] for o in outputs), p23) > 1e-3


def test_medusa_drafts_are_its_heads_argmax_over_the_target_feature(target, tmp_path):
    w = write_medusa(tmp_path, target, heads=3)
    heads = load_medusa(tmp_path, target)
    feats = target_features(target, [[5, 6, 7, 8]], BLOCK)[0][-1:]
    with torch.inference_mode():
        got = heads(feats).argmax(-1)[:, 0].tolist()
    want = []
    for i in range(3):
        x = feats + torch.nn.functional.silu(feats @ w[f"{i}.0.linear.weight"].t() + w[f"{i}.0.linear.bias"])
        want.append(int((x @ w[f"{i}.1.weight"].t()).argmax()))
    assert got == want


def test_heads_that_do_not_fit_the_target_are_refused_with_the_reason(target, tmp_path):
    wide = tiny_model(0, vocab=16)
    write_eagle(tmp_path / "e", wide)
    raw = json.loads((tmp_path / "e" / "config.json").read_text())
    (tmp_path / "e" / "config.json").write_text(json.dumps({**raw, "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="width 64"):
        load_eagle(tmp_path / "e", target)
    (tmp_path / "e3").mkdir()
    (tmp_path / "e3" / "config.json").write_text(json.dumps({**raw, "architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(ModelLoadError, match="EAGLE-3"):
        load_eagle(tmp_path / "e3", target)
    write_medusa(tmp_path / "m", tiny_model(0, vocab=12))
    with pytest.raises(ModelLoadError, match="over 12 tokens"):
        load_medusa(tmp_path / "m", target)
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="medusa_num_heads"):
        load_medusa(tmp_path / "m", target)


# ------------------------------------------------------------------------ trees


@pytest.mark.parametrize("ops", ["torch", "native"])
def test_a_tree_forward_gives_each_node_the_logits_of_its_own_path(ops):
    """One forward over a root and a draft tree (tree mask, positions by depth, slots in
    order) gives every node the logits the target gives the chain from the root to it."""
    from tokenmill.kernels.native import load_native
    from tokenmill.model.ops import NativeOps, TorchOps
    from tokenmill.worker.tree import verification_layout

    if ops == "native" and not load_native():
        pytest.skip("the native kernels did not build")
    model = tiny_model(5, vocab=16)
    model.ops = NativeOps() if ops == "native" else TorchOps()
    runner = ModelRunner(model, allocate_kv_cache(model.config, 32, BLOCK, torch.float32, CPU), BLOCK, CPU)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    parents, tokens = [-1, -1, 0, 0, 1, 2, 4], [6, 7, 8, 9, 10, 11, 12]
    all_logits(runner, [seq(prompt[:-1], list(range(8)))])  # the context, cached
    positions, mask = verification_layout(parents, 1, len(prompt) - 1)
    tree = seq(prompt[-1:] + tokens, list(range(8)), num_computed=len(prompt) - 1)
    tree.positions, tree.tree_mask = positions, mask
    got = all_logits(runner, [tree])
    fresh = ModelRunner(model, allocate_kv_cache(model.config, 32, BLOCK, torch.float32, CPU), BLOCK, CPU)
    for i in range(len(tokens)):
        path, a = [], i
        while a >= 0:
            path.insert(0, tokens[a])
            a = parents[a]
        want = all_logits(fresh, [seq(prompt + path, list(range(8)))])[-1]
        torch.testing.assert_close(got[1 + i], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], all_logits(fresh, [seq(prompt, list(range(8)))])[-1], rtol=1e-4, atol=1e-4)


def tree_workload(vocab):
    """Greedy requests (trees), some with penalties and min_tokens (judged along each node's
    path), and sampled ones (chains) in the same batches."""
    prompts, params = workload(vocab)
    for i in (2, 5, 8):
        params[i] = SamplingParams(temperature=0.8, seed=i, max_tokens=params[i].max_tokens)
    params[4] = SamplingParams(temperature=0, max_tokens=30, min_tokens=20, stop_token_ids=(3,), frequency_penalty=0.5)
    return prompts, params


@pytest.mark.parametrize(
    "method,width,kv",
    [
        ("eagle", 2, "auto"),
        ("eagle-draft-vocab", 3, "auto"),
        ("eagle", 2, "int8"),
        ("medusa", 2, "auto"),
        ("medusa", 3, "int8"),
    ],
)
def test_tree_verification_is_greedy_identical_through_chunks_sharing_and_preemption(
    target, tmp_path, method, width, kv
):
    prompts, params = tree_workload(16)
    chain = engine_with(target, None, "ngram", kv=kv)
    expected = run(chain, prompts, params)
    if method == "medusa":
        write_medusa(tmp_path, target, heads=4)
        engine = medusa_engine(target, tmp_path, num_blocks=30, width=width, k=5, budget=16, kv=kv)
    else:
        write_eagle(tmp_path, target, draft_ids=[1, 2, 4, 8, 9, 15, 3, 0] if method == "eagle-draft-vocab" else None)
        engine = eagle_engine(target, tmp_path, num_blocks=30, width=width, k=5, budget=16, kv=kv)
    proposer, shapes = engine.core.runner.proposer, Counter()
    propose = proposer.propose

    def counting(*a, **kw):
        drafts = propose(*a, **kw)
        shapes.update(
            "tree" if d.parents is not None and len(set(d.parents)) < len(d.parents) else "chain"
            for d in drafts.values()
        )
        return drafts

    proposer.propose = counting
    got = run(engine, prompts, params)
    assert shapes["tree"] > 20 and shapes["chain"] > 5  # greedy requests drafted trees, sampled ones chains
    greedy = [str(i) for i, p in enumerate(params) if p.temperature == 0]
    assert {r: got[r] for r in greedy} == {r: expected[r] for r in greedy}
    assert engine.core.scheduler.num_preemptions > 0 and engine.core.kv.stats.hits > 0
    assert engine.core.spec_decode_stats.num_drafts > 0 and engine.core.spec_decode_stats.num_accepted_tokens > 0
