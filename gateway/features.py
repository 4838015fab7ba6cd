"""Target features held by the gateway for feature-based drafts (EAGLE family), as opaque row-major bytes.

The gateway never decodes them: it appends the rows each target call returns and slices the rows a draft pod has
not seen yet. Row p is the target feature of committed token p, so a sequence with L committed tokens holds L-1 rows
(the last token has no KV yet). Keeping every row lets a draft pod that lost its state be re-prefilled.
"""
from __future__ import annotations

from dataclasses import dataclass

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class FeatureRows:
    dtype: str
    row_shape: tuple[int, ...]  # shape of one row, e.g. (hidden,) or (3 * hidden,)
    data: bytes
    num_rows: int

    @property
    def row_bytes(self) -> int:
        n = _ITEMSIZE[self.dtype]
        for d in self.row_shape:
            n *= d
        return n


class FeatureLog:
    def __init__(self) -> None:
        self._chunks: list[FeatureRows] = []
        self.num_rows = 0

    def reset(self, rows: FeatureRows | None) -> None:
        self._chunks, self.num_rows = [], 0
        if rows is not None:
            self.append(rows)

    def append(self, rows: FeatureRows) -> None:
        if self._chunks and (rows.dtype, rows.row_shape) != (self._chunks[0].dtype, self._chunks[0].row_shape):
            raise ValueError("feature rows changed dtype or shape mid-sequence")
        self._chunks.append(rows)
        self.num_rows += rows.num_rows

    def slice(self, start: int, end: int) -> FeatureRows | None:
        """Rows [start, end) as one FeatureRows; None when the log is empty. Walks chunks from the end, since drafts
        usually ask for the newest rows only."""
        if not self._chunks:
            return None
        if not 0 <= start <= end <= self.num_rows:
            raise ValueError(f"feature rows [{start}, {end}) out of range (have {self.num_rows})")
        first = self._chunks[0]
        rb = first.row_bytes
        pieces: list[bytes] = []
        chunk_end = self.num_rows
        for chunk in reversed(self._chunks):
            chunk_start = chunk_end - chunk.num_rows
            lo, hi = max(start, chunk_start), min(end, chunk_end)
            if lo < hi:
                pieces.append(chunk.data[(lo - chunk_start) * rb:(hi - chunk_start) * rb])
            if chunk_start <= start:
                break
            chunk_end = chunk_start
        return FeatureRows(first.dtype, first.row_shape, b"".join(reversed(pieces)), end - start)
