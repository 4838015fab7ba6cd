"""Greedy speculative output equals HF transformers' greedy `generate`, token for token, through the real step path
(in-process gRPC servers, servicers, engines, proposers, the gateway scheduler and its clients).

Targets are tiny random checkpoints of three families; STANDALONE drafts are noisy copies of the target so that
acceptance is high but imperfect (both the accept and the reject branches run), NGRAM drafts from repeated prompts.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
import transformers

from tests.stack import generate_ids, local_stack, perturbed_copy
from tests.tiny_models import make_tiny_model

FAMILIES = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = make_tiny_model(request.param, root / "target")
    draft = perturbed_copy(target, root / "draft", noise=0.03)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    return target, draft, hf


def hf_greedy(hf, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    rand = torch.randint(3, vocab, (40,), generator=gen).tolist()
    repeated = rand[:6] * 4  # repetitive text so NGRAM finds matches
    return [rand[:5], rand[:23], repeated, [rand[0]]]


CONFIGS = [
    pytest.param("NONE", 0, 1, 1, id="plain"),
    pytest.param("STANDALONE", 3, 1, 4, id="standalone-chain"),
    pytest.param("STANDALONE", 3, 3, 8, id="standalone-tree"),
    pytest.param("NGRAM", 0, 1, 8, id="ngram"),
]


@pytest.mark.parametrize("algorithm,steps,topk,ndt", CONFIGS)
async def test_greedy_speculative_matches_hf_generate(pair, algorithm, steps, topk, ndt):
    target, draft, hf = pair
    vocab = hf.config.vocab_size
    async with local_stack(target, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt) as scheduler:
        for i, prompt in enumerate(prompts(vocab)):
            # Lengths that end mid-tree: drafts proposed past max_new_tokens must not be committed.
            max_new = 13 + 5 * i
            expected = hf_greedy(hf, prompt, max_new)
            got, usage, finish = await generate_ids(scheduler, prompt, max_new, request_id=f"p{i}")
            assert got == expected, f"prompt {i}: speculative output diverged from HF greedy"
            assert finish.value == "length"
            assert usage.completion_tokens == max_new
            if algorithm == "STANDALONE":
                assert usage.accepted_draft_tokens > 0, "a noisy copy of the target should get drafts accepted"
        await _assert_no_kv_leak(scheduler)


@pytest.mark.parametrize("algorithm,steps,topk,ndt", CONFIGS[1:3])
async def test_greedy_stops_on_eos_inside_an_accepted_run(pair, algorithm, steps, topk, ndt):
    target, draft, hf = pair
    prompt = prompts(hf.config.vocab_size)[1]
    free_run = hf_greedy(hf, prompt, 30)
    eos = free_run[9]  # a token greedy decoding emits: generation must end right after its first occurrence
    expected = hf_greedy(hf, prompt, 30, eos=eos)
    assert expected[-1] == eos and len(expected) <= 10
    async with local_stack(target, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt, eos_token_ids=[eos]) as scheduler:
        got, usage, finish = await generate_ids(scheduler, prompt, 30)
        assert got == expected
        assert finish.value == "stop"
        await _assert_no_kv_leak(scheduler)


async def test_concurrent_requests_batched_match_hf(pair):
    target, draft, hf = pair
    all_prompts = prompts(hf.config.vocab_size)
    async with local_stack(target, algorithm="STANDALONE", draft_path=draft, num_steps=3, topk=2,
                           num_draft_tokens=6) as scheduler:
        results = await asyncio.gather(*(generate_ids(scheduler, p, 17, request_id=f"c{i}")
                                         for i, p in enumerate(all_prompts)))
        for prompt, (got, _, _) in zip(all_prompts, results):
            assert got == hf_greedy(hf, prompt, 17)
        await _assert_no_kv_leak(scheduler)


async def _assert_no_kv_leak(scheduler) -> None:
    runner, proposer = scheduler.test_target_runner, scheduler.test_proposer

    def clean() -> bool:
        return runner.num_free_tokens() == runner.num_total_tokens() and (proposer is None or proposer.num_seqs == 0)

    for _ in range(100):  # releases go out at the start of the next loop iteration; poll with a deadline
        if clean():
            break
        scheduler._wakeup.set()
        await asyncio.sleep(0.02)
    assert runner.num_free_tokens() == runner.num_total_tokens(), "target KV leaked"
    assert proposer is None or proposer.num_seqs == 0, "draft state leaked"


async def test_unreachable_draft_falls_back_to_target_only(pair):
    """DESIGN.md §2 fallback: with the draft pod gone, sequences continue target-only with the same greedy text."""
    target, draft, hf = pair
    prompt = prompts(hf.config.vocab_size)[1]
    async with local_stack(target, algorithm="STANDALONE", draft_path=draft, num_steps=3, topk=1,
                           num_draft_tokens=4) as scheduler:
        first, _, _ = await generate_ids(scheduler, prompt, 8, request_id="before")
        await scheduler.test_servers[1].stop(grace=None)  # the draft pod disappears
        got, usage, finish = await generate_ids(scheduler, prompt, 20, request_id="after")
        assert got == hf_greedy(hf, prompt, 20)
        assert first == got[:8]
        assert usage.proposed_draft_tokens == 0 and finish.value == "length"
        await _assert_no_kv_leak_target(scheduler)


async def _assert_no_kv_leak_target(scheduler) -> None:
    runner = scheduler.test_target_runner
    for _ in range(100):
        if runner.num_free_tokens() == runner.num_total_tokens():
            break
        await asyncio.sleep(0.02)
    assert runner.num_free_tokens() == runner.num_total_tokens(), "target KV leaked"
