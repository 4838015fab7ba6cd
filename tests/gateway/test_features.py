"""FeatureLog slices the rows a draft has not seen from the chunks the target returned, byte for byte."""
from __future__ import annotations

import numpy as np
import pytest

from gateway.features import FeatureLog, FeatureRows


def rows(values: np.ndarray) -> FeatureRows:
    return FeatureRows("float32", tuple(values.shape[1:]), values.astype(np.float32).tobytes(), values.shape[0])


def test_slices_across_chunks_equal_numpy_slicing():
    full = np.arange(30 * 4, dtype=np.float32).reshape(30, 4)
    log = FeatureLog()
    for lo, hi in [(0, 7), (7, 8), (8, 20), (20, 30)]:
        log.append(rows(full[lo:hi]))
    assert log.num_rows == 30
    for start, end in [(0, 30), (5, 9), (7, 8), (19, 30), (29, 30), (12, 12)]:
        got = log.slice(start, end)
        assert got.num_rows == end - start
        assert np.frombuffer(got.data, np.float32).reshape(-1, 4).tolist() == full[start:end].tolist()


def test_reset_and_validation():
    log = FeatureLog()
    assert log.slice(0, 0) is None
    log.reset(rows(np.zeros((3, 2))))
    assert log.num_rows == 3
    with pytest.raises(ValueError):
        log.slice(2, 5)
    with pytest.raises(ValueError):
        log.append(rows(np.zeros((1, 3))))


def test_a_log_that_starts_past_row_zero():
    """With the draft in the target's process the rows of fused steps stay on the pod: the log restarts at the
    committed end and holds later rows at their positions."""
    full = np.arange(20 * 3, dtype=np.float32).reshape(20, 3)
    log = FeatureLog()
    log.reset(None, start=12)
    assert (log.start, log.end) == (12, 12) and log.covers(12, 12) and not log.covers(0, 12)
    log.append(rows(full[12:15]))
    log.append(rows(full[15:17]))
    assert log.covers(13, 17) and not log.covers(11, 17) and not log.covers(13, 16)
    got = log.slice(13, 17)
    assert np.frombuffer(got.data, np.float32).reshape(-1, 3).tolist() == full[13:17].tolist()
    with pytest.raises(ValueError, match=r"\[11, 17\) out of range \(have \[12, 17\)\)"):
        log.slice(11, 17)
