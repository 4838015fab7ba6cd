"""Per-request output text: incremental detokenization and stop-string matching.

`IncrementalDetokenizer` turns committed token ids into newly final text, decoding only a bounded window; it holds
back text that ends in an incomplete UTF-8 sequence. `StopStringMatcher` cuts the text at the first stop string.
Neither knows about sequences, sampling or the wire.
"""
from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids with `push`, get the text that became final; `flush` at the end returns whatever is held.

    The prefix-offset / read-offset technique (vLLM's): decode `ids[prefix:read]` and `ids[prefix:]`; the new text is
    the difference. Decoding a few tokens of left context keeps tokenizers that merge or strip spaces at the window
    start (SentencePiece) correct. When the new text ends in U+FFFD a multi-byte character is still incomplete, so
    nothing is emitted until a later token completes it (or `max_pending_tokens` proves the U+FFFD genuine).
    """

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True, max_pending_tokens: int = 8):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.max_pending_tokens = max_pending_tokens
        self._ids: list[int] = []  # only the window: tokens from the prefix offset on
        self._prefix_len = 0  # tokens of left context (already emitted) at the start of `_ids`
        self.num_tokens = 0

    def push(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        self.num_tokens += len(token_ids)
        prefix_text = self._decode(self._ids[: self._prefix_len])
        new_text = self._decode(self._ids)[len(prefix_text):]
        pending = len(self._ids) - self._prefix_len
        if (not new_text or new_text.endswith(_REPLACEMENT)) and pending < self.max_pending_tokens:
            return ""  # an incomplete character (or only skipped special tokens): wait for more tokens
        return self._restart(new_text)

    def flush(self) -> str:
        """The held-back text (a trailing incomplete character decodes to U+FFFD); call once, at the end."""
        if len(self._ids) == self._prefix_len:
            return ""
        prefix_text = self._decode(self._ids[: self._prefix_len])
        full_text = self._decode(self._ids)
        return self._restart(full_text[len(prefix_text):])

    def _restart(self, text: str) -> str:
        """Everything decoded so far is emitted: the just-read tokens become the left context of the next window."""
        self._ids = self._ids[self._prefix_len:]
        self._prefix_len = len(self._ids)
        return text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


class StopStringMatcher:
    """Feed output text with `push`; get (text safe to emit now, the matched stop string or None).

    A suffix that could be the start of a stop string is held back until it is decided; on a match, the text before
    the stop is returned and everything from the stop on is dropped. Work per push is bounded by the held suffix
    (shorter than the longest stop) plus the new text.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", None
        buffer = self._held + text
        best_at, best = -1, None
        for stop in self.stops:
            at = buffer.find(stop)
            if at != -1 and (best is None or at < best_at or (at == best_at and len(stop) > len(best))):
                best_at, best = at, stop
        if best is not None:
            self._held = ""
            self.matched = best
            return buffer[:best_at], best
        keep = self._partial_match_len(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """At the end of the output: the held-back suffix was not a stop after all."""
        held, self._held = self._held, ""
        return held if self.matched is None else ""

    def _partial_match_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
