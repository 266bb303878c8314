"""Ragged: many variable-length id sequences in one flat int32 array and its offsets (the encoded
datasets' storage: one array instead of one per example, cut and padded with numpy at once)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


class Ragged:
    """Sequences of ids in one flat array: sequence i is flat[offsets[i]:offsets[i + 1]] (a view)."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def of(cls, seqs: Sequence[Sequence[int]]) -> Ragged:
        offsets = np.concatenate([[0], np.cumsum(np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs)))])
        return cls(np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(offsets[-1])), offsets)

    def __getitem__(self, i: int | slice) -> np.ndarray | Ragged:
        if isinstance(i, slice):  # a run of sequences over the same flat array
            r = range(len(self))[i]
            if r.step != 1:
                raise ValueError(f"Ragged takes contiguous slices only, got step {r.step}")
            return Ragged(self.flat, self.offsets[r.start : max(r.start, r.stop) + 1])
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} of {len(self)}")
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)
