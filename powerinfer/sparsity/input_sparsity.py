"""Activation sparsity in every projection's input (TEAL: Liu et al., "Training-Free Activation
Sparsity in Large Language Models", ICLR 2025), calibrated offline and measured for quality.

An entry of a projection's input whose magnitude is at most its threshold is zeroed before the
projection reads it, so that input channel's weight column need not be read. Per layer, four
inputs (`PARTS`): attention's q/k/v (one input, shared), its output projection, the FFN's gate
and up (one input) and the FFN's down (its neuron activations: magnitude sparsity there is the
FFN's own neuron sparsity, as an oracle of it). Decode steps only: the rows of a prompt stay
dense (`Sparsifier(dense_rows=...)`).

Thresholds come from the calibration text's inputs (`sample_magnitudes`: a histogram of each
input's |x| over every token, in log space), one per input and layer: the magnitude under which
the asked-for share of that input's entries falls: every input at the target (`calibrate`, the
uniform allocation), or TEAL's block-wise greedy allocation (`greedy_allocation`: within each
block, the share raised where it costs the block's output least per weight saved). The
model-wide sparsity is the share of the projections' weights not read, each input weighted by
the weights it multiplies (`model_wide`).

The criterion is TEAL's, |x|, by default; `column_norms` gives WINA's (Chen et al., "WINA:
Weight Informed Neuron Activation", 2025): |x_i| times the norm of the weights channel i
multiplies, so that of two equal entries the one whose column moves the output less is zeroed
first (`sample_magnitudes(scales=)`, `Sparsifier(scales=)`; measured, not the bundle's rule:
BENCHMARKS.md).
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..cpu import last_level_cache
from ..errors import ConfigError

log = logging.getLogger("powerinfer")

PARTS = ("qkv", "o", "gate_up", "down")
LOG_LO, LOG_HI, BINS = -9.0, 4.0, 6500  # log10 |x| histogram: 0.002 decades a bin


def projections(model) -> dict[tuple[int, str], torch.nn.Module]:
    """(layer, part) -> the module whose input that part is."""
    out = {}
    for i, b in enumerate(model.layers):
        out[(i, "qkv")], out[(i, "o")] = b.attn.wqkv, b.attn.wo
        out[(i, "gate_up")], out[(i, "down")] = b.ffn.w1, b.ffn.w2
    return out


def weights_of(model) -> dict[tuple[int, str], int]:
    """(layer, part) -> how many weights its projection holds (what a zero input column saves,
    per row of that input)."""
    return {k: m.weight.numel() for k, m in projections(model).items()}


def model_wide(sparsity: dict[tuple[int, str], float],
               weights: dict[tuple[int, str], int]) -> float:
    """The share of the projections' weights (of the inputs in `sparsity`) not read."""
    total = sum(weights[k] for k in sparsity)
    return sum(s * weights[k] for k, s in sparsity.items()) / total if total else 0.0


def column_norms(model) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, part) -> each input channel's weight norm (float32, (in_features,)): the L2 norm
    of the projection's column that channel multiplies, WINA's weight of |x_i|."""
    return {k: m.weight.detach().float().norm(dim=0) for k, m in projections(model).items()}


@torch.inference_mode()
def sample_magnitudes(model, windows: list[list[int]], progress: bool = True,
                      scales: dict[tuple[int, str], torch.Tensor] | None = None
                      ) -> dict[tuple[int, str], np.ndarray]:
    """Each projection input's |x| over every token of `windows`, as a histogram of log10 |x|
    (`BINS` bins over [LOG_LO, LOG_HI]; exact zeros in the first); with `scales` (per input, a
    factor a channel: `column_norms`), of |x| times its channel's factor."""
    hist = {k: torch.zeros(BINS, dtype=torch.float64) for k in projections(model)}

    def hook(key):
        def pre(_module, args):
            x = args[0].detach().float().abs()
            if scales is not None:
                x = x * scales[key]
            x = x.flatten()
            hist[key] += torch.histc(torch.log10(x.clamp_min(10 ** LOG_LO)), BINS, LOG_LO,
                                     LOG_HI).double()
        return pre

    handles = [m.register_forward_pre_hook(hook(k)) for k, m in projections(model).items()]
    try:
        model.setup_cache(1, max(len(w) for w in windows))
        for w in tqdm(windows, desc="calibrating input sparsity", unit="window",
                      disable=not progress):
            model(torch.tensor([w]), torch.arange(len(w))[None])
    finally:
        for h in handles:
            h.remove()
    return {k: v.numpy() for k, v in hist.items()}


