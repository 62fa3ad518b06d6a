"""The activation predictors at run time: per layer a low-rank MLP whose logits say which
FFN neurons fire (`Predictors`), loaded from a bundle (`sparsity.train` trains them)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..formats.bundle import Bundle, check_tensor
from ..formats.kquants import widen_rows

INPUTS = ("ffn", "layer")

# How a CPU holds the predictors it runs in bf16 on the kernel's GEMV for decode rows: "q8x16"
# (each matrix also as 8-bit codes, 16 rows a group: read at about twice the rate of its bf16
# rows; see `Predictors.kernel_rows`) or "model" (the bf16 rows); and a GPU's on the Triton
# kernels: their rows as Q8_0 blocks in place of the 16-bit matrices ("q8x16", `device_format`),
# or the 16-bit matrices ("model"). A measurement switch: POWERINFER_PREDICTOR_ROWS=model.
ROWS = os.environ.get("POWERINFER_PREDICTOR_ROWS", "q8x16")


def device_format(device: str | torch.device) -> str | None:
    """"q8_0" where predictors on `device` run on the Triton kernels (a GPU; the CPU under
    TRITON_ON_CPU) and hold each matrix whose width is a multiple of 32 as Q8_0 rows: 1.06
    bytes a weight against 2, in the VRAM budget (a rank-1024 70B-shaped layer's 75 MB in bf16,
    40 MB so) and read at every step; the same 8-bit rounding as a CPU's q8x16 rows. Else None
    (the matrices in `run_dtype`)."""
    d = torch.device(device)
    if ROWS != "q8x16" or (d.type == "cpu" and not kernels.TRITON_ON_CPU):
        return None
    from ..kernels import triton_ffn
    return "q8_0" if triton_ffn.available(d) else None


def held_bytes(ranks: list[int], dim: int, ffn_dim: int, dtype_bytes: int,
               fmt: str | None = None) -> int:
    """Bytes of predictors of these ranks as a device holds them: fc1 (r, dim) and fc2
    (ffn_dim, r) in `dtype_bytes` a weight, or with fmt "q8_0" each matrix whose width is a
    multiple of 32 in Q8_0 rows (`device_format`)."""
    def matrix(rows: int, cols: int) -> int:
        return rows * (kernels.row_bytes("q8_0", cols) if fmt == "q8_0" and cols % 32 == 0
                       else cols * dtype_bytes)
    return sum(matrix(r, dim) + matrix(ffn_dim, r) for r in ranks)


def _in_calls(fn, rows: torch.Tensor, n: int) -> torch.Tensor:
    """fn over `rows` n at a time (at least one call), the outputs concatenated."""
    out = [fn(rows[i:i + n]) for i in range(0, max(rows.shape[0], 1), n)]
    return out[0] if len(out) == 1 else torch.cat(out)


def predict(fc1: torch.Tensor, fc2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # x: (N, dim) -> (N, ffn_dim) bool, PowerInfer's rule
    return F.relu(x @ fc1.T) @ fc2.T >= 0


class Predictors(nn.Module):
    """The per-layer predictors of one input ("ffn" or "layer"), ready to run."""

    def __init__(self, fc1: list[torch.Tensor], fc2: list[torch.Tensor], input: str,
                 threshold: float = 0.0):
        super().__init__()
        assert input in INPUTS and len(fc1) == len(fc2), (input, len(fc1), len(fc2))
        self.input, self.threshold = input, float(threshold)  # active: logit >= threshold
        # the matrices' type (where they run on the Triton kernels, each held as Q8_0 rows where
        # its width allows: `device_format`; widened back to it for torch's matmuls)
        self.dtype = fc1[0].dtype if fc1 else torch.float32
        if fc1 and device_format(fc1[0].device) == "q8_0":
            fc1, fc2 = ([kernels.quantize_rows(w, "q8_0") if w.shape[1] % 32 == 0 else w
                         for w in ws] for ws in (fc1, fc2))
        self.fc1 = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in fc1)
        self.fc2 = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in fc2)
        packs = self._pack_x16()  # buffers, so that a process's held bytes count them
        self.held_x16 = packs is not None
        for i, (a, b) in enumerate(packs or []):
            self.register_buffer(f"x16_fc1_{i}", a, persistent=False)
            self.register_buffer(f"x16_fc2_{i}", b, persistent=False)

    @property
    def ranks(self) -> list[int]:
        return [w.shape[0] for w in self.fc1]

    def logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        # x: (..., dim) -> (..., ffn_dim)
        fc1, fc2 = self.fc1[layer], self.fc2[layer]
        rows = x.reshape(-1, x.shape[-1])
        if self._triton(rows) or (fc1.dtype == torch.uint8 and rows.device == fc1.device):
            # (Q8_0 rows: a prompt's too, MAX_ROWS a call, not widened whole into the budget)
            from ..kernels import triton_ffn
            out = _in_calls(lambda r: triton_ffn.predictor_logits(r, fc1, fc2), rows,
                            triton_ffn.MAX_ROWS)
            return out.view(*x.shape[:-1], -1)
        fmt = self.kernel_format(layer)
        if fmt and x.dtype in (torch.float32, torch.bfloat16):
            # decode rows on the kernel's GEMV, which reads the weights at the memory's rate
            # where torch's bf16 GEMV reaches a third of it (float32 logits either way), and
            # computes each row alone: a row's masks do not depend on the rows beside it, nor,
            # run MAX_ROWS at a time (as the predictor actor's native loop runs them), on the
            # batch's size
            w1, w2, fmt = self.kernel_rows(layer)
            out = _in_calls(lambda r: kernels.pred_logits(r, w1, w2, fmt), rows, kernels.MAX_ROWS)
            return out.view(*x.shape[:-1], -1)
        fc1, fc2 = self.matrices(layer)
        return F.relu(x.to(fc1.dtype) @ fc1.T) @ fc2.T

    def matrices(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's fc1 (r, dim) and fc2 (ffn_dim, r) as matrices of `self.dtype` (Q8_0 rows
        widened: a transient of the layer's size, for rows on another device than theirs)."""
        def matrix(w: torch.Tensor) -> torch.Tensor:
            if w.dtype != torch.uint8:
                return w
            return widen_rows(w, "Q8_0", w.shape[1] // 34 * 32).to(self.dtype)
        return matrix(self.fc1[layer]), matrix(self.fc2[layer])

    def kernel_format(self, layer: int) -> str | None:
        """The kernel library's GEMV format this layer's matrices run in for decode rows: on a
        CPU where the library runs, both widths a multiple of 32 (the kernel's), "q8x16" for bf16
        matrices held so (`held_x16`), else their own precision ("bf16", "f32"); None elsewhere
        (torch's matmuls)."""
        fc1, fc2 = self.fc1[layer], self.fc2[layer]
        fmt = {torch.bfloat16: "bf16", torch.float32: "f32"}.get(fc1.dtype)
        ok = fmt and kernels.usable(fc1) and fc1.shape[1] % 32 == 0 and fc2.shape[1] % 32 == 0
        return None if not ok else "q8x16" if self.held_x16 else fmt

    def kernel_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        """This layer's two matrices as the kernel's GEMV reads them, and their format (see
        `kernel_format`; a layer the kernel runs)."""
        fmt = self.kernel_format(layer)
        if fmt == "q8x16":
            return getattr(self, f"x16_fc1_{layer}"), getattr(self, f"x16_fc2_{layer}"), fmt
        return kernels._as_rows(self.fc1[layer], fmt), kernels._as_rows(self.fc2[layer], fmt), fmt

    def decode_bytes(self) -> int:
        """The bytes of every layer's matrices that a decode step reads (`kernel_rows` where the
        kernel runs them, else the matrices)."""
        return sum(w.nbytes for i in range(len(self.fc1))
                   for w in (self.kernel_rows(i)[:2] if self.kernel_format(i) else
                             (self.fc1[i], self.fc2[i])))

    def _pack_x16(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Each layer's matrices as Q8_0 blocks (the gguf package's rounding, a scale per 32
        weights) in the kernel's 16-row groups (`kernels.pack_q8x16`), where decode rows run on
        the CPU kernel in bf16 (`run_dtype`) and the shapes allow (widths a multiple of 32, the
        neurons of 16): 1.06 bytes a weight where bf16 rows take 2, and the q8x16
        GEMV reads them at about twice the rate (a rank-128 7B-shape layer's 3.9 MB: 0.096 ->
        0.047 ms on a Zen 5 VM, `benchmarks/predictor_rows.py`). Else None. The bf16 matrices
        stay (a prompt's rows run on torch's matmuls)."""
        if ROWS != "q8x16" or not self.fc1:
            return None
        for fc1, fc2 in zip(self.fc1, self.fc2):
            r, dim = fc1.shape
            if (fc1.dtype != torch.bfloat16 or not kernels.usable(fc1) or dim % 32 or r % 32
                    or fc2.shape[0] % 16):
                return None
        return [(kernels.pack_q8x16(kernels.quantize_rows(fc1, "q8_0")),
                 kernels.pack_q8x16(kernels.quantize_rows(fc2, "q8_0")))
                for fc1, fc2 in zip(self.fc1, self.fc2)]

    def active(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        # x: (..., dim) -> per-row predicted-active neurons (..., ffn_dim) bool
        rows = x.reshape(-1, x.shape[-1])
        if self._triton(rows):  # the MLP and the rule in two kernels on the device
            from ..kernels import triton_ffn
            keep = triton_ffn.predict(rows, self.fc1[layer], self.fc2[layer], self.threshold)[0]
            return keep.view(*x.shape[:-1], -1)
        return self.logits(layer, x) >= self.threshold

    def _triton(self, rows: torch.Tensor) -> bool:
        # decode rows on a GPU (Triton installed): the predictor kernels (`triton_ffn.predict`)
        return (rows.shape[0] <= kernels.MAX_ROWS and kernels.on_triton(self.fc1[0])
                and rows.device == self.fc1[0].device)

    def mask(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """(ffn_dim,) bool: the neurons predicted active for any row of x ((B, T, dim) or
        (N, dim))."""
        return self.active(layer, x.reshape(-1, x.shape[-1])).any(0)


def run_dtype(compute_dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype predictors run in beside a model computing in `compute_dtype`: bf16 with a bf16
    model on a CPU where the kernel library runs (its bf16 GEMV; the logits still float32); on a
    GPU the model's own 16-bit type (the Triton kernels widen each weight as they read it and
    sum in float32: half the bytes of float32 matrices, in the VRAM budget and read at every
    step); else float32. Both runtimes take it from here, so they predict the same masks."""
    kind = torch.device(device).type
    if compute_dtype == torch.bfloat16 and kind == "cpu" and kernels.available():
        return torch.bfloat16
    if kind != "cpu" and compute_dtype in (torch.bfloat16, torch.float16):
        return compute_dtype
    return torch.float32


def load_predictors(bundle: Bundle, input: str = "ffn", dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> Predictors:
    """The bundle's predictors for `input`; BundleError if they were never trained."""
    if input not in INPUTS:
        raise ValueError(f"predictor input {input!r}: one of {', '.join(INPUTS)}")
    bundle.require(f"predictors.{input}", "train-predictors")
    name = f"predictors.{input}.safetensors"
    t = bundle.load_tensors(name)
    dim, ffn_dim = bundle.manifest.model.get("dim"), bundle.manifest.model.get("ffn_dim")
    for i in range(bundle.n_layers):  # (a wrong shape failed in the kernel, naming neither)
        check_tensor(bundle.path, name, f"fc1.{i}", t.get(f"fc1.{i}"), (None, dim))
        check_tensor(bundle.path, name, f"fc2.{i}", t.get(f"fc2.{i}"),
                     (ffn_dim, t[f"fc1.{i}"].shape[0]))

    def tensor(name):
        return torch.from_numpy(t[name]).to(device=device, dtype=dtype)

    L = bundle.n_layers
    threshold = bundle.manifest.settings.get(f"predictors.{input}", {}).get("threshold", 0.0)
    return Predictors([tensor(f"fc1.{i}") for i in range(L)],
                      [tensor(f"fc2.{i}") for i in range(L)], input, threshold)
