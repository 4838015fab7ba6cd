"""Adaptive speculation (`--speculative-adaptive [--speculative-adaptive-config F]`, SGLang's semantics for chain
drafts): the number of draft steps per verify is chosen per batch-size slot from a few candidates, following an EMA
of how many drafts the target accepted. Batches of 32 and more default to candidate 0 (no speculation: a target-only
step), because a verify of batch x (steps + 1) tokens stops being memory-bound there and speculation is slower than
plain decoding (default_config).

Config (JSON, keys are batch-size lower bounds): {"1": {"candidate_steps": [1, 3, 7], "down_hysteresis": -0.25},
"8": {"candidate_steps": [0, 1, 3]}, ...}; per slot also ema_alpha (0.2), warmup_batches (10), update_interval (5),
up_hysteresis (0.0), down_hysteresis (-0.25). A batch of B sequences uses the slot with the largest key <= B.

Policy per slot, after each step that speculated: ema = alpha * mean accepted drafts + (1 - alpha) * ema. After the
warm-up, every update_interval steps of that slot: move down while ema <= prev - 0.5 + down_hysteresis (0.5 when
the candidate below is 0), else move up while ema > current - 0.5 + up_hysteresis. At 0 (no drafts, nothing to
measure) each evaluation probes the next candidate with the EMA reset to that candidate (all drafts accepted).
No I/O, no clocks: the scheduler calls `steps_for` before a step and `observe` after it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

_SLOT_KEYS = {"candidate_steps", "ema_alpha", "warmup_batches", "update_interval", "up_hysteresis",
              "down_hysteresis"}


@dataclass
class SlotConfig:
    candidate_steps: list[int]
    ema_alpha: float = 0.2
    warmup_batches: int = 10
    update_interval: int = 5
    up_hysteresis: float = 0.0
    down_hysteresis: float = -0.25

    def __post_init__(self) -> None:
        steps = self.candidate_steps
        if not steps or any(not isinstance(s, int) or s < 0 for s in steps) or sorted(set(steps)) != list(steps):
            raise ValueError(f"candidate_steps must be distinct ascending integers >= 0, got {steps}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.warmup_batches < 0 or self.update_interval < 1:
            raise ValueError("warmup_batches >= 0 and update_interval >= 1")


def default_config(max_steps: int) -> dict[int, SlotConfig]:
    """SGLang's default tiers below batch 32, with the largest batch-1 candidate capped at the configured
    --speculative-num-steps; from batch 32 no drafting (SGLang: from 64). Its batch-32 tier (0 or 1 step) stays at a
    1-step chain whenever most drafts are accepted, whatever the step costs: 8B SYNTHETIC chain through the services
    (bench/gpu_session.sh adaptive), batch 32 at 0.83x plain decoding on an H100 (bench/results/session24; batch 64
    0.88x, its admission waves and drain running below 64), 1.04x on an H200 (bench/results/session15_h200)."""
    top = [s for s in (1, 3, 7) if s < max_steps] + [max_steps]
    return {1: SlotConfig(sorted(set(top)), down_hysteresis=-0.25), 8: SlotConfig([0, 1, min(3, max_steps)]),
            32: SlotConfig([0])}


def load_config(path: str | Path | None, max_steps: int) -> dict[int, SlotConfig]:
    """Slots from a JSON file (None = the defaults); clear ValueErrors for bad files."""
    if path is None:
        return default_config(max_steps)
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read --speculative-adaptive-config {path}: {exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError("--speculative-adaptive-config: expected a JSON object of batch-size slots")
    slots: dict[int, SlotConfig] = {}
    for key, value in raw.items():
        if not str(key).isdigit() or int(key) < 1:
            raise ValueError(f"--speculative-adaptive-config: slot keys are batch sizes >= 1, got {key!r}")
        if not isinstance(value, dict) or not set(value) <= _SLOT_KEYS or "candidate_steps" not in value:
            raise ValueError(f"--speculative-adaptive-config slot {key}: keys {sorted(_SLOT_KEYS)} "
                             "(candidate_steps required)")
        slots[int(key)] = SlotConfig(**value)
    if 1 not in slots:
        raise ValueError("--speculative-adaptive-config needs a slot for batch size 1")
    too_big = [s for slot in slots.values() for s in slot.candidate_steps if s > max_steps]
    if too_big:
        raise ValueError(f"--speculative-adaptive-config: candidate steps {too_big} exceed --speculative-num-steps "
                         f"{max_steps} (the graphs and buffers are sized for it)")
    return slots


def all_candidate_steps(slots: dict[int, SlotConfig]) -> list[int]:
    return sorted({s for slot in slots.values() for s in slot.candidate_steps})


@dataclass
class _SlotState:
    config: SlotConfig
    index: int
    ema: float
    batches: int = 0
    history: list[int] = field(default_factory=list)  # steps after each re-evaluation (for logs and tests)

    @property
    def steps(self) -> int:
        return self.config.candidate_steps[self.index]


# Target-only steps after which a batch that moved into a drafting slot drafts again (see AdaptiveSpec).
RESUME_AFTER_PLAIN_STEPS = 8


class AdaptiveSpec:
    def __init__(self, slots: dict[int, SlotConfig], initial_steps: int,
                 resume_after: int = RESUME_AFTER_PLAIN_STEPS) -> None:
        """initial_steps: --speculative-num-steps; each slot starts at its candidate nearest to it.

        resume_after: a batch whose steps drafted nothing (its slot's tier was 0) and that then moves into a slot
        that drafts -- sequences finished or left, a batch hovering at a slot's edge -- keeps stepping without drafts
        until it has stayed in drafting slots for this many steps. Drafting again first feeds the draft every token
        committed meanwhile (a catch-up forward and a Propose round trip), and a static batch draining below the
        no-draft slot ran its last steps that way: 8B SYNTHETIC chain through the services, batch 32 on an H100,
        0.67x plain decoding (bench/results/session24). Probes inside one slot (a tier at 0 trying the next) are
        not held back."""
        self.keys = sorted(slots)
        self.resume_after = resume_after
        self._plain_slot: int | None = None  # slot key of the last step, when it drafted nothing by its own tier
        self._held = 0  # steps since then held back from a drafting slot
        self.slots: dict[int, _SlotState] = {}
        for key in self.keys:
            cands = slots[key].candidate_steps
            index = min(range(len(cands)), key=lambda i: (abs(cands[i] - initial_steps), -cands[i]))
            self.slots[key] = _SlotState(slots[key], index, float(cands[index]))

    def slot_key(self, batch_size: int) -> int:
        return max((k for k in self.keys if k <= max(batch_size, 1)), default=self.keys[0])

    def steps_for(self, batch_size: int) -> int:
        """Draft steps (0 = a target-only step) for a step over batch_size sequences."""
        key = self.slot_key(batch_size)
        steps = self.slots[key].steps
        if steps and self._plain_slot not in (None, key) and self._held < self.resume_after:
            return 0  # just moved here from a slot that drafts nothing: not yet (resume_after)
        return steps

    def observe(self, batch_size: int, steps_used: int, mean_accepted: float | None) -> None:
        """After a step: steps_used drafts per sequence were proposed (0 = none); mean_accepted = the mean number
        of them the target accepted, over the sequences that had a draft (None when none had one)."""
        key = self.slot_key(batch_size)
        slot = self.slots[key]
        if steps_used > 0:
            self._plain_slot, self._held = None, 0
        elif slot.steps == 0:
            self._plain_slot, self._held = key, 0
        else:
            self._held += 1  # held back by resume_after
        if steps_used != slot.steps:
            return  # the slot moved (or the step fell back to target-only): not this slot's measurement
        cfg = slot.config
        if steps_used > 0:
            if mean_accepted is None:
                return
            slot.ema = cfg.ema_alpha * mean_accepted + (1.0 - cfg.ema_alpha) * slot.ema
        slot.batches += 1
        if slot.batches <= cfg.warmup_batches or (slot.batches - cfg.warmup_batches) % cfg.update_interval:
            return
        cands = cfg.candidate_steps
        if slot.steps == 0:
            if slot.index + 1 < len(cands):  # probe: nothing can be measured without drafting
                slot.index += 1
                slot.ema = float(slot.steps)
        else:
            moved = False
            while slot.index > 0:
                prev = cands[slot.index - 1]
                threshold = 0.5 if prev == 0 else prev - 0.5 + cfg.down_hysteresis
                if slot.ema > threshold:
                    break
                slot.index -= 1
                moved = True
            while not moved and slot.index + 1 < len(cands) and slot.ema > slot.steps - 0.5 + cfg.up_hysteresis:
                slot.index += 1
        slot.history.append(slot.steps)
