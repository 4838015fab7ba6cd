"""Engine-core configuration: the model's shape (`ModelConfig`, read from a HF config) and how the engine runs it
(`EngineConfig`: device, dtype, KV pool size, attention backend).

Knows nothing about services or the wire; the CLI layers build `EngineConfig` from their flags.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# RoPE types whose inv_freq does not depend on the current sequence length; dynamic/longrope do, and need runtime
# recomputation this engine does not do.
_ARCH_BY_MODEL_TYPE = {
    "llama": ["LlamaForCausalLM"],
    "mistral": ["MistralForCausalLM"],
    "qwen2": ["Qwen2ForCausalLM"],
    "qwen3": ["Qwen3ForCausalLM"],
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder; everything the model code and the KV pool need, nothing else."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # The full HF rope parameter dict (rope_type, factor, ...) or None for plain RoPE; hash=False: dicts are unhashable.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None  # dtype the checkpoint was saved in ("bfloat16", ...); "auto" uses it on GPU
    # MTP / NextN layers stored after the decoder (`model.layers.{num_layers + i}.*`, config num_nextn_predict_layers):
    # the draft's (runtime/models/mtp.py), not part of the target's forward.
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "num_layers", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        from transformers import AutoConfig  # lazy: keeps `import runtime.config` cheap

        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        eos = _as_id_list(getattr(hf_config, "eos_token_id", None))
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                for token_id in _as_id_list(json.load(f).get("eos_token_id")):
                    if token_id not in eos:
                        eos.append(token_id)
        return cls.from_hf_config(hf_config, eos_token_ids=eos)

    @classmethod
    def from_hf_config(cls, hf_config: Any, eos_token_ids: list[int] | None = None) -> ModelConfig:
        # Configs built in code (not loaded) often lack `architectures`; model_type then names the family.
        archs = getattr(hf_config, "architectures", None) or _ARCH_BY_MODEL_TYPE.get(hf_config.model_type, [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), archs[0] if archs else "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {archs or hf_config.model_type!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        theta, scaling = _rope_from_hf(hf_config)
        # Qwen2 always has q/k/v bias (no config flag); Llama/Mistral/Qwen3 say so through attention_bias.
        attention_bias = arch == "Qwen2ForCausalLM" or bool(getattr(hf_config, "attention_bias", False))
        dtype = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")  # transformers < 5 name
        if dtype is not None and not isinstance(dtype, str):
            dtype = str(dtype).removeprefix("torch.")
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_position_embeddings=hf_config.max_position_embeddings,
            eos_token_ids=tuple(eos_token_ids if eos_token_ids is not None else _as_id_list(hf_config.eos_token_id)),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            torch_dtype=dtype,
            num_mtp_layers=int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0),
        )


@dataclass
class EngineConfig:
    """How to run a model: where, in which dtype, with how much KV memory, with or without CUDA graphs."""

    device: str = "cpu"
    dtype: str = "auto"  # "auto" = checkpoint dtype on CUDA, float32 on CPU
    load_format: str = "auto"  # "dummy" = random weights of the config's shape, no weight files needed
    # "auto" = triton on CUDA (when installed), torch elsewhere: the CLI's default too (tandem/args.py), so benches and
    # services that build an EngineConfig run the same backend
    attention_backend: str = "auto"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None = ceil(max_total_tokens / block_size), or profiled (below)
    max_total_tokens: int = 65536  # KV capacity over all sequences when num_kv_blocks is None
    # Largest prefill forward in tokens (longer prompts / batches are split; the memory profile measures a prefill of
    # this size); None or <= 0 = no chunking (a prefill of any length in one forward).
    chunked_prefill_size: int | None = 4096
    seed: int = 0
    # Set (on CUDA, with num_kv_blocks None): weights + KV pool take this fraction of the GPU; the KV pool is sized by
    # profiling free memory after loading weights and a warm-up forward, and max_total_tokens is ignored.
    mem_fraction_static: float | None = None
    # CUDA graphs of decode (1 token per sequence) and verify (num_draft_tokens per sequence) forwards, batch sizes
    # bucketed up to cuda_graph_max_bs; CUDA + triton backend only, eager otherwise.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 64
    cuda_graph_num_draft_tokens: int | None = None  # the verify width to capture (root included); None = decode only
    # More verify widths to capture (adaptive speculation: one per draft-steps tier, each <= the one above).
    cuda_graph_extra_widths: tuple[int, ...] = ()
    cuda_graph_max_bs_decode: int | None = None  # largest decode (1 token per sequence) batch captured; None = max_bs
    # Tree-tail width the wide graphs accept; None = cuda_graph_num_draft_tokens. A draft's tree steps (topk tokens
    # per sequence) attend to all earlier steps' nodes: num_steps * topk.
    cuda_graph_mask_width: int | None = None
    # torch.compile the forward captured by the graphs of <= torch_compile_max_bs sequences (see CudaGraphRunner)
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    # Reuse the KV of full blocks of committed tokens across sequences with the same prefix (kv_cache.BlockManager);
    # the target service turns it on unless --disable-radix-cache. Off under tensor parallelism.
    enable_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.max_total_tokens <= 0:
            raise ValueError(f"max_total_tokens must be positive, got {self.max_total_tokens}")
        if not isinstance(self.attention_backend, str) or not self.attention_backend:
            raise ValueError("attention_backend must be a backend name")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_num_draft_tokens is not None and self.cuda_graph_num_draft_tokens <= 0:
            raise ValueError(f"cuda_graph_num_draft_tokens must be positive, got {self.cuda_graph_num_draft_tokens}")
        if self.cuda_graph_max_bs_decode is not None and self.cuda_graph_max_bs_decode < 0:
            raise ValueError(f"cuda_graph_max_bs_decode must be >= 0, got {self.cuda_graph_max_bs_decode}")
        if self.cuda_graph_mask_width is not None and self.cuda_graph_mask_width <= 0:
            raise ValueError(f"cuda_graph_mask_width must be positive, got {self.cuda_graph_mask_width}")
        if self.torch_compile_max_bs <= 0:
            raise ValueError(f"torch_compile_max_bs must be positive, got {self.torch_compile_max_bs}")

    @property
    def resolved_num_kv_blocks(self) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return math.ceil(self.max_total_tokens / self.block_size)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_from_hf(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from transformers 5 `rope_parameters` or older `rope_theta`/`rope_scaling`."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    return theta, scaling
