"""Synthetic ReLU LLMs of real shapes, written as GGUF, for speed benchmarks of the sparse engine.

`write_synthetic(path, preset="7b", n_layers=8)` writes a LLaMA-architecture GGUF file (ReGLU FFN,
relu(gate x) * up as in ReluLLaMA, declared by the key `powerinfer.ffn_activation`) with random
weights in which each FFN neuron fires on a planted fraction of tokens: a power law over a random
order of the neurons, mean firing rate 1 - sparsity. Our loader, llama.cpp-style tools and the
sparse engine read it like any other model; its text is gibberish, its speed and sparsity are real.
`python -m powerinfer.sparsity.synthetic --preset 7b --layers 8 --out FILE` does the same from a shell.

Planting the profile without FFN biases (LLaMA has none):

* Channel 0 of the residual stream is a constant "bias channel", the mechanism trained LLMs grow by
  themselves ("massive activations"): every token embedding holds sqrt(dim) there; no layer reads
  it (column 0 of q, k, v, up and the output head is zero) or writes it (row 0 of attn_output and
  ffn_down is zero). After RMSNorm the FFN input's channel 0 is a near-constant x0 per layer (a few
  percent from token to token), so column 0 of the gate is a bias: b_j = gate[j, 0] * x0.
* The planted rate of neuron j is p_j = min(p_max, C * rank_j^-alpha) over a random permutation of
  the neurons of each layer, C set so that the mean is 1 - sparsity (`planted_profile`). The default
  alpha 1.3 puts 80% of all firings on ~25% of the neurons, as PowerInfer measured for ReluLLaMA
  (26% for LLaMA-70B with ReGLU; 17% for OPT-30B).
* Calibration, layer by layer while writing: a batch of random token sequences runs through the
  layers already made (float32, the model's own attention code). At layer i, neuron j's gate
  pre-activation z_j = gate_j . x over those tokens is a sum of dim weakly dependent terms, close to
  Gaussian; with its mean m_j and std s_j, b_j = -m_j + s_j * Phi^-1(p_j) makes P(z_j + b_j > 0)
  = p_j, and gate[j, 0] = b_j / mean(x0). The next layer calibrates on the output of this one,
  biases included, so the profile holds through the depth. Measured with the dense model on fresh
  random tokens, 7B shape, 4 layers, target 0.9: 0.899-0.900 per layer in sequences of 128 (the
  calibration's length), 0.902-0.905 along one sequence of 1024; the test checks the tiny preset.
* Predictable firing (`subspace` r > 0): each layer's gate rows lie in an r-dimensional subspace
  of the residual stream (gate = A U^T, U an orthonormal (dim, r) basis of that layer off the
  bias channel, A (n_ff, r) Gaussian), as trained models' FFN inputs concentrate in a few
  directions. A neuron's pre-activation then depends on x only through U^T x, so a predictor of
  rank about r can learn which neurons fire; with r = 0 the gate rows are isotropic and only each
  neuron's planted rate can be learnt. Calibration is unchanged.
* A low-rank residual stream (`residual_rank` R >= r): the embeddings and what every layer writes
  back (rows of attn_output and ffn_down) lie in one R-dimensional subspace off the bias channel,
  and each layer's gate subspace inside it, as trained models' hidden states occupy a few hundred
  directions of thousands. A predictor then reads an input of effective dimension R + 1, which
  the few thousand samples of a profile pin down; with a full-rank residual the directions
  outside the gate subspace are noise it must learn to ignore from those samples, and it marks
  about twice the firing neurons to keep 99% of the activation mass (a 7B shape, r 64).
* Attention is made peaky (logits q.k/sqrt(head_dim) of std 4, as trained models' are): with
  near-uniform attention every position would carry the mean of its sequence's values, a component
  shared by the whole sequence that a few calibration sequences cannot average out (the planted
  rates then drift by several tenths of a point per layer on fresh tokens).
* Scales: embeddings N(0, 1); v, gate, up N(0, 1/dim); attn_output and ffn_down are drawn N(0, 1)
  and rescaled from the calibration so that each residual branch adds variance 1/(2 n_layers) per
  channel: the residual's variance grows from 1 to about 2 over any depth. The output head is
  scaled for logits of std ~3; norms are ones; the head is not tied.

Writing streams: tensor infos first, then each tensor's data as soon as it is made (one layer of
float32 weights in memory at a time). Every tensor is drawn from its own seeded generator, so the
same arguments give the same bytes on the same software. 2-D tensors are BF16 (or F16/F32), norms
F32; q/k are stored in llama.cpp's row order, as the loader expects. The vocabulary is a
SentencePiece-style "llama" one (<unk>, <s>, </s>, byte tokens, then letter strings) that
`Tokenizer.from_gguf` accepts.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import itertools
import math
import os
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from ..formats.args import ModelArgs
from ..formats.kquants import quantize
from ..formats.source import unpermute_rows
from ..model.transformer import Block, KVCache, KVTables, Transformer, rope_table
from .profile import top_share

P_MAX = 0.9  # the hottest neurons fire on 90% of tokens


DEFAULT_ALPHA = 1.3


LOGIT_STD = 3.0


CALIB_SEQ_LEN = 128


SCORE_STD = 4.0  # std of the attention logits q.k/sqrt(head_dim): a few positions win


@dataclass(frozen=True, slots=True)
class Shape:
    dim: int
    n_ff: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    context: int = 4096

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def model_args(self) -> ModelArgs:
        return ModelArgs(arch="llama", vocab_size=self.vocab, dim=self.dim, n_layers=self.n_layers,
                         n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, ffn_dim=self.n_ff,
                         ffn_act="reglu", norm_eps=1e-5, max_seq_len=self.context)


PRESETS = {
    "7b": Shape(dim=4096, n_ff=11008, n_layers=32, n_heads=32, n_kv_heads=32, vocab=32000),
    "13b": Shape(dim=5120, n_ff=13824, n_layers=40, n_heads=40, n_kv_heads=40, vocab=32000),
    # grouped-query attention: the FFN is 70% of a block (7B/13B: 67% with attention at 33%)
    "70b": Shape(dim=8192, n_ff=28672, n_layers=80, n_heads=64, n_kv_heads=8, vocab=32000),
    "tiny": Shape(dim=256, n_ff=1024, n_layers=4, n_heads=4, n_kv_heads=2, vocab=1000, context=512),
}


QTYPES = {"bf16": "BF16", "f16": "F16", "f32": "F32"}


QUANTS = ("q4_0", "q4_k_m", "q5_k_m", "q8_0")  # llama.cpp's file types, with its choice of type per tensor


def quant_type(quant: str, name: str, row: int, n_layers: int) -> str:
    """The GGUF type llama.cpp's quantizer gives tensor `name` (rows of `row` values) in a file
    of type `quant`: q8_0 every matrix Q8_0; q4_0 every matrix Q4_0 but the output head, Q6_K;
    q4_k_m Q4_K, with Q6_K for the output head and for attn_v and ffn_down in the layers
    llama.cpp gives more bits (the first and last eighth, and every third between); q5_k_m the
    same over Q5_K. A row that
    a type's blocks do not divide takes Q8_0, as llama.cpp falls back."""
    if quant == "q8_0":
        want = "Q8_0"
    elif name == "output.weight":
        want = "Q6_K"
    elif quant == "q4_0":
        want = "Q4_0"
    else:
        want = "Q4_K" if quant == "q4_k_m" else "Q5_K"
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name.endswith(("attn_v.weight", "ffn_down.weight")) and _more_bits(layer, n_layers):
            want = "Q6_K"
    block = 256 if want.endswith("_K") else 32
    return want if row % block == 0 else "Q8_0"


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class SyntheticModel:
    """What `write_synthetic` wrote: shapes, the planted profile and what calibration measured."""

    path: Path
    shape: Shape
    dtype: str
    seed: int
    sparsity: float  # target: mean fraction of neurons with a zero activation per token
    alpha: float
    subspace: int  # rank of the gate rows' subspace (0: isotropic)
    residual_rank: int  # rank of the residual stream's subspace (0: full)
    planted: np.ndarray  # (n_layers, n_ff) planted firing probability of each neuron
    calib_firing: np.ndarray  # (n_layers, n_ff) firing rate on the calibration tokens
    file_bytes: int
    seconds: float

    def summary(self) -> dict:
        return {"path": str(self.path), **dataclasses.asdict(self.shape), "dtype": self.dtype,
                "seed": self.seed, "target_sparsity": self.sparsity, "alpha": self.alpha,
                "subspace": self.subspace, "residual_rank": self.residual_rank,
                "calib_sparsity": [round(1 - float(f.mean()), 4) for f in self.calib_firing],
                "top10pct_share": round(top_share(self.planted[0], 0.1), 3),
                "file_gb": round(self.file_bytes / 1e9, 3), "seconds": round(self.seconds, 1)}


