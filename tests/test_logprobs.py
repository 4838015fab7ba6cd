"""logprobs: every emitted token's log-probability (and the top-k alternatives) under the target's raw distribution,
whichever step emitted it — the prefill, a verified draft token, the bonus token, a continuous-decode step — equals
HF transformers' log-softmax at that position; through the gateway the chunks carry them aligned with their tokens."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.types import GenerateParams, request_sampling
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner
from runtime.sampling import SamplingParams
from runtime.speculative.tree import DraftTree
from core.types import StopRule
from target_service.engine import PrefillInput, TargetEngine, VerifyInput
from tests.stack import local_stack, perturbed_copy
from tests.tiny_models import make_tiny_model

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("logprobs"))


@pytest.fixture(scope="module")
def hf(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def _reference(hf, tokens: list[int], start: int, k: int):
    """HF (logprob, top-k ids, top-k logprobs) of tokens[start:], each predicted from its prefix."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)
    out = []
    for p in range(start, len(tokens)):
        values, ids = lp[p - 1].topk(k)
        out.append((lp[p - 1, tokens[p]].item(), ids.tolist(), values.tolist()))
    return out


def _close(got, want):
    assert len(got) == len(want)
    for (g, gi, gv), (w, wi, wv) in zip(got, want):
        assert g == pytest.approx(w, abs=1e-4) and gi == wi and gv == pytest.approx(wv, abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_logprobs_of_prefill_tree_and_continuous_steps_equal_hf(tiny, hf, temperature):
    engine = TargetEngine(ModelRunner(tiny, EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096)))
    sampling = SamplingParams(temperature=temperature, seed=3)
    stop = StopRule(64, prompt_len=len(PROMPT))
    pre = engine.prefill([PrefillInput("s", PROMPT, True, sampling, stop, logprobs=3)])[0]
    committed = [*PROMPT, *pre.token_ids]
    lps = list(pre.logprobs)
    # a tree whose first branch is the target's own greedy continuation, so drafts get accepted
    greedy = _reference(hf, committed + [0], len(committed), 1)[0][1][0]
    tree = DraftTree([greedy, 77, 12], [-1, -1, 0])
    out = engine.verify([VerifyInput("s", len(committed), committed[-1], tree, sampling, stop, logprobs=3)])[0]
    committed += out.token_ids
    lps += out.logprobs
    out = engine.verify([VerifyInput("s", len(committed), committed[-1], DraftTree([], []), sampling, stop,
                                     num_decode_steps=4, logprobs=3)])[0]
    committed += out.token_ids
    lps += out.logprobs
    assert len(lps) == len(committed) - len(PROMPT) >= 6
    _close(lps, _reference(hf, committed, len(PROMPT), 3))


async def test_gateway_chunks_carry_logprobs_through_speculative_steps(tiny, hf, tmp_path):
    draft = perturbed_copy(Path(tiny), tmp_path / "draft", noise=0.05)
    async with local_stack(tiny, algorithm="STANDALONE", draft_path=draft, num_steps=3, topk=2,
                           num_draft_tokens=6) as scheduler:
        params = GenerateParams("r", PROMPT, 20, sampling=request_sampling(temperature=0.0), detokenize=False,
                                logprobs=2)
        tokens, entries, usage = [], [], None
        async for chunk in scheduler.generate(params):
            assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids)
            tokens += chunk.token_ids
            entries += chunk.logprobs
            usage = chunk.usage or usage
    assert usage.accepted_draft_tokens > 0  # drafts were accepted: their logprobs came from verify rows
    _close(entries, _reference(hf, PROMPT + tokens, len(PROMPT), 2))
