"""EAGLE / EAGLE-3 through the real step path: the target returns features over gRPC, the gateway forwards each draft
pod the rows it has not seen, the EagleProposer drafts chains and trees — and greedy output equals HF `generate`.
(Heads are random, in the published layouts; acceptance itself is covered in tests/eagle/.)"""
from __future__ import annotations

import pytest
import torch
import transformers

from tests.eagle.heads import make_eagle3_head, make_eagle_head
from tests.stack import generate_ids, local_stack
from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy, prompts
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-e2e")
    path = make_tiny_model("llama", root / "target", num_hidden_layers=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return path, root, hf


@pytest.mark.parametrize("algorithm,steps,topk,ndt", [
    ("EAGLE", 3, 1, 4), ("EAGLE", 3, 2, 6), ("EAGLE3", 3, 1, 4), ("EAGLE3", 4, 3, 10),
])
async def test_eagle_family_greedy_matches_hf_through_the_services(target, algorithm, steps, topk, ndt):
    path, root, hf = target
    head = (make_eagle_head(path, str(root / "eagle")) if algorithm == "EAGLE"
            else make_eagle3_head(path, str(root / "eagle3")))
    async with local_stack(path, algorithm=algorithm, draft_path=head, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt) as scheduler:
        for i, prompt in enumerate(prompts(hf.config.vocab_size)[:3]):
            got, usage, _ = await generate_ids(scheduler, prompt, 15 + 4 * i, request_id=f"e{i}")
            assert got == hf_greedy(hf, prompt, 15 + 4 * i)
            assert usage.proposed_draft_tokens > 0, "the EAGLE draft pod never proposed: feature plumbing broken"
        await _assert_no_kv_leak(scheduler)