def planted_profile(n_ff: int, n_layers: int, sparsity: float = 0.9, alpha: float = DEFAULT_ALPHA,
                    seed: int = 0, p_max: float = P_MAX) -> np.ndarray:
    """(n_layers, n_ff) firing probabilities: min(p_max, C rank^-alpha), the mean 1 - sparsity,
    ranks a random permutation per layer (from the seed)."""
    target = 1.0 - sparsity
    if not 0 < target < p_max:
        raise ConfigError(f"sparsity must be in ({1 - p_max:g}, 1), got {sparsity}")
    if alpha < 0:
        raise ConfigError(f"alpha must be >= 0, got {alpha}")
    ranks = np.arange(1, n_ff + 1, dtype=np.float64)
    lo, hi = math.log(target), math.log(p_max) + alpha * math.log(n_ff)  # bounds on log C
    for _ in range(100):  # the mean grows with C: bisect log C
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.minimum(p_max, math.exp(mid) * ranks ** -alpha).mean() < target else (lo, mid)
    by_rank = np.minimum(p_max, math.exp(lo) * ranks ** -alpha)
    out = np.empty((n_layers, n_ff), dtype=np.float32)
    for i in range(n_layers):
        perm = torch.randperm(n_ff, generator=_generator(seed, f"blk.{i}.profile")).numpy()
        out[i] = by_rank[perm]  # neuron j gets rank perm[j]
    return out


