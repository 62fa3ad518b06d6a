"""The hybrid sparse FFN, applied to a finished dense model (`apply_hybrid_ffn`).

Each layer's neurons are split into a hot set (the GPU's under a placement) and a cold set (the
CPU's), each keeping its neurons' rows contiguous: gathered rows of gate/up and rows of the
transposed down matrix (`down_t`, one row per neuron). The dense FFN's weights are dropped: the
two sets hold every neuron once.

A neuron *fires* for a token when its score exceeds the layer's threshold: the score is
|act(gate x)| for SwiGLU and ReGLU (CATS), and the activation itself for dReLU and ReLU; ReLU-family
models use threshold 0 (their natural zeros), SwiGLU models a calibrated one. Per decode step only
the predicted-active neurons are computed (the union over the batch's rows); neurons that were
computed but score under the threshold are zeroed, so the sparse model is the thresholded model.
Which neurons are active comes from a mask source: the oracle (the true scores) or the
predictors, reading either the residual entering the FFN or the layer input (lookahead).

Prefill stays dense (every neuron, no threshold; over records on the CPU the kernel library's
product for many rows, else torch's matmuls `NeuronSet.PROMPT_ROWS` tokens at a time, so that a
token's answer does not depend on the tokens beside it) unless `token_masks` is
set, which applies each token's own mask in a many-token pass: evaluation uses it to measure the
sparse model's perplexity in one teacher-forced pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..formats.args import UNGATED
from .predictor import Predictors
from .transformer import FFN, Transformer, wide

# (layer, predictor input (..., dim)) -> per-row active neurons (..., ffn_dim) bool
MaskSource = Callable[[int, torch.Tensor], torch.Tensor]


# a decode step with a predictor in one kernel call where it can (`HybridFFN._fused_decode`;
# False: the modules' ops one at a time, as a baseline to time)
FUSED_DECODE = True


def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a @ w, in float32 where w was widened to it for bf16 a (`wide`), rounded to a's dtype."""
    return a @ w if a.dtype == w.dtype else (a.float() @ w).to(a.dtype)


def activate(act: str, gate: torch.Tensor | None, up: torch.Tensor):
    """Pre-activations -> (firing score, activation), both (..., n)."""
    if act == "relu":
        h = F.relu(up)
        return h, h
    if act == "gelu":
        h = F.gelu(up)
        return h.abs(), h
    if act == "dreglu":
        h = F.relu(gate) * F.relu(up)
        return h, h
    a = {"swiglu": F.silu, "reglu": F.relu,
         "geglu": lambda g: F.gelu(g, approximate="tanh")}[act](gate)
    return a.abs(), a * up


