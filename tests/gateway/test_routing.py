"""Cache-aware target routing (gateway/routing.py): a prompt goes to the pod that holds its prefix unless loads are
unbalanced or the match is short; otherwise the least loaded pod; consistent_hash keeps rendezvous hashing. Through
two real in-process target services: requests sharing a system prompt meet one pod's prefix cache and stay exact."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from gateway.pods import PodPool
from gateway.routing import PrefixRouter, RoutingConfig


@dataclass(frozen=True)
class Pod:
    address: str


PODS = [Pod("a:1"), Pod("b:1"), Pod("c:1")]
SYSTEM = list(range(100, 164))  # 4 full blocks of 16


def test_a_shared_prefix_follows_the_pod_that_holds_it_and_new_prompts_spread():
    router = PrefixRouter(RoutingConfig())
    first = router.choose("s0", SYSTEM + [1, 2], PODS, {})
    load = {first.address: 1}
    assert router.choose("s1", SYSTEM + [7, 8, 9], PODS, load) == first  # 4 of 4 blocks cached there
    assert router.num_cache_routed == 1
    load[first.address] += 1
    assert router.choose("n", [5] * 40, PODS, load) != first  # an unrelated prompt goes to a least loaded pod


def test_unbalanced_loads_or_a_short_match_go_to_the_least_loaded_pod():
    config = RoutingConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    router = PrefixRouter(config)
    holder = router.choose("s0", SYSTEM + [1], PODS, {})
    busy = {holder.address: 10}
    chosen = router.choose("s1", SYSTEM + [2], PODS, busy)
    assert chosen != holder  # 10 vs 0 running: balance first
    mostly_new = SYSTEM[:16] + list(range(500, 564)) + [3]  # 1 of 5 blocks cached on holder: below 0.5
    router.choose("s2", mostly_new, PODS, {p.address: 1 for p in PODS})
    assert router.num_cache_routed == 0  # neither choice was made by the cache


def test_consistent_hash_policy_is_rendezvous_hashing():
    router = PrefixRouter(RoutingConfig(policy="consistent_hash"))
    pool = PodPool(PODS)
    for i in range(20):
        assert router.choose(f"seq-{i}", SYSTEM, PODS, {}) == pool.route(f"seq-{i}")


@pytest.mark.parametrize("kwargs", [dict(policy="random"), dict(cache_threshold=1.5), dict(balance_rel_threshold=0.5),
                                    dict(block_size=0)])
def test_bad_routing_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        RoutingConfig(**kwargs)


def test_no_live_pod_gives_none():
    assert PrefixRouter().choose("s", SYSTEM, [], {}) is None


async def test_two_target_pods_requests_with_a_shared_prompt_meet_one_prefix_cache(tmp_path):
    from gateway.clients import TargetClient
    from gateway.scheduler import Scheduler, SchedulerConfig, SpecConfig
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from target_service.engine import TargetEngine
    from target_service.server import serve_target
    from tests.stack import generate_ids
    from tests.test_lossless_greedy import hf_greedy
    from tests.tiny_models import load_hf_model, make_tiny_model

    path = make_tiny_model("llama", tmp_path / "m")
    hf = load_hf_model(path)
    config = EngineConfig(device="cpu", dtype="float32", max_total_tokens=4096, enable_prefix_cache=True)
    servers, clients, runners = [], [], []
    for _ in range(2):
        runner = ModelRunner(str(path), config)
        server, port = await serve_target(TargetEngine(runner), str(path), "127.0.0.1", 0)
        servers.append(server)
        runners.append(runner)
        clients.append(TargetClient(f"127.0.0.1:{port}"))
    info = await clients[0].info()
    scheduler = Scheduler(targets=clients, drafts=[], tokenizer=None, model_name="tiny",
                          max_context_len=info.max_context_len, vocab_size=info.vocab_size, eos_token_ids=[],
                          spec=SpecConfig("NONE", 0, 1, 1), config=SchedulerConfig(request_timeout_s=60))
    await scheduler.start()
    try:
        system = [3 + (7 * i) % 200 for i in range(48)]
        asks = [system + [10 + i, 20 + i] for i in range(4)]
        results = [await generate_ids(scheduler, p, 6, request_id=f"r{i}") for i, p in enumerate(asks)]
    finally:
        await scheduler.close()
        for c in clients:
            await c.close()
        for s in servers:
            await s.stop(grace=None)
    assert [usage.cached_prompt_tokens for _, usage, _ in results] == [0, 48, 48, 48]
    hits = sorted(r.block_manager.num_cache_hits for r in runners)
    assert hits == [0, 3 * 48]  # every follow-up met the first request's pod
    assert scheduler.router.num_cache_routed == 3
    for prompt, (out, _, _) in zip(asks, results):
        assert out == hf_greedy(hf, prompt, 6)