def write_synthetic(path: str | Path, preset: str | Shape = "7b", n_layers: int | None = None,
                    sparsity: float = 0.9, alpha: float = DEFAULT_ALPHA, seed: int = 0,
                    dtype: str = "bf16", calib_tokens: int = 512, subspace: int = 0,
                    residual_rank: int = 0, progress: bool = True,
                    quant: str | None = None) -> SyntheticModel:
    """Write a synthetic ReGLU model with a planted firing profile as a GGUF file.

    preset: "7b", "13b", "70b", "tiny" or a `Shape`; n_layers overrides its depth. sparsity: the target
    mean fraction of inactive neurons per token (above 1 - P_MAX); alpha: the power-law exponent
    of the firing rates over neuron ranks; dtype of the 2-D tensors: "bf16", "f16" or "f32";
    calib_tokens: random tokens (whole sequences of 128) run through the layers to set the biases;
    subspace: the rank r of each layer's gate rows (0: isotropic, firing unpredictable beyond each
    neuron's rate; see the module docstring); residual_rank: the rank R of the residual stream
    (0: full; else at least r, and the gate subspaces lie in it); quant: "q4_0", "q4_k_m",
    "q5_k_m" or "q8_0" writes the matrices in those GGUF block types instead of dtype (`quant_type`).
    The file appears under its name only once complete."""
    import gguf
    from tqdm import tqdm

    t0 = time.perf_counter()
    if isinstance(preset, str) and preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
    shape = PRESETS[preset] if isinstance(preset, str) else preset
    if n_layers is not None:
        if n_layers < 1:
            raise ConfigError(f"n_layers must be >= 1, got {n_layers}")
        shape = dataclasses.replace(shape, n_layers=n_layers)
    if dtype not in QTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(QTYPES)}, got {dtype!r}")
    if calib_tokens < CALIB_SEQ_LEN:
        raise ConfigError(f"calib_tokens must be >= {CALIB_SEQ_LEN}, got {calib_tokens}")
    if not 0 <= subspace < shape.dim:
        raise ConfigError(f"subspace must be in [0, {shape.dim}), got {subspace}")
    if residual_rank and not subspace <= residual_rank < shape.dim:
        raise ConfigError(f"residual_rank must be 0 or in [subspace, {shape.dim}), got {residual_rank}")
    planted = planted_profile(shape.n_ff, shape.n_layers, sparsity, alpha, seed)
    T = gguf.GGMLQuantizationType
    if quant is not None and quant not in QUANTS:
        raise ConfigError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")

    def qtype(name, shp):
        if len(shp) != 2:
            return T.F32
        return T[quant_type(quant, name, shp[1], shape.n_layers) if quant else QTYPES[dtype]]

    layout = [(name, shp, qtype(name, shp)) for name, shp in _layout(shape)]
    path = Path(path)
    partial = path.with_name(path.name + ".partial")

    w = gguf.GGUFWriter(partial, "llama")
    _add_metadata(w, shape, quant or dtype, seed, sparsity, alpha, calib_tokens, subspace,
                  residual_rank)
    for name, shp, qtype in layout:
        w.add_tensor_info(name, shp, np.dtype(np.float32), _nbytes(shp, qtype), raw_dtype=qtype)
    calib_firing = []
    writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="synthetic-writer")
    pending = None
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with tqdm(total=sum(_nbytes(shp, qtype) for _, shp, qtype in layout), unit="B",
                  unit_scale=True, desc=f"writing {path.name}", disable=not progress) as bar:
            made = _tensors(shape, planted, seed, calib_tokens, calib_firing, subspace,
                            residual_rank)
            for (name, shp, qtype), (made_name, t) in zip(layout, made, strict=True):
                assert name == made_name and tuple(t.shape) == shp, (name, made_name, t.shape)
                # encoded and written on a thread of its own while the next tensors are drawn
                # and calibrated; at most two tensors wait
                if pending is not None:
                    bar.update(pending.result())
                pending = writer.submit(_write, w, t, qtype)
            if pending is not None:
                bar.update(pending.result())
                pending = None
        w.close()
        partial.replace(path)
    except BaseException:
        if pending is not None:
            concurrent.futures.wait([pending])
        w.close()
        partial.unlink(missing_ok=True)
        raise
    finally:
        writer.shutdown()
    return SyntheticModel(path, shape, quant or dtype, seed, sparsity, alpha, subspace, residual_rank, planted,
                          torch.stack(calib_firing).numpy(), path.stat().st_size,
                          time.perf_counter() - t0)


