"""SYNTHETIC proposer (synthetic acceptance, benchmarks only): greedy output equals HF greedy through the real step
path (in-process gRPC target and draft servers, the gateway scheduler and its clients), and the measured accept
length tracks the expected sum_{i=0..D} a^i (exactly for a = 1 and a = 0)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

from draft_service.proposer import ProposeInput, SpecShape
from draft_service.synthetic import (Oracle, SyntheticHead, SyntheticProposer, expected_tau, rate_for_tau,
                                     tree_shape)
from runtime.config import EngineConfig, ModelConfig
from tests.stack import generate_ids
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target = make_tiny_model("llama", tmp_path_factory.mktemp("synthetic") / "target")
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    return target, hf


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                          eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 9, 30)]


@contextlib.asynccontextmanager
async def synthetic_stack(target, oracle: Oracle, rate: float, steps: int, topk: int, ndt: int, head: bool = True,
                          overlap: bool = False):
    from draft_service.server import serve_draft
    from gateway.clients import DraftClient, TargetClient
    from gateway.scheduler import Scheduler, SchedulerConfig, SpecConfig
    from runtime.model_runner import ModelRunner
    from target_service.engine import TargetEngine
    from target_service.server import serve_target

    engine_config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=8192)
    target_config = ModelConfig.from_pretrained(str(target))
    head_obj = SyntheticHead(target_config, engine_config, 64, 256) if head else None
    proposer = SyntheticProposer(rate, target_config.vocab_size, oracle, seed=0, head=head_obj)
    tserver, tport = await serve_target(TargetEngine(ModelRunner(str(target), engine_config)), str(target),
                                        "127.0.0.1", 0)
    dserver, dport = await serve_draft(proposer, "synthetic", "127.0.0.1", 0)
    tclient, dclient = TargetClient(f"127.0.0.1:{tport}"), DraftClient(f"127.0.0.1:{dport}")
    info = await tclient.info()
    scheduler = Scheduler(targets=[tclient], drafts=[dclient], tokenizer=None, model_name="tiny",
                          max_context_len=info.max_context_len, vocab_size=info.vocab_size, eos_token_ids=[],
                          spec=SpecConfig("SYNTHETIC", steps, topk, ndt),
                          config=SchedulerConfig(max_running_requests=8, request_timeout_s=120,
                                                 enable_overlap_drafting=overlap))
    await scheduler.start()
    scheduler.test_proposer = proposer
    try:
        yield scheduler
    finally:
        await scheduler.close()
        for s in (tserver, dserver):
            await s.stop(grace=None)
        await tclient.close()
        await dclient.close()


def make_oracle(hf, ps: list[list[int]], n: int) -> Oracle:
    return Oracle({tuple(p): hf_greedy(hf, p, n) for p in ps})


@pytest.mark.parametrize("rate,steps,topk,ndt", [(0.8, 3, 1, 4), (0.7, 4, 3, 10)], ids=["chain", "tree"])
async def test_synthetic_greedy_matches_hf(tiny, rate, steps, topk, ndt):
    target, hf = tiny
    ps = prompts(hf.config.vocab_size)
    max_new = 21
    oracle = make_oracle(hf, ps[:3], max_new + steps)  # the last prompt is unknown to the oracle
    async with synthetic_stack(target, oracle, rate, steps, topk, ndt) as scheduler:
        accepted = 0
        for i, prompt in enumerate(ps):
            got, usage, finish = await generate_ids(scheduler, prompt, max_new, request_id=f"s{i}")
            assert got == hf_greedy(hf, prompt, max_new), f"prompt {i}: SYNTHETIC output diverged from HF greedy"
            assert usage.completion_tokens == max_new and finish.value == "length"
            if i < 3:
                accepted += usage.accepted_draft_tokens
            else:
                assert usage.accepted_draft_tokens <= 1, "an unknown prompt gets wrong drafts"
        assert accepted > 0
        stats = scheduler.test_proposer.stats
        assert stats["unknown_seqs"] == 1 and stats["diverged_seqs"] == 0


@pytest.mark.parametrize("rate", [1.0, 0.75])
async def test_synthetic_predrafts_guess_the_spine_and_output_is_hf_greedy(tiny, rate):
    """--enable-overlap-drafting with SYNTHETIC: the pre-draft's bonus guess is what the draft's spine holds there, so
    at a = 1 every guess comes true (no Propose round trips after the first), and below that both paths run; the
    head spends its compute on the guessed tokens. Output equals HF greedy either way, and the drafts are accepted
    exactly as without pre-drafts: a wrong guessed path does not end the sequence's oracle (it did: every sequence
    then drafted wrong tokens, tau 1.02 through the services)."""
    target, hf = tiny
    ps = prompts(hf.config.vocab_size)[:3]
    steps, max_new = 3, 25
    accepted = {}
    for overlap in (False, True):
        async with synthetic_stack(target, make_oracle(hf, ps, max_new + 2 * steps), rate, steps, 1, steps + 1,
                                   overlap=overlap) as sched:
            hits = misses = accepted[overlap] = 0
            for i, prompt in enumerate(ps):
                got, usage, _ = await generate_ids(sched, prompt, max_new, request_id=f"o{i}")
                assert got == hf_greedy(hf, prompt, max_new)
                hits, misses = hits + usage.predraft_hits, misses + usage.predraft_misses
                accepted[overlap] += usage.accepted_draft_tokens
            assert sched.test_proposer.stats["diverged_seqs"] == 0
    assert accepted[True] == accepted[False] > 0
    assert hits > 0
    if rate == 1.0:
        assert misses == 0, f"a = 1: every guess is the oracle's ({hits} hits, {misses} misses)"
    else:
        assert misses > 0


@pytest.mark.parametrize("rate", [1.0, 0.0])
async def test_synthetic_tau_exact_at_the_extremes(tiny, rate):
    target, hf = tiny
    ps = prompts(hf.config.vocab_size)[:2]
    steps = 3
    max_new = 1 + (steps + 1) * 6  # the prefill token, then 6 full chain steps at a = 1
    async with synthetic_stack(target, make_oracle(hf, ps, max_new + steps), rate, steps, 1, steps + 1) as sched:
        for i, prompt in enumerate(ps):
            got, usage, _ = await generate_ids(sched, prompt, max_new, request_id=f"e{i}")
            assert got == hf_greedy(hf, prompt, max_new)
            tau = 1 + usage.accepted_draft_tokens / usage.verify_steps
            assert tau == pytest.approx(expected_tau(rate, steps)), f"rate {rate}: measured tau {tau}"


async def test_synthetic_tau_tracks_expected():
    """a = 0.8, chain of 4 (expected 3.36) and a 6/4/16 tree (expected 3.95) over many steps, on an oracle of known
    tokens (the proposer's own bookkeeping, no model: the accept rule is the verifier's greedy one)."""
    from runtime.speculative.verify import verify_greedy

    vocab = 1000
    gen = torch.Generator().manual_seed(0)
    for spec in (SpecShape(4, 1, 5), SpecShape(6, 4, 16)):
        taus = []
        for s in range(8):
            prompt = torch.randint(0, vocab, (8,), generator=gen).tolist()
            truth = torch.randint(0, vocab, (400,), generator=gen).tolist()
            proposer = SyntheticProposer(0.8, vocab, Oracle({tuple(prompt): truth}), seed=s)
            committed = [*prompt, truth[0]]
            proposer.prefill("x", committed)
            new: list[int] = []
            while len(committed) < len(prompt) + 300:
                tree = proposer.propose([ProposeInput("x", len(committed), new, spec)])[0].tree
                full = [*prompt, *truth]
                # Greedy target: row 0 predicts the token after the root, row i+1 after node i (at its depth).
                depths = tree.depths()
                rows = [full[len(committed)]] + [full[len(committed) + d + 1] for d in depths]
                outcome = verify_greedy(tree, torch.tensor(rows))
                new = outcome.tokens
                committed += new
                taus.append(len(new))
        measured = sum(taus) / len(taus)
        expected = expected_tau(0.8, min(spec.num_steps, spec.num_draft_tokens - 1))
        assert abs(measured - expected) < 0.12 * expected, f"{spec}: measured {measured:.3f}, expected {expected:.3f}"


def test_tree_shape_and_rate_inversion():
    for spec in (SpecShape(3, 1, 4), SpecShape(6, 4, 16), SpecShape(8, 8, 60), SpecShape(7, 8, 32)):
        shape = tree_shape(spec)
        assert len(shape.parents) == spec.num_draft_tokens - 1
        assert all(-1 <= p < i for i, p in enumerate(shape.parents))
        assert sum(shape.spine) == min(spec.num_steps, spec.num_draft_tokens - 1)
    assert expected_tau(rate_for_tau(3.5, 5), 5) == pytest.approx(3.5)
    with pytest.raises(ValueError):
        rate_for_tau(7.0, 5)
    with pytest.raises(ValueError):
        SyntheticProposer(1.5, 100)


def test_oracle_roundtrip_and_bad_file(tmp_path):
    oracle = Oracle({(1, 2): [5, 6, 7]})
    oracle.save(tmp_path / "o.json")
    loaded = Oracle.load(tmp_path / "o.json")
    assert loaded.match([1, 2, 5])[1] == [1, 2, 5, 6, 7]
    assert loaded.match([1, 2, 9]) is None
    (tmp_path / "bad.json").write_text('{"entries": 3}')
    with pytest.raises(ValueError, match="synthetic oracle"):
        Oracle.load(tmp_path / "bad.json")


def test_synthetic_head_spends_compute_and_keeps_no_speculative_kv():
    target_config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256)
    head = SyntheticHead(target_config, EngineConfig(device="cpu", dtype="float32", max_total_tokens=2048), 64, 100)
    assert head.model.lm_head.weight.shape == (100, 64) and head.feature_size == 3 * 128
    proposer = SyntheticProposer(1.0, 512, Oracle({(1, 2, 3): list(range(10, 60))}), head=head)
    proposer.prefill("a", [1, 2, 3, 10])
    tree = proposer.propose([ProposeInput("a", 4, [], SpecShape(5, 4, 12))])[0].tree
    assert len(tree) == 11 and head.runner.kv_len("a") == 3  # committed positions [0, C-1) only
    assert [tree.token_ids[i] for i in range(len(tree)) if tree.depths()[i] == 0].count(11) == 1
    proposer.release(["a"])
    assert head.runner.num_free_tokens() == head.runner.num_total_tokens()


def test_oracle_file_is_reread_when_it_changes(tmp_path):
    path = tmp_path / "oracle.json"
    proposer = SyntheticProposer(1.0, 100, oracle_path=path)  # no file yet: every draft is wrong
    proposer.prefill("a", [1, 2, 3])
    assert proposer.stats["unknown_seqs"] == 1
    Oracle({(1, 2): [3, 4, 5, 6]}).save(path)
    proposer.prefill("b", [1, 2, 3])
    tree = proposer.propose([ProposeInput("b", 3, [], SpecShape(3, 1, 4))])[0].tree
    assert tree.token_ids == [4, 5, 6] and proposer.stats["unknown_seqs"] == 1


def test_serve_passes_synthetic_flags_to_the_draft():
    from tandem.cli import build_parser
    from tandem.launch import commands

    args = build_parser().parse_args(["serve", "--speculative-algorithm", "SYNTHETIC", "--synthetic-oracle", "o.json",
                                      "--synthetic-accept-rate", "0.9", "--synthetic-head-hidden", "0"])
    args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 8, 8, 60
    draft = commands(args)["draft-0"]
    for flag, value in (("--synthetic-oracle", "o.json"), ("--synthetic-accept-rate", "0.9"),
                        ("--synthetic-head-hidden", "0"), ("--speculative-algorithm", "SYNTHETIC")):
        assert draft[draft.index(flag) + 1] == value
