"""bench/speculative.py smoke (synthetic acceptance): the in-process sweep on a tiny config, one batch size and one
config, writes results.json / results.md with every reported field (speed is measured in bench/, never asserted)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "speculative.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_speculative", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_speculative_bench_smoke_inprocess(tmp_path):
    bench = load_bench()
    bench.main(["--tiny", "--device", "cpu", "--batch-sizes", "2", "--configs", "3/1/4@4", "--prompt-len", "12",
                "--max-new-tokens", "13", "--head-hidden", "64", "--draft-vocab", "256", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["synthetic_acceptance"] and "SYNTHETIC" in result["label"]
    assert "SYNTHETIC ACCEPTANCE" in (tmp_path / "results.md").read_text()
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"AR", "chain 3/1/4"}
    for row in rows.values():
        for field in ("batch_size", "tau", "tau_expected", "tok_s", "speedup", "t_verify_ms", "t_draft_ms",
                      "efficiency", "accept_rate", "tokens", "target_steps", "verify_over_ar_step", "speedup_bound"):
            assert row[field] is not None, field
        assert row["speedup_bound"] == pytest.approx(row["tau"] / row["verify_over_ar_step"])
        assert row["batch_size"] == 2 and row["tok_s"] > 0 and row["t_verify_ms"] > 0
    chain = rows["chain 3/1/4"]
    # tau 4 = a chain of 3 accepted in full: the rate is 1 and every drafted oracle token is accepted (the last step
    # may be cut by max_new_tokens).
    assert chain["accept_rate"] == 1.0 and chain["tau_expected"] == 4.0
    assert chain["tau"] > 3.0 and chain["t_draft_ms"] > 0
    assert chain["oracle"]["diverged_seqs"] == 0 and chain["oracle"]["unknown_seqs"] == 0
    assert chain["oracle"]["outputs_off_oracle"] == 0 and chain["oracle"]["calibration_runs"] == 0
    assert rows["AR"]["tau"] == 1.0 and rows["AR"]["speedup"] == 1.0


def test_services_full_batch_window_counts_only_while_every_sequence_decodes():
    path = BENCH.parent / "speculative_services.py"
    spec = importlib.util.spec_from_file_location("bench_speculative_services", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Three streams of chunk (arrival time, tokens): the third joins a wave later (first token at 2.0), the first
    # finishes first (last token at 5.0); the window (2.0, 5.0] holds the calls at 3, 4 and 5.
    outs = [{"chunks": [(1.0, 1), (2.0, 4), (3.0, 4), (4.0, 4), (5.0, 3)]},
            {"chunks": [(1.0, 1), (2.0, 4), (3.0, 4), (4.0, 4), (5.0, 4), (6.0, 4), (7.0, 1)]},
            {"chunks": [(2.0, 1), (3.0, 4), (4.0, 4), (5.0, 4), (6.0, 4), (7.0, 4)]}]
    assert module.full_batch(outs) == (4 + 4 + 3 + 4 + 4 + 4 + 4 + 4 + 4, 3.0)
    assert module.full_batch([{"chunks": [(1.0, 1)]}, {"chunks": [(2.0, 1)]}]) == (0, 0.0)  # never all decoding
    assert module.full_batch([{"chunks": []}]) == (0, 0.0)
