"""The streamed text never shows a cut character (service.detokenizer.TextStream), on real
byte-level BPE tokenizers: the tiny pair's and the default target's (SmolLM2, when set up),
where emoji and CJK characters split across tokens, and a stream can end between their bytes
(max_new_tokens ran out)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from blockspec.service.detokenizer import TextStream
from blockspec.workers.models import DEFAULT_TARGET, TINY_TARGET

TEXTS = [
    "emoji 🙂🚀 and a family 👨‍👩‍👧 in one line",
    "中文字符和日本語のテキスト, 한국어도",
    "naïve café ½ × 3 ≥ 1, 𝄞 and 🎉🎉🎉",
]
TOKENIZERS = [
    pytest.param(TINY_TARGET, id="tiny"),
    pytest.param(
        DEFAULT_TARGET,
        id="smollm2",
        marks=pytest.mark.skipif(
            not DEFAULT_TARGET.exists(), reason="default pair not set up (scripts/setup.sh)"
        ),
    ),
]


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request):
    return AutoTokenizer.from_pretrained(request.param, local_files_only=True)


def streamed(tokenizer, ids: list[int], seed: int) -> list[str]:
    """Pieces of text a stream of `ids` (in chunks of 1-3 tokens) sends, the flush last."""
    rng, s, pieces, i = random.Random(seed), TextStream(tokenizer, []), [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        pieces.append(s.feed(ids[i : i + n])[0])
        i += n
    return [*pieces, s.flush()]


def test_a_stream_that_ends_inside_a_character_drops_it(tokenizer):
    """Cut the token ids at every position: whatever the chunking, no piece (the flush
    included) carries U+FFFD, and the text is the whole text's prefix of complete characters."""
    cut_inside = 0
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        for end in range(1, len(ids) + 1):
            one_piece = tokenizer.decode(ids[:end])
            cut_inside += one_piece.endswith("\ufffd")
            for seed in range(3):
                pieces = streamed(tokenizer, ids[:end], seed)
                assert not any("\ufffd" in p for p in pieces), (end, pieces)
                assert "".join(pieces) == one_piece.rstrip("\ufffd")
                assert text.startswith("".join(pieces))
    assert cut_inside >= 3  # the texts do split characters across tokens here


def test_a_character_split_across_feeds_arrives_whole(tokenizer):
    """Feed one token at a time: the piece that completes a multi-byte character carries all
    of it, and the pieces before it none of its bytes."""
    text = "ok 🚀 中"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = streamed(tokenizer, ids, seed=0)
    s = TextStream(tokenizer, [])
    singles = [s.feed([i])[0] for i in ids] + [s.flush()]
    assert "".join(singles) == "".join(pieces) == text
    assert any(p == "" for p in singles)  # a rocket's first bytes were held back
    assert any("🚀" in p for p in singles)
