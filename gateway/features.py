"""Target features held by the gateway for feature-based drafts (EAGLE family), as opaque row-major bytes.

The gateway never decodes them: it appends the rows each target call returns and slices the rows a draft pod has
not seen yet. Row p is the target feature of committed token p, so a sequence with L committed tokens holds L-1 rows
(the last token has no KV yet). Keeping every row lets a draft pod that lost its state be re-prefilled. A log may
start past row 0 (`start`): with the draft in the target's process the rows of fused steps stay on the pod, and the
log then holds only the rows since, which is all a draft that kept its state needs.
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
        self.start = 0  # position of the first row held

    @property
    def end(self) -> int:
        """One past the position of the last row held."""
        return self.start + self.num_rows

    def reset(self, rows: FeatureRows | None, start: int = 0) -> None:
        """Hold `rows` (None: none) from position `start` on."""
        self._chunks, self.num_rows, self.start = [], 0, start
        if rows is not None:
            self.append(rows)

    def covers(self, start: int, end: int) -> bool:
        return self.start <= start and end == self.end

    def append(self, rows: FeatureRows) -> None:
        if self._chunks and (rows.dtype, rows.row_shape) != (self._chunks[0].dtype, self._chunks[0].row_shape):
            raise ValueError("feature rows changed dtype or shape mid-sequence")
        self._chunks.append(rows)
        self.num_rows += rows.num_rows

    def slice(self, start: int, end: int) -> FeatureRows | None:
        """Rows of positions [start, end) as one FeatureRows; None when the log is empty. Walks chunks from the end,
        since drafts usually ask for the newest rows only."""
        if not self._chunks:
            return None
        if not self.start <= start <= end <= self.end:
            raise ValueError(f"feature rows [{start}, {end}) out of range (have [{self.start}, {self.end}))")
        start, end = start - self.start, end - self.start
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
