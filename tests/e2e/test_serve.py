"""End to end: `tandem serve` starts target, draft and gateway as three real processes on loopback; the official
`openai` client (strict response validation) and a gRPC client drive them. Also checks greedy output against HF
transformers on the bundled model, bad input, KV release after a client disconnect, and a clean Ctrl-C shutdown.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest
import torch
import transformers

from protos.tandem.v1 import tandem_pb2 as pb
from protos.tandem.v1 import tandem_pb2_grpc as pb_grpc
from tandem.args import DEFAULT_MODEL
from tandem.launch import free_port as _free_port

pytestmark = pytest.mark.slow
SERVICE_KEY = "e2e-service-key"  # the model services' credential (tandem serve would generate one)
SERVICE_AUTH = (("authorization", f"Bearer {SERVICE_KEY}"),)


class Stack:
    def __init__(self, *extra: str):
        self.http, self.grpc, self.target, self.draft = (_free_port() for _ in range(4))
        cmd = [sys.executable, "-m", "tandem.cli", "serve", "--port", str(self.http), "--grpc-port", str(self.grpc),
               "--target-port", str(self.target), "--draft-port", str(self.draft), "--log-level", "warning", *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_SERVICE_API_KEY=SERVICE_KEY)
        self.proc = subprocess.Popen(cmd, env=env)
        self.base_url = f"http://127.0.0.1:{self.http}"

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"tandem serve exited with {self.proc.returncode}"
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("the stack did not become healthy")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=30)

    def target_memory(self) -> pb.MemoryState:
        with grpc.insecure_channel(f"127.0.0.1:{self.target}") as ch:
            stub = pb_grpc.TargetServiceStub(ch)
            return stub.Info(pb.InfoRequest(), timeout=10, metadata=SERVICE_AUTH).memory


@pytest.fixture(scope="module")
def stack():
    s = Stack("--speculative-algorithm", "STANDALONE")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", _strict_response_validation=True,
                         max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [DEFAULT_MODEL.name]


@pytest.mark.parametrize("repetition_penalty", [None, 1.3], ids=["plain", "repetition-penalty"])
def test_completion_greedy_equals_hf_generate(client, repetition_penalty):
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32).eval()
    prompt = "def fibonacci(n):\n    "
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    penalty = {} if repetition_penalty is None else {"repetition_penalty": repetition_penalty}
    with torch.no_grad():
        out = hf.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids), **penalty)
    expected_ids = out[0, ids.shape[1]:].tolist()
    resp = client.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True, **penalty})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 40
    assert resp.choices[0].text == tokenizer.decode(expected_ids, skip_special_tokens=True)
    details = resp.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0


def test_n_choices_through_the_real_stack(client):
    resp = client.completions.create(model=DEFAULT_MODEL.name, prompt="def add(a, b):\n    ", max_tokens=12,
                                     temperature=0.8, seed=5, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2] and resp.usage.completion_tokens == 36
    again = client.completions.create(model=DEFAULT_MODEL.name, prompt="def add(a, b):\n    ", max_tokens=12,
                                      temperature=0.8, seed=5, n=3, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seed + i per choice: reproducible
    assert len({c.text for c in resp.choices}) > 1  # and the choices are different samples


def test_logprobs_through_the_real_stack_equal_hf(client):
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32).eval()
    prompt = "import numpy as np\n\n\ndef "
    resp = client.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=16, temperature=0,
                                     logprobs=3, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    ids = tokenizer(prompt, return_tensors="pt").input_ids[0].tolist()
    out_ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize(resp.choices[0].text)]
    with torch.no_grad():
        full = torch.tensor([ids + out_ids])
        ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
    want = [ref[len(ids) - 1 + j, t].item() for j, t in enumerate(out_ids)]
    assert len(lp.token_logprobs) == 16 and all(len(d) == 3 for d in lp.top_logprobs)
    assert lp.token_logprobs[:len(want)] == pytest.approx(want, abs=2e-3)
    chat = client.chat.completions.create(model=DEFAULT_MODEL.name, messages=[{"role": "user", "content": "def f():"}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    entries = [c for chunk in chat for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert entries and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_chat_completion_and_stream_with_usage(client):
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    resp = client.chat.completions.create(model=DEFAULT_MODEL.name, messages=messages, max_tokens=24,
                                          temperature=0)
    assert resp.object == "chat.completion"
    text = resp.choices[0].message.content
    assert resp.usage.completion_tokens <= 24
    chunks = list(client.chat.completions.create(model=DEFAULT_MODEL.name, messages=messages, max_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_a_repeated_long_prompt_reports_cached_prompt_tokens(client):
    """The target's prefix cache (on by default): the second request with the same long prompt reuses its full KV
    blocks, says so in usage.prompt_tokens_details.cached_tokens, and answers the same."""
    prompt = "def parse_header(line: str) -> dict:\n    \"\"\"Split a header line into fields.\"\"\"\n" * 4
    first = client.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=16, temperature=0)
    again = client.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=16, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and again.usage.prompt_tokens - 16 < cached < again.usage.prompt_tokens


def test_stop_string_ends_the_completion(client):
    full = client.completions.create(model=DEFAULT_MODEL.name, prompt="import os\nimport ", max_tokens=30,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    resp = client.completions.create(model=DEFAULT_MODEL.name, prompt="import os\nimport ", max_tokens=30,
                                     temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == full[: full.index(stop)]


def test_sampled_completion_with_seed_is_reproducible(client):
    kwargs = dict(model=DEFAULT_MODEL.name, prompt="class ", max_tokens=20, temperature=0.8, top_p=0.9, seed=123,
                  extra_body={"top_k": 50})
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


@pytest.mark.parametrize("body,status", [
    (b"{not json", 400),
    ({"model": DEFAULT_MODEL.name, "prompt": "x", "temperature": "hot"}, 400),
    ({"model": "no-such-model", "prompt": "x"}, 404),
    ({"model": DEFAULT_MODEL.name, "prompt": "x", "max_tokens": 10_000_000}, 400),
    ({"model": DEFAULT_MODEL.name, "messages": []}, 400),
    ({"model": DEFAULT_MODEL.name, "prompt": "x", "n": 1000}, 400),
    ({"model": DEFAULT_MODEL.name, "prompt": "word " * 50_000}, 400),
])
def test_bad_input_gets_an_openai_error_body(stack, body, status):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    if isinstance(body, bytes):
        r = httpx.post(stack.base_url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(stack.base_url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]


def test_grpc_generate_streams_and_rejects_bad_input(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc}") as ch:
        stub = pb_grpc.GatewayStub(ch)
        responses = list(stub.Generate(pb.GenerateRequest(text="def main():", max_new_tokens=12, ignore_eos=True),
                                       timeout=120))
        assert sum(len(r.token_ids) for r in responses) == 12
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 12
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(max_new_tokens=4), timeout=30))  # neither text nor token_ids
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = stub.Info(pb.InfoRequest(), timeout=10)
        assert info.speculative_algorithm == "STANDALONE"


def test_client_disconnect_frees_kv_on_the_target(stack, client):
    # Chat streaming: legacy completion chunks carry `finish_reason: null`, which strict clients refuse.
    stream = client.chat.completions.create(model=DEFAULT_MODEL.name, messages=[{"role": "user", "content": "def"}],
                                            max_tokens=1500, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        mem = stack.target_memory()
        if mem.free_kv_tokens == mem.total_kv_tokens and mem.num_seqs == 0:
            break
        time.sleep(0.2)
    assert mem.free_kv_tokens == mem.total_kv_tokens and mem.num_seqs == 0


def test_ngram_stack_and_clean_shutdown():
    s = Stack("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8")
    try:
        s.wait_ready()
        c = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", _strict_response_validation=True,
                          max_retries=0, timeout=120)
        prompt = "for i in range(10):\n    print(i)\n" * 3
        resp = c.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=30, temperature=0,
                                    extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 30
    finally:
        assert s.stop() == 0


def test_adaptive_speculation_and_continuous_decode_through_real_processes():
    """--speculative-adaptive and --num-continuous-decode-steps reach the right processes and keep greedy == HF, alone
    (the bs>=1 tier drafts) and with eight concurrent streams (the bs>=8 tier, candidates [0, 1, 3]; whatever plain
    decodes happen run three steps per Verify call)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32).eval()
    prompts = ["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n        ", "import os\n\n\ndef "]
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))
        expected.append(tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True))
    s = Stack("--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4", "--speculative-adaptive", "--num-continuous-decode-steps", "3")
    try:
        s.wait_ready()
        c = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", _strict_response_validation=True,
                          max_retries=0, timeout=120)

        def complete(prompt: str):
            return c.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})

        solo = complete(prompts[0])  # batch 1: the [1, 3] tier drafts
        assert solo.choices[0].text == expected[0]
        assert solo.usage.completion_tokens_details.accepted_prediction_tokens > 0
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            batch = list(pool.map(complete, [prompts[i % 3] for i in range(8)]))
        assert [r.choices[0].text for r in batch] == [expected[i % 3] for i in range(8)]
    finally:
        assert s.stop() == 0


def test_colocated_draft_through_real_processes():
    """`tandem serve --colocate-draft`: no draft process; the target pod serves the bundled EAGLE-3 head itself (its
    Info names the algorithm), each Verify drafts the next tree, and greedy output equals HF generate."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32).eval()
    prompt = "def quicksort(items):\n    "
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))
    expected = tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    s = Stack("--speculative-algorithm", "EAGLE3", "--colocate-draft")
    try:
        s.wait_ready()
        with grpc.insecure_channel(f"127.0.0.1:{s.target}") as ch:
            info = pb_grpc.TargetServiceStub(ch).Info(pb.InfoRequest(), timeout=10, metadata=SERVICE_AUTH)
        assert info.algorithm == "EAGLE3"
        c = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", _strict_response_validation=True,
                          max_retries=0, timeout=120)
        resp = c.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=32, temperature=0,
                                    extra_body={"ignore_eos": True})
        assert resp.choices[0].text == expected
        assert resp.usage.completion_tokens_details.accepted_prediction_tokens > 0
    finally:
        assert s.stop() == 0
