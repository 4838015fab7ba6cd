"""Pipelined greedy decode (ModelRunner.greedy_decode_steps) through the graph runner's real buffers (fake capture, see
fake_graphs.py): the device-fed token chain gives exactly the tokens of one decode forward per step, the KV it leaves
behind is the same (later forwards agree), buckets pad, and TargetEngine's --num-continuous-decode-steps takes the
pipelined path for greedy batches, cutting at stops and length like the step-by-step loop."""

from __future__ import annotations

import pytest
import torch

from core.types import FinishReason
from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner, SeqForward
from runtime.sampling import SamplingParams
from runtime.speculative.tree import DraftTree
from core.types import StopRule
from target_service.engine import PrefillInput, Status, TargetEngine, VerifyInput
from tests.graphs.fake_graphs import install_fake_graphs
from tests.tiny_models import make_tiny_model

PROMPTS = [[5, 17, 42, 7, 99, 3], [8, 1, 250, 60], [33, 34, 35, 36, 37, 38, 39]]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_tiny_model("llama", tmp_path_factory.mktemp("pipelined"))


def _runner(path: str, graphs: bool, max_total_tokens: int = 2048) -> ModelRunner:
    runner = ModelRunner(path, EngineConfig(device="cpu", dtype="float32", attention_backend="triton", block_size=4,
                                            max_total_tokens=max_total_tokens, cuda_graph_max_bs=4))
    if graphs:
        install_fake_graphs(runner, sizes=[1, 2, 4])
    return runner


def _prefill(runner: ModelRunner) -> list[int]:
    for i, p in enumerate(PROMPTS):
        runner.add_seq(f"s{i}")
    out = runner.forward([SeqForward(f"s{i}", p[:-1]) for i, p in enumerate(PROMPTS)])
    del out
    return [p[-1] for p in PROMPTS]  # the pending last tokens (no KV yet)


def test_device_fed_chain_equals_one_forward_per_step(llama):
    ref, pipe = _runner(llama, graphs=False), _runner(llama, graphs=True)
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    last_ref, last_pipe = _prefill(ref), _prefill(pipe)
    want = [[] for _ in ids]
    for _ in range(6):
        out = ref.forward([SeqForward(s, [t]) for s, t in zip(ids, last_ref)])
        last_ref = [int(row[-1].argmax()) for row in out.logits]
        for w, t in zip(want, last_ref):
            w.append(t)
    assert pipe.can_decode_continuously(ids)
    before = pipe.graph_runner.num_replays()
    got = pipe.greedy_decode_steps(ids, last_pipe, 6)
    assert got == want
    assert pipe.graph_runner.num_replays() - before == 6  # every step replayed a graph (3 sequences -> bucket 4)
    assert [pipe.kv_len(s) for s in ids] == [ref.kv_len(s) for s in ids]
    # The KV the chain wrote is the KV step-by-step decoding writes: the next forward agrees.
    nxt = [w[-1] for w in want]
    a = ref.forward([SeqForward(s, [t]) for s, t in zip(ids, nxt)])
    b = pipe.forward([SeqForward(s, [t]) for s, t in zip(ids, nxt)])
    assert torch.allclose(torch.cat(a.logits), torch.cat(b.logits), atol=1e-4)


def test_no_graphs_or_open_tree_region_means_no_pipeline(llama):
    eager = _runner(llama, graphs=False)
    _prefill(eager)
    assert not eager.can_decode_continuously(["s0"])
    pipe = _runner(llama, graphs=True)
    _prefill(pipe)
    pipe.forward([SeqForward("s0", [1, 2], parents=[-1, 0], logits="all")])  # an open tree region
    assert not pipe.can_decode_continuously(["s0"]) and pipe.can_decode_continuously(["s1"])


def _engine(path: str, graphs: bool) -> TargetEngine:
    return TargetEngine(_runner(path, graphs))


