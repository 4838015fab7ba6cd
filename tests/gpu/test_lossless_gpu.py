"""Lossless on the GPU: greedy output of every algorithm through the real step path (in-process gRPC target and draft
services + the gateway scheduler) on CUDA — triton attention, CUDA graphs with lm_head/argmax/tree verification
inside, draft graphs, fused elementwise kernels in graphs — equals HF transformers' greedy output, token for token, on
the bundled demo pair in float32 (bf16 rounding differs between any two kernels, so fp32 is the exact-match setting;
the demo model is trained, so fp32 near-ties are rare)."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.gpu.conftest import skip_without_gpu

skip_without_gpu()

import torch  # noqa: E402

from core import algorithms  # noqa: E402
from tandem.args import DEFAULT_DRAFT, DEFAULT_EAGLE, DEFAULT_EAGLE3, DEFAULT_MODEL, REPO_ROOT  # noqa: E402
from tests.stack import generate_ids, local_stack  # noqa: E402

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def prompts_and_reference():
    from transformers import AutoModelForCausalLM

    lines = (DEFAULT_MODEL / "heldout_prompts.jsonl").read_text().splitlines()[:8]
    prompts = [json.loads(line)["prompt_ids"] for line in lines]
    model = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).to("cuda").eval()
    want = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    return prompts, want


@pytest.mark.parametrize("algorithm,draft,steps,topk,ndt,extra", [
    pytest.param("NONE", None, 0, 1, 1, None, id="plain"),
    pytest.param("STANDALONE", DEFAULT_DRAFT, 3, 1, 4, None, id="standalone-chain"),
    pytest.param("STANDALONE", DEFAULT_DRAFT, 4, 2, 8, None, id="standalone-tree"),
    pytest.param("EAGLE3", DEFAULT_EAGLE3, 5, 4, 16, None, id="eagle3-tree"),
    pytest.param("EAGLE", DEFAULT_EAGLE, 3, 1, 4, None, id="eagle-chain-mtp"),
    pytest.param("NEXTN", DEFAULT_EAGLE, 3, 4, 8, None, id="nextn-tree"),
    pytest.param("NGRAM", None, 0, 1, 8, None, id="ngram"),
    pytest.param("UNO", None, 1, 1, 4, None, id="uno-linear"),  # the target drafts: LoRA rows in an eager forward
    pytest.param("UNO", None, 3, 4, 8, None, id="uno-tree"),
    # --colocate-draft: the draft in the target's process, each Verify drafting the next tree; with the static steps
    # the verify step's feature rows live in its graph's output buffer (the hand-over must copy them)
    pytest.param("EAGLE3", DEFAULT_EAGLE3, 5, 4, 16, {"colocate": True, "static_steps": True},
                 id="eagle3-tree-colocate-static"),
    pytest.param("EAGLE3", DEFAULT_EAGLE3, 3, 1, 4, {"colocate": True}, id="eagle3-chain-colocate"),
    pytest.param("STANDALONE", DEFAULT_DRAFT, 3, 1, 4, {"colocate": True}, id="standalone-chain-colocate"),
    # --enable-run-ahead: the pod runs the expected next call on its worker thread while the answer travels
    pytest.param("EAGLE3", DEFAULT_EAGLE3, 5, 4, 16, {"colocate": True, "static_steps": True, "run_ahead": True,
                                                      "num_continuous_decode_steps": 4},
                 id="eagle3-tree-colocate-static-k4-run-ahead"),
    pytest.param("NONE", None, 0, 1, 1, {"run_ahead": True, "num_continuous_decode_steps": 4}, id="ar-run-ahead"),
])
async def test_greedy_equals_hf_on_cuda(prompts_and_reference, algorithm, draft, steps, topk, ndt, extra):
    prompts, want = prompts_and_reference
    lora = REPO_ROOT / "models" / algorithms.get("UNO").bundled_draft if algorithm == "UNO" else None
    async with local_stack(DEFAULT_MODEL, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt, max_total_tokens=16384, device="cuda",
                           dtype="float32", lora_path=lora, **(extra or {})) as scheduler:
        results = await asyncio.gather(*(generate_ids(scheduler, p, NEW_TOKENS, request_id=f"g{i}")
                                         for i, p in enumerate(prompts)))
    got = [r[0] for r in results]
    mismatched = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    tau = sum(r[1].completion_tokens for r in results) / sum(r[1].verify_steps + 1 for r in results)
    print(f"{algorithm} {steps}/{topk}/{ndt}: tau {tau:.2f}, mismatched prompts {mismatched}")
    assert not mismatched, f"{algorithm}: outputs differ from HF greedy for prompts {mismatched}"


@pytest.mark.parametrize("algorithm,draft,steps,topk,ndt", [
    pytest.param("EAGLE3", DEFAULT_EAGLE3, 5, 4, 16, id="eagle3-tree"),
    pytest.param("EAGLE3", DEFAULT_EAGLE3, 3, 1, 4, id="eagle3-chain"),
    pytest.param("STANDALONE", DEFAULT_DRAFT, 4, 2, 8, id="standalone-tree"),
])
async def test_chained_steps_equal_hf_on_cuda(prompts_and_reference, algorithm, draft, steps, topk, ndt):
    """Speculative steps chained on the device (target_service/chained.py: the glue graphs between the static verify
    and draft graphs, one readback per call) with the draft co-located, 4 steps per call, 3 sequences at once (a
    bucket of 4 with a padding row) and then one: greedy == HF, and the chained runs happened."""
    prompts, want = prompts_and_reference
    async with local_stack(DEFAULT_MODEL, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt, max_total_tokens=16384, device="cuda", dtype="float32",
                           colocate=True, static_steps=True, num_continuous_decode_steps=4) as scheduler:
        results = await asyncio.gather(*(generate_ids(scheduler, p, NEW_TOKENS, request_id=f"c{i}")
                                         for i, p in enumerate(prompts[:3])))
        results.append(await generate_ids(scheduler, prompts[3], NEW_TOKENS, request_id="c3"))
        chained = scheduler.test_servicers[0].chained
        runs = chained.num_runs if chained is not None else 0
    got = [r[0] for r in results]
    mismatched = [i for i, (g, w) in enumerate(zip(got, want[:4])) if g != w]
    print(f"chained {algorithm} {steps}/{topk}/{ndt}: {runs} chained runs, mismatched prompts {mismatched}")
    assert runs > 0
    assert not mismatched, f"{algorithm} chained: outputs differ from HF greedy for prompts {mismatched}"


async def test_chained_steps_with_a_sampled_neighbour_on_cuda(prompts_and_reference):
    """A sampled request beside greedy ones (EAGLE3 5/4/16 co-located, 4 steps per call): the greedy sequences are
    chained on the device while the sampled one steps one by one in the same calls; greedy == HF."""
    prompts, want = prompts_and_reference
    async with local_stack(DEFAULT_MODEL, algorithm="EAGLE3", draft_path=DEFAULT_EAGLE3, num_steps=5, topk=4,
                           num_draft_tokens=16, max_total_tokens=16384, device="cuda", dtype="float32",
                           colocate=True, static_steps=True, num_continuous_decode_steps=4) as scheduler:
        results = await asyncio.gather(
            *(generate_ids(scheduler, p, NEW_TOKENS, request_id=f"m{i}") for i, p in enumerate(prompts[:3])),
            generate_ids(scheduler, prompts[3], 2 * NEW_TOKENS, temperature=0.8, seed=1, request_id="sampled"))
        runs = scheduler.test_servicers[0].chained.num_runs
    got = [r[0] for r in results[:3]]
    mismatched = [i for i, (g, w) in enumerate(zip(got, want[:3])) if g != w]
    print(f"chained beside a sampled request: {runs} chained runs, mismatched prompts {mismatched}")
    assert runs > 0 and len(results[3][0]) == 2 * NEW_TOKENS
    assert not mismatched
