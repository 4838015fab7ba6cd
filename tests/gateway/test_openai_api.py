"""OpenAI REST front under a real uvicorn server, driven by the official openai client (strict validation) and raw
httpx: responses, streaming, stop strings, usage, every error as an OpenAI envelope, and client disconnects.
"""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from gateway.openai_api import build_app
from gateway.types import GenerateParams, Overloaded
from tests.gateway.conftest import MODEL_NAME, FakeBackend, build_tiny_tokenizer

ENVELOPE_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", _strict_response_validation=True,
                         max_retries=0, timeout=30)


def expected(backend: FakeBackend, tokenizer, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False
             ) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) the FakeBackend produces for this prompt."""
    ids = backend.output_ids(GenerateParams("x", prompt_ids, max_tokens))
    if not ignore_eos:
        for i, t in enumerate(ids):
            if t in backend.eos_token_ids:
                return ids[: i + 1], tokenizer.decode(ids[: i + 1]), "stop"
    return ids, tokenizer.decode(ids), "length"


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def assert_envelope(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == ENVELOPE_KEYS and error["message"]
    return error


# ---------------------------------------------------------------------------------------------------- happy paths
def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")


def test_chat_completion_stops_at_eos_with_usage_and_spec_stats(client, backend, tokenizer):
    messages = [{"role": "user", "content": "hello world"}]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0)
    prompt_ids = tokenizer.apply_chat_template(messages)
    ids, text, finish = expected(backend, tokenizer, prompt_ids, 40)
    assert finish == "stop"  # the reversed ChatML prompt reaches <|im_end|>, an EOS of the model
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == "stop"
    usage = resp.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), len(ids))
    assert usage.total_tokens == len(prompt_ids) + len(ids)
    spec = usage.model_extra["spec"]
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens == spec["accepted_draft_tokens"] > 0
    assert details.rejected_prediction_tokens == spec["proposed_draft_tokens"] - spec["accepted_draft_tokens"]
    assert spec["mean_accept_length"] == pytest.approx(len(ids) / (spec["verify_steps"] + 1), abs=1e-4)
    assert backend.requests[-1].sampling.temperature == 0.0


def test_chat_without_max_tokens_may_use_the_whole_context(client, backend, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model=MODEL_NAME, messages=messages)
    prompt_len = len(tokenizer.apply_chat_template(messages))
    assert backend.requests[-1].max_new_tokens == backend.max_context_len - prompt_len


def test_completion_runs_to_max_tokens(client, backend, tokenizer):
    prompt = "hello world hello there"
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=7, seed=-1,
                                     extra_body={"top_k": 5})
    ids, text, finish = expected(backend, tokenizer, tokenizer.encode(prompt), 7)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (text, "length")
    assert resp.usage.completion_tokens == 7
    sampling = backend.requests[-1].sampling
    assert (sampling.top_k, sampling.seed) == (5, None)  # seed -1 = no seed


def test_penalties_reach_the_backend(client, backend):
    client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=4, presence_penalty=0.5,
                              frequency_penalty=-0.25, extra_body={"repetition_penalty": 1.2})
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                   presence_penalty=1.5, logit_bias={"7": -100, "12": 4.5})
    completion, chat = backend.requests[-2].sampling, backend.requests[-1].sampling
    assert dict(chat.logit_bias) == {7: -100.0, 12: 4.5} and completion.logit_bias == ()
    assert (completion.presence_penalty, completion.frequency_penalty, completion.repetition_penalty) == \
        (0.5, -0.25, 1.2)
    assert (chat.presence_penalty, chat.frequency_penalty, chat.repetition_penalty) == (1.5, 0.0, 1.0)


def test_completion_defaults_to_16_tokens(client, backend):
    resp = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox jumps")
    assert backend.requests[-1].max_new_tokens == 16 and resp.usage.completion_tokens == 16


@pytest.mark.parametrize("prompt_kind", ["ids", "nested_ids", "list_of_one_str"])
def test_completion_accepts_token_id_and_list_prompts(client, backend, tokenizer, prompt_kind):
    ids = tokenizer.encode("the lazy dog")
    prompt = {"ids": ids, "nested_ids": [ids], "list_of_one_str": ["the lazy dog"]}[prompt_kind]
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4)
    assert backend.requests[-1].prompt_token_ids == ids
    assert resp.choices[0].text == expected(backend, tokenizer, ids, 4)[1]


def test_stop_string_cuts_the_completion(client, backend, tokenizer):
    prompt = "general kenobi there hello world"
    full = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12).choices[0].text
    stop = full[4:7]
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, stop=[stop, "zzz"])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == full[: full.index(stop)]
    assert backend.requests[-1].stop == [stop, "zzz"]


def test_chat_stream_with_usage(client, backend, tokenizer):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=30, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hey"}],
                                                 max_tokens=5, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("include_usage", [False, True])
def test_raw_completion_stream_ends_with_done(server, backend, tokenizer, include_usage):
    body = {"model": MODEL_NAME, "prompt": "hello world hello there", "max_tokens": 9, "stream": True,
            "stream_options": {"include_usage": include_usage}}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text_chunks = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == expected(
        backend, tokenizer, tokenizer.encode(body["prompt"]), 9)[1]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert all(c["object"] == "text_completion" for c in chunks)
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    else:
        assert all(c["usage"] is None for c in chunks)


# ---------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 10_000}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "word " * 2000}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "frequency_penalty": -9}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "logit_bias": {"hello": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "logit_bias": {"5": 250}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x"} | {"model": MODEL_NAME, "stream": "yes please"}, 400, "stream"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content[0]"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 250}, 400, "messages"),
])
def test_bad_input_gets_an_openai_error_envelope_and_the_server_keeps_working(server, path, body, status, param):
    url = server.base_url + path
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    error = assert_envelope(r, status)
    assert error["param"] == param
    ok = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_error_codes_for_unknown_model_and_context_length(server):
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert assert_envelope(r, 404)["code"] == "model_not_found"
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 300},
                   timeout=30)
    error = assert_envelope(r, 400)
    assert error["code"] == "context_length_exceeded" and "maximum context length is 256" in error["message"]


def test_body_over_the_limit_is_413(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x" * (2 << 20)},
                   timeout=30)
    assert_envelope(r, 413)


def test_unknown_route_and_wrong_method_are_enveloped(server):
    assert_envelope(httpx.get(server.base_url + "/v1/nope", timeout=30), 404)
    assert_envelope(httpx.get(server.base_url + "/v1/completions", timeout=30), 405)


def test_backend_rejection_keeps_its_status_even_when_streaming(server, backend, client):
    backend.admission_error = Overloaded("queue full")
    for stream in (False, True):
        r = httpx.post(server.base_url + "/v1/completions",
                       json={"model": MODEL_NAME, "prompt": "x", "stream": stream}, timeout=30)
        assert assert_envelope(r, 429)["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL_NAME, prompt="x")


def test_unexpected_backend_exception_is_500_without_retry(server, backend):
    backend.admission_error = RuntimeError("boom")
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}, timeout=30)
    assert_envelope(r, 500)
    assert r.headers["x-should-retry"] == "false" and "boom" not in r.text


def test_mid_stream_error_is_an_error_event_then_done(server, backend, client):
    backend.mid_stream_error = Overloaded("KV cache exhausted")
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello world"}], "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=30) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert set(error) == ENVELOPE_KEYS and error["message"] == "KV cache exhausted"
    with pytest.raises(openai.APIError, match="KV cache exhausted"):
        list(client.chat.completions.create(model=MODEL_NAME, messages=body["messages"], stream=True))


def test_server_side_abort_is_an_error_not_a_finish_reason(server, backend):
    backend.abort_after_chunks = 1
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hello world"},
                   timeout=30)
    assert assert_envelope(r, 499)["type"] == "request_aborted"
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=30,
                      json={"model": MODEL_NAME, "prompt": "hello world", "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "request_aborted"


# ---------------------------------------------------------------------------------------------------- disconnects
def test_client_disconnect_mid_stream_closes_the_backend_stream(server, backend):
    backend.hang_after_chunks = 2
    body = {"model": MODEL_NAME, "prompt": "hello world hello there", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["text"]
    # leaving the block closed the connection while the backend waits for its next step
    assert backend.closed_event.wait(timeout=10), "the backend stream was not closed after the client left"
    assert backend.closed_early == [backend.requests[-1].request_id]


def test_client_disconnect_while_waiting_for_a_plain_response_closes_the_backend_stream(server, backend):
    backend.hang_after_chunks = 1
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hello"}, timeout=0.5)
    assert backend.closed_event.wait(timeout=10)
    assert backend.closed_early == [backend.requests[-1].request_id]


def test_client_disconnect_before_the_first_token_closes_the_backend_stream(server, backend):
    backend.hang_after_chunks = 0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", timeout=0.5,
                   json={"model": MODEL_NAME, "prompt": "hello", "stream": True})
    assert backend.closed_event.wait(timeout=10)


# ---------------------------------------------------------------------------------------------------- health
def test_health_follows_the_backend(server, backend):
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    backend.healthy = False
    assert_envelope(httpx.get(server.base_url + "/health", timeout=30), 503)


def test_health_uses_an_async_health_check_when_given(make_server, backend, tokenizer):
    state = {"ok": False}

    async def check() -> bool:
        return state["ok"]

    s = make_server(build_app(backend, tokenizer, MODEL_NAME, max_model_len=256, health_check=check))
    assert httpx.get(s.base_url + "/health", timeout=30).status_code == 503
    state["ok"] = True
    assert httpx.get(s.base_url + "/health", timeout=30).status_code == 200


def test_chat_without_a_chat_template_is_a_clear_400(make_server, tmp_path):
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer(build_tiny_tokenizer(tmp_path, with_chat_template=False))
    s = make_server(build_app(FakeBackend(tok), tok, MODEL_NAME, max_model_len=256))
    r = httpx.post(s.base_url + "/v1/chat/completions",
                   json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}]}, timeout=30)
    assert "no chat template" in assert_envelope(r, 400)["message"]


def test_completion_stream_through_the_openai_client(server, backend, tokenizer):
    # Not strict: openai-python's `CompletionChoice.finish_reason` is a required non-null Literal, so strict mode
    # rejects the spec's (and OpenAI's own) `"finish_reason": null` in legacy-completion chunks. Chat chunks are fine.
    c = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=30)
    chunks = list(c.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == expected(backend, tokenizer,
                                                                    tokenizer.encode("hello world"), 6)[1]
    assert chunks[-1].choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------------- n > 1
def test_n_choices_non_streaming_with_summed_usage(client, backend, tokenizer):
    resp = client.completions.create(model=MODEL_NAME, prompt="alpha beta gamma", max_tokens=6, temperature=0.7,
                                     seed=11, n=3, extra_body={"ignore_eos": True})
    prompt_ids = tokenizer.encode("alpha beta gamma")
    ids, text, _ = expected(backend, tokenizer, prompt_ids, 6, ignore_eos=True)
    assert [c.index for c in resp.choices] == [0, 1, 2] and all(c.text == text for c in resp.choices)
    assert resp.usage.prompt_tokens == len(prompt_ids)  # the shared prompt counts once
    assert resp.usage.completion_tokens == 3 * len(ids)
    reqs = backend.requests[-3:]
    assert len({r.request_id for r in reqs}) == 3 and [r.sampling.seed for r in reqs] == [11, 12, 13]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content


def test_n_choices_streaming_carry_their_index_and_one_usage(server, backend, tokenizer):
    body = {"model": MODEL_NAME, "prompt": "one two three four", "max_tokens": 7, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 21
    _, text, _ = expected(backend, tokenizer, tokenizer.encode("one two three four"), 7, ignore_eos=True)
    for i in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(ch["text"] for ch in mine) == text
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]


def test_n_streaming_chat_with_the_official_client(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello there"}],
                                            max_tokens=6, n=2, stream=True)
    by_index: dict[int, str] = {0: "", 1: ""}
    roles = set()
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            by_index[choice.index] += choice.delta.content or ""
    assert roles == {0, 1} and by_index[0] == by_index[1] != ""


def test_n_closing_the_stream_closes_every_choice(server, backend):
    backend.hang_after_chunks = 1
    body = {"model": MODEL_NAME, "prompt": "a b c d e f", "max_tokens": 50, "n": 2, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    assert backend.closed_event.wait(10)
    deadline = time.monotonic() + 10
    while len(backend.closed_early) + len(backend.aborted) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(set(backend.closed_early) | set(backend.aborted)) >= 2


# ---------------------------------------------------------------------------------------------------- logprobs
def test_completion_logprobs_legacy_shape(client, backend, tokenizer):
    resp = client.completions.create(model=MODEL_NAME, prompt="alpha beta", max_tokens=5, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    ids, _, _ = expected(backend, tokenizer, tokenizer.encode("alpha beta"), 5, ignore_eos=True)
    lp = resp.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs == pytest.approx([backend.fake_logprob(t, 2)[0] for t in ids])
    assert [list(d.values()) for d in lp.top_logprobs] == [backend.fake_logprob(t, 2)[2] for t in ids]
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(ids))]
    assert backend.requests[-1].logprobs == 2


def test_chat_logprobs_with_top_alternatives_stream_and_not(client, backend):
    messages = [{"role": "user", "content": "tell me"}]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, logprobs=True,
                                          top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6)
    assert plain.choices[0].logprobs is None and backend.requests[-1].logprobs is None
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, logprobs=True,
                                                top_logprobs=1, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(len(c.top_logprobs) == 1 for c in streamed)


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
])
def test_bad_logprobs_requests(server, body, param):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": MODEL_NAME, **body}, timeout=30)
    assert assert_envelope(r, 400)["param"] == param
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "logprobs": 21},
                   timeout=30)
    assert assert_envelope(r, 400)["param"] == "logprobs"


def test_requests_may_name_any_served_name_or_the_model_path(make_server, backend, tokenizer):
    """--served-model-name takes several names (vLLM's way); the model's path and folder name work too."""
    from tandem.services import model_aliases

    aliases = model_aliases("models/demo-model", ["demo", "demo-alias"])
    assert {"demo", "demo-alias", "models/demo-model", "demo-model"} <= set(aliases)
    server = make_server(build_app(backend, tokenizer, "demo", max_model_len=backend.max_context_len,
                                   served_model_names=["demo-alias"], model_aliases=aliases))
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", _strict_response_validation=True,
                           max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == ["demo", "demo-alias"]
    for name in ("demo", "demo-alias", "models/demo-model", "demo-model"):
        resp = client.completions.create(model=name, prompt="hello", max_tokens=3, temperature=0)
        assert resp.model == "demo" and resp.choices[0].text is not None
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.model == "demo"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="models", prompt="hello", max_tokens=3)
