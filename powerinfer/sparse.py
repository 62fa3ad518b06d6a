"""The hybrid sparse FFN, applied to a finished dense model (`apply_hybrid_ffn`).

Each layer's neurons are split into a hot set (the GPU's under a placement) and a cold set (the
CPU's). Per decode step only the active neurons are computed: dot products with the gathered rows
of gate/up, and the down projection as an axpy over rows of the transposed down matrix
(`down_t`, one row per neuron). Which neurons are active comes from a mask source: the oracle
(the true activations, for testing and for profiling) or, later, a predictor. Prefill stays dense.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .model import FFN, Transformer

# (layer index, FFN input x (B, 1, dim)) -> active neurons (ffn_dim,) bool
MaskSource = Callable[[int, torch.Tensor], torch.Tensor]


class NeuronSet(nn.Module):
    """A subset of one layer's neurons, each neuron's rows stored contiguously."""

    def __init__(self, dense: FFN, idx: torch.Tensor):
        super().__init__()
        w1, b1 = dense.w1.weight.detach(), dense.w1.bias
        if dense.act == "relu":  # w1 is up (fc1) alone
            gate, up = None, w1
        else:  # w1 is [gate; up]
            gate, up = w1[:dense.ffn_dim][idx].contiguous(), w1[dense.ffn_dim:]
        self.register_buffer("idx", idx)
        self.register_buffer("gate", gate)  # (n, dim) rows of the gate projection
        self.register_buffer("up", up[idx].contiguous())  # (n, dim)
        self.register_buffer("up_b", None if b1 is None else b1.detach()[idx].contiguous())
        self.register_buffer("down_t", dense.w2.weight.detach().t()[idx].contiguous())  # (n, dim)
        self.act = dense.act

    def forward(self, x: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        # x: (B, 1, dim); active: (n,) bool over this set -> partial FFN output (B, 1, dim)
        sel = active.nonzero().squeeze(-1)
        up = x @ self.up[sel].t()  # (B, 1, k)
        if self.up_b is not None:
            up = up + self.up_b[sel]
        if self.act == "relu":
            h = F.relu(up)
        else:
            gate = x @ self.gate[sel].t()
            if self.act == "swiglu":
                h = F.silu(gate) * up
            elif self.act == "reglu":
                h = F.relu(gate) * up
            else:  # dreglu
                h = F.relu(gate) * F.relu(up)
        return h @ self.down_t[sel]  # axpy over the active rows of down_t


class HybridFFN(nn.Module):
    """Replaces `Block.ffn`: hot set + cold set, computing predicted-active neurons only."""

    def __init__(self, layer: int, dense: FFN, hot: torch.Tensor, masks: MaskSource):
        super().__init__()
        assert hot.shape == (dense.ffn_dim,) and hot.dtype == torch.bool, hot.shape
        self.layer, self.dense, self.masks = layer, dense, masks
        self.register_buffer("hot_mask", hot)
        self.hot = NeuronSet(dense, hot.nonzero().squeeze(-1))
        self.cold = NeuronSet(dense, (~hot).nonzero().squeeze(-1))
        self.down_b = dense.w2.bias

    def forward(self, x):
        if x.shape[1] != 1:  # prefill: dense and batched
            return self.dense(x)
        active = self.masks(self.layer, x)  # (ffn_dim,): the union over the batch's rows
        y = self.hot(x, active[self.hot.idx]) + self.cold(x, active[self.cold.idx])
        return y if self.down_b is None else y + self.down_b


def oracle_masks(model: Transformer, threshold: float = 0.0) -> MaskSource:
    """The true firing pattern: neurons whose |activation| exceeds `threshold` in any row."""
    def masks(layer: int, x: torch.Tensor) -> torch.Tensor:
        h = model.layers[layer].ffn.dense.neurons(x)  # (B, 1, ffn_dim)
        return (h.abs() > threshold).flatten(0, -2).any(0)
    return masks


def apply_hybrid_ffn(model: Transformer, masks: MaskSource | None = None,
                     hot: list[torch.Tensor] | None = None) -> Transformer:
    """Swap every layer's FFN for a HybridFFN. hot[i] is layer i's (ffn_dim,) bool placement
    (default: all neurons cold); masks defaults to the oracle."""
    masks = masks or oracle_masks(model)
    for i, block in enumerate(model.layers):
        assert isinstance(block.ffn, FFN), "apply_hybrid_ffn on a model that already has one"
        h = hot[i] if hot is not None else torch.zeros(model.args.ffn_dim, dtype=torch.bool)
        block.ffn = HybridFFN(i, block.ffn, h.to(block.ffn.w1.weight.device), masks)
    return model
