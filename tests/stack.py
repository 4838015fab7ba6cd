"""Test helpers: run the real target/draft gRPC servers in-process on port 0 and a real Scheduler over them.

Used by the lossless tests (greedy output vs HF generate) so that the whole step path — convert, servicer, engine,
proposer, scheduler, clients — is exercised without the cost of process start-up. The e2e tests start real processes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gateway.clients import DraftClient, TargetClient
from gateway.scheduler import Scheduler, SchedulerConfig, SpecConfig
from gateway.types import GenerateParams, request_sampling


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 0) -> Path:
    """A draft that agrees with the target most of the time: the same weights plus Gaussian noise."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            noisy = {k: v + noise * v.std() * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
                     for k, v in tensors.items()}
            save_file(noisy, str(dst / f.name), metadata={"format": "pt"})
        elif f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@contextlib.asynccontextmanager
async def local_stack(target_path: Path, *, algorithm: str = "NONE", draft_path: Path | None = None,
                      num_steps: int = 0, topk: int = 1, num_draft_tokens: int = 1, eos_token_ids=(),
                      ngram_kwargs: dict | None = None, max_total_tokens: int = 8192,
                      enable_overlap_drafting: bool = False, adaptive=None, device: str = "cpu",
                      dtype: str = "float32", num_continuous_decode_steps: int = 1, inline_steps: bool = True,
                      prefix_cache: bool = True, static_steps: bool = False, overlap_schedule: str = "auto",
                      defer_delivery: bool = True,
                      tokenizer=None, use_rejection_sampling: bool = False, accept_thresholds=None,
                      multi_layer: bool = False, draft_window_size: int | None = None,
                      lora_path: Path | None = None, colocate: bool = False, run_ahead: bool = False,
                      chain_steps: bool = True, static_max_bs: int = 4):
    """Yields a started Scheduler wired to in-process gRPC target (and draft) servers. adaptive: an AdaptiveSpec;
    device/dtype: of both model services (tests/gpu runs the same stack on CUDA); inline_steps: the services'
    ModelWorker mode; prefix_cache: the target's and a STANDALONE draft's (on by default, as `tandem` runs them);
    static_steps: the triton backend with the static draft and verify steps (runtime/speculative/draft_step.py,
    verify_step.py) for the served shape, as `tandem serve` runs them on a GPU (on CPU: TRITON_INTERPRET=1);
    overlap_schedule: the gateway's ping-pong halves (gateway/overlap.py), auto/on/off; defer_delivery: a step's
    tokens are streamed while the next call is in flight (False: --disable-overlap-schedule's sequential loop);
    tokenizer: the gateway's (gateway.tokenizer.Tokenizer), for requests that detokenize and stop on strings;
    use_rejection_sampling: an EAGLE draft samples chains of sampled requests (--speculative-use-rejection-sampling);
    accept_thresholds: the target's AcceptThresholds (--speculative-accept-threshold-single/-acc);
    multi_layer: multi-layer EAGLE over the draft checkpoint's MTP layers (--enable-multi-layer-eagle);
    draft_window_size: a DFLASH draft's --speculative-draft-window-size;
    lora_path: UNO's adapter (--uno-lora-path): the target server also serves DraftService, as `tandem target` does;
    colocate: the draft's proposer is served by the target server (`--colocate-draft`): every Verify drafts the next
    tree in the same call; run_ahead: the target pod runs the call it expects next (`--enable-run-ahead`); chain_steps:
    a call's speculative steps after its first chained on the device (static steps; target_service/chained.py);
    static_max_bs: the static steps' largest batch bucket."""
    from draft_service.server import serve_draft
    from runtime.config import EngineConfig
    from runtime.model_runner import ModelRunner
    from target_service.engine import TargetEngine
    from target_service.server import serve_target

    engine_config = EngineConfig(device=device, dtype=dtype, max_total_tokens=max_total_tokens,
                                 attention_backend="triton" if static_steps else "auto")
    target_runner = ModelRunner(str(target_path), dataclasses.replace(engine_config, enable_prefix_cache=prefix_cache))
    proposer = None
    capture = {}
    if algorithm in ("EAGLE", "EAGLE3", "NEXTN"):  # feature drafts (NEXTN: draft_path = an MTP target itself)
        from draft_service.eagle import EagleProposer

        proposer = EagleProposer(str(target_path), str(draft_path), engine_config, algorithm,
                                 use_rejection_sampling=use_rejection_sampling,
                                 multi_layer_steps=num_steps if multi_layer else 0)
        capture = ({"feature_layers": proposer.target_capture_layers} if algorithm == "EAGLE3"
                   else {"final_norm_features": True})
    elif algorithm == "DFLASH":  # block draft: the target returns the draft's target layers
        from draft_service.dflash import DFlashProposer

        proposer = DFlashProposer(str(target_path), str(draft_path), engine_config, window_size=draft_window_size)
        capture = {"feature_layers": proposer.target_capture_layers}
    servers = []
    engine = TargetEngine(target_runner, **capture,
                          **({"accept_thresholds": accept_thresholds} if accept_thresholds is not None else {}))
    if static_steps:
        assert engine.enable_static_verify(num_draft_tokens, max_bs=static_max_bs)
    uno = None
    if algorithm == "UNO":
        from target_service.uno import UnoProposer, attach_adapter

        attach_adapter(engine, str(lora_path))
        uno = UnoProposer(engine)
    if algorithm == "STANDALONE":
        from draft_service.standalone import StandaloneProposer

        proposer = StandaloneProposer(ModelRunner(str(draft_path), dataclasses.replace(
            engine_config, enable_prefix_cache=prefix_cache)))
    elif algorithm == "NGRAM":
        from draft_service.ngram import NgramConfig
        from draft_service.ngram_draft import NgramDraft

        proposer = NgramDraft(NgramConfig(num_draft_tokens=num_draft_tokens, **(ngram_kwargs or {})))
    if proposer is not None and static_steps and algorithm not in ("NGRAM", "DFLASH"):
        from draft_service.proposer import SpecShape

        assert proposer.enable_static_step(SpecShape(num_steps, topk, num_draft_tokens), max_bs=static_max_bs)
    on_target = uno or (proposer if colocate else None)  # the target server also serves DraftService
    server, port = await serve_target(engine, str(target_path), "127.0.0.1", 0, inline_steps=inline_steps,
                                      proposer=on_target, run_ahead=run_ahead,
                                      chain_steps=chain_steps)
    servers.append(server)
    target = TargetClient(f"127.0.0.1:{port}")
    draft = DraftClient(f"127.0.0.1:{port}") if on_target is not None else None
    if proposer is not None and on_target is None:
        server, port = await serve_draft(proposer, str(draft_path or ""), "127.0.0.1", 0, inline_steps=inline_steps)
        servers.append(server)
        draft = DraftClient(f"127.0.0.1:{port}")
    info = await target.info()
    scheduler = Scheduler(targets=[target], drafts=[draft] if draft else [], tokenizer=tokenizer, model_name="tiny",
                          max_context_len=info.max_context_len, vocab_size=info.vocab_size,
                          eos_token_ids=list(eos_token_ids),
                          spec=SpecConfig(algorithm, num_steps, topk, num_draft_tokens),
                          config=SchedulerConfig(max_running_requests=16, request_timeout_s=300,
                                                 enable_overlap_drafting=enable_overlap_drafting,
                                                 num_continuous_decode_steps=num_continuous_decode_steps,
                                                 speculative_steps_per_call=num_continuous_decode_steps,
                                                 overlap_schedule=overlap_schedule, defer_delivery=defer_delivery,
                                                 drafts_on_target=colocate),
                          adaptive=adaptive)
    await scheduler.start()
    scheduler.test_target_runner = target_runner  # for KV-leak assertions
    scheduler.test_engine = engine
    scheduler.test_proposer = proposer or uno
    scheduler.test_servers = servers
    scheduler.test_servicers = [s.servicer for s in servers]
    try:
        yield scheduler
    finally:
        await scheduler.close()
        await target.close()  # clients first: their open step streams end before the servers go away
        if draft:
            await draft.close()
        for s in servers:
            await s.stop(grace=None)


async def generate_ids(scheduler: Scheduler, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                       seed: int | None = None, request_id: str = "r",
                       stop_token_ids: list[int] | None = None) -> tuple[list[int], object]:
    """Run one request to completion; returns (output ids, final usage, finish reason)."""
    params = GenerateParams(request_id=request_id, prompt_token_ids=prompt, max_new_tokens=max_new_tokens,
                            sampling=request_sampling(temperature=temperature, seed=seed), detokenize=False,
                            stop_token_ids=list(stop_token_ids or []))
    out, usage, finish = [], None, None
    async for chunk in scheduler.generate(params):
        out.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            usage, finish = chunk.usage, chunk.finish_reason
    return out, usage, finish
