"""TargetEngine: the target model's sequences, batched prefill and tree verification, stop checks, release.

Owns per-sequence committed tokens (a mirror of the gateway's list, used to check `committed_len`), sampling
generators and the KV held by the ModelRunner. Knows nothing about gRPC: the servicer converts wire messages into
the step items of core/steps.py. Invariant per sequence: KV holds `len(token_ids) - 1` tokens; the last committed
token is the pending root of the next verify. One exception, UNO's self-draft (`self_draft`): its draft pass computes
the root's KV for real (a clean target row) and the root's next token, the clean root; the next Verify starts from
there (a `PendingRoot`), and anything else first rolls the root's KV back.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from core.steps import PrefillInput, StepOutput, VerifyInput
from core.types import DraftTree, FinishReason
from core.types import SeqStatus as Status
from runtime.chunked import forward_chunked
from runtime.kv_cache import OutOfKVBlocks
from runtime.model_runner import ModelRunner, SeqForward
from runtime.speculative.acceptance import GreedyRows, TargetSeq, accept, new_generator, sample_rows, token_logprobs
from runtime.speculative.verify import EXACT, AcceptThresholds
from runtime.speculative.verify_step import VerifyItem

MAX_TOP_LOGPROBS = 20  # as OpenAI's API
MAX_DECODE_STEPS = 256  # --num-continuous-decode-steps upper bound (one call's deadline must cover them)


@dataclasses.dataclass
class PendingRoot:
    """UNO: the draft pass of `self_draft` wrote the KV of the last committed token (row 0 ran without the LoRA, a
    clean target forward) and drew the clean root from that row exactly as plain decoding would."""

    committed_len: int
    token_id: int  # the clean root: the target's own next token (argmax or sample of row 0)
    row: torch.Tensor  # (V,) row 0's raw logits (log-probabilities of the clean root)


@dataclasses.dataclass
class SelfDraft:
    """What `self_draft` returns for one sequence: the clean root and the logits of the LoRA rows."""

    root_token_id: int
    draft_logits: torch.Tensor  # (F - 1, V): row i predicts the token i + 1 places after the clean root
    seq: TargetSeq  # its sampling and generator (a sampled draft draws from the sequence's own stream)


class TargetEngine:
    """Batched prefill/verify over many sequences with one model forward per call."""

    def __init__(self, runner: ModelRunner, feature_layers: list[int] | None = None, final_norm_features=False,
                 accept_thresholds: AcceptThresholds = EXACT):
        """feature_layers: residual-stream layer inputs captured for feature drafts (EAGLE-3 aux states; index
        num_layers = the last layer's output). final_norm_features: EAGLE-2 features, the lm_head input.
        accept_thresholds: SGLang's --speculative-accept-threshold-single/-acc for sampled tree verification (exact
        at 1.0; lossy below)."""
        self.runner = runner
        self.accept_thresholds = accept_thresholds
        num_layers = runner.model_config.num_layers
        self._capture = [num_layers] if final_norm_features else feature_layers
        self._final_norm = final_norm_features
        self.feature_dim = len(self._capture) * runner.model_config.hidden_size if self._capture else 0
        self.device = runner.device
        self.max_context_len = runner.model_config.max_position_embeddings
        self._seqs: dict[str, TargetSeq] = {}
        self._prefix_cache = runner.block_manager.prefix_cache
        self.last_forward_ms = 0.0
        # Pipelined plain decode runs enqueue the next call's steps before their readback (ModelRunner
        # .greedy_decode_steps prefetch): set by a target pod that runs ahead with a device-bound decode step
        # (tandem.args.decode_prefetch, chosen by bench/gpu_session.sh stage prefetch_ab)
        self.decode_prefetch = False
        if self._capture:  # feature steps then replay CUDA graphs too (they return these layers' states)
            runner.set_graph_capture_layers(self._capture)
        self._static_verify = None  # runtime.speculative.verify_step.StaticVerifyStep, see enable_static_verify
        self.draft_lora: list | None = None  # UNO: runtime.lora.LoRALinear wrappers of the draft rows' adapter
        self._pending: dict[str, PendingRoot] = {}  # UNO: sequences whose root KV the draft pass wrote
        # UNO's noise tokens (never a sequence's own stream), drawn on the host: they enter the forward as token ids,
        # so a device draw would cost a readback per sequence per draft pass
        self._noise = torch.Generator()
        self._noise.manual_seed(runner.engine_config.seed)

    def enable_static_verify(self, width: int, max_bs: int) -> bool:
        """Verify greedy batches of trees of `width` tokens (root included) as one static device step
        (runtime/speculative/verify_step.py: forward, tree walk, KV compaction and feature gather in one CUDA graph
        per batch bucket on CUDA, eager elsewhere); everything else keeps the eager path. Needs the triton backend."""
        if width < 2 or max_bs < 1 or not hasattr(self.runner.attn_backend, "use_static_metadata"):
            return False
        from runtime.speculative.verify_step import StaticVerifyStep

        step = StaticVerifyStep(self.runner, width, max_bs, self._capture, self._final_norm)
        step.capture()
        self._static_verify = step
        return True

    # ---------------------------------------------------------------- lifecycle
    def prefill(self, inputs: list[PrefillInput]) -> list[StepOutput]:
        """Prompts into KV, one forward for the batch (chunked when long). With the prefix cache on, a prompt's
        leading full blocks already cached are reused (at least its last token is computed: its logits sample the
        first token); requests returning features compute every prompt token (a draft needs all of them). Prompts
        that share a first block with an earlier prompt of the same batch (n > 1, a burst with one system prompt)
        wait for a second forward, so that they reuse what the first one computed."""
        outputs: dict[int, StepOutput] = {}
        total_ms = 0.0
        for group in self._split_shared_prefixes(inputs):
            if group:
                self.last_forward_ms = 0.0
                outputs.update((id(inp), out) for inp, out in self._prefill(group))
                total_ms += self.last_forward_ms
        self.last_forward_ms = total_ms
        return [outputs[id(inp)] for inp in inputs]

    def _split_shared_prefixes(self, inputs: list[PrefillInput]) -> tuple[list[PrefillInput], list[PrefillInput]]:
        if not self._prefix_cache or len(inputs) < 2:
            return inputs, []
        bs = self.runner.block_manager.block_size
        seen: set[tuple[int, ...]] = set()
        first, second = [], []
        for inp in inputs:
            key = tuple(inp.token_ids[:bs]) if len(inp.token_ids) > bs + 1 and not inp.return_features else None
            (second if key is not None and key in seen else first).append(inp)
            if key is not None:
                seen.add(key)
        return first, second

    def _prefill(self, inputs: list[PrefillInput]) -> list[tuple[PrefillInput, StepOutput]]:
        outputs: list[StepOutput] = []
        forwards: list[tuple[PrefillInput, SeqForward]] = []
        pending = 0  # KV slots the queued forwards will take
        for inp in inputs:
            if inp.seq_id in self._seqs:  # re-sync: start over from the gateway's committed list
                self.release([inp.seq_id])
            out = StepOutput(inp.seq_id)
            outputs.append(out)
            error = self._check_prefill(inp)
            if error:
                out.status, out.error = Status.INVALID, error
                continue
            kv_tokens = inp.token_ids if inp.sample_next_token else inp.token_ids[:-1]
            lookup = kv_tokens[:-1] if self._prefix_cache and not inp.return_features else None
            cached = self.runner.add_seq(inp.seq_id, lookup)  # claims the cached blocks it reuses
            need = self._tokens_needed(len(kv_tokens) - cached)
            budget = self.runner.num_free_tokens() - pending
            if need > budget:
                self.runner.free_seq(inp.seq_id)
                out.status, out.error = Status.OUT_OF_MEMORY, f"needs {need} KV slots, {budget} free"
                continue
            pending += need
            out.num_cached_tokens = cached
            self._seqs[inp.seq_id] = TargetSeq(list(inp.token_ids), inp.sampling, inp.stop,
                                               new_generator(inp.sampling, self.device))
            if kv_tokens:
                logits = "last" if inp.sample_next_token else "none"
                forwards.append((inp, SeqForward(inp.seq_id, list(kv_tokens[cached:]), logits=logits)))
        logits, features = self._forward([f for _, f in forwards], outputs, any(i.return_features for i in inputs),
                                         self._fast_greedy(inp for inp, _ in forwards), chunked=True)
        by_id = {o.seq_id: o for o in outputs}
        for (inp, _), rows, feats in zip(forwards, logits, features):
            if inp.seq_id in self._seqs and self.runner.has_seq(inp.seq_id):
                self.runner.cache_prefix(inp.seq_id, self._seqs[inp.seq_id].token_ids)
            if inp.return_features:
                by_id[inp.seq_id].features = feats
            if not inp.sample_next_token or rows is None:
                continue
            seq = self._seqs[inp.seq_id]
            token = sample_rows(rows, seq)[-1]
            self._commit(by_id[inp.seq_id], seq, [token])
            if inp.logprobs >= 0:
                by_id[inp.seq_id].logprobs = token_logprobs(rows[-1:], [token], inp.logprobs)
        return list(zip(inputs, outputs))

    def verify(self, inputs: list[VerifyInput]) -> list[StepOutput]:
        """One verify forward for the batch; then, for plain decodes asking num_decode_steps > 1 (SGLang's
        --num-continuous-decode-steps), more decode forwards back to back, each fed the token the last one emitted,
        until each such sequence has its steps, stops, or a step fails (it keeps what the earlier steps emitted)."""
        for inp in inputs:
            if not 1 <= inp.num_decode_steps <= MAX_DECODE_STEPS:
                raise ValueError(f"num_decode_steps must be in 1..{MAX_DECODE_STEPS}, got {inp.num_decode_steps}")
        outputs = self._decode_pipelined(inputs)
        if outputs is not None:  # every step of a plain greedy batch pipelined, the first one included
            forward_ms = self.last_forward_ms
            more = list(zip(inputs, outputs))
        else:
            outputs = self._verify_once(inputs)
            forward_ms = self.last_forward_ms
            more = [(inp, out) for inp, out in zip(inputs, outputs)
                    if inp.num_decode_steps > 1 and not inp.tree.token_ids]
            forward_ms += self._pipelined_steps(more)
        while True:
            more = [(inp, out) for inp, out in more if out.status == Status.OK and out.finish_reason is None
                    and out.token_ids and out.num_steps < inp.num_decode_steps and inp.seq_id in self._seqs]
            if not more:
                break
            nexts = []
            for inp, _ in more:
                tokens = self._seqs[inp.seq_id].token_ids
                nexts.append(dataclasses.replace(inp, committed_len=len(tokens), root_token_id=tokens[-1]))
            failed = set()
            for (inp, out), step in zip(more, self._verify_once(nexts)):
                if step.status != Status.OK:  # e.g. out of KV: keep what the earlier steps emitted, stop here
                    failed.add(inp.seq_id)
                    continue
                out.token_ids += step.token_ids
                out.logprobs += step.logprobs
                out.finish_reason = step.finish_reason
                out.num_steps += 1
                if step.features is not None and out.features is not None:
                    out.features = torch.cat([out.features, step.features])
            more = [(inp, out) for inp, out in more if inp.seq_id not in failed]
            forward_ms += self.last_forward_ms
        self.last_forward_ms = forward_ms
        return outputs

    def _decode_pipelined(self, inputs: list[VerifyInput]) -> list[StepOutput] | None:
        """A batch of plain greedy decodes asking several steps, every one of them pipelinable: all its steps as one
        pipelined run (`_pipelined_steps`), the first step too, so a call makes one readback instead of two. The
        outputs (the sequential loop in `verify` runs what the run leaves), or None for anything else (then the
        first step is a plain verify). Sets last_forward_ms."""
        if not inputs or not all(not inp.tree.token_ids and inp.num_decode_steps > 1 and self._pipelinable(inp)
                                 and inp.seq_id not in self._pending for inp in inputs):
            return None
        seqs = [self._seqs.get(inp.seq_id) for inp in inputs]
        # the versioning rule first (a rollback is what the plain verify would apply too)
        if any(seq is None for seq in seqs) or not all(self._sync(inp, seq) for inp, seq in zip(inputs, seqs)):
            return None
        more = [(inp, StepOutput(inp.seq_id, num_steps=0)) for inp in inputs]
        self.last_forward_ms = self._pipelined_steps(more, min_steps=1)
        if not any(out.num_steps for _, out in more):  # nothing ran (no graph, short of KV): the plain verify
            return None
        return [out for _, out in more]

    @staticmethod
    def _pipelinable(inp: VerifyInput) -> bool:
        """A decode ModelRunner.greedy_decode_steps can run: greedy, without logprobs, features or penalties (they
        need the logits)."""
        return (inp.sampling.is_greedy and not inp.return_features and inp.logprobs < 0
                and not inp.sampling.has_penalties)

    def _pipelined_steps(self, more: list[tuple[VerifyInput, StepOutput]], min_steps: int = 2) -> float:
        """Continuous decode of greedy sequences on CUDA graphs with the token fed on the device
        (ModelRunner.greedy_decode_steps): as many steps as every such sequence still wants and may emit, host work
        overlapped with the GPU and one readback; the sequential loop in `verify` does whatever is left (also a run
        of fewer than min_steps, or one the free KV would not hold). An output with no step yet (num_steps 0) starts
        from its committed end. Returns the milliseconds spent."""
        if not more:
            return 0.0
        group = [(inp, out) for inp, out in more if out.status == Status.OK and out.finish_reason is None
                 and (out.token_ids or out.num_steps == 0) and self._pipelinable(inp) and inp.seq_id in self._seqs]
        if not group or not self.runner.can_decode_continuously([inp.seq_id for inp, _ in group]):
            return 0.0
        steps = min(min(inp.num_decode_steps - out.num_steps for inp, out in group),
                    min(self._room(self._seqs[inp.seq_id]) for inp, _ in group))
        if steps < min_steps or len(group) * self._tokens_needed(steps) > self.runner.num_free_tokens():
            return 0.0  # (short of KV: the sequential loop's verifies report it sequence by sequence)
        # the next call's steps, when every sequence will still have room for them after this run
        prefetch = steps if self.decode_prefetch and all(
            self._room(self._seqs[inp.seq_id]) >= 2 * steps for inp, _ in group) else 0
        start = time.perf_counter()
        tokens = self.runner.greedy_decode_steps([inp.seq_id for inp, _ in group],
                                                 [self._seqs[inp.seq_id].token_ids[-1] for inp, _ in group], steps,
                                                 prefetch=prefetch)
        for (inp, out), emitted in zip(group, tokens):
            if not emitted:
                continue
            step = StepOutput(inp.seq_id)
            self._commit(step, self._seqs[inp.seq_id], emitted)  # a cut (stop, length) finishes and frees the seq
            out.token_ids += step.token_ids
            out.finish_reason = step.finish_reason
            out.num_steps += len(step.token_ids)
        return (time.perf_counter() - start) * 1e3

    def _room(self, seq: TargetSeq) -> int:
        """Tokens this sequence may still emit before its length limit or the context end."""
        generated = len(seq.token_ids) - seq.stop.prompt_len
        return min(seq.stop.max_new_tokens - generated, self.max_context_len - len(seq.token_ids))

    def _verify_once(self, inputs: list[VerifyInput]) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        forwards: list[tuple[VerifyInput, SeqForward]] = []
        pendings: dict[str, PendingRoot] = {}
        budget = self.runner.num_free_tokens()
        for inp in inputs:
            out = StepOutput(inp.seq_id, num_draft_tokens=len(inp.tree.token_ids))
            outputs.append(out)
            seq = self._seqs.get(inp.seq_id)
            pending = self._take_pending(inp)
            if seq is None or not self._sync(inp, seq):
                out.status, out.error = Status.STALE, "unknown sequence or committed_len mismatch"
                continue
            try:
                inp.tree.validate()
            except ValueError as exc:
                out.status, out.error = Status.INVALID, f"bad draft tree: {exc}"
                continue
            if pending is not None:  # UNO: the root's KV exists; the tree's node 0 is the clean root
                need = self._tokens_needed(len(inp.tree))
                if need > budget:
                    out.status, out.error = Status.OUT_OF_MEMORY, f"tree of {len(inp.tree)} needs {need} KV slots"
                    self._drop_pending(inp.seq_id, pending)
                    continue
                budget -= need
                forwards.append((inp, SeqForward(inp.seq_id, list(inp.tree.token_ids),
                                                 positions=[len(seq.token_ids) + d for d in inp.tree.depths()],
                                                 parents=list(inp.tree.parents), logits="all")))
                pendings[inp.seq_id] = pending
                continue
            n = len(inp.tree.token_ids) + 1
            need = self._tokens_needed(n)
            if need > budget:
                out.status, out.error = Status.OUT_OF_MEMORY, f"tree of {n} needs {need} KV slots, {budget} free"
                continue
            budget -= need
            kv_len = len(seq.token_ids) - 1
            # Region node 0 is the root (the pending bonus token); draft node i is region node i + 1.
            parents = [-1] + [p + 1 for p in inp.tree.parents]
            depths = [0] + [d + 1 for d in inp.tree.depths()]
            forwards.append((inp, SeqForward(inp.seq_id, [inp.root_token_id, *inp.tree.token_ids],
                                             positions=[kv_len + d for d in depths], parents=parents, logits="all")))
        if not pendings and self._verify_static(forwards, outputs):
            return outputs
        logits, features = self._forward([f for _, f in forwards], outputs, any(i.return_features for i in inputs),
                                         self._fast_greedy(inp for inp, _ in forwards))
        by_id = {o.seq_id: o for o in outputs}
        for (inp, _), rows, feats in zip(forwards, logits, features):
            if rows is None:
                continue
            seq, out = self._seqs[inp.seq_id], by_id[inp.seq_id]
            if inp.seq_id in pendings:
                self._accept_from_clean_root(inp, rows, seq, out, pendings[inp.seq_id])
                continue
            outcome = accept(inp.tree, rows, seq, self.accept_thresholds)
            kept_nodes = [0] + [i + 1 for i in outcome.accepted_nodes]  # region nodes: root + accepted path
            self.runner.compact(inp.seq_id, kept_nodes)
            out.num_accepted_drafts = outcome.num_accepted_drafts
            self._commit(out, seq, outcome.tokens)
            if inp.logprobs >= 0:  # row kept_nodes[j] predicted emitted token j
                out.logprobs = token_logprobs(rows[kept_nodes[: len(out.token_ids)]], out.token_ids, inp.logprobs)
            if inp.return_features and feats is not None:
                # The root and the accepted drafts now have KV; a stop may have cut the run short.
                out.features = feats[kept_nodes[: len(out.token_ids)]]
        return outputs

    def _accept_from_clean_root(self, inp: VerifyInput, rows, seq: TargetSeq, out: StepOutput,
                                pending: PendingRoot) -> None:
        """UNO (SGLang's verify at prefix C+1): the clean root is the target's own next token, drawn from a clean row
        exactly as plain decoding draws it, so it is emitted as is; the rest of the tree hangs below it and is
        verified from the forward's rows (row j = node j's output) by the ordinary rules — greedy walk, exact p/q
        rejection for a sampled chain that carries its q, exact tree sampling otherwise."""
        subtree = DraftTree(list(inp.tree.token_ids[1:]), [p - 1 for p in inp.tree.parents[1:]],
                            None if inp.tree.draft_probs is None else inp.tree.draft_probs[1:])
        # Penalties of the rows below the root count the clean root as generated, as plain decoding would.
        with_root = dataclasses.replace(seq, token_ids=[*seq.token_ids, pending.token_id])
        outcome = accept(subtree, rows, with_root, self.accept_thresholds)
        self.runner.compact(inp.seq_id, [0] + [i + 1 for i in outcome.accepted_nodes])
        out.num_accepted_drafts = 1 + outcome.num_accepted_drafts
        self._commit(out, seq, [pending.token_id, *outcome.tokens])
        if inp.logprobs >= 0:
            kept = [0] + [i + 1 for i in outcome.accepted_nodes]
            lp_rows = torch.cat([pending.row.unsqueeze(0), rows[kept[: len(out.token_ids) - 1]]])
            out.logprobs = token_logprobs(lp_rows, out.token_ids, inp.logprobs)

    # ---------------------------------------------------------------- UNO self-drafting
    def self_draft(self, requests: list[tuple[str, int, int]]) -> list[SelfDraft | None]:
        """UNO's draft pass (sglang_spec.md §7.4), one forward for the batch: per (seq_id, committed_len, width F),
        the last committed token (the seed) then F - 1 uniform-random noise tokens at the next positions; the LoRA
        applies to the noise rows only. Row 0 is a clean target forward: its KV is kept (the seed's, as a Verify
        would write it) and its token is the clean root. The noise rows' KV is dropped. None for a sequence this
        engine cannot draft for now (unknown, another committed length, out of KV): its Verify runs as usual."""
        results: list[SelfDraft | None] = [None] * len(requests)
        forwards, segment_ids, owners = [], [], []
        budget = self.runner.num_free_tokens()
        vocab = self.runner.model_config.vocab_size
        for i, (seq_id, committed_len, width) in enumerate(requests):
            seq = self._seqs.get(seq_id)
            if seq is None or committed_len != len(seq.token_ids) or width < 1:
                continue
            self._drop_pending(seq_id, self._pending.get(seq_id))
            need = self._tokens_needed(width)
            if need > budget or len(seq.token_ids) + width > self.max_context_len:
                continue
            budget -= need
            noise = torch.randint(0, vocab, (width - 1,), generator=self._noise).tolist()
            forwards.append(SeqForward(seq_id, [seq.token_ids[-1], *noise], logits="all"))
            segment_ids += [-1] + [0] * (width - 1)
            owners.append(i)
        if not forwards:
            return results
        from runtime.lora import segments

        start = time.perf_counter()
        graphs, self.runner.use_cuda_graph = self.runner.use_cuda_graph, False  # captured graphs know no LoRA
        try:
            with segments(self.draft_lora or [], segment_ids):  # rows 1.. of each sequence: the LoRA's
                result = self.runner.forward(forwards)
        except OutOfKVBlocks:
            return results
        finally:
            self.runner.use_cuda_graph = graphs
        self.last_forward_ms = (time.perf_counter() - start) * 1e3
        seqs = [self._seqs[requests[i][0]] for i in owners]
        # The clean roots: exactly plain decoding's draw (penalties, sampling, seed); the greedy ones without
        # penalties are row 0's argmax, read back together (one copy for the batch, not one per sequence).
        plain = [j for j, seq in enumerate(seqs) if seq.sampling.is_greedy and not seq.sampling.has_penalties]
        roots = dict(zip(plain, torch.stack([result.logits[j][0] for j in plain]).argmax(dim=-1).tolist()
                         if plain else []))
        for j, (i, rows, seq) in enumerate(zip(owners, result.logits, seqs)):
            seq_id, committed_len, _ = requests[i]
            self.runner.truncate(seq_id, committed_len)  # keep the seed's KV, drop the noise rows'
            root = roots[j] if j in roots else sample_rows(rows[:1], seq)[0]
            self._pending[seq_id] = PendingRoot(committed_len, root, rows[0])
            results[i] = SelfDraft(root, rows[1:], seq)
        return results

    def _take_pending(self, inp: VerifyInput) -> PendingRoot | None:
        """The sequence's pending clean root when this Verify builds on it (same committed length, a tree whose one
        top node is that root); otherwise the root's KV is rolled back and the Verify runs as usual."""
        pending = self._pending.pop(inp.seq_id, None)
        if pending is None:
            return None
        tree = inp.tree
        if (pending.committed_len == inp.committed_len and tree.token_ids and tree.token_ids[0] == pending.token_id
                and tree.parents.count(-1) == 1):
            return pending
        self._drop_pending(inp.seq_id, pending)
        return None

    def _drop_pending(self, seq_id: str, pending: PendingRoot | None) -> None:
        """Roll back the root KV a draft pass wrote (the invariant: KV holds all committed tokens but the last)."""
        self._pending.pop(seq_id, None)
        if pending is not None and self.runner.has_seq(seq_id) and self.runner.kv_len(seq_id) >= pending.committed_len:
            self.runner.truncate(seq_id, pending.committed_len - 1)

    def _verify_static(self, forwards: list[tuple[VerifyInput, SeqForward]], outputs: list[StepOutput]) -> bool:
        """The batch through the static verify step when it can take all of it (greedy, no logprobs or penalties,
        every tree `width` tokens, within its buckets); False = run the eager path. The step walks the argmax only:
        sampled requests — and with them accept thresholds < 1 and p/q rejection sampling, which act on sampled
        requests alone — always run eagerly."""
        step = self._static_verify
        if step is None or not forwards or len(forwards) > step.max_bs:
            return False
        if not self._fast_greedy(inp for inp, _ in forwards):
            return False
        if any(inp.tree.draft_probs is not None for inp, _ in forwards):  # drafted by sampling: never the argmax walk
            return False
        bm = self.runner.block_manager
        spans = {}
        for inp, sf in forwards:
            start = self.runner.kv_len(inp.seq_id)
            spans[inp.seq_id] = start
            if not step.fits(len(sf.token_ids), bm.blocks_for(start + step.width)):
                return False
        start_t = time.perf_counter()
        try:
            self.runner.reserve({seq_id: start + step.width for seq_id, start in spans.items()})
        except OutOfKVBlocks:
            return False  # the eager path reports it per sequence
        items = []
        for inp, sf in forwards:
            start = spans[inp.seq_id]
            items.append(VerifyItem(sf.token_ids, sf.parents, sf.positions, bm.slots(inp.seq_id, start, start + step.width),
                                    start, bm.block_table(inp.seq_id)))
        results = step.verify(items)
        self.last_forward_ms = (time.perf_counter() - start_t) * 1e3
        by_id = {o.seq_id: o for o in outputs}
        for (inp, _), res in zip(forwards, results):
            seq, out = self._seqs[inp.seq_id], by_id[inp.seq_id]
            self.runner.written(inp.seq_id, spans[inp.seq_id] + len(res.tokens))  # root + accepted drafts
            out.num_accepted_drafts = len(res.accepted_nodes)
            self._commit(out, seq, res.tokens)
            if inp.return_features and res.features is not None:
                out.features = res.features[: len(out.token_ids)]
        return True

    # ---------------------------------------------------------------- chained speculative steps
    def chain_ready(self, inp: VerifyInput, num_steps: int, max_accept: int) -> bool:
        """Whether this sequence can take num_steps greedy steps chained on the device (runtime/speculative/
        fused_step.py), each verifying a tree of the static verify step's width and emitting at most max_accept
        tokens: known, at the committed length named, greedy without logprobs or penalties, room for the run below
        its context end and within the step's block tables."""
        step = self._static_verify
        seq = self._seqs.get(inp.seq_id)
        if (step is None or seq is None or not self._fast_greedy([inp]) or inp.seq_id in self._pending
                or inp.committed_len != len(seq.token_ids) or seq.token_ids[-1] != inp.root_token_id
                or len(inp.tree.token_ids) != step.width - 1):
            return False
        start = len(seq.token_ids) - 1
        if self.runner.kv_len(inp.seq_id) != start or self.runner.region_start(inp.seq_id) is not None:
            return False
        total = self._chain_total(start, num_steps, max_accept)
        return total + 1 <= self.max_context_len and self.runner.block_manager.blocks_for(total) <= step.max_blocks

    def chain_useful_steps(self, inp: VerifyInput, max_accept: int) -> int:
        """The steps a chained run of this (chain_ready) sequence is sure to use: its length limit (max_new_tokens,
        the context end) lies at least that many whole accepted paths ahead. Steps past its end would still run on
        the device, for output the commit drops."""
        return max(1, -(-self._room(self._seqs[inp.seq_id]) // max_accept))

    def _chain_total(self, start: int, num_steps: int, max_accept: int) -> int:
        return start + (num_steps - 1) * max_accept + self._static_verify.width

    def chain_reserve(self, inputs: list[VerifyInput], num_steps: int,
                      max_accept: int) -> list[tuple[int, list[int]]] | None:
        """The worst case's KV of a chained run of these (chain_ready) sequences, all or nothing. Returns each
        sequence's (verify region start, block table), or None: nothing changed."""
        totals = {inp.seq_id: self._chain_total(self.runner.kv_len(inp.seq_id), num_steps, max_accept)
                  for inp in inputs}
        try:
            self.runner.reserve(totals)
        except OutOfKVBlocks:
            return None
        bm = self.runner.block_manager
        return [(self.runner.kv_len(inp.seq_id), bm.block_table(inp.seq_id)) for inp in inputs]

    def chain_commit(self, inp: VerifyInput, steps: list[list[int]]) -> StepOutput:
        """The outcome of a chained run for one sequence (chain_reserve'd): its KV now holds the root and every
        accepted draft of all steps; the tokens are committed step by step as a Verify commits them (a stop or the
        length limit cuts the run and finishes the sequence; what the device computed past it is dropped)."""
        seq = self._seqs[inp.seq_id]
        self.runner.written(inp.seq_id, len(seq.token_ids) - 1 + sum(len(tokens) for tokens in steps))
        out = StepOutput(inp.seq_id, num_steps=0)
        for tokens in steps:
            step = StepOutput(inp.seq_id, num_accepted_drafts=len(tokens) - 1)
            self._commit(step, seq, tokens)
            out.token_ids += step.token_ids
            out.num_accepted_drafts += step.num_accepted_drafts
            out.num_draft_tokens += len(inp.tree.token_ids)
            out.num_steps += 1
            if step.finish_reason is not None:
                out.finish_reason = step.finish_reason
                break
        return out

    def chain_abort(self, inputs: list[VerifyInput]) -> None:
        """A chained run that did not happen (or failed): the reserved KV goes back; what it wrote past each
        sequence's KV end is never read."""
        for inp in inputs:
            if self.runner.has_seq(inp.seq_id):
                self.runner.written(inp.seq_id, self.runner.kv_len(inp.seq_id))

    def release(self, seq_ids: list[str]) -> int:
        released = 0
        for seq_id in seq_ids:
            self._pending.pop(seq_id, None)
            if self._seqs.pop(seq_id, None) is not None:
                released += 1
            if self.runner.has_seq(seq_id):
                self.runner.free_seq(seq_id)
        return released

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    # ---------------------------------------------------------------- helpers
    def _check_prefill(self, inp: PrefillInput) -> str:
        if not inp.token_ids:
            return "empty prompt"
        vocab = self.runner.model_config.vocab_size
        if max(inp.token_ids) >= vocab:
            return f"token id {max(inp.token_ids)} outside the vocabulary ({vocab})"
        if len(inp.token_ids) >= self.max_context_len:
            return f"{len(inp.token_ids)} tokens exceed the context length {self.max_context_len}"
        if any(token >= vocab for token, _ in inp.sampling.logit_bias):
            return f"logit_bias names a token id outside the vocabulary ({vocab})"
        return ""

    def _tokens_needed(self, n: int) -> int:
        # A new block may be opened for every sequence; count whole blocks so the pre-check never under-estimates.
        bs = self.runner.block_manager.block_size
        return (n + bs - 1) // bs * bs + bs

    def _sync(self, inp: VerifyInput, seq: TargetSeq) -> bool:
        """Apply the versioning rule: roll back to a shorter committed_len, refuse a longer one."""
        if inp.committed_len > len(seq.token_ids) or inp.committed_len < 1:
            return False
        if inp.committed_len < len(seq.token_ids):
            del seq.token_ids[inp.committed_len:]
            self.runner.truncate(inp.seq_id, inp.committed_len - 1)
        return seq.token_ids[-1] == inp.root_token_id

    @staticmethod
    def _all_greedy(inputs) -> bool:
        return all(inp.sampling.is_greedy for inp in inputs)

    @staticmethod
    def _fast_greedy(inputs) -> bool:
        """Argmax-only readback: every sequence greedy and none asking for logprobs or penalties (those need the
        logits)."""
        return all(inp.sampling.is_greedy and inp.logprobs < 0 and not inp.sampling.has_penalties for inp in inputs)

    def _forward(self, forwards: list[SeqForward], outputs: list[StepOutput], features: bool = False,
                 greedy: bool = False, chunked: bool = False):
        """(rows per forward, features per forward or None). rows: logits (rows, vocab), or when greedy (every
        sequence of the batch greedy) the host list of each row's argmax: no logits leave the device. chunked
        (prefill): forwards of at most --chunked-prefill-size tokens (runtime/chunked.py), results as of one."""
        if not forwards:
            return [], []
        capture = self._capture if features and self._capture else None
        limit = self.runner.engine_config.chunked_prefill_size if chunked else None
        start = time.perf_counter()
        try:
            result = forward_chunked(self.runner, forwards, limit, capture_layers=capture,
                                     outputs="argmax" if greedy else "logits")
        except OutOfKVBlocks as exc:  # the pre-check should make this unreachable; fail the batch cleanly
            by_id = {o.seq_id: o for o in outputs}
            for f in forwards:
                by_id[f.seq_id].status, by_id[f.seq_id].error = Status.OUT_OF_MEMORY, str(exc)
                self.release([f.seq_id])
            return [None] * len(forwards), [None] * len(forwards)
        self.last_forward_ms = (time.perf_counter() - start) * 1e3
        feats = list(result.features) if capture else [None] * len(forwards)
        if capture and self._final_norm:
            feats = [self.runner.model.norm(f) if f is not None else None for f in feats]
        if not greedy:
            return list(result.logits), feats
        rows = [GreedyRows(r) for r in result.argmax]
        for row, walk in zip(rows, result.greedy_tree or ()):
            row.walk = walk
        return rows, feats

    def _commit(self, out: StepOutput, seq: TargetSeq, tokens: list[int]) -> None:
        """Append emitted tokens, cutting the run at the first stop token / length limit."""
        stop = seq.stop
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            generated = len(seq.token_ids) + len(kept) - stop.prompt_len
            if token in stop.stop_token_ids and not stop.ignore_eos:
                out.finish_reason = FinishReason.STOP
                break
            if generated >= stop.max_new_tokens or len(seq.token_ids) + len(kept) >= self.max_context_len:
                out.finish_reason = FinishReason.LENGTH
                break
        if len(kept) < len(tokens):  # accepted drafts past the stop are not committed
            out.num_accepted_drafts = min(out.num_accepted_drafts, len(kept))
        seq.token_ids.extend(kept)
        out.token_ids = kept
        if self._prefix_cache:  # blocks the new tokens filled become reusable (multi-turn chat, n > 1, retries)
            self.runner.cache_prefix(out.seq_id, seq.token_ids)
        if out.finish_reason is not None:
            # The gateway releases finished sequences; drop the KV now so a lost Release cannot leak it.
            self.release([out.seq_id])
