"""The fused elementwise path of runtime/models/llama.py (Triton RMSNorm, add + RMSNorm, RoPE, SiLU-mul) forced on
through the real ModelRunner gives the torch path's logits, aux hidden states and greedy tokens: tiny Llama (GQA,
untied), Qwen2 (qkv bias) and Qwen3 (q/k norm) checkpoints, fp32 and bf16. On CPU the kernels run in the Triton
interpreter. Also: auto mode keeps CPU on the torch path, and the switch never engages under autograd."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from runtime.config import EngineConfig
from runtime.model_runner import ModelRunner, SeqForward
from runtime.models import llama
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = make_tiny_model(family, tmp_path_factory.mktemp("tiny"))
        return cache[family]

    return get


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


class _Pair:
    """Two runners over one checkpoint: [0] runs the torch path, [1] the fused kernels."""

    def __init__(self, path: str, device: torch.device, dtype: str) -> None:
        cfg = EngineConfig(device=str(device), dtype=dtype, block_size=4, max_total_tokens=512,
                           attention_backend="torch")
        self.runners = [ModelRunner(path, cfg), ModelRunner(path, cfg)]

    def forward(self, batch, **kw):
        outs = []
        for fused, r in zip((False, True), self.runners):
            with llama.fused_elementwise(fused):
                outs.append(r.forward(batch, **kw))
        return outs

    def add_seq(self, s: str) -> None:
        for r in self.runners:
            r.add_seq(s)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_path_matches_torch_path_fp32(family, tiny_path, device, monkeypatch):
    used: list[str] = []
    real = llama._k
    monkeypatch.setattr(llama, "_k", lambda name: used.append(name) or real(name))
    pair = _Pair(tiny_path(family), device, "float32")
    seqs = {"a": _tokens(9, 1), "b": _tokens(4, 2)}
    for s in seqs:
        pair.add_seq(s)
    for batch in ([SeqForward(s, ids, logits="all") for s, ids in seqs.items()],  # prefill
                  [SeqForward("a", [5]), SeqForward("b", [7])],  # decode
                  [SeqForward("a", _tokens(5, 3), parents=[-1, 0, 0, 1, 2], logits="all")]):  # tree verify
        want, got = pair.forward(batch, capture_layers=[0, 2, 3])  # 3 = after the last layer, before the norm
        for w, g in zip(want.logits + want.features, got.logits + got.features):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert set(used) == {"norm", "rope", "activation"}, "the forced run went through all three kernel modules"


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")])
def test_fused_path_gives_the_same_greedy_tokens(family, dtype, tiny_path, device):
    pair = _Pair(tiny_path(family), device, dtype)
    pair.add_seq("g")
    generated = []
    for fused, r in zip((False, True), pair.runners):
        with llama.fused_elementwise(fused):
            next_id = int(r.forward([SeqForward("g", _tokens(6, 12))]).logits[0][-1].argmax())
            tokens = [next_id]
            for _ in range(8):
                next_id = int(r.forward([SeqForward("g", [next_id])]).logits[0][-1].argmax())
                tokens.append(next_id)
        generated.append(tokens)
    assert generated[0] == generated[1]
    assert len(set(generated[0])) > 2


def test_switch_auto_is_off_on_cpu_and_never_under_autograd():
    x = torch.zeros(2, 4)
    with llama.fused_elementwise(None):
        assert not llama.use_fused(x)
    with llama.fused_elementwise(True):
        with torch.no_grad():
            assert llama.use_fused(x)
        assert not llama.use_fused(x)  # grad mode on: the kernels have no backward
    with llama.fused_elementwise(False), torch.no_grad():
        assert not llama.use_fused(x)


def test_auto_mode_fuses_only_inside_cuda_graph_capture():
    """Eager CUDA forwards keep torch ops (a Triton launch from Python costs more than the ops it replaces);
    graph capture and its warm-up (runtime/cuda_graph.py) use the fused kernels."""
    from types import SimpleNamespace

    cuda_like = SimpleNamespace(is_cuda=True)
    with llama.fused_elementwise(None), torch.no_grad():
        assert not llama.use_fused(cuda_like)
        with llama.graph_capture_mode():
            assert llama.use_fused(cuda_like)
            assert not llama.use_fused(torch.zeros(1))  # CPU tensors never
        assert not llama.use_fused(cuda_like)
    with llama.fused_elementwise(False), llama.graph_capture_mode(), torch.no_grad():
        assert not llama.use_fused(cuda_like)


def test_model_import_does_not_import_the_kernels():
    code = ("import sys, runtime.models.llama, runtime.model_runner; "
            "assert not any(m in sys.modules for m in ('tandem_kernels.norm', 'tandem_kernels.rope', 'tandem_kernels.activation'))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_switch_value_is_a_typed_error():
    code = "import runtime.models.llama"
    env = {**os.environ, "TANDEM_FUSED_ELEMENTWISE": "maybe"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "TANDEM_FUSED_ELEMENTWISE='maybe'" in proc.stderr


def _tp_rank_main(rank: int, port: int, path: str, prompt: list[int], steps: int, out_path: str) -> None:
    from runtime.distributed import destroy_tp, init_tp, run_worker
    from target_service.tp import rank_device

    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported in this process
    llama._FUSED_MODE = True
    device = rank_device("cpu", rank)
    tp = init_tp(rank, 2, "127.0.0.1", port, device)
    runner = ModelRunner(path, EngineConfig(device=device, dtype="float32", max_total_tokens=512,
                                            attention_backend="torch", disable_cuda_graph=True), tp=tp)
    try:
        if rank == 0:
            tokens = _greedy(runner, prompt, steps)
            runner.stop_workers()
            with open(out_path, "w") as f:
                f.write(" ".join(map(str, tokens)) + "\n" + " ".join(sorted(llama._kernels)))
        else:
            run_worker(runner)
        # Both ranks leave the group together: a rank tearing its gloo pairs down while the other still used them
        # aborted it once ("terminate called without an active exception", exit -6) on a busy 2-core box.
        torch.distributed.barrier()
    except BaseException:
        destroy_tp()
        raise
    # Done: leave without tearing the gloo pairs down. Even after the barrier a rank's teardown aborted it now and then
    # on a busy 2-core box ("terminate called without an active exception", exit -6); the OS closes the sockets.
    os._exit(0)


def _greedy(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    runner.add_seq("g")
    tokens = [int(runner.forward([SeqForward("g", prompt)]).logits[0][-1].argmax())]
    for _ in range(steps):
        tokens.append(int(runner.forward([SeqForward("g", [tokens[-1]])]).logits[0][-1].argmax()))
    return tokens


def test_tp2_fused_path_gives_the_torch_path_greedy_tokens(tiny_path, tmp_path):
    import multiprocessing as mp

    from target_service.tp import free_port

    path, prompt, steps = tiny_path("llama"), _tokens(7, 21), 6
    with llama.fused_elementwise(False):
        want = _greedy(ModelRunner(path, EngineConfig(device="cpu", dtype="float32", max_total_tokens=512,
                                                      attention_backend="torch")), prompt, steps)
    ctx = mp.get_context("spawn")
    port, out = free_port(), tmp_path / "tp2.txt"
    procs = [ctx.Process(target=_tp_rank_main, args=(r, port, path, prompt, steps, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], f"TP ranks exited with {codes}"
    tokens, kernels_used = out.read_text().split("\n")
    assert kernels_used.split() == ["activation", "norm", "rope"], "rank 0 ran the fused kernels"
    assert [int(t) for t in tokens.split()] == want


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_heads_fused_path_matches_torch_path(kind, tiny_path, tmp_path, monkeypatch):
    # The draft heads reuse DecoderLayer / Attention / MLP / RMSNorm (EAGLE's layer 0 has no input norm).
    used: list[str] = []
    real = llama._k
    monkeypatch.setattr(llama, "_k", lambda name: used.append(name) or real(name))
    from runtime.models.eagle import load_draft_head
    from tests.eagle.heads import make_eagle3_head, make_eagle_head

    target = tiny_path("llama")
    if kind == "eagle":
        path, algorithm, width = make_eagle_head(target, str(tmp_path / kind), num_layers=2), "EAGLE", 64
    else:
        path = make_eagle3_head(target, str(tmp_path / kind), draft_vocab_size=96, aux_layer_ids=[0, 1, 2])
        algorithm, width = "EAGLE3", 3 * 64
    engine = EngineConfig(device="cpu", dtype="float32", max_total_tokens=512, block_size=4)
    feats = torch.randn(6, width, generator=torch.Generator().manual_seed(0))
    outs = []
    for fused in (False, True):
        with llama.fused_elementwise(fused):
            model, config = load_draft_head(path, target, engine, algorithm)
            runner = ModelRunner(None, engine, config, model=model)
            runner.add_seq("s")
            tokens, f = [5, 17, 200, 33, 9, 250], model.project_features(feats) if kind == "eagle3" else feats
            first = runner.forward([SeqForward("s", tokens, logits="all", capture_hidden=True, input_features=f)])
            step = runner.forward([SeqForward("s", [40], capture_hidden=True, input_features=first.hidden[0][-1:])])
            outs.append([first.logits[0], first.hidden[0], step.logits[0], step.hidden[0]])
    assert set(used) == {"norm", "rope", "activation"}
    for want, got in zip(*outs):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_eagle3_head_fused_path_matches_torch_path(tiny_path, tmp_path, device):
    """The EAGLE-3 decoder layer's fused form (its post-attention residual add inside the norm's launch) gives the
    torch path's logits and recurrent hidden, prefill and a step."""
    from runtime.models.eagle import load_draft_head
    from tests.eagle.heads import make_eagle3_head

    target = tiny_path("llama")
    head = make_eagle3_head(target, str(tmp_path / "eagle3"), draft_vocab_size=96)
    cfg = EngineConfig(device=str(device), dtype="float32", block_size=4, max_total_tokens=512,
                       attention_backend="torch")
    outs = []
    for fused in (False, True):
        model, config = load_draft_head(head, target, cfg, "EAGLE3")
        runner = ModelRunner(None, cfg, config, model=model)
        runner.add_seq("s")
        feats = model.project_features(torch.randn(6, 3 * 64, generator=torch.Generator().manual_seed(0)).to(device))
        with llama.fused_elementwise(fused), torch.no_grad():
            first = runner.forward([SeqForward("s", _tokens(6, 4), logits="all", capture_hidden=True,
                                               input_features=feats)])
            step = runner.forward([SeqForward("s", [9], logits="last", capture_hidden=True,
                                              input_features=first.hidden[0][-1:])])
        outs.append([first.logits[0], first.hidden[0], step.logits[0], step.hidden[0]])
    for w, g in zip(*outs):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
