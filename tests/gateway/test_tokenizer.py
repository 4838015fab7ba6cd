"""Tokenizer wrapper: EOS ids from all config files, chat templates and message validation."""
from __future__ import annotations

import pytest

from gateway.tokenizer import Tokenizer
from gateway.types import InvalidRequest
from tests.gateway.conftest import build_tiny_tokenizer


def test_eos_ids_merge_tokenizer_and_generation_config_list(tokenizer):
    assert tokenizer.eos_token_ids == [0, 2]  # <|endoftext|> from the tokenizer, <|im_end|> from the list


def test_encode_decode_round_trip_follows_hf_defaults(tokenizer):
    text = "Héllo wörld 日本語 🙂"
    assert tokenizer.encode(text) == tokenizer.hf(text)["input_ids"]
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.vocab_size == len(tokenizer.hf)


def test_chat_template_appends_the_generation_prompt(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                      {"type": "text", "text": "there"}]}])
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
    (["hello"], "messages[0]"),
])
def test_bad_messages_are_invalid_requests(tokenizer, messages, param):
    with pytest.raises(InvalidRequest) as err:
        tokenizer.apply_chat_template(messages)
    assert err.value.param == param


def test_missing_chat_template_is_a_clear_invalid_request(tmp_path):
    tok = Tokenizer(build_tiny_tokenizer(tmp_path, with_chat_template=False))
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_folder_fails_at_startup(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer(tmp_path / "nope")


def test_text_that_cannot_fit_is_rejected_before_tokenizing(tokenizer, monkeypatch):
    text = "a" * (tokenizer.max_token_bytes * 100 + 1)
    monkeypatch.setattr(tokenizer.hf, "encode", lambda *a, **k: pytest.fail("tokenized a hopeless prompt"))
    with pytest.raises(InvalidRequest, match="maximum context length is 100") as err:
        tokenizer.encode(text, max_len=100)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest, match="maximum context length"):
        tokenizer.apply_chat_template([{"role": "user", "content": text}], max_len=100)


def test_bound_never_rejects_a_prompt_that_fits(tokenizer):
    for text in ("Héllo wörld 日本語 🙂 " * 5, "hello world " * 20, "\n" * 50):
        n = len(tokenizer.encode(text))
        assert tokenizer.encode(text, max_len=n) == tokenizer.encode(text)
