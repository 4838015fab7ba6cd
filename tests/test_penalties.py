"""Presence / frequency / repetition penalties and logit_bias, applied by the target in every verify row exactly as plain decoding
would (committed tokens plus the row's tree path), so speculation stays lossless with them:
penalize_logits against a naive per-token reference; greedy through the real step path (plain, STANDALONE tree,
NGRAM) == HF `generate(repetition_penalty=...)` and == a token-by-token reference loop for presence/frequency;
validation at the API edges. The sampled path's χ² test is in tests/test_sampling_distribution.py."""
from __future__ import annotations

import collections

import pytest
import torch

from gateway.types import GenerateParams, InvalidRequest, request_sampling
from runtime.sampling import SamplingParams, penalize_logits
from tests.stack import local_stack, perturbed_copy
from tests.test_lossless_greedy import _assert_no_kv_leak
from tests.tiny_models import load_hf_model, make_tiny_model


def _naive(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    out = logits.clone().float()
    counts = collections.Counter(output)
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in counts.items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    for t, b in p.logit_bias:
        out[t] += b
    return out


@pytest.mark.parametrize("p", [
    SamplingParams(presence_penalty=0.5),
    SamplingParams(frequency_penalty=-0.7),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=1.0, frequency_penalty=0.4, repetition_penalty=0.8),
    SamplingParams(logit_bias=((7, -5.0), (30, 2.5))),
    SamplingParams(frequency_penalty=0.3, logit_bias=((9, 100.0),)),
], ids=["presence", "frequency", "repetition", "all", "logit-bias", "bias-and-frequency"])
def test_penalize_logits_equals_a_naive_reference_per_row(p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    prompt, output = [1, 2, 3, 3, 40], [7, 7, 9, 3]
    paths = [[], [11], [11, 7], [12]]
    got = penalize_logits(logits, p, prompt, output, paths)
    for r, path in enumerate(paths):
        torch.testing.assert_close(got[r], _naive(logits[r], p, prompt, output + path))
    assert torch.equal(penalize_logits(logits, SamplingParams(), prompt, output), logits)


@pytest.mark.parametrize("kwargs", [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                                    {"logit_bias": {5: 101.0}}, {"logit_bias": {-1: 1.0}}])
def test_out_of_range_penalties_are_refused_everywhere(kwargs):
    engine_kwargs = {k: tuple(v.items()) if isinstance(v, dict) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError):
        SamplingParams(**engine_kwargs)
    with pytest.raises(InvalidRequest) as exc:
        request_sampling(**kwargs)
    assert exc.value.param == next(iter(kwargs))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("penalties")
    target = make_tiny_model("llama", root / "target")
    return target, perturbed_copy(target, root / "draft", noise=0.03), load_hf_model(target)


def _reference_greedy(hf, prompt: list[int], n: int, p: SamplingParams) -> list[int]:
    """Token-by-token greedy decoding of HF's logits with the naive penalty formula."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            ids.append(int(_naive(logits, p, prompt, ids[len(prompt):]).argmax()))
    return ids[len(prompt):]


async def _generate(scheduler, prompt, n, sampling, request_id):
    params = GenerateParams(request_id=request_id, prompt_token_ids=prompt, max_new_tokens=n, sampling=sampling,
                            detokenize=False)
    out = []
    async for chunk in scheduler.generate(params):
        out.extend(chunk.token_ids)
    return out


PROMPTS = [[5, 9, 13, 2, 7, 11, 3], [4, 4, 4, 8, 4, 4, 8, 4], [30, 31, 32, 33, 30, 31, 32, 33, 30]]
CONFIGS = [
    pytest.param("NONE", 0, 1, 1, id="plain"),
    pytest.param("STANDALONE", 3, 2, 6, id="standalone-tree"),
    pytest.param("STANDALONE", 3, 1, 4, id="standalone-chain"),
    pytest.param("NGRAM", 0, 1, 6, id="ngram"),
]


@pytest.mark.parametrize("algorithm,steps,topk,ndt", CONFIGS)
async def test_greedy_with_repetition_penalty_equals_hf_generate(pair, algorithm, steps, topk, ndt):
    target, draft, hf = pair
    sampling = request_sampling(temperature=0.0, repetition_penalty=1.3)
    async with local_stack(target, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt) as scheduler:
        outs = [await _generate(scheduler, p, 24, sampling, f"rp{i}") for i, p in enumerate(PROMPTS)]
        await _assert_no_kv_leak(scheduler)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            expect = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, repetition_penalty=1.3,
                                 eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt),
                                                                                              dtype=torch.long))
        assert out == expect[0, len(prompt):].tolist()


@pytest.mark.parametrize("algorithm,steps,topk,ndt", CONFIGS)
async def test_greedy_with_presence_and_frequency_penalties_equals_the_reference(pair, algorithm, steps, topk, ndt):
    target, draft, hf = pair
    sampling = request_sampling(temperature=0.0, presence_penalty=0.6, frequency_penalty=0.9)
    p = SamplingParams(presence_penalty=0.6, frequency_penalty=0.9)
    async with local_stack(target, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt) as scheduler:
        outs = [await _generate(scheduler, prompt, 20, sampling, f"pf{i}") for i, prompt in enumerate(PROMPTS)]
    for prompt, out in zip(PROMPTS, outs):
        assert out == _reference_greedy(hf, prompt, 20, p)
    plain = [_reference_greedy(hf, prompt, 20, SamplingParams()) for prompt in PROMPTS]
    assert plain != outs  # the penalties change what these prompts decode to


@pytest.mark.parametrize("algorithm,steps,topk,ndt", CONFIGS)
async def test_greedy_with_logit_bias_equals_the_reference_and_bans_tokens(pair, algorithm, steps, topk, ndt):
    target, draft, hf = pair
    plain = [_reference_greedy(hf, prompt, 16, SamplingParams()) for prompt in PROMPTS]
    banned = {t: -100.0 for t in {out[0] for out in plain} | {out[3] for out in plain}}  # each prompt's 1st/4th
    sampling = request_sampling(temperature=0.0, logit_bias={**banned, 17: 3.0})
    p = SamplingParams(logit_bias=tuple(sorted({**banned, 17: 3.0}.items())))
    async with local_stack(target, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt) as scheduler:
        outs = [await _generate(scheduler, prompt, 16, sampling, f"lb{i}") for i, prompt in enumerate(PROMPTS)]
        with pytest.raises(InvalidRequest) as exc:  # ids past the vocabulary are refused before admission
            await _generate(scheduler, PROMPTS[0], 4, request_sampling(logit_bias={10 ** 6: 1.0}), "bad")
        assert exc.value.param == "logit_bias"
    for prompt, out in zip(PROMPTS, outs):
        assert out == _reference_greedy(hf, prompt, 16, p) and not set(out) & set(banned)