class NeuronSet(nn.Module):
    """A subset of one layer's neurons, each neuron's rows stored contiguously.

    fmt None keeps gate, up and down_t as torch tensors (the reference path); a kernel format
    (`kernels.FORMATS`) keeps them as the CPU kernel's neuron-major records instead, and a decode
    step runs the kernel, reading each computed neuron's rows once where they lie. Many-token
    steps widen the records (a view for f32/bf16, WIDEN_BYTES at a time for int8/4-bit)."""

    # widened rows a many-token step over quantized records holds at a time (measured on a 7B
    # layer's 5,504 Q4_0 neurons, 15 tokens: 287 ms in 2,048-neuron float32 chunks, 86 ms in
    # 512 KiB of bf16, 20 ms in 8 MiB; more gained nothing)
    WIDEN_BYTES = 8 << 20
    # rows (tokens) of every matmul of a many-token step in torch (`_widened_rows`: a set
    # without records on the CPU kernel, a GPU's, per-token masks): a prompt's tokens in chunks of
    # this many, the last padded with zeros, so that each product has one shape. torch's bf16 matmul
    # picks its kernel by the row count, and a row's sums then differ in their last bits with
    # the rows it is multiplied beside (a prompt's tail after a cached prefix, a chunk of a
    # prompt, several prompts in one step); a sparse model's predictor turns such bits into
    # other neurons. At one shape a row's product is the same floats wherever it sits (tested).
    # A small step pays the chunk's arithmetic, a little beside widening the rows (SmolLM2's
    # layer: 0.79 ms for 5 rows, 1.07 for 64)
    PROMPT_ROWS = 64

    def __init__(self, act: str, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                 idx: torch.Tensor, fmt: str | None = None):
        # w1: (2n, dim) [gate; up] when gated, else (n, dim) up (fc1); b1: (n,) or None;
        # w2: (dim, n) down; idx: (k,) the neurons of this set
        n = w2.shape[1]
        gate = w1[:n].index_select(0, idx) if act not in UNGATED else None  # (k, dim)
        up = (w1[n:] if act not in UNGATED else w1).index_select(0, idx)
        down_t = w2.t().index_select(0, idx)  # (k, dim)
        up_b = None if b1 is None else b1.index_select(0, idx)
        super().__init__()
        self._hold(act, idx, fmt, w2.dtype, w2.shape[0], up_b, (gate, up, down_t))

    @classmethod
    def from_rows(cls, act: str, idx: torch.Tensor, fmt: str | None, dtype: torch.dtype,
                  dim: int, up_b: torch.Tensor | None = None, rows=None,
                  records: torch.Tensor | None = None) -> "NeuronSet":
        """A set from its neurons' own rows: rows = (gate or None, up, down_t), each (k, dim),
        or, for a kernel format, `records` already packed (`kernels.pack`)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out._hold(act, idx, fmt, dtype, dim, up_b, rows, records)
        return out

    def _hold(self, act, idx, fmt, dtype, dim, up_b, rows=None, records=None):
        self.act, self.fmt, self.dtype, self.dim = act, fmt, dtype, dim
        self.register_buffer("idx", idx)
        self.register_buffer("up_b", up_b)
        if fmt is None:
            gate, up, down_t = rows
            self.register_buffer("gate", gate)
            self.register_buffer("up", up)
            self.register_buffer("down_t", down_t)
            self.register_buffer("records", None)
        else:
            if records is None:
                records = kernels.pack(*rows, fmt)
            self.register_buffer("records", records)
            self.register_buffer("all", torch.arange(len(idx)))
            self.register_buffer("bias32", None if up_b is None else up_b.float())

    def reformat(self, fmt: str | None) -> "NeuronSet":
        """The same neurons held in another format (None: the torch path)."""
        gate, up, down_t = self.rows()
        w1 = up if gate is None else torch.cat([gate, up])
        out = NeuronSet(self.act, w1, self.up_b, down_t.t(), torch.arange(len(self.idx)), fmt)
        out.idx = self.idx
        return out

    @classmethod
    def of(cls, dense: FFN, idx: torch.Tensor, fmt: str | None = None) -> "NeuronSet":
        b1 = None if dense.w1.bias is None else dense.w1.bias.detach()
        return cls(dense.act, dense.w1.weight.detach(), b1, dense.w2.weight.detach(), idx, fmt)

    def rows(self, lo: int = 0, hi: int | None = None):
        """(gate or None, up, down_t) of neurons lo:hi, (n, dim) each in the set's dtype."""
        if self.records is None:
            gate = None if self.gate is None else self.gate[lo:hi]
            return gate, self.up[lo:hi], self.down_t[lo:hi]
        rows = kernels.unpack(self.records[lo:hi], self.fmt, self.dim, self.act not in UNGATED)
        return tuple(None if r is None else r.to(self.dtype) for r in rows)

    def _blocks(self, f32: bool = False):
        """(lo, hi, (gate or None, up, down_t)) over the set's neurons in its dtype, for
        many-token steps: one block of views for the torch path and f32/bf16 records; else
        WIDEN_BYTES of widened rows at a time, written into this thread's one reused buffer (a
        block's rows are valid until the next block is asked for). f32: in float32 (the products
        of many bf16 rows where the CPU emulates bf16: `wide`), WIDEN_BYTES of them at a time."""
        n = len(self.idx)
        if self.records is None or self.fmt in kernels.PLAIN_FORMATS or n == 0:
            if not f32 or n == 0:
                yield 0, n, self.rows()
                return
            step = max(16, self.WIDEN_BYTES // (3 * self.dim * 4))
            for lo in range(0, n, step):
                hi = min(lo + step, n)
                yield lo, hi, tuple(None if t is None else t.float() for t in self.rows(lo, hi))
            return
        rows = 3 if self.act not in UNGATED else 2
        for lo, hi, w in kernels.widened(self.records, self.fmt, rows, self.dim,
                                         torch.float32 if f32 else self.dtype, self.WIDEN_BYTES):
            yield lo, hi, ((w[:, 0] if rows == 3 else None), w[:, -2], w[:, -1])

    def scores(self, x):  # x: (..., dim) -> firing scores (..., k)
        return torch.cat([self._pre(x, None, lo, hi, w)[0]
                          for lo, hi, w in self._blocks(wide(x))], -1)

    def _prompt_rows(self, x, threshold: float, keep):
        """Every neuron for many tokens x (B, T, dim) (keep: (B, T, k) or None): over records on
        the CPU the kernel library's product (`kernels.records_rows`, the records widened a block
        at a time), which a cold executor without torch runs too; else `_widened_rows`. Either
        way each row's answer is the same floats whatever rows share its step."""
        if (keep is None and self.records is not None and kernels.usable(self.records)
                and x.dtype in (torch.float32, torch.bfloat16)):
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return kernels.records_rows(rows, self.records, self.bias32, threshold, self.act,
                                        self.fmt).view(x.shape)
        return self._widened_rows(x, threshold, keep)

    def _widened_rows(self, x, threshold: float, keep):
        """`_prompt_rows` in torch: dense matmuls, a block of the set's rows at a time, over
        PROMPT_ROWS rows at a time (the last chunk padded). On a GPU in one product: its decode
        kernels add with atomics, so its sequences are not held to that."""
        dim = x.shape[-1]
        rows = x.reshape(-1, dim)
        n = rows.shape[0]
        C = self.PROMPT_ROWS if x.device.type == "cpu" else max(n, 1)
        pad = -n % C
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, dim)])
        if keep is not None:
            keep = keep.reshape(n, -1)
            keep = torch.cat([keep, keep.new_zeros(pad, keep.shape[-1])]) if pad else keep
        y = None
        for lo, hi, w in self._blocks(wide(rows)):
            for c in range(0, n + pad, C):
                score, h = self._pre(rows[c:c + C], None, lo, hi, w)
                if threshold > 0:
                    h = h * (score > threshold)
                if keep is not None:
                    h = h * keep[c:c + C, lo:hi]
                part = mm(h, w[2])
                if y is None:  # (in the products' dtype)
                    y = part.new_empty(n + pad, dim)
                if lo == 0:
                    y[c:c + C] = part
                else:
                    y[c:c + C] += part
        if y is None:  # no rows
            return x.new_zeros(x.shape)
        return y[:n].view(x.shape)

    def _pre(self, x, sel, lo=0, hi=None, rows=None):
        # rows: (gate, up, down_t) of neurons lo:hi (None: the whole set's)
        # index_select, not w[sel]: the advanced-indexing kernel is ~3x slower at gathering rows
        gate, up, _ = self.rows(lo, hi) if rows is None else rows
        pick = (lambda w: w) if sel is None else (lambda w: w.index_select(0, sel))
        x32 = x if up.dtype == x.dtype else x.float()  # (rows widened to float32: `_blocks`)
        u = (x32 @ pick(up).t()).to(x.dtype)
        if self.up_b is not None:
            u = u + pick(self.up_b[lo:hi])
        g = None if gate is None else (x32 @ pick(gate).t()).to(x.dtype)
        return activate(self.act, g, u)

    def forward(self, x, sel=None, threshold: float = 0.0, keep=None):
        # x: (B, T, dim); sel: indices into this set (None: all), or for the kernel a (k,) bool
        # mask over it; keep: per-row masks, (B, T, len(sel)) with indices, (B, T, k) with a mask
        if x.shape[0] == 0:  # an empty batch: nothing to compute
            return x.new_zeros(x.shape)
        B, T = x.shape[:2]
        if self.records is not None and T == 1:
            k = None if keep is None else keep.reshape(B * T, -1).contiguous()
            rows = x.reshape(B * T, -1)
            if kernels.on_triton(self.records):  # decode over a GPU's records: the Triton kernel
                from ..kernels import triton_ffn
                y = triton_ffn.neuron_ffn(rows, self.records, sel, k, self.bias32, threshold,
                                          self.act, self.fmt)
                return y.unsqueeze(1)
            if rows.dtype not in (torch.float32, torch.bfloat16):
                rows = rows.float()
            y = kernels.neuron_ffn(rows.contiguous(), self.records, self.all if sel is None else sel,
                                   k, self.bias32, threshold, self.act, self.fmt)
            return y.to(x.dtype).view(B, T, -1)
        if sel is None:  # every neuron, many tokens (a prompt's step)
            return self._prompt_rows(x, threshold, keep)
        score, h = self._pre(x, sel)
        if threshold > 0:
            h = h * (score > threshold)
        if keep is not None:
            h = h * keep
        # the axpy over the active rows of down_t, fused with their gather: (B, 1, k) -> (B, 1, dim)
        B = h.shape[0]
        y = F.embedding_bag(sel.expand(B, -1), self.down_t, per_sample_weights=h.reshape(B, -1),
                            mode="sum")
        return y.unsqueeze(1)