def _run(engine: TargetEngine, steps: int, max_new: int, stop_ids=frozenset()):
    stops = [StopRule(max_new, stop_token_ids=stop_ids, prompt_len=len(p)) for p in PROMPTS]
    pre = engine.prefill([PrefillInput(f"s{i}", p, True, GREEDY, stops[i]) for i, p in enumerate(PROMPTS)])
    committed = [[*p, *o.token_ids] for p, o in zip(PROMPTS, pre)]
    outs = engine.verify([VerifyInput(f"s{i}", len(c), c[-1], DraftTree([], []), GREEDY, stops[i],
                                      num_decode_steps=steps) for i, c in enumerate(committed)])
    return [o.token_ids for o in pre], outs


def test_engine_continuous_decode_takes_the_pipelined_path_and_matches(llama, monkeypatch):
    calls = []
    real = ModelRunner.greedy_decode_steps
    monkeypatch.setattr(ModelRunner, "greedy_decode_steps", lambda self, *a: calls.append(a[2]) or real(self, *a))
    _, want = _run(_engine(llama, graphs=False), 8, 64)
    _, got = _run(_engine(llama, graphs=True), 8, 64)
    assert calls == [8]  # all 8 steps pipelined, the first one too: one readback per call
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.status == Status.OK and o.num_steps == 8 and len(o.token_ids) == 8 for o in got)


def test_a_batch_that_cannot_pipeline_its_first_step_verifies_it_plainly(llama, monkeypatch):
    """A sequence asking logprobs (they need the logits) keeps the whole batch's first step a plain verify; the
    steps after it pipeline for the sequences that may, and the output is the eager engine's."""
    calls = []
    real = ModelRunner.greedy_decode_steps
    monkeypatch.setattr(ModelRunner, "greedy_decode_steps", lambda self, *a: calls.append(a[2]) or real(self, *a))
    outs = {}
    for graphs in (False, True):
        engine = _engine(llama, graphs)
        stops = [StopRule(64, prompt_len=len(p)) for p in PROMPTS]
        pre = engine.prefill([PrefillInput(f"s{i}", p, True, GREEDY, stops[i]) for i, p in enumerate(PROMPTS)])
        committed = [[*p, *o.token_ids] for p, o in zip(PROMPTS, pre)]
        outs[graphs] = engine.verify([VerifyInput(f"s{i}", len(c), c[-1], DraftTree([], []), GREEDY, stops[i],
                                                  num_decode_steps=5, logprobs=1 if i == 0 else -1)
                                      for i, c in enumerate(committed)])
    assert calls == [4]  # s1's last 4 steps; the first step of both, and every step of s0, verified plainly
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert len(outs[True][0].logprobs) == 5


def test_engine_pipelined_run_cuts_at_stop_and_length(llama):
    first, free = _run(_engine(llama, graphs=True), 8, 64)
    stop_token = free[1].token_ids[3]
    _, cut = _run(_engine(llama, graphs=True), 8, 64, stop_ids=frozenset({stop_token}))
    assert cut[1].finish_reason == FinishReason.STOP and cut[1].token_ids == free[1].token_ids[:4]
    _, short = _run(_engine(llama, graphs=True), 8, 5)  # 1 token from prefill, 4 more fit
    assert all(o.finish_reason == FinishReason.LENGTH and len(o.token_ids) == 4 for o in short)


def test_continuous_decode_short_of_kv_reports_it_instead_of_failing_the_call(llama):
    """Steps that would not fit the free KV are not pipelined: the plain verifies run until a sequence's step no
    longer fits, which ends that sequence's run with what it emitted (the call itself succeeds)."""
    engine = TargetEngine(_runner(llama, graphs=True, max_total_tokens=64))
    stop = StopRule(200, prompt_len=len(PROMPTS[0]))
    [pre] = engine.prefill([PrefillInput("s0", PROMPTS[0], True, GREEDY, stop)])
    committed = [*PROMPTS[0], *pre.token_ids]
    [out] = engine.verify([VerifyInput("s0", len(committed), committed[-1], DraftTree([], []), GREEDY, stop,
                                       num_decode_steps=100)])
    assert out.status == Status.OK and 0 < len(out.token_ids) < 100
    assert len(committed) + len(out.token_ids) <= 64
