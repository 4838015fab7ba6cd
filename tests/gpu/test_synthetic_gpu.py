"""SYNTHETIC acceptance on CUDA: the in-process speculative bench on a tiny bf16 Llama with CUDA graphs (decode and
verify widths re-captured per config) and the random EAGLE-3-sized head on the GPU. Prints the table; asserts the
machinery (every row filled, accept length near the expected one), never speed."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from tests.gpu.conftest import skip_without_gpu

skip_without_gpu()

BENCH = Path(__file__).resolve().parents[2] / "bench" / "speculative.py"


def test_speculative_bench_tiny_on_cuda(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_speculative_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    bench.main(["--tiny", "--device", "cuda:0", "--batch-sizes", "1", "8", "--configs", "4/1/5@5", "6/4/16@4",
                "--prompt-len", "64", "--max-new-tokens", "96", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    with capsys.disabled():
        print("\n" + (tmp_path / "results.md").read_text())
    rows = [r for r in result["rows"] if r["config"] != "AR"]
    assert len(rows) == 4 and result["device_name"] != "cpu"
    for r in rows:
        off = r["oracle"]["outputs_off_oracle"]
        assert r["t_verify_ms"] > 0 and r["t_draft_ms"] > 0 and r["efficiency"] is not None
        if r["accept_rate"] == 1.0 and off == 0:  # 4/1/5@5: every drafted token is the target's
            assert r["tau"] > 4.5, r
        elif off == 0:
            assert abs(r["tau"] - r["tau_expected"]) < 0.3 * r["tau_expected"], r