class BlockSlice(nn.Module):
    """Neurons lo..hi of one layer's FFN, all computed at every step (a plan with no predictor:
    the actor runtime's dense split), from a file whose gate and up are in 4-bit blocks, lo and
    hi multiples of 32: the slice's gate and up rows and its columns of down are whole blocks of
    the file, held as `quant.Q4Linear`s (the same bytes; down as one Q8_0 `KernelLinear` where
    the file keeps it in more bits) and run on the GEMVs the dense model runs, where the
    per-neuron kernel would read a neuron at a time and widen a many-token step's rows.
    Called as a NeuronSet is for every neuron (sel None); answers in float32, so that the
    executors' partial sums are added before the one rounding the dense FFN makes."""

    def __init__(self, act: str, idx: torch.Tensor, w1: nn.Module, down: nn.Module,
                 up_b: torch.Tensor | None):
        super().__init__()
        self.act, self.w1, self.down = act, w1, down
        self.register_buffer("idx", idx)
        self.up_b = None if up_b is None else nn.Parameter(up_b, requires_grad=False)

    def forward(self, x, sel=None, threshold: float = 0.0, keep=None):
        assert sel is None and keep is None and threshold <= 0, "a block slice computes every neuron"
        h = self.w1(x)  # (..., 2k): gate rows then up rows; (..., k) for plain ReLU
        gate, up = h.chunk(2, -1) if self.act not in UNGATED else (None, h)
        if self.up_b is not None:
            up = up + self.up_b
        return self.down(activate(self.act, gate, up)[1].float())  # same 8-bit blocks of h


