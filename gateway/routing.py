"""Cache-aware choice of a target pod for a new sequence (the role of SGLang router's cache_aware policy), so that
requests sharing a prompt prefix meet the KV their pod's prefix cache already holds.

The gateway remembers, per target pod, the block chains of the prompts it sent there (a bounded LRU of chain keys at
the pods' KV block size). A new sequence goes to the live pod holding the longest prefix of its prompt when that
covers at least `cache_threshold` of the prompt's full blocks and the pods' loads are balanced; otherwise to the least
loaded live pod, ties broken by rendezvous hashing of the sequence id (gateway.pods). Loads are running sequences per
pod; they count as unbalanced when max - min > balance_abs_threshold and max > min * balance_rel_threshold. Knows
nothing about the wire; the scheduler keeps a sequence on its pod while that pod is up (its KV lives there).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from gateway.pods import rendezvous_weight

C = TypeVar("C")
POLICIES = ("cache_aware", "consistent_hash")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "cache_aware"  # or "consistent_hash": rendezvous hashing of the sequence id only
    block_size: int = 16  # the target pods' KV block size (only full blocks are cached there)
    cache_threshold: float = 0.5  # fraction of the prompt's full blocks a pod must hold to be chosen for them
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_blocks_per_pod: int = 1 << 18  # remembered chain keys per pod (LRU)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {self.policy!r}")
        if self.block_size < 1 or self.max_blocks_per_pod < 1 or self.balance_abs_threshold < 0:
            raise ValueError("block_size and max_blocks_per_pod must be >= 1, balance_abs_threshold >= 0")
        if not 0.0 <= self.cache_threshold <= 1.0 or self.balance_rel_threshold < 1.0:
            raise ValueError("cache_threshold must be in [0, 1] and balance_rel_threshold >= 1")


class PrefixRouter(Generic[C]):
    def __init__(self, config: RoutingConfig = RoutingConfig()) -> None:
        self.config = config
        self._blocks: dict[str, OrderedDict[int, None]] = {}  # pod address -> chain keys it was sent, oldest first
        self.num_cache_routed = 0  # sequences placed by prefix match (metrics, tests)

    def choose(self, seq_id: str, prompt: Sequence[int], live: list[C], load: dict[str, int]) -> C | None:
        """The pod for a new (or moved) sequence with this prompt, among `live`; records the choice."""
        if not live:
            return None
        if self.config.policy == "consistent_hash":
            return max(live, key=lambda c: rendezvous_weight(seq_id, c.address))
        keys = self._chain(prompt)
        loads = [load.get(c.address, 0) for c in live]
        balanced = not (max(loads) - min(loads) > self.config.balance_abs_threshold
                        and max(loads) > min(loads) * self.config.balance_rel_threshold)
        best, best_len = None, 0
        if keys and balanced:
            for pod in live:
                n = self._match(pod.address, keys)
                if n > best_len:
                    best, best_len = pod, n
        if best is not None and best_len >= self.config.cache_threshold * len(keys):
            self.num_cache_routed += 1
            chosen = best
        else:
            least = min(loads)
            chosen = max((c for c, n in zip(live, loads) if n == least),
                         key=lambda c: rendezvous_weight(seq_id, c.address))
        self._remember(chosen.address, keys)
        return chosen

    def forget(self, address: str) -> None:
        """A pod left or restarted: its cache is gone."""
        self._blocks.pop(address, None)

    def _chain(self, prompt: Sequence[int]) -> list[int]:
        # The pods reuse full blocks of prompt[:-1] (the last token is always computed).
        bs, keys, parent = self.config.block_size, [], 0
        for i in range((len(prompt) - 1) // bs):
            parent = hash((parent, tuple(prompt[i * bs:(i + 1) * bs])))
            keys.append(parent)
        return keys

    def _match(self, address: str, keys: list[int]) -> int:
        blocks = self._blocks.get(address)
        if not blocks:
            return 0
        n = 0
        for key in keys:
            if key not in blocks:
                break
            n += 1
        return n

    def _remember(self, address: str, keys: list[int]) -> None:
        blocks = self._blocks.setdefault(address, OrderedDict())
        for key in keys:
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.config.max_blocks_per_pod:
            blocks.popitem(last=False)
