"""End to end: `tandem serve` with --speculative-use-rejection-sampling on the bundled target and its EAGLE-3 head, as
three real processes. The launcher hands the flag to the draft (which samples chains and sends q) and the target
(which verifies by p/q rejection); greedy output still equals HF `generate`, sampled requests get drafts accepted
and reproduce with a seed (the official `openai` client, strict response validation)."""
from __future__ import annotations

import openai
import pytest
import torch
import transformers

from tandem.args import DEFAULT_MODEL
from tests.e2e.test_serve import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    stack = Stack("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk",
                  "1", "--speculative-num-draft-tokens", "4", "--speculative-use-rejection-sampling",
                  "--speculative-attention-mode", "decode")
    try:
        stack.wait_ready()
        yield openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", _strict_response_validation=True,
                            max_retries=0, timeout=120)
    finally:
        assert stack.stop() == 0


def test_greedy_with_rejection_sampling_on_equals_hf_generate(client):
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32).eval()
    prompt = "import json\n\ndef load(path):\n    "
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))
    resp = client.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=32, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def test_sampled_requests_accept_rejection_sampled_drafts_and_reproduce(client):
    kwargs = dict(model=DEFAULT_MODEL.name, prompt="class LRUCache:\n    def __init__(self", max_tokens=48,
                  temperature=0.8, seed=11, extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    details = first.usage.completion_tokens_details
    assert first.usage.completion_tokens == 48
    assert details is not None and details.accepted_prediction_tokens > 0
    assert client.completions.create(**kwargs).choices[0].text == first.choices[0].text
