"""Workarounds for library versions and platforms, kept in one place."""
from __future__ import annotations

import numpy as np


def gguf_reader(path):
    """A `gguf.GGUFReader` that parses over a plain ndarray view of its memory map.

    The stock reader slices an `np.memmap` hundreds of thousands of times while reading metadata,
    and memmap's `__array_finalize__` dominates (over 3 s for a 49k-token vocabulary); the same
    parse over a plain view of the same mapping takes a fraction of that.
    """
    import gguf

    class _PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

    return _PlainViewReader(path, "r")
