"""Overlap scheduling across the draft and target pods: two micro-batches that ping-pong.

Tandem's draft and target are separate processes (often separate GPUs). A sequential step keeps one of them idle at a
time: Propose(batch) on the draft, then Verify(batch) on the target. With two halves A and B of the running batch, the
scheduler instead runs Verify(A) and Propose(B) at once, then Verify(B) and Propose(A): each half still alternates
Propose -> Verify (the tree a half verifies was drafted from its committed tokens, so the output is unchanged), but
both pods work at once. Each such phase advances half the batch by one step.

Whether that pays depends on the shapes: a phase costs max(Verify(n/2), Propose(n/2)). While a verify of n/2
sequences costs nearly what a verify of n does (small batches, weight-bandwidth bound), two phases cost more than one
sequential step; at large batches (compute-bound verifies) or with a draft as slow as the verify, the halves win.
So `OverlapSchedule` measures: per batch-size bucket it runs each mode for a few iterations, keeps the throughput
(committed tokens per second of step time) of both, uses the better one, and re-probes the other now and then, as the
measured rate drifts with context length and acceptance. `--disable-overlap-schedule` (SGLang's flag) keeps the
sequential loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SEQUENTIAL = "sequential"
PINGPONG = "pingpong"


@dataclass
class _Bucket:
    rate: dict[str, float] = field(default_factory=dict)  # EMA of committed tokens per second of step time
    samples: dict[str, int] = field(default_factory=lambda: {SEQUENTIAL: 0, PINGPONG: 0})
    mode: str = SEQUENTIAL  # the mode its iterations run now
    run_left: int = 0  # iterations left in the current probe of the non-preferred mode
    since_probe: int = 0  # iterations since the last probe
    skip: int = 0  # iterations whose measurement is transitional (the first after a switch)


class OverlapSchedule:
    """Per batch-size bucket (powers of two), sequential steps or ping-pong halves, by measured throughput.

    warm: measured iterations of each mode before the first choice; probe_every / probe_len: how often and how long
    the mode not chosen is run again; alpha: EMA weight of a new measurement; margin: ping-pong is chosen only when
    its rate beats the sequential one by this factor (the sequential loop is the safe side: a wrong split costs up to
    a third of the throughput, H200 demo family at batch 8 in `bench/results/overlap_h200/`); min_batch: smaller
    batches never split; force: always this mode (batches of >= min_batch), measuring nothing (tests, A/B benchmarks).

    Callers pass only steady iterations to `observe` (no sequence in its first steps: a new sequence's first Propose
    also catches the draft up over the whole prompt, which made sequential steps look slow while a batch ramped up).
    """

    def __init__(self, *, min_batch: int = 2, warm: int = 6, probe_every: int = 100, probe_len: int = 4,
                 alpha: float = 0.2, margin: float = 1.1, force: str | None = None) -> None:
        if (min_batch < 2 or warm < 1 or probe_every < 1 or probe_len < 1 or not 0 < alpha <= 1
                or margin < 1):
            raise ValueError("min_batch >= 2, warm >= 1, probe_every >= 1, probe_len >= 1, 0 < alpha <= 1, "
                             "margin >= 1")
        self.margin = margin
        if force not in (None, SEQUENTIAL, PINGPONG):
            raise ValueError(f"force must be None, {SEQUENTIAL!r} or {PINGPONG!r}")
        self.force = force
        self.min_batch, self.warm, self.probe_every, self.probe_len, self.alpha = (min_batch, warm, probe_every,
                                                                                   probe_len, alpha)
        self._buckets: dict[int, _Bucket] = {}
        self.iterations = {SEQUENTIAL: 0, PINGPONG: 0}  # iterations run in each mode (metrics, tests)

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def mode_for(self, batch_size: int) -> str:
        """The mode of the next iteration for a running batch of this size."""
        if batch_size < self.min_batch:
            return SEQUENTIAL
        b = self._buckets.setdefault(self.bucket(batch_size), _Bucket())
        want = self.force or self._choose(b)
        if want != b.mode:
            b.mode, b.skip = want, 1  # the first iteration after a switch fills or drains the pipeline
        self.iterations[b.mode] += 1
        return b.mode

    def _choose(self, b: _Bucket) -> str:
        for mode in (SEQUENTIAL, PINGPONG):  # warm-up: measure both
            if b.samples[mode] < self.warm:
                return mode
        best = PINGPONG if b.rate[PINGPONG] > self.margin * b.rate[SEQUENTIAL] else SEQUENTIAL
        other = PINGPONG if best == SEQUENTIAL else SEQUENTIAL
        if b.run_left > 0:
            b.run_left -= 1
            return other
        b.since_probe += 1
        if b.since_probe >= self.probe_every:
            b.since_probe, b.run_left = 0, self.probe_len - 1
            return other
        return best

    def observe(self, batch_size: int, mode: str, tokens: int, seconds: float) -> None:
        """One iteration of `mode` committed `tokens` tokens in `seconds` of step time."""
        if batch_size < self.min_batch or seconds <= 0:
            return
        b = self._buckets.setdefault(self.bucket(batch_size), _Bucket())
        if mode != b.mode:
            return
        if b.skip > 0:
            b.skip -= 1
            return
        rate = tokens / seconds
        old = b.rate.get(mode)
        b.rate[mode] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
        b.samples[mode] += 1

    def rates(self) -> dict[int, dict[str, float]]:
        """Measured throughput per bucket and mode (metrics, benchmarks)."""
        return {k: dict(b.rate) for k, b in sorted(self._buckets.items())}
