"""Incremental detokenization for a streamed answer: token ids in, final text out.

The gateway (service/gateway.py) feeds each decode step's new tokens to a :class:`TextStream`
and sends the text it returns; stop strings are cut here, where the text exists.
"""

from __future__ import annotations


class TextStream:
    """Incremental detokenization with stop strings: emitted text is final (never a broken
    character, never the start of a stop string that later completes).

    A token boundary inside a multi-byte UTF-8 character (byte-level BPE splits emoji and CJK
    into byte tokens) decodes to U+FFFD until the next tokens complete the character: that
    text is held back until then, and dropped at the end if they never come (:meth:`flush`).

    Each feed decodes only the new tokens, with the previous feed's tokens as left context
    (tokenizers whose pieces depend on their neighbours decode as they would in one piece), so
    a stream costs O(n) decoding, not O(n²) (vLLM's incremental detokenizer does the same).
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        # Text that could still be the beginning of a stop string is held back.
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded text of ids[:read]
        self.prefix = self.read = 0  # ids[prefix:read]: left context for the next decode
        self.sent = 0  # characters of `text` already emitted
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites text across piece boundaries. Special
        # tokens (end of turn, end of text) are control, not text; their ids are still sent.
        return self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def _tail(self) -> str:
        """Text of ids[read:] (decoded after its left context ids[prefix:read])."""
        left = self._decode(self.ids[self.prefix : self.read])
        return self._decode(self.ids[self.prefix :])[len(left) :]

    def feed(self, ids: list[int]) -> tuple[str, list[int]]:
        """Text and token ids to emit for `ids`; sets `stopped` when a stop string appeared
        (the text ends before it; token ids end with the token that completed it)."""
        start = len(self.ids)
        self.ids += ids
        text = self.text + self._tail()
        # Trailing U+FFFDs may be an incomplete UTF-8 sequence (one per byte with byte-fallback
        # tokenizers): keep their tokens for the next decode and the characters unsent; the
        # text before them is final.
        pending = len(text) - len(text.rstrip("\ufffd"))
        if not pending:
            self.text, self.prefix, self.read = text, self.read, len(self.ids)
        found = [(at, s) for s in self.stops if (at := text.find(s, self.sent)) >= 0]
        if found:
            at, stop = min(found)
            self.stopped = True
            cut = next(
                (
                    j
                    for j in range(start + 1, len(self.ids) + 1)
                    if stop in self._decode(self.ids[:j])
                ),
                len(self.ids),
            )
            new_ids, self.ids = self.ids[start:cut], self.ids[:cut]
            delta, self.sent = text[self.sent : at], at
            return delta, new_ids
        end = len(text) - max(self.hold, pending)
        if end <= self.sent:
            return "", ids
        delta, self.sent = text[self.sent : end], end
        return delta, ids

    def flush(self) -> str:
        """Text held back at the end. A character the stream ended inside (the output length
        ran out between its bytes) is dropped, not shown as U+FFFD: its tokens stay in the
        token ids, but no text ends on a cut character (vLLM's detokenizer does the same)."""
        if self.stopped:
            return ""
        tail = self._tail()
        # self.text never ends inside a character (feed sets it only then), so any trailing
        # U+FFFDs here are the pending tokens' incomplete sequence.
        self.text += tail.rstrip("\ufffd")
        self.prefix = self.read = len(self.ids)
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
