"""SYNTHETIC proposer — synthetic acceptance, benchmarks only.

Measures the speculative machinery (verify cost, draft cost, loop overhead) at a controlled accept length on dummy
weights, where no real draft can agree with the target. It knows the target's greedy continuation of each prompt from
an oracle (a JSON file written by a reference AR run, `bench/speculative.py`) and proposes it, keeping the token at
each absolute position with probability `accept_rate` (a seeded hash of prompt and position, so reruns agree) and
putting a wrong token there otherwise. It spends the real compute of an EAGLE-3-sized head (fc 3h->h, one Llama
decoder layer over its own paged KV, draft-vocab lm_head, the top-k beam builder) with random weights on the draft's
device, `num_steps` forwards per Propose; that output is discarded.

Trees: the shape depends only on (num_steps, topk, num_draft_tokens): best-first over child ranks (a spine of rank-0
children at every depth, then rank 1 siblings, ...), cut to num_draft_tokens - 1 nodes, parents first, sibling
order shuffled. The oracle token sits on the spine; every other node is wrong. A chain or tree of depth D thus has
expected accept length (bonus included) sum_{i=0..D} a^i. Lossless by construction: the target verifies everything.
A sequence whose prompt the oracle does not know, or whose committed tokens left the oracle's, gets wrong tokens
(accept length ~1).
"""
from __future__ import annotations

import heapq
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from core.steps import ProposeInput, SpecShape
from core.types import DraftTree
from draft_service.drafter import ModelDrafter
from draft_service.proposer import Proposer
from runtime.config import EngineConfig, ModelConfig
from runtime.speculative.tree import BeamTreeBuilder, host_rows

logger = logging.getLogger(__name__)
ORACLE_FORMAT = "tandem-synthetic-oracle/1"
_MASK = (1 << 64) - 1


def expected_tau(accept_rate: float, depth: int) -> float:
    """Expected tokens per verify step (bonus included) when each of `depth` spine positions is kept with prob a."""
    return sum(accept_rate ** i for i in range(depth + 1))


def rate_for_tau(tau: float, depth: int) -> float:
    """The accept rate whose expected_tau at this depth is `tau` (bisection; tau must be in [1, depth + 1])."""
    if not 1.0 <= tau <= depth + 1:
        raise ValueError(f"accept length {tau} is not reachable with depth {depth} (range [1, {depth + 1}])")
    if tau in (1.0, depth + 1):
        return 0.0 if tau == 1.0 else 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tau(mid, depth) < tau else (lo, mid)
    return (lo + hi) / 2


