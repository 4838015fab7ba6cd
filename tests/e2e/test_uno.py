"""End to end: `tandem serve --speculative-algorithm UNO` with no model flag serves the bundled demo target with its
bundled draft LoRA (models/tandem-demo-code-uno): two real processes (target, which also serves DraftService, and
gateway; no draft process), driven by the official `openai` client; greedy output equals HF `generate` of the target,
linear (1/1/4) and tree (3/4/8) mode, and the target's own drafts are accepted."""
from __future__ import annotations

import openai
import pytest
import torch
import transformers

from tandem.args import DEFAULT_MODEL
from tests.e2e.test_serve import Stack

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):\n    ", "class Stack:\n    def __init__(self):\n        "]


@pytest.fixture(scope="module")
def expected():
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = hf.generate(ids, do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones_like(ids))
        out.append(tokenizer.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True))
    return out


@pytest.mark.parametrize("shape", [("1", "1", "4"), ("3", "4", "8")], ids=["linear", "tree"])
def test_uno_serves_the_bundled_lora_and_matches_hf_greedy(expected, shape):
    steps, topk, ndt = shape
    s = Stack("--speculative-algorithm", "UNO", "--device", "cpu", "--speculative-num-steps", steps,
              "--speculative-eagle-topk", topk, "--speculative-num-draft-tokens", ndt)
    try:
        s.wait_ready()
        client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", _strict_response_validation=True,
                               max_retries=0, timeout=120)
        accepted = 0
        for prompt, want in zip(PROMPTS, expected):
            resp = client.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=32, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert resp.choices[0].text == want
            assert resp.usage.completion_tokens == 32
            accepted += resp.usage.completion_tokens_details.accepted_prediction_tokens
        # each Verify emits the clean root plus LoRA drafts: far more than one accepted draft per two tokens
        assert accepted > 32
        # a sampled request runs too (exactness is the χ² tests' job)
        resp = client.completions.create(model=DEFAULT_MODEL.name, prompt=PROMPTS[0], max_tokens=16, temperature=0.8,
                                         top_p=0.9, seed=3, extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 16
    finally:
        assert s.stop() == 0
