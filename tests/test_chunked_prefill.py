"""--chunked-prefill-size: the target splits long prompts (and batches of prompts) into forwards of at most that many
tokens; the first sampled token, the KV it leaves (later steps) and the EAGLE features are those of one big forward."""
from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner
from runtime.sampling import SamplingParams
from runtime.speculative.tree import DraftTree
from core.types import StopRule
from target_service.engine import PrefillInput, TargetEngine, VerifyInput
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(100, 123))]  # 37 + 3 + 23 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("chunked"))


def _engine(path, chunk):
    runner = ModelRunner(path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096,
                                            chunked_prefill_size=chunk))
    return TargetEngine(runner, final_norm_features=True)


def _run(engine):
    forwards = []
    real = engine.runner.forward
    engine.runner.forward = lambda batch, **kw: forwards.append(sum(len(f.token_ids) for f in batch)) or real(batch, **kw)
    pre = engine.prefill([PrefillInput(f"s{i}", p, True, GREEDY, StopRule(16, prompt_len=len(p)), return_features=True)
                          for i, p in enumerate(PROMPTS)])
    prefill_forwards = list(forwards)
    committed = [[*p, *o.token_ids] for p, o in zip(PROMPTS, pre)]
    steps = engine.verify([VerifyInput(f"s{i}", len(c), c[-1], DraftTree([7, 9], [-1, 0]), GREEDY,
                                       StopRule(16, prompt_len=len(PROMPTS[i]))) for i, c in enumerate(committed)])
    return pre, steps, prefill_forwards


def test_chunks_give_the_tokens_kv_and_features_of_one_forward(tiny):
    big_pre, big_steps, big_fw = _run(_engine(tiny, None))
    pre, steps, fw = _run(_engine(tiny, 10))
    assert big_fw == [63] and fw == [10] * 6 + [3] and max(fw) <= 10
    assert [o.token_ids for o in pre] == [o.token_ids for o in big_pre]
    assert [o.token_ids for o in steps] == [o.token_ids for o in big_steps]  # the KV the chunks wrote is right
    for a, b in zip(pre, big_pre):
        assert a.features.shape == b.features.shape
        assert torch.allclose(a.features, b.features, atol=1e-5)


def test_flag_reaches_both_services_and_sizes_the_config():
    from tandem.cli import build_parser
    from tandem.launch import commands
    from tandem.services import _engine_config

    args = build_parser().parse_args(["serve", "--chunked-prefill-size", "2048"])
    cmds = commands(args)
    assert all("2048" in c[c.index("--chunked-prefill-size") + 1] for n, c in cmds.items() if n != "gateway")
    target_args = build_parser().parse_args(["target", "--chunked-prefill-size", "-1"])
    assert _engine_config(target_args, target=True).chunked_prefill_size == -1