def _mix(*values: int) -> int:
    """splitmix64 over the values: a stable hash (Python's hash() is salted per process)."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & _MASK)) & _MASK
        x = (x + 0x9E3779B97F4A7C15) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
    return x


def _wrong(truth: int, offset: int, key: int, vocab: int) -> int:
    """A token that is never `truth`: a stable hash of (offset, sequence key) away from it."""
    return (truth + 1 + (offset + key) % (vocab - 1)) % vocab


class Oracle:
    """Prompt token ids -> the target's greedy continuation (a reference AR run's output)."""

    def __init__(self, entries: dict[tuple[int, ...], list[int]] | None = None) -> None:
        self.entries = {tuple(k): list(v) for k, v in (entries or {}).items()}
        self._lengths = sorted({len(k) for k in self.entries})

    def __len__(self) -> int:
        return len(self.entries)

    @classmethod
    def load(cls, path: str | Path) -> Oracle:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"synthetic oracle {path}: {exc}") from None
        if raw.get("format") != ORACLE_FORMAT or not isinstance(raw.get("entries"), list):
            raise ValueError(f"synthetic oracle {path}: expected {{'format': {ORACLE_FORMAT!r}, 'entries': [...]}}")
        entries = {}
        for i, e in enumerate(raw["entries"]):
            if not e.get("prompt_ids") or not isinstance(e.get("continuation"), list):
                raise ValueError(f"synthetic oracle {path}: entry {i} needs prompt_ids and continuation")
            entries[tuple(int(t) for t in e["prompt_ids"])] = [int(t) for t in e["continuation"]]
        return cls(entries)

    def save(self, path: str | Path) -> None:
        data = {"format": ORACLE_FORMAT, "note": "synthetic acceptance, benchmarks only",
                "entries": [{"prompt_ids": list(k), "continuation": v} for k, v in self.entries.items()]}
        Path(path).write_text(json.dumps(data))

    def match(self, token_ids: list[int]) -> tuple[int, list[int]] | None:
        """(prompt hash, prompt + continuation) of the entry these committed tokens follow, None if none."""
        for n in self._lengths:
            if n > len(token_ids):
                break
            key = tuple(token_ids[:n])
            cont = self.entries.get(key)
            if cont is not None and list(token_ids[n:]) == cont[: len(token_ids) - n]:
                return _mix(n, *key), [*key, *cont]
        return None


@dataclass(frozen=True)
class _Shape:
    parents: list[int]
    depths: list[int]  # 0-based: the node predicts position committed_len + depth
    spine: list[bool]  # on the all-rank-0 path (the oracle path)
    offsets: list[int]  # per node, a fixed pseudo-random offset its wrong token is derived from
    spine_nodes: list[int]  # indices of the spine nodes


def tree_shape(spec: SpecShape) -> _Shape:
    """Best-first over child ranks (score = sum of ranks on the path, shallower first on ties), num_draft_tokens - 1
    nodes, ordered by depth (parents first). Deterministic per spec."""
    budget = max(spec.num_draft_tokens - 1, 0)
    heap: list[tuple[int, int, int, int, bool]] = []  # (score, depth, seq, parent picked index, spine)
    counter = 0
    for r in range(spec.topk):
        heap.append((r, 0, counter, -1, r == 0))
        counter += 1
    heapq.heapify(heap)
    picked: list[tuple[int, int, bool]] = []  # (depth, parent picked index, spine)
    while heap and len(picked) < budget:
        score, depth, _, parent, spine = heapq.heappop(heap)
        picked.append((depth, parent, spine))
        if depth + 1 < spec.num_steps:
            for r in range(spec.topk):
                heapq.heappush(heap, (score + r, depth + 1, counter, len(picked) - 1, spine and r == 0))
                counter += 1
    # Sibling order shuffled (a stable hash), so the oracle child is not always first; depth order keeps parents first.
    order = sorted(range(len(picked)), key=lambda i: (picked[i][0], _mix(spec.topk, i)))
    new_index = {old: new for new, old in enumerate(order)}
    return _Shape([-1 if picked[i][1] < 0 else new_index[picked[i][1]] for i in order],
                  [picked[i][0] for i in order], [picked[i][2] for i in order],
                  [_mix(spec.topk, spec.num_steps, i) for i in range(len(order))],
                  [new for new, old in enumerate(order) if picked[old][2]])


class SyntheticHead(ModelDrafter):
    """An EAGLE-3-sized head with random weights (runtime/models/eagle3.py), run for its cost only: a drafter that
    SyntheticProposer feeds every Prefill / Propose / Release it gets and whose trees it discards."""

    algorithm = "SYNTHETIC"
    kv_lag = 1  # EAGLE's KV layout: the committed positions [0, C-1)
    chainable = True  # its features are constants: nothing to keep after a chained run

    def __init__(self, target_config: ModelConfig, engine_config: EngineConfig, hidden_size: int | None = None,
                 draft_vocab_size: int = 32000) -> None:
        from runtime.model_runner import ModelRunner
        from runtime.models.eagle import materialize
        from runtime.models.eagle3 import Eagle3Options, LlamaEagle3ForCausalLM
        from runtime.models.loader import init_dummy_weights

        super().__init__()
        h = hidden_size or target_config.hidden_size
        head_dim = 128 if h % 128 == 0 and h >= 512 else 32
        if h % head_dim:
            raise ValueError(f"synthetic head hidden size {h} must be a multiple of {head_dim}")
        heads = h // head_dim
        config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=target_config.vocab_size, hidden_size=h,
                             num_layers=1, num_heads=heads, num_kv_heads=max(1, heads // 4), head_dim=head_dim,
                             intermediate_size=int(h * 3.5), rms_norm_eps=1e-5, rope_theta=500000.0,
                             max_position_embeddings=target_config.max_position_embeddings)
        options = Eagle3Options(target_hidden_size=target_config.hidden_size,
                                draft_vocab_size=min(draft_vocab_size, target_config.vocab_size))
        model = materialize(lambda: LlamaEagle3ForCausalLM(config, options), config, engine_config)
        init_dummy_weights(model, engine_config.seed)
        self.model = model.eval()
        self.runner = ModelRunner(None, engine_config, config, model=self.model)
        self.feature_size = self.model.feature_size
        self.draft_vocab_size = options.draft_vocab_size
        self.max_context_len = config.max_position_embeddings

    def _new_static_step(self, spec: SpecShape, max_bs: int):
        """EAGLE-3's static draft step of this shape (the tree budget capped at what the beam can produce)."""
        from runtime.speculative.draft_step import StaticDraftStep, StepShape

        ndt = min(spec.num_draft_tokens, 1 + spec.topk + (spec.num_steps - 1) * spec.topk ** 2)
        return StaticDraftStep(self.runner, StepShape(spec.num_steps, spec.topk, max(ndt, 2), spec.num_steps + 1),
                               max_bs, feature_head=True)

    def _on_prefill(self, seq_id: str) -> None:
        self.runner.add_seq(seq_id)

    def _fits(self, inp: ProposeInput) -> bool:
        committed_len, spec = inp.committed_len, inp.spec
        if committed_len < 2 or spec.num_steps < 1 or committed_len - 1 + spec.num_steps > self.max_context_len:
            return False
        kv = self.runner.kv_len(inp.seq_id) if self.runner.has_seq(inp.seq_id) else 0
        need = committed_len - kv + spec.num_steps * spec.topk + 2 * self.runner.block_manager.block_size
        return need <= self.runner.num_free_tokens()

    def _catch_up_features(self, inp: ProposeInput, start: int, end: int) -> torch.Tensor:
        runner = self.runner
        return torch.full((end - start, self.feature_size), 0.01, device=runner.device, dtype=runner.dtype)

    def _catch_up(self, inputs: list[ProposeInput]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """EAGLE's catch-up over the committed tokens the head has not seen (KV holds [0, C-1)), constant features;
        per sequence (logits, recurrent hidden) at the root's position C-2."""
        from runtime.model_runner import SeqForward

        if not inputs:
            return {}
        runner = self.runner
        forwards = []
        for inp in inputs:
            seq_id, tokens = inp.seq_id, self._tokens[inp.seq_id]
            first = min(runner.kv_len(seq_id), len(tokens) - 2)
            runner.truncate(seq_id, first)
            n = len(tokens) - 1 - first
            feats = torch.full((n, self.feature_size), 0.01, device=runner.device, dtype=runner.dtype)
            forwards.append(SeqForward(seq_id, tokens[first + 1:], logits="last", capture_hidden=True,
                                       input_features=self.model.project_features(feats)))
        out = runner.forward(forwards)
        return {f.seq_id: (logits[-1], hidden[-1]) for f, logits, hidden in zip(forwards, out.logits, out.hidden)}

    def _expand(self, group: list[ProposeInput], spec: SpecShape,
                roots: list[tuple[torch.Tensor, torch.Tensor]]) -> list[DraftTree]:
        from runtime.model_runner import SeqForward

        logits = torch.stack([root_logits for root_logits, _ in roots])  # (b, draft_vocab)
        hidden = torch.stack([root_hidden for _, root_hidden in roots])  # (b, H)
        b, k = len(group), spec.topk
        ndt = min(spec.num_draft_tokens, 1 + k + (spec.num_steps - 1) * k * k)
        builder = BeamTreeBuilder(b, spec.num_steps, k, max(ndt, 2))
        nodes = builder.first(torch.log_softmax(logits.float(), dim=-1))
        parent_hidden = hidden.unsqueeze(1).expand(b, k, -1)
        for step in range(1, spec.num_steps):
            s = step - 1
            ranks = nodes.parents - (s - 1) * k if s > 0 else torch.zeros_like(nodes.parents)
            feats = parent_hidden.gather(1, ranks.to(parent_hidden.device).unsqueeze(-1).expand(
                -1, -1, parent_hidden.shape[-1]))
            # draft-vocab ids are valid target ids (the draft vocab is smaller); one readback per step
            tokens, parents = host_rows(nodes.tokens, nodes.parents)
            out = self.runner.forward([
                SeqForward(inp.seq_id, tokens[i], positions=[inp.committed_len - 1 + s] * k,
                           parents=parents[i], logits="all", capture_hidden=True, input_features=feats[i])
                for i, inp in enumerate(group)])
            parent_hidden = torch.stack(out.hidden)
            nodes = builder.next(torch.log_softmax(torch.stack(out.logits).float(), dim=-1))
        return builder.finalize()  # host readback: the draft's GPU work is done before the tree goes out


class SyntheticTrees:
    """SyntheticProposer._tree as static-shape device code, for speculative steps chained on the device
    (runtime/speculative/fused_step.py's tree source): per sequence, the oracle token and the keep decision of every
    position a run may draft at (from its start) and each node's wrong-token offset, loaded once per run; the tree
    at committed length L is then gathers: node i holds the oracle token of position L + depth_i where it sits on
    the spine and the keep stream keeps it, else _wrong of it. The same tokens _tree gives while the sequence
    follows its oracle (a sequence whose tokens left it mid-run gets the oracle's tokens until the run ends: wrong
    drafts either way, rejected by the target's verify)."""

    def __init__(self, shape: _Shape, vocab_size: int, max_bs: int, span: int, device) -> None:
        self.vocab_size, self.span = vocab_size, span
        self.depths = torch.tensor(shape.depths, dtype=torch.long, device=device)
        self.parents = torch.tensor(shape.parents, dtype=torch.long, device=device)
        self.spine = torch.tensor(shape.spine, dtype=torch.bool, device=device)
        m = len(shape.depths)
        # per sequence: [base (the committed length at the run's start), truth (span), keep (span), offsets (M)]
        self.rows = torch.zeros(max_bs, 1 + 2 * span + m, dtype=torch.long, device=device)

    def trees(self, b: int, committed_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        span, rows = self.span, self.rows[:b]
        pos = (committed_len - rows[:, 0]).unsqueeze(1) + self.depths  # (b, M) positions from the run's start
        pos = pos.clamp(0, span - 1)
        truth = rows[:, 1:1 + span].gather(1, pos)
        keep = rows[:, 1 + span:1 + 2 * span].gather(1, pos) > 0
        wrong = (truth + 1 + rows[:, 1 + 2 * span:]) % self.vocab_size
        tokens = torch.where(self.spine & keep & (truth >= 0), truth, wrong)
        return tokens, self.parents.expand(b, -1)

    def load(self, b: int, rows: np.ndarray) -> None:
        """rows: SyntheticProposer.chain_tree_rows' array, one row per sequence (<= b): [base, truth (run span),
        keep (run span), offsets (M)] over the run's span (<= this source's); what lies past it, and the bucket's
        other rows, are zeros."""
        span, m, num = self.span, len(self.depths), len(rows)
        run = (rows.shape[1] - 1 - m) // 2  # the run's span (<= the source's)
        host = torch.zeros(b, self.rows.shape[1], dtype=torch.long)
        src = torch.from_numpy(rows)
        host[:num, :1 + run] = src[:, :1 + run]
        host[:num, 1 + span:1 + span + run] = src[:, 1 + run:1 + 2 * run]
        host[:num, 1 + 2 * span:] = src[:, 1 + 2 * run:]
        self.rows[:b].copy_(host)


@dataclass
class _SeqOracle:
    key: int
    full: list[int] | None  # prompt + the target's greedy continuation; None = unknown, diverged or exhausted
    rng: random.Random
    keep: list[bool] = field(default_factory=list)  # keep[p]: the oracle token at position p is drafted right
    checked: int = 0  # committed tokens [0, checked) are known to equal the oracle's


class SyntheticProposer(Proposer):
    """Synthetic acceptance, benchmarks only: the oracle continuation kept at `accept_rate` per position."""

    algorithm = "SYNTHETIC"

    def __init__(self, accept_rate: float, vocab_size: int, oracle: Oracle | None = None, seed: int = 0,
                 head: SyntheticHead | None = None, oracle_path: str | Path | None = None) -> None:
        """oracle_path: a JSON oracle re-read whenever it changes (checked at each Prefill), so a benchmark can write
        it after the service started; a missing file means an empty oracle."""
        super().__init__()
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"synthetic accept rate must be in [0, 1], got {accept_rate}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.accept_rate = accept_rate
        self.vocab_size = vocab_size
        self.oracle = oracle or Oracle()
        self.oracle_path = Path(oracle_path) if oracle_path else None
        self._oracle_mtime: int | None = None
        self._refresh_oracle()
        self.seed = seed
        self.head = head
        self._seq: dict[str, _SeqOracle] = {}
        self._shapes: dict[SpecShape, _Shape] = {}
        self.stats = {"proposals": 0, "with_oracle": 0, "diverged_seqs": 0, "unknown_seqs": 0, "exhausted_seqs": 0}

    def memory(self) -> tuple[int, int]:
        if self.head is None:
            return 0, 0
        return self.head.runner.num_free_tokens(), self.head.runner.num_total_tokens()

    def _refresh_oracle(self) -> None:
        if self.oracle_path is None:
            return
        try:
            mtime = self.oracle_path.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != self._oracle_mtime:
            self.oracle = Oracle.load(self.oracle_path)
            self._oracle_mtime = mtime
            logger.info("synthetic oracle %s: %d prompts", self.oracle_path, len(self.oracle))

    def _on_prefill(self, seq_id: str) -> None:
        self._refresh_oracle()
        tokens = self._tokens[seq_id]
        if self.head is not None:
            self.head.prefill(seq_id, tokens)
        found = self.oracle.match(tokens)
        if found is None:
            self.stats["unknown_seqs"] += 1
            key, full = _mix(len(tokens), *tokens[:64]), None
        else:
            key, full = found
        # Keep decisions come from a stream seeded by (seed, prompt), drawn in position order: reruns agree.
        self._seq[seq_id] = _SeqOracle(key, full, random.Random(_mix(self.seed, key)))

    def _on_rollback(self, seq_id: str, kept_len: int) -> None:
        state = self._seq[seq_id]
        state.checked = min(state.checked, kept_len)

    def enable_static_step(self, spec: SpecShape, max_bs: int) -> bool:
        return self.head is not None and self.head.enable_static_step(spec, max_bs)

    @property
    def runner(self):  # the synthetic head's, when it spends real compute
        return self.head.runner if self.head is not None else None

    def _on_release(self, seq_id: str) -> None:
        self._seq.pop(seq_id, None)
        if self.head is not None:
            self.head.release([seq_id])

    def _guess_next(self, inputs: list[ProposeInput]) -> dict[str, int]:
        """Pre-drafts: the draft's own next token after the guessed path, i.e. what its spine would hold there (the
        oracle's token where the keep stream keeps it, a wrong one otherwise). The head's compute follows in _draft
        (its catch-up runs over the guessed path and this token)."""
        guesses = {}
        for inp in inputs:
            tokens, state = self._tokens[inp.seq_id], self._seq[inp.seq_id]
            length, full = len(tokens), self._follows_oracle(inp.seq_id, committed=False)
            truth = full[length] if full is not None and length < len(full) else -1
            kept = truth >= 0 and self._kept(state, length)
            guesses[inp.seq_id] = truth if kept else _wrong(truth, _mix(length), state.key, self.vocab_size)
        return guesses

    def _draft(self, inputs: list[ProposeInput]) -> list[DraftTree]:
        if self.head is not None:  # the head drafts from the same committed tokens; its trees are discarded
            self.head.propose(inputs)
        return [self._tree(inp) for inp in inputs]

    def _tree(self, inp: ProposeInput) -> DraftTree:
        """Plain Python over the cached shape: at batch 64 with 60-node trees this is ~1 ms, not tens."""
        spec = inp.spec
        if spec.num_steps < 1 or spec.num_draft_tokens < 2:
            return DraftTree([], [])
        shape = self._shape(spec)
        tokens = self._tokens[inp.seq_id]
        state = self._seq[inp.seq_id]
        length = len(tokens)
        full = self._follows_oracle(inp.seq_id, committed=not inp.append_guess)
        self.stats["proposals"] += 1
        n = 0
        if full is not None:
            self.stats["with_oracle"] += 1
            n = len(full)
        vocab, key = self.vocab_size, state.key
        truths = [full[length + d] if length + d < n else -1 for d in shape.depths]
        out = [_wrong(t, o, key, vocab) for t, o in zip(truths, shape.offsets)]
        for i in shape.spine_nodes:
            if truths[i] >= 0 and self._kept(state, length + shape.depths[i]):
                out[i] = truths[i]
        return DraftTree(out, list(shape.parents))

    # ---- chained speculative steps (target_service/chained.py): the head drafts for its cost, the oracle the trees
    @property
    def chainable(self) -> bool:
        return self.head is not None

    def chain_shapes(self) -> list[SpecShape]:
        return self.head.chain_shapes() if self.head is not None else []

    def chain_step(self, spec: SpecShape):
        return self.head.chain_step(spec) if self.head is not None else None

    def chain_tree_source(self, spec: SpecShape, max_bs: int, span: int) -> SyntheticTrees:
        return SyntheticTrees(self._shape(spec), self.vocab_size, max_bs, span, self.head.runner.device)

    def _shape(self, spec: SpecShape) -> _Shape:
        """The cached tree shape of a spec."""
        shape = self._shapes.get(spec)
        if shape is None:
            shape = self._shapes[spec] = tree_shape(spec)
        return shape

    def chain_tree_rows(self, seq_ids: list[str], spec: SpecShape, span: int) -> np.ndarray:
        """SyntheticTrees.load's rows: per sequence [base, truth (span), keep (span), offsets (M)] for a run starting
        at its committed length now, over the `span` positions the run may draft at (truth -1 past the oracle). One
        numpy array: at batch 64 a run's rows cost well under a millisecond of the target's host time."""
        shape = self._shape(spec)
        m = len(shape.offsets)
        rows = np.full((len(seq_ids), 1 + 2 * span + m), -1, dtype=np.int64)
        n = self.vocab_size - 1
        offsets = np.asarray([o % n for o in shape.offsets], dtype=np.int64)  # (the offsets are 64-bit hashes)
        for i, seq_id in enumerate(seq_ids):
            length, state = len(self._tokens[seq_id]), self._seq[seq_id]
            full = self._follows_oracle(seq_id)
            rows[i, 0] = length
            if full is not None and length < len(full):
                ahead = full[length:length + span]
                rows[i, 1:1 + len(ahead)] = ahead
            self._kept(state, length + span - 1)  # extends the keep stream over the span
            rows[i, 1 + span:1 + 2 * span] = state.keep[length:length + span]
            rows[i, 1 + 2 * span:] = (offsets + state.key % n) % n
        return rows

    def chain_ready(self, seq_id: str, committed_len: int, spec: SpecShape, num_steps: int, max_accept: int) -> bool:
        return (len(self._tokens.get(seq_id, ())) == committed_len
                and self.head.chain_ready(seq_id, committed_len, spec, num_steps, max_accept))

    def chain_reserve(self, seqs: list[tuple[str, int]], spec: SpecShape, num_steps: int, max_accept: int):
        return self.head.chain_reserve(seqs, spec, num_steps, max_accept)

    def chain_commit(self, seq_id: str, new_tokens: list[int], last_feature) -> None:
        self._tokens[seq_id].extend(new_tokens)
        self.head.chain_commit(seq_id, new_tokens, last_feature)

    def chain_abort(self, seq_ids: list[str]) -> None:
        self.head.chain_abort(seq_ids)

    def _follows_oracle(self, seq_id: str, committed: bool = True) -> list[int] | None:
        """The sequence's oracle (prompt + continuation) while its tokens still follow it; None from the first token
        that left it (numerics) or ran past its end. committed=False: the tokens end with a pre-draft's guessed path
        (still being verified), whose leaving the oracle only means this guess is wrong: the Propose after the
        Verify rolls it back, and the oracle stays."""
        tokens, state = self._tokens[seq_id], self._seq[seq_id]
        length, full = len(tokens), state.full
        if full is not None and state.checked < length:
            if length > len(full) or tokens[state.checked:] != full[state.checked:length]:
                if not committed:
                    return None
                # The target's tokens left the oracle's (numerics), or ran past it: wrong tokens from here.
                self.stats["diverged_seqs" if length <= len(full) else "exhausted_seqs"] += 1
                state.full = full = None
            else:
                state.checked = length
        return full

    def _kept(self, state: _SeqOracle, pos: int) -> bool:
        """Whether the draft has the oracle token at absolute position pos right (the seeded keep stream)."""
        keep = state.keep
        while len(keep) <= pos:
            keep.append(state.rng.random() < self.accept_rate)
        return keep[pos]


def build(build) -> tuple[SyntheticProposer, str]:
    """Registry factory (core/algorithms.py): the SYNTHETIC proposer with its random EAGLE-3-sized head, from the
    --synthetic-* flags. build: tandem.services.DraftBuild."""
    args = build.args
    target_config = ModelConfig.from_pretrained(build.target_path)
    if not args.synthetic_oracle:
        logger.warning("SYNTHETIC without --synthetic-oracle: every draft token is wrong (accept length 1)")
    head = None
    if args.synthetic_head_hidden != 0:
        head = SyntheticHead(target_config, build.engine_config("dummy", draft=False), args.synthetic_head_hidden,
                             args.synthetic_draft_vocab)
    try:  # the oracle file is re-read when it changes (a benchmark writes it after its reference AR run)
        proposer = SyntheticProposer(args.synthetic_accept_rate, target_config.vocab_size, None, args.random_seed,
                                     head, oracle_path=args.synthetic_oracle)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return proposer, str(args.synthetic_oracle or "synthetic")
