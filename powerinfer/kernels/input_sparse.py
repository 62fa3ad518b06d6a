"""Input sparsity (TEAL) for a 4-bit projection: the mixin of the CPU's `Q4Linear` and
`KQuantLinear` (`powerinfer.model.quant`) and the GPU's `BlockLinear` (`triton_linear`), with the
kernel library's one-row product over a copy held by input channel (q4c)."""
from __future__ import annotations

import torch

from .. import kernels


class InputSparse:
    """Input sparsity (TEAL) for a 4-bit projection that can hold its matrix in the q4c layout
    (`_q4c`): `sparsify_input` makes the copy, `sparse_product` runs a one-row step on it."""

    # (the same matrix in the q4c layout, its kind (`kernels.Q4C_KINDS`), the input's threshold)
    # and the channels kept and seen (int64, 2), or None
    sparse: tuple | None = None
    sparse_stats: torch.Tensor | None = None
    sparsifiable = True  # whether `_q4c` can hold this matrix

    def _q4c(self) -> tuple[torch.Tensor, int]:
        """The matrix in the q4c layout, and its kind."""
        raise NotImplementedError

    def sparsify_input(self, threshold: float | None, stats: torch.Tensor | None = None):
        """Input sparsity from now on: a one-row step (decode) zeroes the input entries at or
        under `threshold` and reads only the other channels' weights, from a copy of the matrix
        held by input channel (the same bytes again); stats, where given, counts the channels
        kept and seen. None: dense again (the copy dropped)."""
        if threshold is None:
            self.sparse = self.sparse_stats = None
            return
        assert self.sparsifiable, self
        w, kind = self._q4c()
        self.sparse, self.sparse_stats = (w, int(kind), float(threshold)), stats

    q4c_dtypes = (torch.float32, torch.bfloat16)  # the inputs `_q4c_product` takes

    def sparse_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x W^T (no bias) from the q4c copy where x is one row of `q4c_dtypes` and the copy is
        made, else None (the dense product's turn)."""
        if self.sparse is None or x.numel() != self.in_features or x.dtype not in self.q4c_dtypes:
            return None
        w, kind, t = self.sparse
        return self._q4c_product(x, w, kind, t)

    @property
    def sparse_rows(self) -> int:
        """The output rows the q4c copy holds (the first rows; all of them but where a subclass
        holds the rest in runs of their own: `KQuantLinear`)."""
        return self.out_features

    def _q4c_product(self, x: torch.Tensor, w: torch.Tensor, kind: int, t: float) -> torch.Tensor:
        """The one-row product over the copy (the CPU kernel's, which counts the channels)."""
        return kernels.linear_q4c(x, w, self.sparse_rows, kind, t, self.sparse_stats)
