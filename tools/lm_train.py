"""Training loop for small causal LMs (HF `LlamaForCausalLM`) on a token stream, on CPU or GPU, bounded by a step
count or a wall-clock budget, with progress lines (mean loss since the last line, lr, tokens/s).

Shared by the bundled-model trainers (tools/train_tiny_default.py, tools/train_demo_pair.py) and the general draft
trainer (tools/train_draft.py). Knows nothing about tokenizers or checkpoint folders (tools/lm_data.py).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class LMTrainConfig:
    batch_size: int = 16
    context_len: int = 256
    peak_lr: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    max_steps: int | None = None  # stop after this many steps (None = only the time budget)
    time_budget_s: float | None = None  # stop after this much wall time; the LR schedule follows elapsed/budget
    bf16_autocast: bool = True
    log_every: int = 50
    progress_bar: bool = False  # a progress bar (stderr) instead of log lines
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.max_steps is None and self.time_budget_s is None:
            raise ValueError("set max_steps or time_budget_s")
        if self.batch_size < 1 or self.context_len < 2:
            raise ValueError("batch_size must be >= 1 and context_len >= 2")


def lr_at(step: int, frac: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% of peak as `frac` (progress) goes 0 -> 1.

    Progress is elapsed time / budget when training on a time budget, so that the run still anneals properly when
    the device is shared with other processes and the step rate changes mid-run."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, max(0.0, frac))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


class StreamSampler:
    """Random (batch, context + 1) windows of a token stream held on the training device."""

    def __init__(self, stream: torch.Tensor, context_len: int, device: str, seed: int) -> None:
        self.stream = stream.to(device)
        self.context_len = context_len
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.num_starts = stream.numel() - context_len - 1
        if self.num_starts < 1:
            raise ValueError(f"token stream of {stream.numel()} tokens is shorter than one context window")
        self.offsets = torch.arange(context_len + 1, device=device)

    def sample(self, batch_size: int) -> torch.Tensor:
        starts = torch.randint(0, self.num_starts, (batch_size, 1), generator=self.gen, device=self.stream.device)
        return self.stream[starts + self.offsets].long()  # (B, T + 1)


def train_lm(model: torch.nn.Module, stream: torch.Tensor, cfg: LMTrainConfig, name: str = "model") -> dict:
    """Train `model` (HF causal LM) in place on random windows of `stream`; returns the training record."""
    device = torch.device(cfg.device)
    model.to(device).train()
    nparams = sum(p.numel() for p in model.parameters())
    log(f"{name}: {nparams / 1e6:.2f} M params, batch {cfg.batch_size} x {cfg.context_len}, "
        f"{'budget %.0f s' % cfg.time_budget_s if cfg.time_budget_s else '%d steps' % cfg.max_steps} on {device}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.peak_lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    sampler = StreamSampler(stream, cfg.context_len, cfg.device, cfg.seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16_autocast)
    t0 = time.time()
    tokens = step = 0
    window_loss, window_steps, last = torch.zeros((), device=device), 0, None
    losses: list[tuple[int, float]] = []  # (step, mean loss of the steps since the previous entry)
    while True:
        elapsed = time.time() - t0
        frac = max(step / cfg.max_steps if cfg.max_steps else 0.0,
                   elapsed / cfg.time_budget_s if cfg.time_budget_s else 0.0)
        if frac >= 1.0:
            break
        batch = sampler.sample(cfg.batch_size)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, frac, cfg.peak_lr, cfg.warmup_steps)
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += cfg.batch_size * cfg.context_len
        window_loss += loss.detach()
        window_steps += 1
        if step % cfg.log_every == 0 or step == 1:
            last = window_loss.item() / window_steps  # one sync per log line, not per step
            window_loss.zero_()
            window_steps = 0
            losses.append((step, round(last, 4)))
            elapsed = time.time() - t0
            line = (f"step {step} loss {last:.3f} lr {opt.param_groups[0]['lr']:.2e} "
                    f"tok/s {tokens / max(elapsed, 1e-9):,.0f} tokens {tokens / 1e6:.1f}M")
            if cfg.progress_bar:
                progress(round(frac * 1000), 1000, t0, f"{name} {line}")
            else:
                log(f"{name} {line} elapsed {elapsed:.0f}s")
    if window_steps:
        last = window_loss.item() / window_steps
        losses.append((step, round(last, 4)))
    wall = time.time() - t0
    model.eval()
    return dict(params=nparams, steps=step, tokens_seen=tokens,
                final_train_loss=round(last, 4) if last is not None else None, wall_time_s=round(wall, 1),
                tokens_per_s=round(tokens / max(wall, 1e-9)), loss_curve=losses,
                schedule=f"linear warm-up ({cfg.warmup_steps} steps) + cosine to 10% over the budget",
                optimizer=f"AdamW(betas=(0.9,0.95), wd={cfg.weight_decay}, fused={fused})",
                config={k: v for k, v in asdict(cfg).items() if k not in ("log_every", "progress_bar")})


@torch.no_grad()
def heldout_loss(model, docs: list[torch.Tensor], context_len: int, max_tokens: int, device: str = "cpu",
                 bf16_autocast: bool = False) -> float:
    """Mean next-token loss (nats) over consecutive windows of held-out token sequences, up to max_tokens."""
    total, count = 0.0, 0
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16_autocast)
    for ids in docs:
        for s in range(0, ids.numel() - 1, context_len):
            chunk = ids[s:s + context_len + 1].long().to(device)
            if chunk.numel() < 2:
                break
            with autocast:
                logits = model(input_ids=chunk[None, :-1]).logits[0].float()
            total += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
            count += chunk.numel() - 1
            if count >= max_tokens:
                return total / count
    return total / max(count, 1)


def progress(done: int, total: int, start: float, extra: str = "", width: int = 30) -> None:
    """A one-line progress bar on stderr (rewritten in place on a terminal, one line per call otherwise)."""
    frac = done / max(total, 1)
    bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
    elapsed = time.time() - start
    eta = elapsed / frac - elapsed if frac > 0 else float("nan")
    end = "\r" if sys.stderr.isatty() and done < total else "\n"
    print(f"[{bar}] {done}/{total} {elapsed:.0f}s eta {eta:.0f}s {extra}", end=end, file=sys.stderr, flush=True)
