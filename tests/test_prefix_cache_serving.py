"""The target's prefix cache through the real step path (in-process gRPC services + gateway scheduler): requests
that share a prompt prefix reuse its KV, report it as cached prompt tokens, and still decode exactly HF's greedy
tokens (plain, STANDALONE trees, EAGLE-3 requests that need every prompt feature); a follow-up turn reuses the
blocks the first turn's answer filled; nothing leaks; --disable-radix-cache turns it off."""
from __future__ import annotations

import asyncio

import pytest

from tests.stack import generate_ids, local_stack, perturbed_copy
from tests.test_lossless_greedy import _assert_no_kv_leak, hf_greedy
from tests.tiny_models import load_hf_model, make_tiny_model

BLOCK = 16  # EngineConfig's default KV block size


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    target = make_tiny_model("llama", root / "target")
    return target, perturbed_copy(target, root / "draft", noise=0.03), load_hf_model(target)


def _system(vocab: int, n: int = 40) -> list[int]:
    return [3 + (11 * i + 5) % (vocab - 3) for i in range(n)]  # a shared "system prompt"


@pytest.mark.parametrize("algorithm,steps,topk,ndt", [
    pytest.param("NONE", 0, 1, 1, id="plain"),
    pytest.param("STANDALONE", 3, 2, 6, id="standalone-tree"),
])
async def test_shared_prefixes_hit_the_cache_and_stay_lossless(pair, algorithm, steps, topk, ndt):
    target, draft, hf = pair
    system = _system(hf.config.vocab_size)
    asks = [system + [7, 8, 9], system + [21, 22], system + [7, 8, 9], system[:20] + [30]]
    async with local_stack(target, algorithm=algorithm, draft_path=draft, num_steps=steps, topk=topk,
                           num_draft_tokens=ndt) as scheduler:
        first, usage, _ = await generate_ids(scheduler, asks[0], 20, request_id="r0")
        assert usage.cached_prompt_tokens == 0
        results = await asyncio.gather(*(generate_ids(scheduler, p, 20, request_id=f"r{i + 1}")
                                         for i, p in enumerate(asks[1:])))
        bm = scheduler.test_target_runner.block_manager
        assert bm.num_cache_hits > 0
        if algorithm == "STANDALONE":  # the draft model reuses the shared prompt's KV too
            assert scheduler.test_proposer.runner.block_manager.num_cache_hits >= 4 * BLOCK
        await _assert_no_kv_leak(scheduler)  # cached blocks nobody uses count as free
    assert first == hf_greedy(hf, asks[0], 20)
    for prompt, (out, usage, _) in zip(asks[1:], results):
        assert out == hf_greedy(hf, prompt, 20)
    # Only full blocks are shared: the 40 common tokens fill two; the last ask shares its first 16 tokens.
    assert [u.cached_prompt_tokens for _, u, _ in results] == [2 * BLOCK, 2 * BLOCK, BLOCK]


async def test_a_follow_up_turn_reuses_the_blocks_of_the_first_answer(pair):
    target, _, hf = pair
    prompt = _system(hf.config.vocab_size, 20)
    async with local_stack(target) as scheduler:
        answer, _, _ = await generate_ids(scheduler, prompt, 30, request_id="t1")
        follow = prompt + answer + [5, 6, 7]
        out, usage, _ = await generate_ids(scheduler, follow, 12, request_id="t2")
        await _assert_no_kv_leak(scheduler)
    # KV held prompt + answer[:-1] (49 tokens) when the first turn ended: 3 full blocks, 2 of them past the prompt
    assert usage.cached_prompt_tokens == 3 * BLOCK
    assert out == hf_greedy(hf, follow, 12)


async def test_eagle3_requests_compute_their_whole_prompt(tmp_path):
    from tests.eagle.heads import make_eagle3_head

    target = make_tiny_model("llama", tmp_path / "t", num_hidden_layers=4)
    head = make_eagle3_head(target, str(tmp_path / "e3"))
    hf = load_hf_model(target)
    prompt = _system(hf.config.vocab_size)
    async with local_stack(target, algorithm="EAGLE3", draft_path=head, num_steps=3, topk=2,
                           num_draft_tokens=6) as scheduler:
        outs = [await generate_ids(scheduler, prompt, 16, request_id=f"e{i}") for i in range(2)]
    for out, usage, _ in outs:
        assert usage.cached_prompt_tokens == 0 and out == hf_greedy(hf, prompt, 16)