def threshold_for(hist: np.ndarray, sparsity: float) -> float:
    """The magnitude under which `sparsity` of the histogram's entries fall (0: none)."""
    if sparsity <= 0:
        return 0.0
    cum = np.cumsum(hist) / hist.sum()
    b = int(np.searchsorted(cum, sparsity))
    return float(10 ** (LOG_LO + (b + 1) * (LOG_HI - LOG_LO) / BINS))  # the bin's upper edge


def share_under(hist: np.ndarray, threshold: float) -> float:
    """The share of the histogram's entries at or under `threshold` (threshold_for's inverse, to
    the bin)."""
    if threshold <= 0:
        return 0.0
    b = int(round((math.log10(threshold) - LOG_LO) * BINS / (LOG_HI - LOG_LO))) - 1
    return float(np.cumsum(hist)[min(max(b, 0), BINS - 1)] / hist.sum())


def calibrate(hists: dict[tuple[int, str], np.ndarray], sparsity: float,
              parts: tuple[str, ...] = PARTS) -> dict[tuple[int, str], float]:
    """Uniform allocation: every input in `parts` at `sparsity` (its own threshold each)."""
    return {k: threshold_for(h, sparsity) for k, h in hists.items() if k[1] in parts}


@torch.inference_mode()
def greedy_allocation(model, windows: list[list[int]], hists: dict[tuple[int, str], np.ndarray],
                      targets: list[float], parts: tuple[str, ...] = PARTS, step: float = 0.1,
                      layers: list[int] | None = None, progress: bool = True
                      ) -> dict[float, dict[tuple[int, str], float]]:
    """TEAL's block-wise greedy allocation: per layer, from dense, the share of one input at a
    time is raised by `step` (its own entries' share, threshold from `hists`), the input whose
    step costs the least error in the block's output per weight it saves (the block run alone on
    its dense inputs from `windows`, only its own inputs sparsified), until the block's
    weight-weighted sparsity reaches each of `targets`. Every block reaches the same share, so
    the model-wide sparsity is the target's, spread within each block where it costs least.
    Returns target -> thresholds ((layer, part) -> magnitude), as `calibrate` does; `layers`:
    only these layers' (the others' inputs stay dense)."""
    weights = weights_of(model)
    chosen = range(len(model.layers)) if layers is None else layers
    captured: dict[int, list] = {i: [] for i in chosen}

    def keep_input(i):
        def pre(_module, args):
            captured[i].append((args[0].clone(), *args[1:]))
        return pre

    handles = [model.layers[i].register_forward_pre_hook(keep_input(i)) for i in chosen]
    try:
        model.setup_cache(1, max(len(w) for w in windows))
        for w in windows:
            model(torch.tensor([w]), torch.arange(len(w))[None])
    finally:
        for h in handles:
            h.remove()
    out: dict[float, dict[tuple[int, str], float]] = {t: {} for t in targets}
    for i in tqdm(chosen, desc="allocating input sparsity", unit="layer", disable=not progress):
        block = model.layers[i]
        # (a window's block run rewrites its own positions of the layer's KV cache first)
        ref = [block(*a) for a in captured[i]]
        W = {p: weights[(i, p)] for p in parts}
        total = sum(W.values())

        def error(share: dict[str, float]) -> float:
            th = {(i, p): threshold_for(hists[(i, p)], s) for p, s in share.items()}
            with Sparsifier(model, th):
                return sum(float((block(*a) - r).float().pow(2).sum())
                           for a, r in zip(captured[i], ref))

        share = {p: 0.0 for p in parts}
        now, sparsity = 0.0, 0.0
        due = sorted(targets)

        def reached(t: float):
            out[t].update({(i, p): threshold_for(hists[(i, p)], s) for p, s in share.items()})

        while due:
            while due and sparsity >= due[0] - 1e-9:
                reached(due.pop(0))
            if not due:
                break
            best = None
            for p in parts:
                if share[p] + step > 0.99:
                    continue
                trial = dict(share, **{p: share[p] + step})
                e = error(trial)
                cost = (e - now) / (step * W[p])  # error added per weight no longer read
                if best is None or cost < best[0]:
                    best = (cost, e, trial)
            if best is None:  # every input at its limit: the targets left as far as it got
                for t in due:
                    reached(t)
                break
            _, now, share = best
            sparsity = sum(share[p] * W[p] for p in parts) / total
    captured.clear()
    return out


