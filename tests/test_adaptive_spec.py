"""Adaptive speculation (--speculative-adaptive): the per-slot policy (SGLang's semantics) and the real step path —
greedy output stays HF's token for token while the number of draft steps changes, and large batches step without
drafts."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from gateway.adaptive import AdaptiveSpec, SlotConfig, all_candidate_steps, default_config, load_config
from tandem.args import DEFAULT_DRAFT, DEFAULT_MODEL, resolve_spec
from tandem.cli import build_parser
from tests.stack import generate_ids, local_stack


def _spec(cands, initial, **kw):
    return AdaptiveSpec({1: SlotConfig(cands, warmup_batches=kw.pop("warmup", 2), update_interval=1, **kw)}, initial)


def test_defaults_follow_sglang_tiers_capped_at_the_configured_steps_and_stop_drafting_from_batch_32():
    spec = AdaptiveSpec(default_config(7), 7)
    assert [spec.steps_for(b) for b in (1, 7, 8, 31, 32, 63, 64, 200)] == [7, 7, 3, 3, 0, 0, 0, 0]
    assert default_config(3)[1].candidate_steps == [1, 3] and all_candidate_steps(default_config(3)) == [0, 1, 3]


def test_high_acceptance_moves_up_and_low_acceptance_moves_down():
    spec = _spec([1, 3, 7], 3)
    for _ in range(4):
        spec.observe(1, spec.steps_for(1), 3.0)  # every draft accepted
    assert spec.steps_for(1) == 7
    for _ in range(30):
        spec.observe(1, spec.steps_for(1), 0.1)  # almost nothing accepted
    assert spec.steps_for(1) == 1
    assert spec.slots[1].history[0] == 7 and spec.slots[1].history[-1] == 1  # tiers after each evaluation


def test_middling_acceptance_holds_the_tier():
    spec = _spec([1, 3, 7], 3)
    for _ in range(40):
        spec.observe(1, spec.steps_for(1), 1.8)  # 1.8 of 3: above 1 - 0.5 - 0.25, not above 3 - 0.5
    assert spec.steps_for(1) == 3


def test_zero_tier_probes_the_next_candidate_and_falls_back():
    spec = _spec([0, 2], 0)
    spec.observe(1, 0, None)
    spec.observe(1, 0, None)
    assert spec.steps_for(1) == 0  # still warming up
    spec.observe(1, 0, None)
    assert spec.steps_for(1) == 2 and spec.slots[1].ema == 2.0  # probed, EMA reset to "all accepted"
    for _ in range(7):
        spec.observe(1, spec.steps_for(1), 0.0)  # the EMA decays 2 -> 0.42 (<= 0.5): back to no drafts
    assert spec.steps_for(1) == 0
    spec.observe(1, 0, None)  # and at 0 every evaluation probes again (SGLang: nothing to measure without drafts)
    assert spec.steps_for(1) == 2


def test_observations_of_another_tier_are_ignored():
    spec = _spec([1, 3], 3, warmup=0)
    spec.observe(1, 1, 0.0)  # a step that used 1 draft step while the slot is at 3 (it moved meanwhile)
    assert spec.slots[1].batches == 0 and spec.steps_for(1) == 3


def test_a_batch_leaving_the_no_draft_slot_drafts_again_only_after_resume_after_steps():
    spec = AdaptiveSpec({1: SlotConfig([3]), 32: SlotConfig([0])}, 3, resume_after=3)
    assert spec.steps_for(5) == 3  # nothing stepped plainly yet: draft at once
    spec.observe(5, 3, 2.0)
    assert spec.steps_for(40) == 0
    spec.observe(40, 0, None)
    for _ in range(3):  # the batch drained below 32: held back three steps, then drafting again
        assert spec.steps_for(20) == 0
        spec.observe(20, 0, None)
    assert spec.steps_for(20) == 3 and spec.slots[1].batches == 1  # held-back steps are not the slot's measurements
    spec.observe(20, 3, 2.0)
    spec.observe(40, 0, None)
    for bs in (20, 20, 40, 20, 20):  # hovering at the edge: every return to the no-draft slot starts the wait afresh
        assert spec.steps_for(bs) == 0
        spec.observe(bs, 0, None)
    assert spec.steps_for(20) == 0
    spec.observe(20, 0, None)
    assert spec.steps_for(20) == 3


def test_config_file_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.json"
    for text, message in (("{", "cannot read"), ("[]", "JSON object"), ('{"8": {"candidate_steps": [0]}}', "slot for "
                          "batch size 1"), ('{"1": {"candidate_steps": [9]}}', "exceed"),
                          ('{"1": {"candidate_steps": [1], "bogus": 1}}', "keys"),
                          ('{"1": {"candidate_steps": [3, 1]}}', "ascending"), ('{"x": {}}', "batch sizes")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_config(bad, 7)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"1": {"candidate_steps": [1, 3]}, "16": {"candidate_steps": [0, 1]}}))
    assert sorted(load_config(good, 3)) == [1, 16]


def test_cli_accepts_chains_only_and_sizes_target_graphs_per_tier(tmp_path):
    from tandem.launch import _spec_flags
    from tandem.services import _engine_config

    def parse(*flags):
        args = build_parser().parse_args(["serve", "--speculative-algorithm", "STANDALONE", *flags])
        alg, steps, topk, ndt = resolve_spec(args)
        args.speculative_algorithm, args.speculative_num_steps = alg, steps
        args.speculative_eagle_topk, args.speculative_num_draft_tokens = topk, ndt
        return args

    for flags in (["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"],
                  ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--enable-overlap-drafting"]):
        with pytest.raises(SystemExit, match="adaptive"):
            parse("--speculative-adaptive", "--speculative-num-steps", "3", *flags)
    args = parse("--speculative-adaptive", "--speculative-num-steps", "7", "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", "8")
    assert "--speculative-adaptive" in _spec_flags(args)
    config = _engine_config(args, target=True)
    assert config.cuda_graph_num_draft_tokens == 8 and set(config.cuda_graph_extra_widths) == {2, 4, 8}


def _hf_greedy(prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL), dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


async def test_adaptive_steps_stay_lossless_and_large_batches_do_not_draft():
    prompts = [json.loads(line)["prompt_ids"][-48:]
               for line in (DEFAULT_MODEL / "heldout_prompts.jsonl").read_text().splitlines()[:6]]
    want = _hf_greedy(prompts, 24)
    slots = {1: SlotConfig([1, 3], warmup_batches=2, update_interval=2), 4: SlotConfig([0])}
    adaptive = AdaptiveSpec(slots, 3)
    async with local_stack(DEFAULT_MODEL, algorithm="STANDALONE", draft_path=DEFAULT_DRAFT, num_steps=3, topk=1,
                           num_draft_tokens=4, max_total_tokens=16384, adaptive=adaptive) as scheduler:
        out, usage, _ = await generate_ids(scheduler, prompts[0], 24, request_id="solo")
        assert out == want[0]
        assert usage.proposed_draft_tokens > 0 and adaptive.slots[1].history  # drafted, and re-evaluated
        results = await asyncio.gather(*(generate_ids(scheduler, p, 24, request_id=f"b{i}")
                                         for i, p in enumerate(prompts)))
    assert [r[0] for r in results] == want
    assert adaptive.slots[4].batches >= 10  # the batch-6 steps ran in the no-draft tier
    proposed = sum(r[1].proposed_draft_tokens for r in results)
    assert proposed < usage.proposed_draft_tokens * len(prompts)  # far fewer drafts than six solo runs


def test_the_draft_captures_a_static_step_for_every_adaptive_tier():
    """On CUDA every tier's chain (steps/1/steps+1) drafts through its own static step, not step by step from the
    host (tandem/services._static_step); the served shape first."""
    from types import SimpleNamespace

    from tandem.cli import build_parser
    from tandem.services import _static_step

    enabled = []
    proposer = SimpleNamespace(runner=SimpleNamespace(device=SimpleNamespace(type="cuda")),
                               enable_static_step=lambda shape, max_bs: enabled.append(shape) or True)
    def args_list():
        return ["draft", "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "5", "--speculative-eagle-topk",
                "1", "--speculative-num-draft-tokens", "6", "--speculative-adaptive"]

    args = build_parser().parse_args(args_list())
    _static_step(proposer, args)
    shapes = [(s.num_steps, s.topk, s.num_draft_tokens) for s in enabled]
    assert shapes[0] == (5, 1, 6) and len(shapes) == len(set(shapes)) > 1
    assert all(topk == 1 and ndt == steps + 1 for steps, topk, ndt in shapes)
    enabled.clear()
    plain = [a for a in args_list() if a != "--speculative-adaptive"]
    _static_step(proposer, build_parser().parse_args(plain))
    assert [(s.num_steps, s.topk, s.num_draft_tokens) for s in enabled] == [(5, 1, 6)]
