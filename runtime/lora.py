"""LoRA adapters on the target's own layers, applied per row of a batched forward (UNO's draft rows).

Loads an adapter in PEFT's safetensors layout (`adapter_config.json`: r, lora_alpha, target_modules, use_rslora;
`adapter_model.safetensors`: `...layers.{i}.self_attn.q_proj.lora_A.weight` (r, in) and `.lora_B.weight` (out, r)),
maps HF module names onto Tandem's fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj, o_proj, down_proj)
and wraps those projections in `LoRALinear`. A forward adds the low-rank delta only to the rows whose segment id names
the adapter (`segments(model, ids)`); rows with id -1, and every forward outside `segments`, run the base weights
alone, bit for bit. Knows nothing about sequences, KV or sampling; TP is not supported (UNO requires TP=1).
"""
from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

NO_ADAPTER = -1  # segment id of a row that runs the base weights only
# HF module name -> (Tandem's fused module, index of the part in its output)
_FUSED = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
          "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
          "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
          "down_proj": ("mlp.down_proj", 0)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRAConfig:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {self.r}")
        unknown = sorted(set(self.target_modules) - set(_FUSED))
        if unknown:
            raise ValueError(f"LoRA target_modules {unknown} are not projections of a Llama-family layer "
                             f"({', '.join(_FUSED)})")

    @property
    def scaling(self) -> float:
        """PEFT's scale of B @ A: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_dict(cls, raw: dict) -> LoRAConfig:
        if raw.get("peft_type", "LORA").upper() != "LORA":
            raise ValueError(f"not a LoRA adapter: peft_type {raw.get('peft_type')!r}")
        modules = raw.get("target_modules") or []
        if isinstance(modules, str):  # PEFT also allows one regex / name
            modules = [m for m in _FUSED if re.fullmatch(modules, m) or m == modules]
        return cls(int(raw["r"]), float(raw.get("lora_alpha", raw["r"])), tuple(modules),
                   bool(raw.get("use_rslora", False)))

    def to_dict(self) -> dict:
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r, "lora_alpha": self.lora_alpha,
                "target_modules": list(self.target_modules), "use_rslora": self.use_rslora, "lora_dropout": 0.0,
                "bias": "none", "fan_in_fan_out": False}


@dataclass
class LoRAAdapter:
    """One adapter: weights[(layer, hf_module)] = (A (r, in), B (out, r))."""

    config: LoRAConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(path: str | Path) -> LoRAAdapter:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors); ValueError when it is not one."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{folder} is not a PEFT LoRA adapter: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = LoRAConfig.from_dict(json.loads((folder / CONFIG_FILE).read_text()))
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(folder / WEIGHTS_FILE)).items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"{folder / WEIGHTS_FILE}: unexpected tensor {key!r} (only lora_A/lora_B of layer "
                             "projections are supported)")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in config.target_modules:
            raise ValueError(f"{key}: {module} is not in the adapter's target_modules {list(config.target_modules)}")
        parts.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"layer {layer} {module}: needs both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != config.r or b.shape[1] != config.r:
            raise ValueError(f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have "
                             f"rank r={config.r}")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise ValueError(f"{folder / WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(config, weights)


def save_adapter(path: str | Path, config: LoRAConfig,
                 weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None) -> None:
    """Write PEFT's layout (key prefix `base_model.model.model.layers.{i}`), as PEFT's save_pretrained would."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, module), (a, b) in sorted(weights.items()):
        group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = a.detach().to(dtype).contiguous().cpu()
        tensors[f"{prefix}.lora_B.weight"] = b.detach().to(dtype).contiguous().cpu()
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps({**config.to_dict(), **(extra_config or {})}, indent=2) + "\n")