@dataclass
class Counts:
    zeroed: int = 0
    entries: int = 0
    per_key: dict = field(default_factory=dict)  # (layer, part) -> [zeroed, entries]


class Sparsifier:
    """Forward pre-hooks that zero each projection input's entries at or under its threshold,
    in the rows from `dense_rows` on (the positions before are a prompt's, dense), and count what
    they zeroed. With `scales` (as `sample_magnitudes` takes them), an entry is compared to the
    threshold times its channel's factor. Use as a context manager."""

    def __init__(self, model, thresholds: dict[tuple[int, str], float], dense_rows: int = 0,
                 scales: dict[tuple[int, str], torch.Tensor] | None = None):
        self.model, self.thresholds, self.dense_rows = model, thresholds, dense_rows
        self.scales = scales or {}
        self.counts, self.handles = Counts(), []

    def __enter__(self):
        mods = projections(self.model)
        for key, t in self.thresholds.items():
            if t > 0:
                self.handles.append(mods[key].register_forward_pre_hook(self._hook(key, t)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, key, t: float):
        scale = self.scales.get(key)

        def pre(_module, args):
            x = args[0]
            sparse = x[:, self.dense_rows:] if x.dim() == 3 else x
            keep = (sparse.abs() if scale is None else sparse.abs() * scale) > t
            c = self.counts.per_key.setdefault(key, [0, 0])
            n, z = keep.numel(), int(keep.numel() - keep.sum())
            c[0] += z
            c[1] += n
            self.counts.zeroed += z
            self.counts.entries += n
            if x.dim() == 3 and self.dense_rows:
                x = x.clone()
                x[:, self.dense_rows:] = sparse * keep
                return (x, *args[1:])
            return (x * keep, *args[1:])
        return pre

    def realised(self, weights: dict[tuple[int, str], int]) -> float:
        """The model-wide sparsity these hooks realised (weights not read, per input row)."""
        return model_wide({k: z / n for k, (z, n) in self.counts.per_key.items() if n}, weights)


@dataclass
class Quality:
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    tokens: int = 0

    def row(self, dense_ppl: float | None = None) -> dict:
        ppl = math.exp(self.nll / self.tokens)
        return {"ppl": ppl, "ppl_delta": (ppl / dense_ppl - 1) if dense_ppl else 0.0,
                "top1": self.top1 / self.tokens, "kl": self.kl / self.tokens}


@torch.inference_mode()
def held_out_quality(model, windows: list[list[int]], variants: dict[str, dict],
                     progress: bool = True, scales: dict[str, dict] | None = None
                     ) -> dict[str, dict]:
    """Perplexity on `windows` of the dense model and of each variant (name -> thresholds; its
    criterion's channel factors in `scales`, name -> as `Sparsifier` takes them, where given), with
    every token's inputs sparsified (teacher-forced decoding: each position as a decode step
    whose earlier positions were decoded sparsely too), and each variant's top-1 agreement and
    KL divergence from the dense model's next-token distribution, and its realised sparsity."""
    weights = weights_of(model)
    model.setup_cache(1, max(len(w) for w in windows))
    q = {name: Quality() for name in ("dense", *variants)}
    realised = {name: Sparsifier(model, {}) for name in variants}
    for w in tqdm(windows, desc="held-out perplexity", unit="window", disable=not progress):
        ids, pos = torch.tensor([w]), torch.arange(len(w))[None]
        target = ids[0, 1:]
        ref = F.log_softmax(model(ids, pos)[0, :-1].float(), -1)  # (a bf16 model's in float)
        for name in q:
            if name == "dense":
                logp = ref
            else:
                s = Sparsifier(model, variants[name], scales=(scales or {}).get(name))
                s.counts = realised[name].counts
                with s:
                    logp = F.log_softmax(model(ids, pos)[0, :-1].float(), -1)
            v = q[name]
            v.nll -= float(logp.gather(-1, target[:, None]).sum())
            v.kl += float((ref.exp() * (ref - logp)).sum())
            v.top1 += int((logp.argmax(-1) == ref.argmax(-1)).sum())
            v.tokens += len(w) - 1
    dense_ppl = math.exp(q["dense"].nll / q["dense"].tokens)
    out = {name: v.row(dense_ppl) for name, v in q.items()}
    for name in variants:
        out[name]["realised"] = realised[name].realised(weights)
    out["dense"]["realised"] = 0.0
    return out


@torch.inference_mode()
def greedy(model, prompt: list[int], n: int, thresholds: dict | None = None,
           scales: dict | None = None) -> list[int]:
    """n greedy tokens after `prompt`, the prompt's rows dense and every decode step's inputs
    sparsified (`scales`: the criterion's channel factors, as `Sparsifier` takes them; each step
    recomputes the sequence: its earlier decode rows sparse again, the same values a KV cache of
    sparse steps holds)."""
    ids = list(prompt)
    model.setup_cache(1, len(prompt) + n)
    for _ in range(n):
        x, pos = torch.tensor([ids]), torch.arange(len(ids))[None]
        if thresholds:
            with Sparsifier(model, thresholds, dense_rows=len(prompt), scales=scales):
                logits = model(x, pos)[0, -1]
        else:
            logits = model(x, pos)[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


# ---- the bundle's step and the engine's side ----

KERNEL_PARTS = ("qkv", "o", "gate_up")  # the inputs the q4c kernel serves (down's is the FFN's)
BUNDLE_FILE = "input_sparsity.json"


def calibrate_bundle(model_name: str, out: str, sparsity: float = 0.25, corpus: str = "lee",
                     tokens: int = 8192, held_out: int = 4096, window: int = 256,
                     progress: bool = True, dtype: str = "float32"):
    """The pipeline's input-sparsity step: thresholds for attention's q/k/v, its output
    projection and the FFN's gate/up at `sparsity` each (the uniform allocation, which held
    quality best on the real models: BENCHMARKS.md), from `tokens` of the corpus's calibration
    part, and their quality on `held_out` tokens of its held-out part (perplexity against the
    dense model, teacher-forced decode steps). Written into the bundle at `out` as
    input_sparsity.json (a new bundle where there is none). `dtype`: the model's type while it
    runs (`config.DTYPES`; bf16 holds a 7B in half of float32's 27 GB). Returns the bundle."""
    from ..formats.bundle import Bundle, BundleError, model_record
    from ..config import torch_dtype
    from ..model.load import load_model
    from .corpus import load_corpus, token_windows

    if not 0 < sparsity < 1:
        raise ConfigError(f"sparsity must be in (0, 1), got {sparsity}")
    model, tok, path = load_model(model_name, torch_dtype(dtype))
    try:
        b = Bundle.open(out)
        b.check_model(path)
    except BundleError as e:
        if (Path(out) / "manifest.json").exists():
            raise e
        b = None  # a new bundle, made once its part is computed: a run that fails or is
        # stopped leaves no half-made bundle behind (before: a folder with a bare manifest)
    calib = token_windows(tok, load_corpus(corpus, "calibration"), window, tokens)
    held = token_windows(tok, load_corpus(corpus, "held_out"), window, held_out)
    thresholds = calibrate(sample_magnitudes(model, calib, progress), sparsity, KERNEL_PARTS)
    q = held_out_quality(model, held, {"sparse": thresholds}, progress)
    if b is None:
        b = Bundle.create(out, model_record(path, model.args))
    b.save_json(BUNDLE_FILE, {
        "target": sparsity, "allocation": "uniform", "parts": list(KERNEL_PARTS),
        "thresholds": [[i, part, t] for (i, part), t in sorted(thresholds.items())],
        "calibration": {"corpus": corpus, "tokens": sum(map(len, calib)), "window": window,
                        "dtype": dtype},
        "quality": {"held_out_tokens": sum(map(len, held)), "dense_ppl": q["dense"]["ppl"],
                    "ppl": q["sparse"]["ppl"], "ppl_increase": q["sparse"]["ppl_delta"],
                    "top1": q["sparse"]["top1"], "realised": q["sparse"]["realised"]}})
    b.mark("input_sparsity", {"sparsity": sparsity, "tokens": tokens, "corpus": corpus})
    return b


def bundle_thresholds(bundle) -> tuple[dict[tuple[int, str], float], dict]:
    """A bundle's (a `Bundle`, or its path) input-sparsity thresholds ((layer, part) ->
    magnitude) and its file's record (target, quality, ...); BundleError where it has none."""
    from ..formats.bundle import Bundle, BundleError
    b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
    b.require("input_sparsity", "calibrate-input")
    rec = b.load_json(BUNDLE_FILE, {"thresholds": list})
    out = {}
    for k, entry in enumerate(rec["thresholds"]):  # [layer, part, magnitude]
        if not (isinstance(entry, list) and len(entry) == 3 and _whole(entry[0])
                and isinstance(entry[1], str) and _number(entry[2])):
            raise BundleError(b.path, f"{BUNDLE_FILE}: 'thresholds' entry {k} is "
                                      f"{json.dumps(entry)[:80]}, expected [layer, part, "
                                      "magnitude]")
        out[(entry[0], entry[1])] = float(entry[2])
    return out, rec


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# A projection of fewer output rows stays dense: its channels' runs (rows / 2 bytes each) are too
# short for skipping them to save reads. On an AVX2 EPYC, half of a buffer read in 4 KB pieces
# took 0.57-0.86 of the whole's time (two runs), in 1-2 KB pieces 0.73-1.22, in 128 bytes
# 1.06-1.46; the q4c product at 25% sparsity ran 1.02-1.21x the dense one over 12,288 and 22,016
# rows, 0.80-0.92x over 4,096 and 0.48-0.72x over SmolLM2's 576-3,072 (`benchmarks/
# input_sparse_gemv.py`). POWERINFER_INPUT_SPARSE_MIN_ROWS sets it (0: every projection with a
# threshold, to measure).
MIN_ROWS = int(os.environ.get("POWERINFER_INPUT_SPARSE_MIN_ROWS", "8192"))
# Whether the sparse product over a size's projections is timed against the dense one at load,
# and the size left dense where it is not faster on this CPU (`_sparse_pays`): at 25% the 7B
# shape's q/k/v and gate/up products ran 0.86-0.95x the dense GEMVs on a Zen 5 EPYC and
# 1.04-1.68x on an Emerald Rapids Xeon (BENCHMARKS.md). Not with MIN_ROWS 0 (every projection
# with a threshold, to measure) nor POWERINFER_INPUT_SPARSE_MEASURE=0 (the plan carries both to
# the actors).
MEASURE = os.environ.get("POWERINFER_INPUT_SPARSE_MEASURE", "1") != "0"
# the share of input entries under threshold the timing's inputs hold where the bundle names
# none; the projections of one size timed in turn (their bytes together past the caches of most
# CPUs, as a token's are); the rounds; and how much faster sparse must be to be taken (a size
# near a tie stays dense, the same either way from one load to the next)
MEASURE_SHARE, MEASURE_MODULES, MEASURE_ROUNDS, MEASURE_MARGIN = 0.25, 8, 5, 0.95


def attach(model, thresholds: dict[tuple[int, str], float], min_rows: int | None = None,
           share: float | None = None, measure: bool | None = None,
           timings: list[str] | None = None) -> tuple[int, int, torch.Tensor]:
    """Input sparsity in the model's decode steps: each 4-bit projection (`Q4Linear`, or a
    `KQuantLinear` of Q4_K or Q6_K rows: `InputSparse.sparsifiable`) whose input has a threshold and that
    has at least `min_rows` output rows (default `MIN_ROWS`) reads only the input channels over
    it (`sparsify_input`: a copy of its matrix held by input channel), where that is faster on
    this CPU than the dense product (`measure`, default `MEASURE`: `_sparse_pays`, timed with
    `share` of each input under its threshold, the bundle's target; each size's times are logged,
    or appended to `timings` where given, for a process whose log is not the user's). Returns how
    many projections took it, how many with a threshold stayed dense (for their size, or as not
    faster here), and the counter of the channels the sparse ones kept and saw (int64 (2,), also
    `model.input_sparse_stats`, which the native loop adds to as well)."""
    from ..model.sparse import ffn_w1
    parts = []
    for i, b in enumerate(model.layers):
        parts += [(i, "qkv", b.attn.wqkv), (i, "o", b.attn.wo), (i, "gate_up", ffn_w1(b.ffn))]
    from ..model.transformer import host_parts
    held = host_parts(model)["weight_bytes"]  # (its KV cache apart)
    n, dense, stats = attach_parts(parts, thresholds, min_rows, share, measure, timings, held)
    model.input_sparse_stats = stats
    return n, dense, stats


def attach_parts(parts, thresholds: dict[tuple[int, str], float], min_rows: int | None = None,
                 share: float | None = None, measure: bool | None = None,
                 timings: list[str] | None = None,
                 held_bytes: int | None = None) -> tuple[int, int, torch.Tensor]:
    """`attach` over (layer, part, module) triples: a process's share of the model (an actor
    group's executor holds some heads' q/k/v rows and output columns, some neurons' gate and up
    rows; a threshold is of each input entry, so every share applies it to the entries it
    reads). `held_bytes`: the weights the process holds, where known; past the last level cache
    its decode steps read them from memory, and each size is timed so (`_sparse_pays`). Returns
    the same three."""
    from ..kernels.input_sparse import InputSparse
    min_rows = MIN_ROWS if min_rows is None else min_rows
    measure = (MEASURE if measure is None else measure) and min_rows > 0
    stats = torch.zeros(2, dtype=torch.long)
    sizes: dict[tuple, list] = {}  # (type, rows, columns, copy's rows) -> [(part, module, threshold)]
    from_memory = held_bytes is not None and held_bytes > last_level_cache()
    dense = 0
    for i, part, m in parts:
        t = thresholds.get((i, part), 0.0)
        # the file's Q4_0/Q4_1 blocks, or a K-quant file's Q4_K or Q6_K rows (a fused q/k/v with a
        # Q6_K v, as a Q4_K_M file has in some layers: a copy of each run; timed apart from the
        # q/k/v of one run)
        if isinstance(m, InputSparse) and m.sparsifiable and t > 0:
            if m.out_features < min_rows:
                dense += 1
                continue
            size = (type(m), m.out_features, m.in_features, m.sparse_rows)
            sizes.setdefault(size, []).append((part, m, t))
    taken = 0
    for group in sizes.values():
        timed = group[:MEASURE_MODULES] if measure else group
        for _, m, t in timed:  # (counted from the first step on, not in the timing)
            m.sparsify_input(t, None)
        if measure:
            pays, line = _sparse_pays(timed, MEASURE_SHARE if share is None else share, from_memory)
            if timings is not None:
                timings.append(line)
            else:
                log.info(line)
            if not pays:
                for _, m, _ in timed:
                    m.sparsify_input(None)  # (its copy dropped)
                dense += len(group)
                continue
            for _, m, t in group[len(timed):]:
                m.sparsify_input(t, None)
        for _, m, _ in group:
            m.sparse_stats = stats
        taken += len(group)
    return taken, dense, stats


def _sparse_pays(group, share: float, from_memory: bool = False) -> tuple[bool, str]:
    """Whether the sparse one-row product over these projections of one size (each with its q4c
    copy made) is faster on this CPU than their dense one, by MEASURE_MARGIN: each (distinct
    matrices, so that a round reads past the caches, as a token does) on an input whose `share`
    of entries are under its threshold, the two ways in turns for MEASURE_ROUNDS rounds after
    one of warm-up; the medians compared. `from_memory`: a buffer of 1.25 times the last level
    cache is read before each round (untimed), so that the round reads its matrices from memory
    as a model past that cache does, where up to MEASURE_MODULES matrices would stay in a
    server CPU's L3 (480 MiB on one Xeon): there the q4c product's heavier arithmetic weighed
    more than the bytes it skips, and a 7B-shape file's mixed q/k/v came out sparse in one load
    and dense in the next. Returns it and a line that says so. Where the product is not the
    CPU kernel's (the Triton one's, `BlockLinear`) or the matrices are not on the host, True
    (not timed here)."""
    from ..kernels.input_sparse import InputSparse
    mods = [m for _, m, _ in group]
    parts = "/".join(sorted({p for p, _, _ in group}))
    size = f"{parts}, {mods[0].out_features} x {mods[0].in_features}"
    if type(mods[0])._q4c_product is not InputSparse._q4c_product or \
            any(b.device.type != "cpu" for m in mods for b in m.buffers()):
        return True, f"input sparsity: {size}: not timed here (not the CPU kernel's product)"
    g = torch.Generator().manual_seed(0)
    xs = []
    for m in mods:
        t, k = m.sparse[2], m.in_features
        under = torch.randperm(k, generator=g)[:round(share * k)]
        mag = torch.full((k,), 2 * t + 1e-3)
        mag[under] = t / 2
        sign = torch.randint(0, 2, (k,), generator=g) * 2 - 1
        xs.append((mag * sign).reshape(1, k).to(torch.bfloat16))
    kept = [m.sparse for m in mods]
    sweep = torch.ones(int(1.25 * last_level_cache()) // 4) if from_memory else None

    def round_of(sparse: bool) -> float:
        try:
            for m, s in zip(mods, kept):
                m.sparse = s if sparse else None
            if sweep is not None:
                sweep.sum()  # (the caches filled with other bytes)
            t0 = time.perf_counter()
            with torch.inference_mode():
                for m, x in zip(mods, xs):
                    m(x)
            return time.perf_counter() - t0
        finally:
            for m, s in zip(mods, kept):
                m.sparse = s

    times = {True: [], False: []}
    for r in range(MEASURE_ROUNDS + 1):
        for sparse in ((True, False) if r % 2 else (False, True)):
            dt = round_of(sparse)
            if r:
                times[sparse].append(dt)
    sweep = None  # (its memory freed)
    ts, td = statistics.median(times[True]), statistics.median(times[False])
    pays = ts < MEASURE_MARGIN * td
    margin = f"{100 * (1 - MEASURE_MARGIN):.0f}%"
    size += ", from memory" if from_memory else ""
    return pays, (f"input sparsity: {size} ({len(mods)} timed): the sparse product at "
                  f"{100 * share:.0f}% of the input {1e3 * ts / len(mods):.3f} ms, the dense "
                  f"{1e3 * td / len(mods):.3f} ms: "
                  + ("sparse" if pays else f"dense (sparse not {margin} faster on this CPU)"))
