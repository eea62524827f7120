"""Gateway units without a service: the incremental detokenizer (service.detokenizer.TextStream)
on the tiny pair's tokenizer (streamed text equals the one-piece decode, never shows a broken
character, stop strings cut text and token ids exactly), and the gRPC code of each error."""

from __future__ import annotations

import pickle
import random

import grpc
import pytest
from ray.serve.exceptions import BackPressureError
from transformers import AutoTokenizer

from blockspec.protos import blockspec_pb2 as pb
from blockspec.service.coordinator import DeadlineExceeded, Overloaded, ReplicaFailed
from blockspec.service.core import refusal_of
from blockspec.service.detokenizer import TextStream
from blockspec.service.gateway import request_params
from blockspec.service.requests import InvalidArgument, Limits, RequestValidator
from blockspec.service.sessions import StoreUnavailableError
from blockspec.workers.models import TINY_TARGET

TEXTS = [
    "def add(a, b):\n    return a + b  # sum\n",
    "naïve café, jalapeño — “quotes” and ½ × 3 ≥ 1",
    "中文字符和日本語のテキスト, 한국어도",
    "emoji 🙂🚀 and a family 👨‍👩‍👧 in one line\n\tindented",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TARGET, local_files_only=True)


def stream(tokenizer, ids: list[int], stops: list[str], seed: int):
    """Feed `ids` in random chunks of 1-4 tokens; returns (pieces, ids emitted, stream)."""
    rng = random.Random(seed)
    s = TextStream(tokenizer, stops)
    pieces, emitted, i = [], [], 0
    while i < len(ids) and not s.stopped:
        n = rng.randint(1, 4)
        text, out = s.feed(ids[i : i + n])
        pieces.append(text)
        emitted += out
        i += n
    pieces.append(s.flush())
    return pieces, emitted, s


@pytest.mark.parametrize("seed", range(5))
def test_streamed_text_equals_the_one_piece_decode(tokenizer, seed):
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        pieces, emitted, _ = stream(tokenizer, ids, [], seed)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) and emitted == ids
        assert not any("\ufffd" in p for p in pieces), pieces  # no broken character shown
    # Arbitrary token sequences (invalid UTF-8 included) stream to their one-piece decode too,
    # less a character cut at the end (tests/test_detokenizer.py).
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    pieces, emitted, _ = stream(tokenizer, ids, [], seed)
    whole = tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert "".join(pieces) == whole and emitted == ids


@pytest.mark.parametrize("seed", range(5))
def test_stop_strings_cut_text_and_ids(tokenizer, seed):
    text = "x = 1\nprint(x)\n# END of 中文 file\nmore text after"
    ids = tokenizer(text)["input_ids"]
    pieces, emitted, s = stream(tokenizer, ids, ["# END", "never"], seed)
    assert s.stopped and "".join(pieces) == "x = 1\nprint(x)\n"
    # The ids end with the token that completed the stop string.
    assert "# END" in tokenizer.decode(emitted) and "# END" not in tokenizer.decode(emitted[:-1])


def test_a_stop_string_that_never_completes_is_released_at_the_end(tokenizer):
    ids = tokenizer("value = 3 # EN")["input_ids"]
    pieces, emitted, s = stream(tokenizer, ids, ["# END"], seed=0)
    assert not s.stopped and "".join(pieces) == "value = 3 # EN" and emitted == ids
    assert "# EN" not in "".join(pieces[:-1])  # held back until the stream ended


CODE = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument("k", "9 out of range"), CODE.INVALID_ARGUMENT),
        (Overloaded("queue full"), CODE.RESOURCE_EXHAUSTED),
        (BackPressureError(num_queued_requests=3, max_queued_requests=2), CODE.RESOURCE_EXHAUSTED),
        (DeadlineExceeded("deadline exceeded"), CODE.DEADLINE_EXCEEDED),
        (ReplicaFailed("actor died"), CODE.UNAVAILABLE),
        (StoreUnavailableError("cannot reach Redis"), CODE.UNAVAILABLE),
        (RuntimeError("boom"), CODE.INTERNAL),
    ],
)
def test_errors_map_to_grpc_codes(error, code):
    refusal = refusal_of(error)
    assert refusal.code == code
    assert str(error) in refusal.details  # the cause reaches the client
    assert refusal.field == ("k" if code == CODE.INVALID_ARGUMENT else None)


LIMITS = Limits(
    vocab_size=100,
    max_context=64,
    max_new_tokens=32,
    max_k=4,
    max_gamma=6,
    default_method="block",
    default_gamma=4,
    default_max_new_tokens=16,
)


def _checked(**fields):
    params = request_params(pb.GenerateRequest(prompt_token_ids=[1, 2], **fields))
    validator = RequestValidator(LIMITS)
    return validator.request(params, validator.prompt_ids(params))


def test_unset_fields_are_the_defaults_and_a_set_zero_is_a_value():
    """proto3 explicit presence: unset means the deployment's default, a set 0 is checked like
    any value (and refused naming the field), not read as "the default"."""
    r = _checked()
    assert (r.method, r.k, r.gamma, r.max_new_tokens) == ("block", 1, 4, 16)
    assert r.sampling.top_k == 0 and r.sampling.temperature == 1.0
    r = _checked(method="gbv", k=3, gamma=2, max_new_tokens=5, top_k=7, temperature=0)
    assert (r.method, r.k, r.gamma, r.max_new_tokens) == ("gbv", 3, 2, 5)
    assert (r.sampling.top_k, r.sampling.temperature) == (7, 0)
    assert _checked(top_k=0).sampling.top_k == 0  # 0 = off, Hugging Face's meaning: allowed
    for field, value, code in [
        ("k", 0, "integer_below_min_value"),
        ("gamma", 0, "integer_below_min_value"),
        ("max_new_tokens", 0, "integer_below_min_value"),
        ("k", 5, "integer_above_max_value"),
        ("temperature", 2.5, "decimal_above_max_value"),
        ("top_k", -1, "integer_below_min_value"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            _checked(method="gbv", **{field: value})
        assert (err.value.field, err.value.code) == (field, code), err.value
    for method in ("auto", "none"):  # their k and gamma are ignored, but a 0 is a mistake
        with pytest.raises(InvalidArgument) as err:
            _checked(method=method, gamma=0)
        assert err.value.field == "gamma"
        assert _checked(method=method, k=3, gamma=2).method == method


def test_chat_roles_are_openais():
    params = request_params(
        pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi"),
                                     pb.ChatMessage(role="robot", content="x")])
    )  # fmt: skip
    with pytest.raises(InvalidArgument) as err:
        RequestValidator(LIMITS).prompt_ids(params)
    assert err.value.field == "messages[1].role" and "'robot'" in err.value.message


def test_an_invalid_argument_survives_pickling_with_its_code():
    err = pickle.loads(
        pickle.dumps(InvalidArgument("k", "0 must be >= 1", "integer_below_min_value"))
    )
    assert (err.field, err.message, err.code) == ("k", "0 must be >= 1", "integer_below_min_value")
