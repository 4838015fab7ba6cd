"""--mem-fraction-static omitted on CUDA: the KV pool is sized for the GPU (SGLang's automatic fraction), and
`tandem serve` splits one GPU's budget between the target and a draft placed on it instead of giving both the
whole of it. Checked without a GPU: the GPU's size is an input."""
from __future__ import annotations

import pytest
import torch

from runtime.memory import GiB, auto_mem_fraction_static
from tandem.args import DEFAULT_DRAFT, DEFAULT_MODEL
from tandem.cli import build_parser
from tandem.launch import commands, gpu_memory_shares
from tandem.services import _engine_config


def _serve(*flags: str):
    args = build_parser().parse_args(["serve", *flags])
    args.speculative_algorithm = args.speculative_algorithm or "NONE"
    args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 3, 1, 4
    return args


@pytest.mark.parametrize("gib, fraction", [(24, 0.817), (80, 0.875), (141, 0.886), (8, 0.65)])
def test_automatic_fraction_leaves_a_reserve_that_grows_with_the_gpu(gib, fraction):
    assert auto_mem_fraction_static(gib * GiB) == pytest.approx(fraction, abs=1e-3)


def test_target_and_draft_on_one_gpu_split_its_budget():
    shares = gpu_memory_shares(_serve("--device", "cuda", "--speculative-algorithm", "STANDALONE"),
                               ["target-0", "draft-0", "gateway"], lambda gpu: 80 * GiB)
    assert set(shares) == {"target-0", "draft-0"}
    assert shares["target-0"] + shares["draft-0"] == pytest.approx(0.875, abs=2e-3)
    size = {p: sum(f.stat().st_size for f in p.glob("*.safetensors")) for p in (DEFAULT_MODEL, DEFAULT_DRAFT)}
    draft_part = size[DEFAULT_DRAFT] / (size[DEFAULT_MODEL] + size[DEFAULT_DRAFT])  # 3.8 of 20.7 MB
    assert shares["draft-0"] == pytest.approx(0.875 * draft_part, abs=2e-3)


def test_separate_gpus_and_ngram_keep_the_whole_budget():
    total = {0: 80 * GiB, 1: 24 * GiB}.__getitem__
    apart = gpu_memory_shares(_serve("--device", "cuda", "--speculative-algorithm", "STANDALONE",
                                     "--draft-base-gpu-id", "1"), ["target-0", "draft-0"], total)
    assert apart == {"target-0": 0.875, "draft-0": 0.817}
    ngram = gpu_memory_shares(_serve("--device", "cuda", "--speculative-algorithm", "NGRAM"),
                              ["target-0", "draft-0"], total)
    assert ngram == {"target-0": 0.875}  # the n-gram draft holds no GPU memory
    two = gpu_memory_shares(_serve("--device", "cuda:1", "--num-target-replicas", "2"), ["target-0", "target-1"],
                            total)
    assert two == {"target-0": 0.408, "target-1": 0.408}


def test_explicit_sizes_and_cpu_are_left_alone():
    total = lambda gpu: 80 * GiB  # noqa: E731
    assert gpu_memory_shares(_serve("--device", "cuda", "--mem-fraction-static", "0.5"), ["target-0"], total) == {}
    assert gpu_memory_shares(_serve("--device", "cuda", "--max-total-tokens", "4096"), ["target-0"], total) == {}
    assert gpu_memory_shares(_serve("--device", "cpu"), ["target-0"], total) == {}


class _Props:
    total_memory = 80 * GiB


def test_serve_passes_each_child_its_share_and_a_lone_service_sizes_for_its_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Props())
    cmds = commands(_serve("--device", "cuda", "--speculative-algorithm", "STANDALONE"))
    fractions = {n: float(c[len(c) - 1 - c[::-1].index("--mem-fraction-static") + 1]) for n, c in cmds.items()
                 if "--mem-fraction-static" in c}
    assert set(fractions) == {"target-0", "draft-0"} and sum(fractions.values()) <= 0.876
    target = build_parser().parse_args(["target", "--device", "cuda"])
    assert _engine_config(target, target=True).mem_fraction_static == 0.875
    assert _engine_config(build_parser().parse_args(["target", "--device", "cpu"]), target=True
                          ).mem_fraction_static is None
