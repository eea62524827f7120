"""The draft's training prompts (models/prompts.py) and the held-out everyday set
(loadtest/everyday.py): the evaluation measures prompts the draft never saw."""

from __future__ import annotations

from collections import Counter

import pytest

from blockspec.loadtest.everyday import EVERYDAY, HELD_OUT_TOPICS, everyday_ids
from blockspec.models import prompts


@pytest.fixture(scope="module")
def grid():
    return prompts


def test_the_held_out_set_has_sixty_conversations_over_eight_kinds():
    assert len(EVERYDAY) >= 8
    assert sum(len(chats) for chats in EVERYDAY.values()) >= 60
    for chats in EVERYDAY.values():
        for turns in chats:
            assert [t["role"] for t in turns] == ["user", "assistant"] * (len(turns) // 2) + [
                "user"
            ]


def test_every_held_out_prompt_is_about_a_held_out_topic():
    """So the disjointness check below covers what the prompts are about."""
    for kind, chats in EVERYDAY.items():
        for turns in chats:
            text = " ".join(t["content"] for t in turns).lower()
            assert any(topic in text for topic in HELD_OUT_TOPICS), (kind, text[:60])


def test_the_training_grid_names_no_held_out_topic(grid):
    grid.assert_disjoint()


def test_the_disjointness_check_catches_a_leak(grid, monkeypatch):
    monkeypatch.setattr(grid, "TOPICS", (*grid.TOPICS, "active volcanoes"))
    with pytest.raises(AssertionError, match="volcan"):
        grid.assert_disjoint()


def test_round_one_is_seeded_and_covers_every_kind(grid):
    a, b = grid.round_one(7, 600), grid.round_one(7, 600)
    assert a == b and a != grid.round_one(8, 600)
    kinds = Counter(kind for kind, _ in a)
    assert set(kinds) == {
        "question", "explanation", "howto", "creative", "practical", "list", "advice", "math",
        "code", "summary",
    }  # fmt: skip
    assert 0.2 < kinds["code"] / len(a) < 0.4  # the code prompts stay in the mix


def test_round_two_continues_round_one_conversations(grid):
    answered = [(k, t, "an answer " * 30) for k, t in grid.round_one(0, 50)]
    chats = grid.round_two(0, answered, 40)
    conversations = [t for k, t in chats if k == "conversation"]
    assert conversations and all(len(t) == 3 and t[1]["role"] == "assistant" for t in conversations)
    assert all(t[0] in [u[0] for _, u, _ in answered] for t in conversations)


def test_everyday_prompts_render_in_the_chat_template():
    from transformers import AutoTokenizer

    from blockspec.workers.models import TINY_TARGET

    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    rows = everyday_ids(tok, 64)
    assert len(rows) == sum(len(c) for c in EVERYDAY.values())
    assert all(0 < len(ids) <= 64 for _, ids in rows)
    by_kind = {kind: [ids for k, ids in rows if k == kind] for kind in EVERYDAY}
    assert everyday_ids(tok, 64, per_kind=2) == [
        (kind, ids) for kind in EVERYDAY for ids in by_kind[kind][:2]
    ]
