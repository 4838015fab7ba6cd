"""End to end: `tandem serve --speculative-algorithm DFLASH` with a DFlash draft (random, in the published layout) for
the bundled demo target: three real processes; the target returns the draft's layers, the draft drafts blocks with
a sliding-window draft KV; greedy output equals HF `generate`, logprobs equal HF's, sampled requests are reproducible
with a seed, and the gateway counted DFLASH drafts."""
from __future__ import annotations

import re

import httpx
import openai
import pytest
import torch
import transformers

from tandem.args import DEFAULT_MODEL
from tests.e2e.test_serve import Stack
from tests.tiny_models import make_tiny_dflash_draft

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    draft = make_tiny_dflash_draft(str(DEFAULT_MODEL), tmp_path_factory.mktemp("dflash-e2e"), block_size=5,
                                   std=0.05)
    s = Stack("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft, "--device", "cpu",
              "--speculative-dflash-block-size", "5", "--speculative-draft-window-size", "24")
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", _strict_response_validation=True,
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def test_dflash_greedy_equals_hf_generate(stack, client, hf, tokenizer):
    prompt = "def fibonacci(n):\n    "
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))
    resp = client.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    assert resp.usage.completion_tokens == 40
    metrics = httpx.get(f"{stack.base_url}/metrics").text
    drafted = re.search(r"^tandem:spec_decode_num_draft_tokens_total (\S+)$", metrics, re.M)
    assert drafted and float(drafted.group(1)) >= 4 * 5, "the DFLASH draft pod proposed no blocks"


def test_dflash_logprobs_equal_hf(client, hf, tokenizer):
    prompt = "import numpy as np\n\n\ndef "
    resp = client.completions.create(model=DEFAULT_MODEL.name, prompt=prompt, max_tokens=12, temperature=0,
                                     logprobs=2, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    ids = tokenizer(prompt, return_tensors="pt").input_ids[0].tolist()
    out_ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize(resp.choices[0].text)]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + out_ids])).logits[0].float(), dim=-1)
    want = [ref[len(ids) - 1 + j, t].item() for j, t in enumerate(out_ids)]
    assert len(lp.token_logprobs) == 12 and all(len(d) == 2 for d in lp.top_logprobs)
    assert lp.token_logprobs[:len(want)] == pytest.approx(want, abs=2e-3)


def test_dflash_sampled_requests_are_reproducible_with_a_seed(client):
    kwargs = dict(model=DEFAULT_MODEL.name, prompt="class Stack:\n    ", max_tokens=16, temperature=0.8, top_p=0.9,
                  seed=7, extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert first.usage.completion_tokens == 16 and first.choices[0].text == again.choices[0].text