def _layout(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy-order shape) of every tensor, in file order."""
    d, f, kv = s.dim, s.n_ff, s.n_kv_heads * s.head_dim
    out = [("token_embd.weight", (s.vocab, d))]
    for i in range(s.n_layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (d,)), (p + "attn_q.weight", (d, d)),
                (p + "attn_k.weight", (kv, d)), (p + "attn_v.weight", (kv, d)),
                (p + "attn_output.weight", (d, d)), (p + "ffn_norm.weight", (d,)),
                (p + "ffn_gate.weight", (f, d)), (p + "ffn_up.weight", (f, d)),
                (p + "ffn_down.weight", (d, f))]
    return out + [("output_norm.weight", (d,)), ("output.weight", (s.vocab, d))]


def _tensors(s: Shape, planted: np.ndarray, seed: int, calib_tokens: int, calib_firing: list,
             subspace: int = 0, residual_rank: int = 0):
    """Yield (GGUF name, float32 tensor) in `_layout` order, calibrating each layer on the way;
    appends each layer's firing rate on the calibration tokens to calib_firing."""
    args, d = s.model_args(), s.dim
    # writes(name, n): (d, n) columns a part writes into the residual stream, row 0 (the bias
    # channel) zero: N(0, 1) entries, or with a residual subspace V (d - 1, R) its columns in V
    # with the same variance per channel
    V = None
    if residual_rank:
        V = torch.linalg.qr(_randn(seed, "residual.basis", (d - 1, residual_rank)))[0]

    def writes(name: str, n: int) -> torch.Tensor:
        if V is None:
            w = _randn(seed, name, (d, n))
        else:
            w = torch.cat([torch.zeros(1, n), V @ _randn(seed, name, (residual_rank, n),
                                                         ((d - 1) / residual_rank) ** 0.5)])
        w[0] = 0.0
        return w

    emb = (_randn(seed, "token_embd.weight", (s.vocab, d)) if V is None
           else writes("token_embd.weight", s.vocab).t().contiguous())  # (vocab, d)
    emb[:, 0] = math.sqrt(d)  # the bias channel
    B, T = calib_tokens // CALIB_SEQ_LEN, CALIB_SEQ_LEN
    tokens = torch.randint(3, s.vocab, (B, T), generator=_generator(seed, "calibration"))
    h = emb[tokens]  # (B, T, dim) the residual stream of the calibration batch
    yield "token_embd.weight", emb
    del emb

    with torch.device("meta"):
        block = Block(args)
    block = block.to_empty(device="cpu").requires_grad_(False)
    block.attn_norm.weight.fill_(1.0)
    block.ffn_norm.weight.fill_(1.0)
    per = -(-T // 16)  # blocks of 16 positions a sequence; row b of the batch is sequence b
    block.attn.kv_cache = KVCache(B * per, s.n_kv_heads, 16, s.head_dim, torch.float32, "cpu")
    kv = KVTables(torch.arange(0, B * T + 1, T), torch.arange(B * per, dtype=torch.int32).view(B, per))
    pos = torch.arange(T).repeat(B)  # (B*T,)
    rope = tuple(t[pos] for t in rope_table(args, T))  # (B*T, head_dim) each
    ones = torch.ones(d)

    for i in range(s.n_layers):
        tensors, h = _attention_part(s, block, h, f"blk.{i}.", seed, writes, (rope, pos, kv))
        yield from tensors
        del tensors
        tensors, h, firing = _ffn_part(s, block, h, f"blk.{i}.", seed, writes, planted[i],
                                       subspace, residual_rank, V)
        calib_firing.append(firing)
        yield from tensors
        del tensors

    # logits = out . norm(h): with N(0, 1) rows their std is the norm of norm(h) off channel 0
    hn = torch.nn.functional.rms_norm(h, (d,), eps=args.norm_eps)
    std = LOGIT_STD / hn[..., 1:].pow(2).sum(-1).mean().sqrt().item()
    out = _randn(seed, "output.weight", (s.vocab, d), std, in_col0=0.0)
    yield "output_norm.weight", ones
    yield "output.weight", out


def _branch_std(s: Shape) -> float:
    """What each branch (a layer's attention, its FFN) adds to the residual stream's std: the
    2 x n_layers branches together keep it near 1."""
    return (2 * s.n_layers) ** -0.5


def _attention_part(s: Shape, block, h: torch.Tensor, p: str, seed: int, writes, where):
    """A layer's attention tensors, scaled so that its branch adds `_branch_std(s)` to the
    calibration batch's residual `h`: ([(name, tensor)], the residual after it)."""
    rope, pos, kv = where
    d, n_kv = s.dim, s.n_kv_heads
    with torch.inference_mode():
        xa = block.attn_norm(h)
        # q . k / sqrt(head_dim) has std SCORE_STD: attention picks a few positions
        qk_std = (SCORE_STD / xa[..., 1:].pow(2).sum(-1).mean()).sqrt().item()
    q = _randn(seed, p + "attn_q.weight", (d, d), qk_std, in_col0=0.0)
    k = _randn(seed, p + "attn_k.weight", (n_kv * s.head_dim, d), qk_std, in_col0=0.0)
    v = _randn(seed, p + "attn_v.weight", k.shape, d ** -0.5, in_col0=0.0)
    o = writes(p + "attn_output.weight", d)  # never writes the bias channel
    with torch.inference_mode():
        # q and k are drawn in the file's (llama.cpp) row order; the model uses the loader's
        block.attn.wqkv.weight.copy_(torch.cat([unpermute_rows(q, s.n_heads),
                                                unpermute_rows(k, s.n_kv_heads), v]))
        block.attn.wo.weight.copy_(o)
        a = block.attn(xa, rope, pos, kv)  # (B, T, dim)
        scale = _branch_std(s) / a[..., 1:].pow(2).mean().sqrt().item()
        h = h + scale * a
    o *= scale
    return [(p + "attn_norm.weight", torch.ones(d)), (p + "attn_q.weight", q),
            (p + "attn_k.weight", k), (p + "attn_v.weight", v), (p + "attn_output.weight", o)], h


def _ffn_part(s: Shape, block, h: torch.Tensor, p: str, seed: int, writes, planted: np.ndarray,
              subspace: int, residual_rank: int, V):
    """A layer's FFN tensors: gate biases that plant its neurons' firing rates (`planted`) on
    the calibration batch, the branch scaled as attention's: ([(name, tensor)], the residual
    after it, each neuron's firing rate on the batch)."""
    d = s.dim
    B, T = h.shape[:2]
    if subspace:  # rows in a subspace of rank r off the bias channel; same scale of gate . x
        basis = torch.linalg.qr(_randn(seed, p + "ffn_gate.basis",
                                       (residual_rank or d - 1, subspace)))[0]
        if V is not None:  # inside the residual stream's subspace
            basis = V @ basis
        gate = _randn(seed, p + "ffn_gate.weight", (s.n_ff, subspace), subspace ** -0.5)
        gate = torch.cat([torch.zeros(s.n_ff, 1), gate @ basis.t()], 1)  # (n_ff, d)
    else:
        gate = _randn(seed, p + "ffn_gate.weight", (s.n_ff, d), d ** -0.5, in_col0=0.0)
    up = _randn(seed, p + "ffn_up.weight", (s.n_ff, d), d ** -0.5, in_col0=0.0)
    down = writes(p + "ffn_down.weight", s.n_ff)
    with torch.inference_mode():
        x = block.ffn_norm(h).flatten(0, 1)  # (N, dim) the FFN inputs
        z = x @ gate.t()  # (N, n_ff) gate pre-activations, bias column still zero
        std, mean = torch.std_mean(z, dim=0)
        bias = std * torch.special.ndtri(torch.from_numpy(planted).double()).float() - mean
        gate[:, 0] = bias / x[:, 0].mean()
        z += x[:, :1] * gate[:, 0]  # now x @ gate.t(), as the model computes it
        act = torch.relu(z) * (x @ up.t())  # (N, n_ff) ReGLU
        del z
        firing = (act != 0).float().mean(0)
        f = act @ down.t()  # (N, dim)
        scale = _branch_std(s) / f[:, 1:].pow(2).mean().sqrt().item()
        h = h + scale * f.view(B, T, d)
        del act, f
    down *= scale
    return [(p + "ffn_norm.weight", torch.ones(d)), (p + "ffn_gate.weight", gate),
            (p + "ffn_up.weight", up), (p + "ffn_down.weight", down)], h, firing


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


DRAW = 1 << 20  # values drawn from one generator: a large tensor's row chunks, drawn in parallel


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that draw a tensor's chunks: torch's normal sampler runs on the calling thread
    alone (one generator), with the GIL released."""
    global _POOL
    if _POOL is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        _POOL = concurrent.futures.ThreadPoolExecutor(max(1, cores or 1),
                                                      thread_name_prefix="synthetic")
    return _POOL


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _forget_pool():  # a forked child has none of its parent's threads: it makes its own pool
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)


def _chunks(rows: int, per_row: int, values: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of about `values` values each: fixed by the shape alone, so the
    bytes do not depend on the machine's cores."""
    step = max(1, values // max(1, per_row))
    return [(lo, min(rows, lo + step)) for lo in range(0, rows, step)]


def _randn(seed: int, name: str, shape, std: float = 1.0,
           in_col0: float | None = None) -> torch.Tensor:
    """N(0, std^2) entries of `shape`; a tensor of more than DRAW values draws each chunk of its
    rows from its own generator ("name[i]"), the chunks in parallel."""
    shape = tuple(shape)
    per_row = math.prod(shape[1:])
    if len(shape) < 2 or shape[0] * per_row <= DRAW:
        t = torch.randn(shape, generator=_generator(seed, name))
    else:
        t = torch.empty(shape)

        def draw(i, lo, hi):
            torch.randn((hi - lo, *shape[1:]), generator=_generator(seed, f"{name}[{i}]"),
                        out=t[lo:hi])

        for f in [_pool().submit(draw, i, lo, hi)
                  for i, (lo, hi) in enumerate(_chunks(shape[0], per_row, DRAW))]:
            f.result()
    t.mul_(std)
    if in_col0 is not None:
        t[:, 0] = in_col0  # column 0 reads the bias channel
    return t


def _nbytes(shape, qtype) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def _write(w, t: torch.Tensor, qtype) -> int:
    """Encode t as qtype and append it to the file: its bytes."""
    data = _encode(t, qtype)
    w.write_tensor_data(data)
    return data.nbytes


def _encode(t: torch.Tensor, qtype) -> np.ndarray:
    """The tensor's bytes as GGUF stores them for qtype (BF16, F16, F32 or a block type)."""
    if qtype.name == "BF16":
        return t.to(torch.bfloat16).view(torch.int16).numpy()  # rounded to nearest even
    if qtype.name in ("F16", "F32"):
        return t.numpy().astype(np.float16 if qtype.name == "F16" else np.float32, copy=False)

    x = t.float().numpy()
    return quantize(x.reshape(-1, x.shape[-1]), qtype.name)


def _add_metadata(w, s: Shape, dtype: str, seed: int, sparsity: float, alpha: float,
                  calib_tokens: int, subspace: int, residual_rank: int):
    import gguf

    w.add_string("general.name", f"synthetic-relu-{s.n_layers}L-{s.dim}d")
    F = gguf.LlamaFileType
    w.add_uint32("general.file_type", int({"bf16": F.MOSTLY_BF16, "f16": F.MOSTLY_F16,
                                           "f32": F.ALL_F32, "q4_0": F.MOSTLY_Q4_0,
                                           "q4_k_m": F.MOSTLY_Q4_K_M, "q5_k_m": F.MOSTLY_Q5_K_M,
                                           "q8_0": F.MOSTLY_Q8_0}[dtype]))
    w.add_uint32("llama.block_count", s.n_layers)
    w.add_uint32("llama.context_length", s.context)
    w.add_uint32("llama.embedding_length", s.dim)
    w.add_uint32("llama.feed_forward_length", s.n_ff)
    w.add_uint32("llama.attention.head_count", s.n_heads)
    w.add_uint32("llama.attention.head_count_kv", s.n_kv_heads)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint32("llama.rope.dimension_count", s.head_dim)
    w.add_uint32("llama.vocab_size", s.vocab)
    w.add_string("powerinfer.ffn_activation", "reglu")
    w.add_uint64("powerinfer.synthetic.seed", seed)
    w.add_float32("powerinfer.synthetic.sparsity", sparsity)
    w.add_float32("powerinfer.synthetic.alpha", alpha)
    w.add_float32("powerinfer.synthetic.p_max", P_MAX)
    w.add_uint32("powerinfer.synthetic.calib_tokens", calib_tokens)
    w.add_uint32("powerinfer.synthetic.subspace", subspace)
    w.add_uint32("powerinfer.synthetic.residual_rank", residual_rank)
    tokens, scores, types = _vocab(s.vocab)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", True)


def _vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then "▁" and the
    letters, then each of those followed by one letter, by two, ... (shorter pieces score higher)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, byte
    if size < len(tokens) + 27:
        raise ValueError(f"vocabulary size must be >= {len(tokens) + 27}, got {size}")

    def pieces():
        level = ["\u2581", *string.ascii_lowercase]
        while True:
            yield from level
            level = [p + c for p in level for c in string.ascii_lowercase]

    n = size - len(tokens)
    tokens += list(itertools.islice(pieces(), n))
    return tokens, [0.0] * 259 + [-float(i) for i in range(n)], types + [1] * n


def random_tokens(vocab: int, n_seqs: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    """(n_seqs, seq_len) random token ids (not the special ones)."""
    return torch.randint(3, vocab, (n_seqs, seq_len), generator=_generator(seed, "measure"))


@torch.inference_mode()
def firing_rates(model: Transformer, tokens: torch.Tensor) -> np.ndarray:
    """(n_layers, ffn_dim): the fraction of `tokens` (B, T) on which each FFN neuron of a dense
    model is nonzero, from one forward pass."""
    B, T = tokens.shape
    model.setup_cache(B, T)
    counts = [None] * len(model.layers)

    def hook(i):
        def count(ffn, inputs):  # inputs: ((B, T, dim),)
            counts[i] = (ffn.neurons(inputs[0]) != 0).flatten(0, 1).sum(0, dtype=torch.float64)
        return count

    handles = [b.ffn.register_forward_pre_hook(hook(i)) for i, b in enumerate(model.layers)]
    try:
        model(tokens, torch.arange(T).expand(B, T))
    finally:
        for handle in handles:
            handle.remove()
    return (torch.stack(counts) / (B * T)).float().numpy()


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (tied values share their mean rank)."""
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m powerinfer.sparsity.synthetic",
                                 description="write a synthetic ReLU model of a real shape as GGUF")
    ap.add_argument("--preset", default="7b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--sparsity", type=float, default=0.9, help="target fraction of inactive neurons")
    ap.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="power-law exponent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", choices=sorted(QTYPES))
    ap.add_argument("--quant", default=None, choices=QUANTS,
                    help="write the matrices in these GGUF block types (llama.cpp's choice per "
                         "tensor) instead of --dtype")
    ap.add_argument("--calib-tokens", type=int, default=512)
    ap.add_argument("--subspace", type=int, default=0,
                    help="rank of the gate rows' subspace (0: isotropic, firing unpredictable)")
    ap.add_argument("--residual-rank", type=int, default=0,
                    help="rank of the residual stream's subspace (0: full)")
    ap.add_argument("--out", "-o", required=True, help="output .gguf file")
    ap.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    try:
        m = write_synthetic(a.out, a.preset, a.layers, a.sparsity, a.alpha, a.seed, a.dtype,
                            a.calib_tokens, a.subspace, a.residual_rank, progress=not a.quiet,
                            quant=a.quant)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for key, value in m.summary().items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
