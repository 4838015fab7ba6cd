"""The committed demo pair (models/tandem-demo-code + its STANDALONE draft, EAGLE-3 and EAGLE-2 heads) keeps its speculative
acceptance on the committed held-out prompts, through the real step path (in-process gRPC target and draft services
and the gateway scheduler, CPU, greedy).

The floors sit at about 0.7x the measured mean accept length: far above 1, so a broken feature path (an off-by-one in
the EAGLE token/feature shift, a draft fed the wrong tokens, a tree mask bug) fails, while float noise does not.
Measured through this path (CPU fp32, these 40 prompts x 64 tokens): STANDALONE chain 2.72, EAGLE3 chain 2.75,
EAGLE3 tree 5/4/16 3.61; EAGLE-2 chain 2.46, tree 5/4/16 3.46 (models/README.md has the H200 and engine-loop
numbers).
"""
from __future__ import annotations

import asyncio
import json

import pytest

from tandem.args import DEFAULT_DRAFT, DEFAULT_EAGLE, DEFAULT_EAGLE3, DEFAULT_MODEL
from tests.stack import generate_ids, local_stack

PROMPTS = DEFAULT_MODEL / "heldout_prompts.jsonl"
MAX_NEW_TOKENS = 64


def _prompts() -> list[list[int]]:
    with open(PROMPTS) as f:
        return [json.loads(line)["prompt_ids"] for line in f if line.strip()]


def test_heldout_prompts_are_committed_and_small():
    prompts = _prompts()
    assert len(prompts) == 40 and all(len(p) == 128 for p in prompts)
    assert PROMPTS.stat().st_size < 100_000


@pytest.mark.parametrize("algorithm,draft,steps,topk,ndt,floor", [
    pytest.param("STANDALONE", DEFAULT_DRAFT, 3, 1, 4, 1.9, id="standalone-chain"),
    pytest.param("EAGLE3", DEFAULT_EAGLE3, 3, 1, 4, 1.9, id="eagle3-chain"),
    pytest.param("EAGLE3", DEFAULT_EAGLE3, 5, 4, 16, 2.5, id="eagle3-tree"),
    # The EAGLE-2 head (H200-trained 132 s): 2.46 chain, 3.46 tree through this path (CPU).
    pytest.param("EAGLE", DEFAULT_EAGLE, 3, 1, 4, 1.8, id="eagle-chain"),
    pytest.param("EAGLE", DEFAULT_EAGLE, 5, 4, 16, 2.5, id="eagle-tree"),
])
async def test_demo_pair_mean_accept_length_on_heldout_prompts(algorithm, draft, steps, topk, ndt, floor):
    prompts = _prompts()
    async with local_stack(DEFAULT_MODEL, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt, max_total_tokens=16384) as scheduler:
        results = await asyncio.gather(*(generate_ids(scheduler, p, MAX_NEW_TOKENS, request_id=f"h{i}")
                                         for i, p in enumerate(prompts)))
    tokens = sum(usage.completion_tokens for _, usage, _ in results)
    steps_taken = sum(usage.verify_steps + 1 for _, usage, _ in results)
    assert tokens == len(prompts) * MAX_NEW_TOKENS
    tau = tokens / steps_taken
    assert tau >= floor, f"{algorithm} {steps}/{topk}/{ndt}: mean accept length {tau:.2f} < floor {floor}"


def test_eagle3_with_no_model_flags_serves_the_bundled_head():
    from tandem.args import resolve_spec
    from tandem.cli import build_parser

    args = build_parser().parse_args(["serve", "--speculative-algorithm", "EAGLE3"])
    assert resolve_spec(args)[0] == "EAGLE3"
    assert args.speculative_draft_model_path == str(DEFAULT_EAGLE3)
    args = build_parser().parse_args(["serve", "--speculative-algorithm", "EAGLE"])
    assert resolve_spec(args)[0] == "EAGLE"
    assert args.speculative_draft_model_path == str(DEFAULT_EAGLE)
    assert (DEFAULT_EAGLE / "config.json").exists()
    args = build_parser().parse_args(["serve", "--speculative-algorithm", "STANDALONE"])
    resolve_spec(args)
    assert args.speculative_draft_model_path is None  # the draft service falls back to DEFAULT_DRAFT