class LoRALinear(nn.Module):
    """A base projection plus low-rank deltas on slices of its output: part p of a fused qkv/gate_up output gets
    scale * x @ A_p^T @ B_p^T. Only rows listed in `rows` (set by `segments`) get the delta."""

    def __init__(self, base: nn.Linear, part_sizes: list[int], scaling: float) -> None:
        super().__init__()
        self.base = base
        self.part_offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        self.part_sizes = part_sizes
        self.scaling = scaling
        self.a: dict[int, torch.Tensor] = {}  # part -> (r, in)
        self.b: dict[int, torch.Tensor] = {}  # part -> (out_part, r)
        self.rows: torch.Tensor | None = None  # (num_adapter_rows,) row indices of the current forward

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def set_part(self, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        w = self.base.weight
        if a.shape[1] != w.shape[1] or b.shape[0] != self.part_sizes[part]:
            raise ValueError(f"LoRA shapes A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a projection of "
                             f"input {w.shape[1]} and output part {self.part_sizes[part]}")
        self.a[part] = a.to(device=w.device, dtype=w.dtype)
        self.b[part] = b.to(device=w.device, dtype=w.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (N, in) -> (N, out)
        y = self.base(x)
        rows = self.rows
        if rows is None or rows.numel() == 0:
            return y
        xs = x.index_select(0, rows)  # (R, in): only the adapter's rows pay for the delta
        delta = torch.cat([self._part_delta(xs, p) for p in range(len(self.part_sizes))], dim=-1)  # (R, out)
        return y.index_add(0, rows, delta.to(y.dtype))

    def _part_delta(self, xs: torch.Tensor, part: int) -> torch.Tensor:
        if part not in self.a:
            return xs.new_zeros(xs.shape[0], self.part_sizes[part])
        return (xs @ self.a[part].T) @ self.b[part].T * self.scaling  # (R, r) -> (R, out_part)


def apply_adapter(model: nn.Module, adapter: LoRAAdapter) -> list[LoRALinear]:
    """Wrap the adapter's projections of a runtime Llama-family model (in place) and return the wrappers. Forwards
    outside `segments` are unchanged."""
    if getattr(model, "tp", None) is not None:
        raise ValueError("LoRA adapters need TP=1")
    layers = model.layers
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        if not 0 <= layer < len(layers):
            raise ValueError(f"the adapter names layer {layer}; the model has {len(layers)}")
        fused, part = _FUSED[module]
        key = (layer, fused)
        if key not in wrapped:
            owner_name, attr = fused.split(".")
            owner = getattr(layers[layer], owner_name)
            base = getattr(owner, attr)
            lora = LoRALinear(base, _part_sizes(owner, attr, base), adapter.config.scaling)
            setattr(owner, attr, lora)
            wrapped[key] = lora
        wrapped[key].set_part(part, a, b)
    return list(wrapped.values())


@contextlib.contextmanager
def segments(wrappers: list[LoRALinear], segment_ids: torch.Tensor | list[int] | None) -> Iterator[None]:
    """Within the block, the rows of every forward whose segment id is 0 (the adapter) get the LoRA delta; rows
    with NO_ADAPTER (-1) run the base weights. segment_ids: (num_tokens,) of the packed forward; a host list is
    turned into row indices without a device sync."""
    if segment_ids is None or not wrappers:
        rows = None
    elif isinstance(segment_ids, torch.Tensor):
        rows = (segment_ids == 0).nonzero().squeeze(-1)
    else:
        device = wrappers[0].weight.device
        rows = torch.tensor([i for i, s in enumerate(segment_ids) if s == 0], dtype=torch.long, device=device)
    for w in wrappers:
        w.rows = rows
    try:
        yield
    finally:
        for w in wrappers:
            w.rows = None


def lora_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, part_sizes: list[int],
                    parts: dict[int, tuple[torch.Tensor, torch.Tensor]], scaling: float,
                    segment_ids: torch.Tensor) -> torch.Tensor:
    """Reference: row by row, the base projection, plus the merged weight W + scale * B A on adapter rows."""
    out = []
    delta = torch.zeros_like(weight)
    offset = 0
    for p, size in enumerate(part_sizes):
        if p in parts:
            a, b = parts[p]
            delta[offset:offset + size] = scaling * (b @ a)
        offset += size
    for i in range(x.shape[0]):
        w = weight + delta if int(segment_ids[i]) == 0 else weight
        out.append(torch.nn.functional.linear(x[i:i + 1], w, bias))
    return torch.cat(out)


def _part_sizes(owner: nn.Module, attr: str, base: nn.Linear) -> list[int]:
    if attr == "qkv_proj":
        return [owner.q_size, owner.kv_size, owner.kv_size]
    if attr == "gate_up_proj":
        half = base.weight.shape[0] // 2
        return [half, half]
    return [base.weight.shape[0]]