def ffn_w1(ffn: nn.Module) -> nn.Module | None:
    """The gate+up projection of an FFN that computes every neuron: a dense FFN's, a block
    slice's (the actor runtime's dense split), a HybridFFN's hot block slice; None for neuron
    sets (a predictor picks their rows) and anything else."""
    if isinstance(ffn, HybridFFN):
        ffn = ffn.hot
    return ffn.w1 if isinstance(ffn, (BlockSlice, FFN)) else None


class HybridFFN(nn.Module):
    """Replaces `Block.ffn` (and takes over `Block.ffn_norm`, so that it sees the pre-norm
    residual a predictor reads): hot set + cold set, computing predicted-active neurons only."""

    def __init__(self, layer: int, dense: FFN, norm: nn.Module, hot: torch.Tensor,
                 masks: MaskSource | None = None, predictor_input: str = "ffn",
                 threshold: float = 0.0, fmt: str | None = None):
        super().__init__()
        assert hot.shape == (dense.ffn_dim,) and hot.dtype == torch.bool, hot.shape
        self._setup(layer, norm, dense.ffn_dim, NeuronSet.of(dense, hot.nonzero().squeeze(-1), fmt),
                    NeuronSet.of(dense, (~hot).nonzero().squeeze(-1), fmt), dense.w2.bias, masks,
                    predictor_input, threshold)

    @classmethod
    def from_sets(cls, layer: int, norm: nn.Module, ffn_dim: int, hot: NeuronSet,
                  cold: NeuronSet | None, down_b: torch.Tensor | None = None,
                  masks: MaskSource | None = None, predictor_input: str = "ffn",
                  threshold: float = 0.0) -> "HybridFFN":
        """From neuron sets read on their own (`partial.read_neuron_set`), with no dense FFN
        ever built; cold None: another process holds the cold neurons."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out._setup(layer, norm, ffn_dim, hot, cold, down_b, masks, predictor_input, threshold)
        return out

    def _setup(self, layer, norm, ffn_dim, hot, cold, down_b, masks, predictor_input, threshold):
        self.layer, self.norm, self.masks, self.threshold = layer, norm, masks, float(threshold)
        self.ffn_dim, self.predictor_input = ffn_dim, predictor_input
        self.hot = hot
        self.cold: NeuronSet | None = cold
        if down_b is not None and not isinstance(down_b, nn.Parameter):
            down_b = nn.Parameter(down_b, requires_grad=False)
        self.down_b = down_b
        self.token_masks = False
        self.stats: LayerStats | None = None  # set to a LayerStats to record what is computed
        self._fused = None  # ((masks, hot, cold), what `_fused_decode` calls or None), found at
        # its first call and again when one of the three changes

    def drop_cold(self):
        """Free the cold neurons: another process computes them (the actor runtime's cold
        executors), and only `hot_part` runs here."""
        self.cold = None

    def active(self, h, x, layer_input):
        # h: residual entering the FFN, x = norm(h), layer_input: the block's input, all
        # (B, T, dim) -> per-row masks (B, T, ffn_dim)
        if self.masks is None:  # oracle: the true scores
            out = torch.empty(*x.shape[:-1], self.ffn_dim, dtype=torch.bool, device=x.device)
            out[..., self.hot.idx] = self.hot.scores(x) > self.threshold
            out[..., self.cold.idx] = self.cold.scores(x) > self.threshold
            return out
        return self.masks(self.layer, layer_input if self.predictor_input == "layer" else h)

    def hot_part(self, x, union=None, rows=None):
        """The hot set's share of the FFN output (before the down bias): every hot neuron for a
        many-token step; for a decode step (x: (B, 1, dim)) the neurons in `union` (None: all,
        read in place), each row keeping its own `rows` (see `decode_rows`)."""
        if x.shape[1] != 1:
            return self.hot(x)
        return decode_rows(self.hot, x, union, rows, self.threshold) if len(self.hot.idx) else 0

    def forward(self, h, layer_input):
        assert self.cold is not None, "the cold neurons were dropped: use hot_part"
        x = self.norm(h)
        if x.shape[1] != 1 and not self.token_masks:  # prefill: dense and batched
            y = self.hot_part(x) + self.cold(x)
        elif x.shape[1] != 1:  # every token with its own mask (evaluation)
            y = self._token_masked(h, x, layer_input)
        elif (y := self._fused_decode(h, x, layer_input)) is not None:
            pass  # decode, the predictor and the neurons in one kernel call
        else:  # decode: the predicted-active neurons (the union over the batch's rows)
            active = self.active(h, x, layer_input).flatten(0, -2)  # (B, ffn_dim)
            union = active[0] if active.shape[0] == 1 else active.any(0)
            rows = None if self.masks is None else active  # the oracle's masks are the threshold
            y = self.hot_part(x, union, rows)
            if len(self.cold.idx):
                y = y + decode_rows(self.cold, x, union, rows, self.threshold)
            if self.stats is not None:
                self._count_decode(x, active, union)
        return y if self.down_b is None else y + self.down_b

    def _count_decode(self, x, active, union):
        # a decode step's record: the neurons computed (the batch's union), those whose score
        # passes the threshold in some row, and those that also are in that row's mask (whose up
        # and down rows the kernel reads); the activation mass of each. The rows are widened a
        # block at a time (`_blocks`), as `scores` does, not all of a layer's at once
        fired = torch.zeros_like(active)
        mag = torch.zeros(active.shape, dtype=torch.float32, device=active.device)
        for s in (self.hot, self.cold):
            for lo, hi, w in s._blocks() if len(s.idx) else ():
                score, act = s._pre(x, None, lo, hi, w)
                fired[:, s.idx[lo:hi]] = (score > self.threshold).flatten(0, -2)
                mag[:, s.idx[lo:hi]] = act.abs().float().flatten(0, -2)
        keep = fired & active
        self.stats.add(rows=1, computed=int(union.sum()), fired=int(fired.any(0).sum()),
                       hit=int(keep.any(0).sum()), mass_fired=float((mag * fired).sum()),
                       mass_hit=float((mag * keep).sum()))

    def _fused_decode(self, h, x, layer_input):
        """A decode step as `kernels.predicted_ffn` computes it (the predictor's logits, the
        rule, the neuron kernel: the values of the modules' path below, in one call), where the
        layer's neurons are one set of kernel records in the layer's order and its masks come
        from a `Predictors` the kernel's GEMV runs; None elsewhere (and while `stats` records)."""
        parts = (self.masks, self.hot, self.cold)  # found again whenever one of these changes
        if self._fused is None or any(a is not b for a, b in zip(self._fused[0], parts)):
            self._fused = (parts, self.predicted_records())
        B = x.shape[0] * x.shape[1]
        if not FUSED_DECODE or self._fused[1] is None or self.stats is not None or B > kernels.MAX_ROWS or \
                x.dtype not in (torch.float32, torch.bfloat16):
            return None
        s, preds, (w1, w2, fmt) = self._fused[1]
        p = (layer_input if self.predictor_input == "layer" else h).reshape(B, -1)
        if p.dtype not in (torch.float32, torch.bfloat16) or not kernels.usable(s.records):
            return None
        y = kernels.predicted_ffn(x.reshape(B, -1), p, w1, w2, fmt, preds.threshold, s.records,
                                  s.bias32, self.threshold, s.act, s.fmt)
        return y.to(x.dtype).view(*x.shape[:2], -1)

    def predicted_records(self):
        """(the neuron set, its `Predictors`, the predictor's matrices as the kernel reads them
        and their format: `Predictors.kernel_rows`) where a decode step can run as one
        `kernels.predicted_ffn` call (one set of kernel records in the layer's order, masks from a
        `Predictors` on the kernel's GEMV), else None."""
        preds = getattr(self.masks, "__self__", None)
        if not isinstance(preds, Predictors) or getattr(self.masks, "__func__", None) is not Predictors.active:
            return None
        sets = [s for s in (self.hot, self.cold) if s is not None and len(s.idx)]
        if len(sets) != 1 or sets[0].records is None or len(sets[0].idx) != self.ffn_dim:
            return None
        s, fmt = sets[0], preds.kernel_format(self.layer)
        if (fmt is None or kernels.on_triton(s.records)
                or not torch.equal(s.idx, torch.arange(self.ffn_dim, device=s.idx.device))):
            return None
        return s, preds, preds.kernel_rows(self.layer)  # (the records' device: checked each call)

    def _token_masked(self, h, x, layer_input):
        # computes every neuron, then keeps per token those both fired and predicted: the same
        # values the decode path computes from the active rows only. The rows are widened a
        # block at a time (`_blocks`), not a whole 4-bit set at once (a 7B layer's in float32:
        # 541 MB)
        predicted = None if self.masks is None else self.active(h, x, layer_input)
        y = 0
        for s in (self.hot, self.cold):
            for lo, hi, w in s._blocks(wide(x)):
                score, act = s._pre(x, None, lo, hi, w)
                fired = score > self.threshold
                chosen = None if predicted is None else predicted[..., s.idx[lo:hi]]
                keep = fired if chosen is None else fired & chosen
                y = y + mm(act * keep, w[2]).float()  # the blocks summed in float32
                if self.stats is not None:
                    mag = act.abs().float()
                    self.stats.add(computed=int((fired if chosen is None else chosen).sum()),
                                   fired=int(fired.sum()), hit=int(keep.sum()),
                                   mass_fired=float((mag * fired).sum()),
                                   mass_hit=float((mag * keep).sum()))
        if self.stats is not None:
            self.stats.add(rows=x.shape[0] * x.shape[1])
        return y.to(x.dtype)


def decode_rows(s: NeuronSet, x, union, rows, threshold: float):
    """One decode step of a neuron set: x (B, 1, dim); union (ffn_dim,) bool, the neurons to
    compute, or None for all of them (no predictor: the set's weights are read in place, with
    no gather); rows (B, ffn_dim) bool, each row's own predicted neurons (None: keep what fires).
    Each row keeps only its own neurons, so a sequence's output does not depend on what it is
    batched with."""
    if union is None:
        assert rows is None, "per-row masks come with their union"
        return s(x, None, threshold)
    if s.records is not None:  # the kernel reads the masks as they are: no index ops here
        whole = len(s.idx) == union.shape[-1]  # every neuron of the layer, in order
        keep = None
        if rows is not None and rows.shape[0] > 1:
            keep = (rows if whole else rows[:, s.idx]).unsqueeze(1)  # (B, 1, k)
        return s(x, union if whole else union[s.idx], threshold, keep)
    sel = union[s.idx].nonzero().squeeze(-1)
    if len(sel) == 0:  # nothing of this set is active (embedding_bag refuses empty bags)
        return x.new_zeros(x.shape)
    keep = None
    if rows is not None and rows.shape[0] > 1:
        keep = rows[:, s.idx.index_select(0, sel)].unsqueeze(1)  # (B, 1, k)
    return s(x, sel, threshold, keep)


@dataclass
class LayerStats:
    """What a HybridFFN computed while recording: rows (tokens, or decode steps), neurons computed,
    neurons fired, fired and computed (hit), and the activation mass of each."""
    rows: int = 0
    computed: int = 0
    fired: int = 0
    hit: int = 0
    mass_fired: float = 0.0
    mass_hit: float = 0.0

    def add(self, **kw):
        for k, v in kw.items():
            setattr(self, k, getattr(self, k) + v)


def apply_hybrid_ffn(model: Transformer, masks: MaskSource | None = None,
                     hot: list[torch.Tensor] | None = None, predictor_input: str = "ffn",
                     thresholds=None, fmt: str | None = "auto") -> Transformer:
    """Swap every layer's FFN for a HybridFFN. hot[i] is layer i's (ffn_dim,) bool placement
    (default: all neurons cold); masks defaults to the oracle; predictor_input is "ffn" (the
    residual entering the FFN) or "layer" (the layer input, read ahead of attention);
    thresholds[i] is layer i's firing threshold (default 0: ReLU-family natural zeros); fmt is
    the neuron sets' kernel format (None: the torch path; "auto": `kernels.format_for`)."""
    assert predictor_input in ("ffn", "layer"), predictor_input
    if fmt == "auto":
        fmt = kernels.format_for(model.tok_embeddings.weight)
    for i, block in enumerate(model.layers):
        assert isinstance(block.ffn, FFN), "apply_hybrid_ffn on a model that already has one"
        h = hot[i] if hot is not None else torch.zeros(model.args.ffn_dim, dtype=torch.bool)
        t = 0.0 if thresholds is None else float(thresholds[i])
        ffn = HybridFFN(i, block.ffn, block.ffn_norm, h.to(block.ffn.w1.weight.device), masks,
                        predictor_input, t, fmt)
        block.ffn, block.ffn_norm = ffn, nn.Identity()
    return model


class HostFFN(nn.Module):
    """A dense FFN kept in host memory under layer offload: its input comes over from the
    device and its output goes back."""

    def __init__(self, ffn: FFN):
        super().__init__()
        self.ffn = ffn.to("cpu")

    def forward(self, x, layer_input=None):
        return self.ffn(x.to("cpu")).to(x.device)


def offload_ffns(model: Transformer, hot: list) -> Transformer:
    """Layer offload on a device: the FFN of every layer whose hot mask is empty moves to the
    host; attention, embeddings, lm_head and the hot layers stay where the model is."""
    for block, h in zip(model.layers, hot):
        if not h.any():
            block.ffn = HostFFN(block.ffn)
    return model


def hybrid_layers(model: Transformer) -> list[HybridFFN]:
    return [b.ffn for b in model.layers if isinstance(b.ffn, HybridFFN)]