async def test_the_cache_can_be_turned_off(pair):
    target, _, hf = pair
    prompt = _system(hf.config.vocab_size)
    async with local_stack(target, prefix_cache=False) as scheduler:
        outs = [await generate_ids(scheduler, prompt, 8, request_id=f"o{i}") for i in range(2)]
        assert scheduler.test_target_runner.block_manager.num_cached_blocks() == 0
    assert all(u.cached_prompt_tokens == 0 and o == hf_greedy(hf, prompt, 8) for o, u, _ in outs)


def test_the_flag_reaches_the_target_engine_config():
    from tandem.cli import build_parser
    from tandem.launch import commands
    from tandem.services import _engine_config

    on = build_parser().parse_args(["target"])
    off = build_parser().parse_args(["target", "--disable-radix-cache"])
    assert _engine_config(on, target=True).enable_prefix_cache
    assert not _engine_config(off, target=True).enable_prefix_cache
    assert not _engine_config(on, draft=True).enable_prefix_cache  # the draft runner keeps its own KV uncached
    # A draft service runs only with an algorithm (unresolved flags used to count as one).
    serve = build_parser().parse_args(["serve", "--speculative-algorithm", "STANDALONE", "--disable-radix-cache"])
    assert "--disable-radix-cache" in commands(serve)["target-0"]
    assert "--disable-radix-cache" in commands(serve)["draft-0"]
    from tandem.services import build_proposer

    for flags, cached in (([], True), (["--disable-radix-cache"], False)):
        args = build_parser().parse_args(["draft", "--speculative-algorithm", "STANDALONE", *flags])
        args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 3, 1, 4
        proposer, _path = build_proposer(args)
        assert proposer.runner.block_manager.prefix_cache is cached


async def test_a_small_kv_pool_evicts_cached_blocks_and_stays_exact(pair):
    """Prompts that together exceed the KV pool: cached blocks are evicted to make room, a later repeat of an evicted
    prompt recomputes it, a recent one still hits, and every output is HF's."""
    target, _, hf = pair
    vocab = hf.config.vocab_size
    prompts = [[3 + (13 * i + 7 * j) % (vocab - 3) for j in range(100)] for i in range(8)]
    async with local_stack(target, max_total_tokens=320) as scheduler:  # 20 blocks: about 2 prompts' worth
        outs = [await generate_ids(scheduler, p, 8, request_id=f"k{i}") for i, p in enumerate(prompts)]
        again_old, usage_old, _ = await generate_ids(scheduler, prompts[0], 8, request_id="old")
        again_new, usage_new, _ = await generate_ids(scheduler, prompts[-1], 8, request_id="new")
        await _assert_no_kv_leak(scheduler)
    for p, (out, _, _) in zip(prompts, outs):
        assert out == hf_greedy(hf, p, 8)
    assert again_old == outs[0][0] and usage_old.cached_prompt_tokens == 0  # evicted long ago
    assert again_new == outs[-1][0] and usage_new.cached_prompt_tokens == 6 * BLOCK  # (100 - 1) // 16 blocks


def test_one_prefill_batch_of_prompts_with_a_shared_prefix_computes_it_once(pair):
    """n > 1 or a burst with one system prompt: the engine prefills the first such prompt, then the others on top of
    its cached blocks, with the first tokens of separate prefills."""
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from runtime.sampling import SamplingParams
    from core.types import StopRule
    from target_service.engine import PrefillInput, TargetEngine

    target, _, hf = pair
    system = _system(hf.config.vocab_size, 50)
    prompts = [system + [9], system + [9], system + [4, 5], [7] * 30, system[:10] + [8]]
    stop = StopRule(max_new_tokens=4, ignore_eos=True)

    def engine() -> TargetEngine:
        return TargetEngine(ModelRunner(str(target), EngineConfig(device="cpu", dtype="float32",
                                                                  max_total_tokens=2048, enable_prefix_cache=True)))

    batched = engine().prefill([PrefillInput(f"s{i}", p, True, SamplingParams(temperature=0), stop)
                                for i, p in enumerate(prompts)])
    alone = [engine().prefill([PrefillInput("x", p, True, SamplingParams(temperature=0), stop)])[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert [o.seq_id for o in batched] == [f"s{i}" for i in range(5)]
    assert [o.num_cached_tokens for o in batched] == [0, 3 * BLOCK, 3 * BLOCK, 0, 0]
