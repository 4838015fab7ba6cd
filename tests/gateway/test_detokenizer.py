"""IncrementalDetokenizer and StopStringMatcher against naive references (decode everything / search the whole text)."""
from __future__ import annotations

import random

import pytest

from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tests.gateway.conftest import SENTENCES


def _chunked(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def test_multibyte_character_split_across_tokens_is_never_emitted_half(tokenizer):
    ids = tokenizer.encode("🎉🐍")
    assert len(ids) > 2, "the tiny vocabulary must split the emoji into byte tokens for this test to mean anything"
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == "🎉🐍"
    # The first character is released as soon as its last byte arrives, before the second one is complete.
    first_done = next(i for i, p in enumerate(pieces) if p)
    assert pieces[first_done] == "🎉" and first_done < len(ids) - 1


@pytest.mark.parametrize("seed", range(5))
def test_incremental_text_equals_decoding_everything(tokenizer, seed):
    rng = random.Random(seed)
    text = " ".join(rng.sample(SENTENCES[:7], 7))
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(chunk) for chunk in _chunked(ids, rng)]
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_are_skipped(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("hello") + [0, 2] + tokenizer.encode(" world")
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == "hello world"


def test_invalid_utf8_is_released_by_flush(tokenizer):
    head = tokenizer.encode("🙂")[0]  # a lone lead byte that never completes
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push([head]) == ""
    assert detok.flush() == "\ufffd"


def test_genuine_replacement_char_does_not_stall_the_stream_forever(tokenizer):
    head = tokenizer.encode("🙂")[0]
    detok = IncrementalDetokenizer(tokenizer, max_pending_tokens=3)
    out = [detok.push([head]) for _ in range(3)]
    assert out[:2] == ["", ""] and out[2] == tokenizer.decode([head] * 3)


def test_stop_string_split_across_chunks():
    m = StopStringMatcher(["world"])
    assert m.push("hello wor") == ("hello ", None)  # "wor" might start the stop: held back
    assert m.push("ld and more") == ("", "world")
    assert m.push("anything") == ("", None)


def test_stop_string_at_the_very_start():
    m = StopStringMatcher(["###"])
    assert m.push("#") == ("", None)
    assert m.push("##tail") == ("", "###")


def test_held_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    m = StopStringMatcher(["abc"])
    assert m.push("xab") == ("x", None)
    assert m.push("d") == ("abd", None)
    assert m.push("ab") == ("", None)
    assert m.flush() == "ab"


def test_earliest_stop_wins():
    m = StopStringMatcher(["lazy", "fox", ""])
    assert m.push("the quick brown fox jumps over the lazy dog") == ("the quick brown ", "fox")


@pytest.mark.parametrize("seed", range(20))
def test_stop_matcher_equals_searching_the_whole_text(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("abc ") for _ in range(60))
    stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    hits = [(text.find(s), -len(s), s) for s in stops if s in text]
    expected = (text[: min(hits)[0]], min(hits)[2]) if hits else (text, None)

    m = StopStringMatcher(stops)
    out, matched, i = [], None, 0
    while i < len(text) and matched is None:
        n = rng.randint(1, 5)
        piece, matched = m.push(text[i:i + n])
        out.append(piece)
        i += n
    if matched is None:
        out.append(m.flush())
    assert ("".join(out), matched) == expected
