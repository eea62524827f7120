"""Our Llama forward (workers/llama.py) on every Hugging Face family that load_model accepts.

Each family is a tiny random checkpoint built from its transformers config class, saved to disk
and read back through ``workers.models.load_model`` (no downloads). Checks: RoPE inverse
frequencies equal HF's bit for bit; tree-batch logits (ragged prefix cache, two rows of
branching trees per request) equal HF's logits along each node's root-to-node path; greedy
decoding one token at a time equals HF's ``generate``; a 2-rank tensor-parallel split (biases,
q/k norms) equals the unsharded model; a ``draft_vocab.json`` head gives HF's logits on the kept
ids and -inf elsewhere; unsupported configs are refused with the field named.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import threading

import pytest
import torch
from test_engine import greedy_reference
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from blockspec import workers
from blockspec.workers.compiled import compile_forward
from blockspec.workers.draft import prefill
from blockspec.workers.llama import KVCache, Llama, LlamaSpec
from blockspec.workers.models import load_model

VOCAB, TOL = 256, 1e-4
# bfloat16 logits (up to ~17 here) of two layouts: equal bit for bit on the AVX-512 BF16 VM;
# another CPU may sum in another order, and bfloat16 keeps 8 bits.
BF16_TOL = 0.1
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.5,  # peaked rows: greedy argmaxes are far from ties
    eos_token_id=None,
)
# Short pre-training context so that a 16-dim head hits all three llama3 bands (kept, smoothed,
# stretched wavelengths).
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
FAMILIES = {  # name: (config class, overrides)
    "llama": (LlamaConfig, dict(tie_word_embeddings=True)),
    "llama3_rope": (LlamaConfig, dict(rope_parameters=LLAMA3_ROPE)),
    "linear_rope": (LlamaConfig, dict(rope_parameters=dict(rope_type="linear", factor=4.0))),
    "llama_biases": (LlamaConfig, dict(attention_bias=True, mlp_bias=True)),  # untied head
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, dict(head_dim=24, tie_word_embeddings=True)),  # 4 * 24 != 64
    "mistral": (MistralConfig, dict()),  # its default sliding_window 4096 >= context 128
}
TIED = {"llama", "qwen2", "qwen3"}


def save_family(name: str, path) -> torch.nn.Module:
    """A random HF model of the family, saved to `path`. Biases and norm weights are randomized
    too (HF initializes them to 0 and 1, which would hide a missing bias or q/k norm)."""
    cls, overrides = FAMILIES[name]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cls(**{**COMMON, **overrides}), dtype=torch.float32)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in pname:
                p.uniform_(0.5, 1.5)
    hf.eval().save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_family(request.param, path)
    return request.param, hf, path


def hf_last_logits(hf, seq: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([seq])).logits[0, -1]


def tree_logits(model: Llama, seed: int = 1, score=None):
    """Two requests (ragged contexts) x two rows, each row a flattened 5-node tree, scored in
    one forward over the prefilled cache (by `score`, model.forward's stand-in, if given).
    Yields (logits [V], full token sequence) per node."""
    parents = [[-1, 0, 1, 0, 3], [-1, 0, 0, 2, 2]]  # row r: node t's parent (-1: the root)
    g = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(0, VOCAB, (t,), generator=g) for t in (5, 9)]
    n, R, T = len(contexts), len(parents), len(parents[0])
    tokens = torch.randint(0, VOCAB, (n, R, T), generator=g)
    chains = []  # chains[r][t]: node t's root-to-node path
    for par in parents:
        chains.append([])
        for t, p in enumerate(par):
            chains[-1].append((chains[-1][p] if p >= 0 else []) + [t])
    mask = torch.zeros(R, T, T, dtype=torch.bool)  # node t sees its ancestors and itself
    depth = torch.zeros(R, T, dtype=torch.int64)
    for r in range(R):
        for t in range(T):
            mask[r, t, chains[r][t]] = True
            depth[r, t] = len(chains[r][t]) - 1
    cache = KVCache(model.spec, model.kv_heads, n, 32, model.embed.dtype, "cpu")
    prefill(model, cache, 0, contexts)
    positions = cache.lengths[:n, None, None] + depth  # [n, R, T]
    logits, *_ = (score or model)(tokens, positions, cache, mask.expand(n, R, T, T))  # [n, R, T, V]
    assert logits.dtype == torch.float32 and logits.shape == (n, R, T, VOCAB)
    for b in range(n):
        for r in range(R):
            for t in range(T):
                path = tokens[b, r, chains[r][t]]
                yield logits[b, r, t], torch.cat([contexts[b], path]).tolist()


def our_greedy(model: Llama, prompt: list[int], steps: int) -> list[int]:
    """Prefill all but the last prompt token, then one token per forward, argmax."""
    cache = KVCache(model.spec, model.kv_heads, 1, len(prompt) + steps, torch.float32, "cpu")
    prefill(model, cache, 0, [torch.tensor(prompt[:-1])])
    out, last = [], prompt[-1]
    one = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    for _ in range(steps):
        pos = cache.lengths[:1].view(1, 1, 1)
        logits, k, v, _ = model(torch.tensor([[[last]]]), pos, cache, one)
        cache.append(k[:, :, 0], v[:, :, 0], torch.zeros(1, 1, dtype=torch.int64), one.view(1))
        last = int(logits[0, 0, 0].argmax())
        out.append(last)
    return out


def test_rope_frequencies_equal_hugging_face(family):
    name, hf, path = family
    model = load_model(path).build()
    assert torch.equal(model.inv_freq, hf.model.rotary_emb.inv_freq)
    plain = dataclasses.replace(model.spec, rope_type="default").inv_freq()
    if name in ("llama3_rope", "linear_rope"):  # the scaling did change some frequencies
        assert not torch.equal(model.inv_freq, plain)
    if name == "llama3_rope":  # ... and kept the highest ones
        assert model.inv_freq[0] == plain[0]


def test_tree_batch_logits_equal_hugging_face(family):
    name, hf, path = family
    loaded = load_model(path)
    state = loaded.state
    assert name in TIED or not torch.equal(
        state["lm_head.weight"], state["model.embed_tokens.weight"]
    )
    models = [loaded.build(), loaded.build(packed=False)]  # oneDNN-packed and F.linear
    if name in TIED:  # a checkpoint without lm_head.weight reads the embeddings instead
        models.append(Llama(loaded.spec, {k: v for k, v in state.items() if k != "lm_head.weight"}))
    for model in models:
        for got, seq in tree_logits(model):
            assert torch.allclose(got, hf_last_logits(hf, seq), atol=TOL), (name, seq)


def linears(model: Llama) -> list[workers.llama.Linear]:
    return [m for m in model.modules() if isinstance(m, workers.llama.Linear)]


def test_onednn_packed_weights_give_dense_logits(family):
    """packed=True runs every projection on oneDNN-packed weights, packed=False none; either
    layout gives the other's logits up to summation order."""
    name, _, path = family
    loaded = load_model(path)
    packed, plain = loaded.build(packed=True), loaded.build(packed=False)
    assert all(w.packed and w.weight.is_mkldnn for w in linears(packed)), name
    assert not any(w.packed for w in linears(plain))
    for (got, _), (want, _) in zip(tree_logits(packed), tree_logits(plain), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_bfloat16_packed_weights_give_dense_logits(family):
    """In bfloat16 too, oneDNN-packed weights give F.linear's logits up to rounding: each
    projection's output is rounded to bfloat16 after another summation order."""
    name, _, path = family
    loaded = load_model(path, "bfloat16")
    packed, plain = loaded.build(packed=True), loaded.build(packed=False)
    assert all(w.packed and w.weight.is_mkldnn for w in linears(packed)), name
    for (got, _), (want, _) in zip(tree_logits(packed), tree_logits(plain), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=BF16_TOL)


def test_int8_weights_are_rounded_once_per_output_feature(family):
    """dtype int8 rounds every projection and the head once, at load, to int8 with one scale
    per output feature (workers.llama.Int8Linear: q = round(w / s), s = max |w_row| / 127),
    and each product is x·(q·s)ᵀ up to its bfloat16 output's rounding. A row-parallel shard
    takes its rows' scales from the whole rows, so a tensor-parallel int8 target is the same
    model as one rank's. (The engine keeps the int8 model's law: tests/test_draft_kinds.py.)"""
    name, _, path = family
    loaded = load_model(path, "int8")
    model = loaded.build()
    int8 = [m for m in model.modules() if isinstance(m, workers.llama.Int8Linear)]
    assert int8 and not linears(model) and all(m.weight.dtype == torch.int8 for m in int8)
    head = loaded.state.get("lm_head.weight", loaded.state["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.scale, head.float().abs().amax(1).div(127).to(head.dtype))
    odd = torch.randn(40, 200, dtype=torch.bfloat16)  # in-features padded to 16s for the kernel
    for m in [*int8, workers.llama.Int8Linear(odd), workers.llama.Int8Linear(odd, odd[:, 0])]:
        x = torch.randn(3, m.shape[1], generator=torch.Generator().manual_seed(2))
        x = x.to(torch.bfloat16)
        q = m.weight[:, : m.shape[1]].float()
        want = x.float() @ (q * m.scale.float()[:, None]).T
        want = want if m.bias is None else want + m.bias.float()
        torch.testing.assert_close(m(x).float(), want, rtol=2**-7, atol=1e-2)
    one, shard = (
        [m.linear.scale for m in loaded.build(rank, world).modules()
         if isinstance(m, workers.llama.RowParallel)]
        for rank, world in ((0, 1), (1, 2))
    )  # fmt: skip
    assert one and all(torch.equal(a, b) for a, b in zip(one, shard, strict=True)), name


def test_int4_rounds_the_layers_in_groups_and_keeps_a_weight_on_a_4_bit_grid(family):
    """dtype int4 rounds each decoder layer's projection once, at load, to 4 bits in groups of
    32 input features (workers.llama.Int4Linear, Q4_1's layout), and leaves the head dense. A
    weight already on such a grid, as a checkpoint dequantized from Q4_1 is (the default
    target), comes back exactly: through identity rows each product returns the weight. A
    tensor-parallel int4 target's row-parallel shards keep whole groups, or it is refused."""
    name, _, path = family
    Int4, Shard = workers.llama.Int4Linear, workers.llama.CheckpointShard
    model = load_model(path, "int4").build()
    layers = [m for m in model.layers.modules() if isinstance(m, (workers.llama.Linear, Int4))]
    assert layers and all(isinstance(m, Int4) for m in layers), name
    assert type(model.lm_head) is workers.llama.Linear and model.embed.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    for width in (64, 40):  # 40: a last group padded with zero weights
        q = torch.randint(0, 16, (24, width), generator=gen).float()
        q[:, ::32], q[:, 1::32] = 0, 15  # every group spans its whole grid: lo and lo + 15 s
        step = 2.0 ** -torch.randint(3, 8, (24, 1), generator=gen).float()
        weight = (q - 8) * step  # [24, width]: bfloat16-exact, as are its steps and zeros
        rounded = Int4(weight)
        assert rounded.shape == (24, width)
        got = rounded(torch.eye(width, dtype=torch.bfloat16))  # [width, 24]
        assert torch.equal(got, weight.T.to(torch.bfloat16)), width
    whole = torch.randn(8, 128, generator=gen)
    shards = [
        Shard({"w.weight": whole}, rank, 2, rounded="int4").row_parallel("w", 64) for rank in (0, 1)
    ]
    joined = torch.cat([s.linear.scale_and_zero for s in shards])
    assert torch.equal(joined, Int4(whole).scale_and_zero)  # the same model at any world
    with pytest.raises(ValueError, match="int4 groups 32 input features"):
        Shard({"w.weight": whole[:, :80]}, 0, 2, rounded="int4").row_parallel("w", 40)


def test_a_compiled_forward_gives_the_eager_logits(tmp_path):
    """compile_forward (the engine's compiled decode forwards: inductor with freezing, which
    packs the dense weights itself) gives the eager logits, biases included, up to the
    rounding of the fused work, reading a wider window than the longest prefix (9)."""
    save_family("llama_biases", tmp_path)
    model = load_model(tmp_path).build(packed=False)
    forward = compile_forward(model)
    score = functools.partial(forward, window=16)
    pairs = zip(tree_logits(model, score=score), tree_logits(model), strict=True)
    for (got, _), (want, _) in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_an_int4_forward_compiles_to_its_eager_logits(tmp_path):
    """torch's int4 kernel inside a compiled forward (`--dtype int4` with `compiled`) computes
    the int4 model: its logits lie within the bfloat16 rounding of the fused work of the eager
    int4 ones (on this random model, whose rounding to int4 moves them several units, a few
    tenths), far nearer than the bfloat16 model's."""
    save_family("llama_biases", tmp_path)
    model = load_model(tmp_path, "int4").build(packed=False)  # as the engine compiles it
    score = functools.partial(compile_forward(model), window=16)
    dense = load_model(tmp_path, "bfloat16").build()
    compiled, eager = tree_logits(model, score=score), tree_logits(model)
    for (got, _), (want, _), (other, _) in zip(compiled, eager, tree_logits(dense), strict=True):
        assert (got - want).abs().max() < 0.25 * (want - other).abs().max()


@pytest.mark.parametrize("native", [True, False])
def test_default_packs_large_cpu_weights_in_a_dtype_the_cpu_computes(native, monkeypatch):
    """By default (packed=None) a projection is packed when it is on a CPU and at least
    PACK_MIN_ELEMENTS: float32 always, bfloat16 where the CPU has bfloat16 instructions."""
    monkeypatch.setattr(workers.llama, "native_bf16", lambda: native)
    cfg = LlamaConfig(**{**COMMON, "hidden_size": 512, "intermediate_size": 768})
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    spec, state = LlamaSpec.from_hf_config(cfg), hf.state_dict()
    big = Llama(spec, state)
    assert all(
        w.packed == (w.shape.numel() >= workers.llama.PACK_MIN_ELEMENTS) for w in linears(big)
    )
    assert {w.packed for w in linears(big)} == {True, False}  # the 256-token head stays dense
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    packed = [w.packed for w in linears(Llama(spec, bf16))]
    assert packed == [native and w.shape.numel() >= workers.llama.PACK_MIN_ELEMENTS
                      for w in linears(big)]  # fmt: skip


def test_greedy_equals_hugging_face_generate(family):
    name, hf, path = family
    model = load_model(path).build()
    prompt = [3, 7, 1, 9, 2, 200]
    assert our_greedy(model, prompt, 10) == greedy_reference(hf, prompt, 10), name


@pytest.mark.parametrize("name", ["llama", "mistral"])  # tied and untied head
def test_draft_vocab_head(name, tmp_path):
    hf = save_family(name, tmp_path)
    kept = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))[:40].tolist())
    (tmp_path / "draft_vocab.json").write_text(json.dumps(kept))
    loaded = load_model(tmp_path)
    assert loaded.head_vocab.tolist() == kept
    model = loaded.build()
    assert model.lm_head.shape == (len(kept), COMMON["hidden_size"])  # gathered once
    dropped = torch.ones(VOCAB, dtype=torch.bool)
    dropped[kept] = False
    for got, seq in tree_logits(model):
        assert torch.allclose(got[kept], hf_last_logits(hf, seq)[kept], atol=TOL), seq
        assert torch.isneginf(got[dropped]).all()
        probs = got.softmax(-1)
        assert (probs[dropped] == 0).all() and torch.isclose(probs.sum(), torch.tensor(1.0))
    for bad in ([5, 3], [1, 1], [VOCAB], [], "x"):
        (tmp_path / "draft_vocab.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"draft_vocab\.json"):
            load_model(tmp_path)


class _Threads:
    """An all-reduce for ranks run as threads of this process (no torch.distributed group)."""

    def __init__(self, world: int):
        self.barrier, self.parts, self.local = threading.Barrier(world), {}, threading.local()

    def all_reduce(self, tensor: torch.Tensor, group=None) -> None:
        self.parts[self.local.rank] = tensor.clone()
        self.barrier.wait()
        total = sum(self.parts[r] for r in sorted(self.parts))
        self.barrier.wait()  # every rank has read the parts before any writes its next one
        tensor.copy_(total)


@pytest.mark.parametrize("name", ["llama_biases", "qwen2", "qwen3"])
def test_tensor_parallel_shards_biases_and_qk_norms(name, tmp_path, monkeypatch):
    save_family(name, tmp_path)
    loaded = load_model(tmp_path)
    seq = torch.randint(0, VOCAB, (1, 1, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]

    def run(model: Llama) -> torch.Tensor:
        cache = KVCache(model.spec, model.kv_heads, 1, 16, torch.float32, "cpu")
        return model(seq, torch.arange(12)[None, None], cache, mask)[0]

    want = run(loaded.build())
    threads = _Threads(2)
    monkeypatch.setattr(workers.llama.dist, "all_reduce", threads.all_reduce)
    got = [None, None]

    def rank(r: int) -> None:
        threads.local.rank = r
        got[r] = run(loaded.build(r, 2))

    workers_ = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for w in workers_:
        w.start()
    for w in workers_:
        w.join()
    for r in range(2):
        assert torch.allclose(got[r], want, atol=TOL), (name, r)


def refused(tmp_path, cfg, field: str) -> None:
    cfg.save_pretrained(tmp_path)  # the config alone: refused before any weights are read
    with pytest.raises(ValueError, match=field):
        load_model(tmp_path)
    with pytest.raises(ValueError, match=field):  # the tensor-parallel target's early check
        LlamaSpec.from_hf_config(cfg)


SMALL = {k: v for k, v in COMMON.items() if k != "initializer_range"}


@pytest.mark.parametrize(
    ("field", "cfg"),
    [
        ("model_type", lambda: GPT2Config()),
        ("model_type", lambda: Phi3Config(**SMALL)),
        ("hidden_act", lambda: LlamaConfig(**SMALL, hidden_act="gelu")),
        (
            "rope_type",
            lambda: LlamaConfig(
                **SMALL,
                rope_parameters=dict(
                    rope_type="yarn", factor=2.0, original_max_position_embeddings=64
                ),
            ),
        ),
        (
            "rope_type",
            lambda: LlamaConfig(**SMALL, rope_parameters=dict(rope_type="dynamic", factor=2.0)),
        ),
        (
            "use_sliding_window",
            lambda: Qwen2Config(
                **SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=0
            ),
        ),
        ("sliding_window", lambda: MistralConfig(**SMALL, sliding_window=16)),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(field, cfg, tmp_path):
    refused(tmp_path, cfg(), field)


def test_windows_that_cover_the_context_are_accepted():
    for cfg in (
        MistralConfig(**SMALL, sliding_window=None),
        MistralConfig(**SMALL, sliding_window=128),  # = max_position_embeddings: never binds
        Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=128, max_window_layers=0),
        Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=2),
    ):
        assert LlamaSpec.from_hf_config(cfg).max_positions == 128


def test_missing_weights_are_named(tmp_path):
    LlamaConfig(**SMALL).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no weights \(model\.safetensors\)"):
        load_model(tmp_path)
    shutil.rmtree(tmp_path)
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(tmp_path)
