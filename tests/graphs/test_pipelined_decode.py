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
    monkeypatch.setattr(ModelRunner, "greedy_decode_steps", lambda self, *a, **k: calls.append(a[2]) or real(self, *a, **k))
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
    monkeypatch.setattr(ModelRunner, "greedy_decode_steps", lambda self, *a, **k: calls.append(a[2]) or real(self, *a, **k))
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


def _reference_tokens(path: str, ids: list[str], steps: int) -> tuple[ModelRunner, list[list[int]]]:
    ref = _runner(path, graphs=False)
    last = _prefill(ref)
    want = [[] for _ in ids]
    for _ in range(steps):
        out = ref.forward([SeqForward(s, [t]) for s, t in zip(ids, last)])
        last = [int(row[-1].argmax()) for row in out.logits]
        for w, t in zip(want, last):
            w.append(t)
    return ref, want


def test_prefetched_steps_are_the_next_runs_first_steps(llama):
    """A run with prefetch enqueues the next run's steps before its readback; the next run that continues there
    takes them instead of replaying them again, and every token and the KV are those of one forward per step."""
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    ref, want = _reference_tokens(llama, ids, 9)
    pipe = _runner(llama, graphs=True)
    last = _prefill(pipe)
    got = [[] for _ in ids]
    replays = []
    for _ in range(3):
        before = pipe.graph_runner.num_replays()
        tokens = pipe.greedy_decode_steps(ids, last, 3, prefetch=3)
        replays.append(pipe.graph_runner.num_replays() - before)
        assert [pipe.kv_len(s) for s in ids] == [len(p) - 1 + len(g) + 3 for p, g in zip(PROMPTS, got)]
        for g, t in zip(got, tokens):
            g.extend(t)
        last = [t[-1] for t in tokens]
    assert got == want
    assert replays == [6, 3, 3]  # the first run: its 3 steps + 3 prefetched; later runs: only the next 3 ahead
    nxt = [w[-1] for w in want]  # the KV behind kv_len is step-by-step decoding's: the next forward agrees
    a = ref.forward([SeqForward(s, [t]) for s, t in zip(ids, nxt)])
    b = pipe.forward([SeqForward(s, [t]) for s, t in zip(ids, nxt)])
    assert torch.allclose(torch.cat(a.logits), torch.cat(b.logits), atol=1e-4)


@pytest.mark.parametrize("between", ["forward", "truncate", "other_tokens", "other_batch", "fewer_steps"])
def test_prefetched_steps_are_dropped_unless_the_run_continues_exactly_there(llama, between):
    """Anything but the exact continuation drops the prefetch (its KV lies past kv_len): the result is what the
    runner computes without one."""
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    pipe, fresh = _runner(llama, graphs=True), _runner(llama, graphs=True)
    last, _ = _prefill(pipe), _prefill(fresh)
    first = pipe.greedy_decode_steps(ids, last, 2, prefetch=2)
    assert fresh.greedy_decode_steps(ids, last, 2) == first
    nxt, run_ids, steps = [t[-1] for t in first], ids, 2
    if between == "forward":  # another forward (here: of one of the sequences) between the runs
        for r in (pipe, fresh):
            r.forward([SeqForward("s0", [nxt[0]])])
        nxt[0] = 7
    elif between == "truncate":
        for r in (pipe, fresh):
            r.truncate("s1", r.kv_len("s1") - 1)
        nxt[1] = first[1][-2]
    elif between == "other_tokens":  # the caller fed another token than the run's last (a rolled-back commit)
        nxt[2] = 11
    elif between == "other_batch":
        run_ids, nxt = ids[:2], nxt[:2]
    else:  # fewer steps than were prefetched
        steps = 1
    before = pipe.graph_runner.num_replays()
    assert pipe.greedy_decode_steps(run_ids, nxt, steps) == fresh.greedy_decode_steps(run_ids, nxt, steps)
    assert pipe.graph_runner.num_replays() - before == steps  # nothing taken from the prefetch
    assert [pipe.kv_len(s) for s in ids] == [fresh.kv_len(s) for s in ids]


def _calls_of_four(path: str, prefetch: bool, stop_ids=frozenset()) -> dict[str, list[int]]:
    """Verify calls of 4 plain decode steps one after another until every sequence finished (40 tokens each)."""
    engine = _engine(path, graphs=True)
    engine.decode_prefetch = prefetch
    stops = [StopRule(40, stop_token_ids=stop_ids, prompt_len=len(p)) for p in PROMPTS]
    pre = engine.prefill([PrefillInput(f"s{i}", p, True, GREEDY, stops[i]) for i, p in enumerate(PROMPTS)])
    committed = {f"s{i}": [*p, *o.token_ids] for i, (p, o) in enumerate(zip(PROMPTS, pre))}
    emitted = {s: [] for s in committed}
    live = list(committed)
    while live:
        outs = engine.verify([VerifyInput(s, len(committed[s]), committed[s][-1], DraftTree([], []), GREEDY,
                                          stops[int(s[1:])], num_decode_steps=4) for s in live])
        for s, o in zip(live, outs):
            assert o.status == Status.OK
            committed[s] += o.token_ids
            emitted[s] += o.token_ids
        live = [s for s, o in zip(live, outs) if o.finish_reason is None]
    return emitted


def test_engine_with_decode_prefetch_matches_across_calls_with_stops(llama, monkeypatch):
    """TargetEngine.decode_prefetch (a pod that runs ahead): Verify calls of 4 plain decode steps one after another,
    one sequence stopping inside a run, give the tokens of the engine without it, and later calls take their steps
    from the prefetch."""
    free = _calls_of_four(llama, prefetch=False)
    stop = frozenset({free["s1"][5]})
    want = _calls_of_four(llama, prefetch=False, stop_ids=stop)
    taken = []
    real = ModelRunner._take_prefetch
    monkeypatch.setattr(ModelRunner, "_take_prefetch", lambda self, *a: taken.append(len(r := real(self, *a))) or r)
    got = _calls_of_four(llama, prefetch=True, stop_ids=stop)
    assert got == want and len(want["s1"]) < 39 and max(len(v) for v in want.values()) == 39
    assert 4 in taken  # steps came from the prefetch (the batch that lost s1 drops it once)


def test_another_sequences_forward_keeps_the_prefetch(llama):
    """A new request's prefill between two runs touches neither the running sequences' KV nor the prefetched tokens:
    the next run still takes the prefetched steps, and its tokens are the plain runner's."""
    ids = ["s0", "s1"]
    pipe, fresh = _runner(llama, graphs=True), _runner(llama, graphs=True)
    last = _prefill(pipe)[:2]
    _prefill(fresh)
    first = pipe.greedy_decode_steps(ids, last, 2, prefetch=2)
    assert fresh.greedy_decode_steps(ids, last, 2) == first
    for r in (pipe, fresh):
        r.add_seq("new")
        r.forward([SeqForward("new", [4, 5, 6])])
    nxt = [t[-1] for t in first]
    before = pipe.graph_runner.num_replays()
    assert pipe.greedy_decode_steps(ids, nxt, 2) == fresh.greedy_decode_steps(ids, nxt, 2)
    assert pipe.graph_runner.num_replays() == before  # both steps came from the prefetch
