"""End to end: `tandem serve --enable-run-ahead` with the bundled EAGLE-3 head in the target's process (serve's
default on one device) — real processes, 4 speculative steps per call: greedy output equals HF `generate`, and the
target pod's metrics count run-ahead hits (its answers to the expected next calls)."""
from __future__ import annotations

import re

import httpx
import openai
import pytest
import torch
import transformers

from tandem.args import DEFAULT_MODEL
from tests.e2e.helpers import free_port
from tests.e2e.test_serve import Stack

pytestmark = pytest.mark.slow


def test_run_ahead_through_the_real_processes_is_lossless_and_hits():
    metrics = free_port()
    stack = Stack("--speculative-algorithm", "EAGLE3", "--device", "cpu", "--enable-run-ahead",
                  "--metrics-port", str(metrics))
    try:
        stack.wait_ready()
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
        for prompt in ["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n        "]:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = hf.generate(ids, do_sample=False, max_new_tokens=48, eos_token_id=None, pad_token_id=0,
                                  attention_mask=torch.ones_like(ids))
            resp = client.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=48, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert resp.choices[0].text == tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
        text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
        hits = re.search(r'run_ahead_total\{outcome="hit",service="target"\} ([0-9.]+)', text)
        assert hits and float(hits.group(1)) > 0, text[-2000:]
    finally:
        assert stack.stop() == 0
