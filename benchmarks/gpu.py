#!/usr/bin/env python3
"""The hybrid runtime on a GPU against layer offload and the whole model on the GPU, one run.

    .venv/bin/python benchmarks/gpu.py [--preset 70b] [--layers 8] [--budget-share 0.3]
        [--cold 2] [--tokens 64] [--device cuda] [--rows hybrid,layer_offload,...] [--out FILE]
        [--quant q4_0|q4_k_m|q8_0 --budget-gb GB] [--workdir DIR]
    .venv/bin/python benchmarks/gpu.py --kernels [--kernel-part attention] [--sweep fused|split|attention] [--out FILE]
    .venv/bin/python benchmarks/gpu.py --plot PNG LABEL=KERNELS.json ...

One command does everything, in a temporary directory (`--workdir DIR`: in DIR, where a later
run reuses the file, the profile and the predictors an earlier one completed, each step
apart, so the rows can run in separate calls):

1. writes a synthetic ReLU model of a real shape (`powerinfer.synthetic`, bf16 or `--quant`'s
   GGUF blocks, a planted power-law activation profile; the GPU widens a 4-bit file to bf16, the
   host keeps its blocks: layer offload's host blocks and the hybrid's cold executors,
   `Config.cold_weights`), by default the first 8 blocks of a LLaMA-70B shape: with
   grouped-query attention a 30% budget holds attention, the KV cache, embeddings, lm_head and
   still about a tenth of the FFN neurons, where in the 7B shape attention alone is 33% of the
   weights;
2. profiles it, trains the layer-input (lookahead) predictors and solves the GPU/CPU placement
   for a VRAM budget of `--budget-share` of the model's weight bytes (the solver counts the KV
   cache, attention, embeddings, lm_head and the predictors inside the budget);
3. decodes the same prompt greedily with three configurations and reports tokens/s after a
   warm-up, as ratios in the same run:
   - `all_gpu`: the in-process dense engine with the whole model on the device;
   - `layer_offload`: the in-process dense engine with the first k blocks (weights and their KV
     cache) on the device and the rest, with embeddings and the output head, on the host, k the
     most that fit the same budget (llama.cpp's -ngl);
   - `hybrid`: the actor runtime: hot neurons, attention, KV cache, embeddings and lm_head on the
     device under the solver's placement, cold neurons in `--cold` CPU executors, the predictor
     in its own actor on the same GPU (its input and masks in CUDA IPC device buffers);
   - `hybrid_eager`: the hybrid with `cuda_graphs=False` (the hot executor's decode step
     launched op by op instead of replayed as CUDA graphs, `actors/graphs.py`): what the graphs
     are worth;
   - `hybrid_predictor_cpu`: the same with `predictor_device="cpu"` (the predictor on host cores,
     its input and masks over the host channels): what the device buffers are worth;
   - with a 4-bit `--quant` file, the same three in the file's blocks on the device
     (`Config(weights="int4")`, read by Triton kernels; llama.cpp's own setting for such a file):
     `layer_offload_int4` (the device's blocks' matrices in the file's blocks, so more of them
     fit), `all_gpu_int4` (every matrix so) and `hybrid_int4` (the hot neurons as 4-bit records
     with Q8_0 down rows, attention's matrices and the head in their blocks, its placement
     solved for those bytes: on the 70B shape attention takes 0.68 GB instead of 2.42, the head
     0.28 instead of 0.52, a neuron 17.5 KiB instead of 48); the embeddings stay bf16. Its
     ratios are taken against the int4 baselines (`hybrid_int4_vs_layer_offload_int4`,
     `hybrid_int4_vs_all_gpu_int4`), and against the bf16 hybrid (`int4_vs_bf16`);
   - `hybrid_hot_cores_even`: the hybrid with the hot executor on an even share of the cores
     (1/(cold+1), the CPU runtime's plan) instead of `actors.group.GPU_HOT_CORES`: what giving
     the cold executors those cores is worth;
   and for each hybrid row the peak device memory (the hot executor's, and the predictor's where
   it shares the GPU) against the budget and where
   a step goes (`breakdown`: the hot executor's step, its waits for masks and for the cold
   partial sums, the predictor's time a call, each cold executor's busy time a step; per step,
   the requests' prefill steps among them).

Targets (the issue's, after PowerInfer's): hybrid at least 5x layer offload, at least 60% of
all-GPU, the budget kept to within 5%. BENCHMARKS.md has the H200's figures; `--out` keeps what
was measured after each configuration. `--device cpu` runs the same flow with every "device"
part on the host: a check of the script and of the runtime's wiring, not a measurement.

Then the kernels alone (`--kernels` runs only these): one FFN layer of the preset's width as
neuron records in bf16 and in Q4_0 (Q8_0 down rows), a decode row, selections from 5% to 100%
of its neurons. Each row gives the time of a call and the GB/s of the rows it had to read,
against the device's measured copy bandwidth (a 1 GiB device-to-device copy):
- `triton split` / `triton fused`: `triton_ffn.neuron_ffn` with a mask (compacted on the
  device, then the index list), the decode row split over the width in two launches, or in
  one (`triton_ffn.DECODE_SPLIT`), with how far the two paths' outputs differ;
- `... graphed`: the same call's launches captured in a CUDA graph and replayed: the device's
  time for it without Python's launch costs (a bound for a decode step launched as a graph;
  the runtime launches its kernels one by one);
- `torch dense`: two matmuls over every row (what the dense model reads whatever fires);
- `torch gathered`: the rows gathered with index_select, then the same math (the path the
  GPU took before the Triton kernels);
- `predictor`: `triton_ffn.predict` for a rank-1024 predictor of the layer (its rows read), its
  matrices in float32, in bf16 (`predictor.run_dtype` beside a bf16 model) and as the Q8_0
  rows a GPU's predictors hold (`predictor.device_format`).
Then torch.profiler's device time for each kernel of a split call (`split_kernels`), and
(`attention`) a decode step's attention over the paged cache for one layer of the preset's
heads: torch's ops against the one-launch kernel (`triton_attention`), eager and graphed.
Target: the Triton kernel at 70% of the copy bandwidth or better at 10% selection. Without a GPU
the kernel rows are skipped, saying so; under TRITON_INTERPRET=1, `--kernels --device cpu` runs
them on a small shape on the CPU, a check of the script, not a measurement.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from powerinfer import Config, PowerInfer
from powerinfer.errors import ConfigError
from powerinfer.model.predictor import device_format
from powerinfer.sparsity.train import train_predictors
from powerinfer.sparsity.profile import ProfileOptions, profile
from powerinfer.sparsity.solver import gpu_bytes, solve_bundle
from powerinfer.sparsity.synthetic import write_synthetic
from runtime import PROMPT, decode_speed, step_breakdown, stream_speed

MAX_SEQ, MAX_BATCH = 512, 1


def _to(device):
    def move(a):
        if isinstance(a, torch.Tensor):  # (to the host: a blocking copy, read at once)
            return a.to(device, non_blocking=device.type != "cpu")
        if isinstance(a, tuple):  # the KV tables are a NamedTuple: keep its type
            moved = [move(x) for x in a]
            return type(a)(*moved) if hasattr(a, "_fields") else tuple(moved)
        return a
    return move


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device,
            dtype: torch.dtype) -> nn.Linear:
    """A torch Linear holding weight (out, in) and bias on `device` in `dtype`."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach().to(device, dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().to(device, dtype), requires_grad=False)
    return lin


def offload_layers(pi: PowerInfer, k: int, device: torch.device, path: Path | None = None,
                   blocks: bool = False) -> PowerInfer:
    """llama.cpp's -ngl k on the in-process engine: blocks [0, k) with their KV cache on
    `device`; embeddings, the other blocks, the final norm and the output head on the host. Each
    block's inputs follow it to its device (a copy only where the device changes). A 4-bit file's
    projections (the host's 4-bit modules) go to the device widened to the model's type, read
    again from the file at `path` (the GPU path widens a 4-bit file: `Config.weights`), or with
    `blocks` in the file's blocks for the Triton kernels (`Config(weights="int4")` on a GPU)."""
    from powerinfer.formats.loader import load_checkpoint
    from powerinfer.engine.partial import device_projection
    from powerinfer.model.quant import KernelLinear

    model = pi.model
    dtype = model.norm.weight.dtype
    source = None
    for i in range(k):
        for owner, attr, names in model.projections(i):
            mod = getattr(owner, attr)
            if isinstance(mod, (nn.Linear, KernelLinear)) and not blocks:
                continue
            if source is None:
                source = load_checkpoint(str(path), with_weights=False).source
            if blocks and (m := device_projection(source, names, dtype)) is not None:
                setattr(owner, attr, m.to(device))
                continue
            if isinstance(mod, (nn.Linear, KernelLinear)):
                continue
            w = torch.cat([source.get(n, dtype) for n in names])
            setattr(owner, attr, _linear(w, mod.bias, device, dtype))
    for b in model.layers[:k]:
        # the CPU kernel's bf16 projections (the host's layers keep them) as torch Linears (an
        # 8-bit matrix widens to float32: to the model's type here)
        for owner in list(b.modules()):
            for name, child in list(owner.named_children()):
                if isinstance(child, KernelLinear):
                    setattr(owner, name, _linear(child.weight, child.bias, device, dtype))
        b.to(device)
    # the engine's C++ layer loop holds the host's tensors of every layer: the modules run its
    # decode and prompt steps
    eng = pi.engine
    eng.native, eng._decode, eng._prompt = None, eng._forward, eng._forward
    for b in list(model.layers) + [model.norm]:
        dev = next(b.parameters()).device
        b.register_forward_pre_hook(lambda mod, args, m=_to(dev): m(args))
    return pi


def memo_ratios(pi: PowerInfer, tokens: int, turns: int = 4) -> list[float]:
    """Decode tok/s with the per-step memo (`model.STEP_MEMO`) over tok/s without it, one ratio
    a turn, measured alternately on the same engine (which goes first alternates too); the
    engine warmed up by `decode_speed` just before, each side is one stream."""
    from powerinfer.model import transformer as model

    out = []
    try:
        for turn in range(turns):
            speed = {}
            for memo in ((True, False) if turn % 2 == 0 else (False, True)):
                model.STEP_MEMO = memo
                speed[memo] = stream_speed(pi, tokens)
            out.append(speed[True] / speed[False])
    finally:
        model.STEP_MEMO = True
    return out


def layers_that_fit(args, budget: int, dtype_bytes: int) -> int:
    """Whole blocks (weights and their KV cache) that fit `budget` bytes."""
    per = gpu_bytes(args, dtype_bytes=dtype_bytes, batch=MAX_BATCH + 1, context=MAX_SEQ,
                    embeddings_on_gpu=False, lm_head_on_gpu=False)
    block = (per["attention"] + per["norms"] + per["kv_cache"]) // args.n_layers \
        + 3 * args.dim * args.ffn_dim * dtype_bytes
    return min(args.n_layers, budget // block)


def layers_that_fit_blocks(path: Path, args, budget: int) -> int:
    """`layers_that_fit` with the blocks' matrices in the file's blocks (`partial.device_bytes`,
    `Config(weights="int4")` on a GPU): whole blocks in order while their bytes fit."""
    from powerinfer.formats.loader import load_checkpoint
    from powerinfer.engine.partial import device_bytes

    src = load_checkpoint(str(path), with_weights=False).source
    per = gpu_bytes(args, dtype_bytes=2, batch=MAX_BATCH + 1, context=MAX_SEQ,
                    embeddings_on_gpu=False, lm_head_on_gpu=False)
    rest = (per["norms"] + per["kv_cache"]) // args.n_layers
    used, k = 0, 0
    for i in range(args.n_layers):
        ffn = (f"{i}.gate", f"{i}.up") if args.gated else (f"{i}.up",)
        used += rest + device_bytes(src, [(f"{i}.q", f"{i}.k", f"{i}.v"), (f"{i}.o",), ffn,
                                          (f"{i}.down",)], 2)
        if used > budget:
            break
        k += 1
    return k


def weight_bytes(path: Path) -> int:
    """The model's weights: the file's tensors (bf16 here), whatever modules hold them."""
    from gguf import GGUFReader
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


SELECTIONS = (0.05, 0.10, 0.25, 0.50, 1.00)


CORPUS = "lee"  # the profile's (`powerinfer.sparsity.corpus`: the gensim package's files)


@contextlib.contextmanager
def decode_split(on: bool):
    """`triton_ffn.DECODE_SPLIT` for every record kind (a decode row split over the width or in
    one launch) for the duration."""
    from powerinfer.kernels import triton_ffn
    default = triton_ffn.DECODE_SPLIT
    triton_ffn.DECODE_SPLIT = {True: on, False: on}
    try:
        yield
    finally:
        triton_ffn.DECODE_SPLIT = default


def _timed(fn, device: torch.device, reps: int) -> float:
    """Seconds per call of fn, after two warm-up calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn(), fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def graphed(fn, device: torch.device):
    """fn's launches captured once in a CUDA graph (its inputs stay where they are): a replay
    is one launch, so what a call costs on the device shows without Python's launch costs.
    None off a GPU."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a device-to-device copy (bytes read plus bytes written)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / _timed(lambda: b.copy_(a), device, 10) / 1e9


def one_layer(dim: int, ffn: int, device: torch.device):
    """One random SwiGLU layer (dim x ffn, bf16) for the kernel rows: the generator that drew it
    (selections come from it next), its gate, up and down rows, a decode row, and its neuron
    records in bf16 and in Q4_0 (Q8_0 down rows)."""
    from powerinfer import kernels

    g = torch.Generator(device=device).manual_seed(0)
    gate, up, down = (torch.randn(ffn, dim, generator=g, device=device, dtype=torch.bfloat16)
                      for _ in range(3))
    x = torch.randn(1, dim, device=device, dtype=torch.bfloat16)
    recs = {"bf16": kernels.pack(gate, up, down, "bf16"),
            "q4_0": kernels.pack(gate.cpu(), up.cpu(), down.cpu(), "q4_0").to(device)}
    return g, (gate, up, down), x, recs


def kernel_rows(preset: str, device: torch.device) -> dict:
    """The hot-FFN kernels alone on one layer of `preset`'s width (see the module's text)."""
    from powerinfer.kernels import triton_ffn
    from powerinfer.sparsity.synthetic import PRESETS

    small = device.type == "cpu"  # the interpreter: a check of the script only
    dim, ffn = (128, 256) if small else (PRESETS[preset].dim, PRESETS[preset].n_ff)
    reps = 2 if small else 20
    out = {"dim": dim, "ffn_dim": ffn, "interpreted": small,
           "copy_gb_s": copy_bandwidth(device, (1 << 20) if small else (1 << 30)), "rows": []}
    g, (gate, up, down), x, recs = one_layer(dim, ffn, device)
    w1 = torch.cat([gate, up])

    def torch_ffn(w1, down_t):  # w1 (2m, dim) gate and up rows; down_t (m, dim)
        g_, u_ = (x @ w1.T).chunk(2, -1)
        return (torch.nn.functional.silu(g_) * u_) @ down_t

    for share in SELECTIONS:
        mask = torch.rand(ffn, generator=g, device=device) < share
        m = int(mask.sum())
        idx = mask.nonzero().squeeze(-1)
        for fmt, rec in recs.items():
            read = m * rec.shape[1]
            # the two paths' sums on the device agree (float32, summed in other orders)
            ys = {}
            for split in (True, False):
                with decode_split(split):
                    ys[split] = triton_ffn.neuron_ffn(x.float(), rec, mask, None, None, 0.0,
                                                      "swiglu", fmt)
            diff = float((ys[True] - ys[False]).abs().max() / ys[False].abs().max().clamp_min(1e-30))
            for split, name in ((True, "triton split"), (False, "triton fused")):
                def call(split=split, rec=rec, fmt=fmt):
                    with decode_split(split):
                        return triton_ffn.neuron_ffn(x, rec, mask, None, None, 0.0, "swiglu", fmt)
                for path, fn in ((name, call), (f"{name} graphed", graphed(call, device))):
                    if fn is None:
                        continue
                    t = _timed(fn, device, reps)
                    out["rows"].append({"path": path, "fmt": fmt, "selection": share,
                                        "neurons": m, "us": t * 1e6, "gb_s": read / t / 1e9,
                                        "split_vs_fused_max_rel": diff})
        t = _timed(lambda: torch_ffn(w1, down), device, reps)
        out["rows"].append({"path": "torch dense", "fmt": "bf16", "selection": share,
                            "neurons": ffn, "us": t * 1e6, "gb_s": 3 * ffn * dim * 2 / t / 1e9})
        t = _timed(lambda: torch_ffn(torch.cat([gate.index_select(0, idx), up.index_select(0, idx)]),
                                     down.index_select(0, idx)), device, reps)
        out["rows"].append({"path": "torch gathered", "fmt": "bf16", "selection": share,
                            "neurons": m, "us": t * 1e6, "gb_s": 3 * m * dim * 2 / t / 1e9})
    if device.type == "cuda":  # where a split call's device time goes, kernel by kernel
        with decode_split(True):
            for share in (0.1, 1.0):
                mask = torch.rand(ffn, generator=g, device=device) < share
                for fmt, rec in recs.items():
                    times = kernel_device_times(lambda: triton_ffn.neuron_ffn(
                        x, rec, mask, None, None, 0.0, "swiglu", fmt))
                    out.setdefault("split_kernels", []).append(
                        {"fmt": fmt, "selection": share, "neurons": int(mask.sum()), "us": times})
                    print(json.dumps(out["split_kernels"][-1]), flush=True)
    rank = 32 if small else 1024
    fc1 = torch.randn(rank, dim, generator=g, device=device) / dim ** 0.5
    fc2 = torch.randn(ffn, rank, generator=g, device=device) / rank ** 0.5
    # in float32, in bf16 as beside a bf16 model (`predictor.run_dtype`), and as the Q8_0 rows a
    # GPU's predictors hold (`predictor.device_format`), read beside a bf16 model
    from powerinfer import kernels
    for fmt, dt in (("f32", torch.float32), ("bf16", torch.bfloat16), ("q8_0", torch.bfloat16)):
        w1, w2 = (w.to(dt) if fmt != "q8_0" else kernels.quantize_rows(w, fmt) for w in (fc1, fc2))
        t = _timed(lambda: triton_ffn.predict(x.to(dt), w1, w2), device, reps)
        out["rows"].append({"path": "predictor", "fmt": fmt, "selection": None, "neurons": ffn,
                            "us": t * 1e6, "gb_s": (w1.nbytes + w2.nbytes) / t / 1e9})
    for r in out["rows"]:
        r["of_copy"] = r["gb_s"] / out["copy_gb_s"]
        print(json.dumps(r), flush=True)
    return out


ATTENTION_SWEEP = [(per_sm, least) for per_sm in (1, 2, 4, 8) for least in (1, 2, 4, 8)]


def attention_rows(preset: str, device: torch.device, contexts=(64, 512, 2048, 8192),
                   sweep: bool = False) -> list[dict]:
    """A decode step's attention over the paged cache for one layer of `preset` (its heads, bf16,
    blocks of 16), one sequence at each context length and 8 at 512 and 2,048: torch's ops
    (`model.paged_attention`, its index work done fresh, as a step's first layer does) against
    the one-launch kernel (`triton_attention`) with one program a sequence and KV head and
    split over the context as it chooses (`splits_for`), eager and as a CUDA graph. `sweep`:
    the split's two constants (SPLIT_PER_SM, SPLIT_MIN_BLOCKS) over ATTENTION_SWEEP too."""
    from powerinfer.model import transformer as M
    from powerinfer.kernels import triton_attention as TA
    from powerinfer.sparsity.synthetic import PRESETS

    p = PRESETS[preset]
    small = device.type == "cpu"
    H, hkv, D = (4, 2, 16) if small else (p.n_heads, p.n_kv_heads, p.dim // p.n_heads)
    bs, rows = 16, []
    chosen = (TA.SPLIT_PER_SM, TA.SPLIT_MIN_BLOCKS)
    paths = [("torch", None), ("triton one program a head", (0, 1)), ("triton", chosen)]
    if sweep:
        paths += [(f"triton split {a}/SM, >={b} blocks", (a, b)) for a, b in ATTENTION_SWEEP]
    for S, ctx in ([(1, c) for c in (contexts[:1] if small else contexts)]
                   + [(8, 512)] + ([] if small else [(8, 2048)])):
        M_ = -(-ctx // bs) + 1
        g = torch.Generator(device=device).manual_seed(S * ctx)
        cache = M.KVCache(S * M_, hkv, bs, D, torch.bfloat16, device)
        cache.k.normal_(generator=g), cache.v.normal_(generator=g)
        tables = torch.arange(S * M_, device=device, dtype=torch.int32).view(S, M_)
        pos = torch.full((S,), ctx - 1, device=device, dtype=torch.long)
        qkv = torch.randn(S, (H + 2 * hkv) * D, generator=g, device=device).bfloat16()
        cos, sin = torch.randn(S, D, device=device), torch.randn(S, D, device=device)
        starts = torch.arange(S + 1, device=device)
        for path, split in paths:
            def call(split=split):
                M.TRITON_ATTENTION = split is not None
                TA.SPLIT_PER_SM, TA.SPLIT_MIN_BLOCKS = split or chosen
                try:
                    return M.paged_attention(qkv, (cos, sin), pos, M.KVTables(starts, tables, None),
                                             cache, H, 0, D ** -0.5)
                finally:
                    M.TRITON_ATTENTION = True
                    TA.SPLIT_PER_SM, TA.SPLIT_MIN_BLOCKS = chosen
            r = {"path": path, "sequences": S, "context": ctx, "splits": 1,
                 "heads": H, "kv_heads": hkv, "head_dim": D}
            if split is not None:
                TA.SPLIT_PER_SM, TA.SPLIT_MIN_BLOCKS = split
                r["splits"] = TA.splits_for(S, hkv, M_, device)
                TA.SPLIT_PER_SM, TA.SPLIT_MIN_BLOCKS = chosen
            r["us"] = _timed(call, device, 2 if small else 50) * 1e6
            if (fn := graphed(call, device)) is not None:
                r["graphed_us"] = _timed(fn, device, 50) * 1e6
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def breakdown(actors: dict, budget: int) -> dict:
    """Where a hybrid decode step's time goes, per step (ms), from the actors' counters: the
    hot executor's step (GPU work and its waits), its waits for masks and for the cold partial
    sums, the predictor's work a call, each cold executor's work; and the hot executor's peak
    device memory against the budget."""
    hot, steps = actors["hot"], max(actors["hot"]["steps"], 1)
    # the GPU's bytes: the hot executor's and, where it shares the GPU, the predictor's
    peak = hot.get("device_peak_bytes")
    pred_peak = actors.get("predictor", {}).get("device_peak_bytes")
    if peak is not None:
        peak += pred_peak or 0
    out = {"hot_neurons": hot["hot_neurons"], "steps": hot["steps"],
           "hot_step_ms": hot["step_s"] / steps * 1e3,
           "mask_wait_ms_per_step": hot.get("mask_wait_s", 0) / steps * 1e3,
           "part_wait_ms_per_step": hot["part_wait_s"] / steps * 1e3,
           "device_peak_bytes": hot.get("device_peak_bytes"),
           "predictor_device_peak_bytes": pred_peak,
           "device_buffer_bytes": hot.get("device_buffer_bytes", 0),
           "within_budget": None if peak is None else peak <= budget}
    if "predictor" in actors:
        p = actors["predictor"]
        out.update(predictor_device=p.get("device"),
                   predictor_ms_per_call=p["busy_s"] / max(p["calls"], 1) * 1e3,
                   predictor_calls=p["calls"])
    out["cold_busy_ms_per_step"] = [round(v.get("busy_s", 0) / steps * 1e3, 3)
                                    for k, v in sorted(actors.items()) if k.startswith("cold.")]
    return out


SWEEP = [(bn, bk, nw) for bn in (8, 16, 32) for bk in (128, 512, 1024) for nw in (4, 8)]


def sweep_rows(preset: str, device: torch.device, copy: float, shares=(0.1, 1.0)) -> list[dict]:
    """The Triton FFN kernel's decode-row tiles (`triton_ffn.TILE_PLAIN`, `TILE_BLOCKS`) timed
    on one layer of `preset`'s width, bf16 and Q4_0 records, at `shares` of its neurons: which
    default the kernel should take on this GPU (copy: the device's copy rate, GB/s)."""
    from powerinfer.kernels import triton_ffn
    from powerinfer.sparsity.synthetic import PRESETS

    dim, ffn = PRESETS[preset].dim, PRESETS[preset].n_ff
    g, _, x, recs = one_layer(dim, ffn, device)
    masks = {sh: torch.rand(ffn, generator=g, device=device) < sh for sh in shares}
    default = (triton_ffn.TILE_PLAIN, triton_ffn.TILE_BLOCKS)
    rows = []
    try:
        for bn, bk, nw in SWEEP:
            triton_ffn.TILE_PLAIN = triton_ffn.TILE_BLOCKS = (bn, bk, nw)
            for fmt, rec in recs.items():
                if fmt != "bf16" and (bk > 512 or nw != 4):
                    continue
                for sh, mask in masks.items():
                    try:
                        t = _timed(lambda: triton_ffn.neuron_ffn(x, rec, mask, None, None, 0.0,
                                                                 "swiglu", fmt), device, 20)
                    except Exception as e:  # a tile the compiler refuses (registers, shared memory)
                        rows.append({"block_n": bn, "block_k": bk, "warps": nw, "fmt": fmt,
                                     "selection": sh, "error": str(e)[:200]})
                        continue
                    read = int(mask.sum()) * rec.shape[1]
                    r = {"block_n": bn, "block_k": bk, "warps": nw, "fmt": fmt, "selection": sh,
                         "us": t * 1e6, "gb_s": read / t / 1e9, "of_copy": read / t / 1e9 / copy}
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    finally:
        triton_ffn.TILE_PLAIN, triton_ffn.TILE_BLOCKS = default
    return rows


# the split decode row's settings: (gate/up tile, down tile, gate/up columns a program, down
# programs a multiprocessor), tiles as (neurons, columns a step, warps); the first is the
# starting point of the sweep in BENCHMARKS.md, then one part varied at a time
SPLIT_SWEEP = [((16, 256, 4), (16, 256, 4), 1024, 8),
               ((16, 128, 4), (16, 256, 4), 1024, 8), ((32, 128, 8), (16, 256, 4), 1024, 8),
               ((8, 512, 4), (16, 256, 4), 1024, 8),
               ((16, 256, 4), (32, 256, 4), 1024, 8), ((16, 256, 4), (16, 512, 4), 1024, 8),
               ((16, 256, 4), (32, 128, 4), 1024, 8), ((16, 256, 4), (64, 128, 8), 1024, 8),
               ((16, 256, 4), (16, 256, 4), 512, 8), ((16, 256, 4), (16, 256, 4), 2048, 8),
               ((16, 256, 4), (16, 256, 4), 1024, 4), ((16, 256, 4), (16, 256, 4), 1024, 16)]


def split_sweep_rows(preset: str, device: torch.device, copy: float,
                     shares=(0.1, 1.0)) -> list[dict]:
    """The split decode row's settings (`triton_ffn.SPLIT_TILES`, `SPLIT_COLS`, `DOWN_PER_SM`)
    timed as `sweep_rows` times the one-launch kernel's tiles, eager and as a CUDA graph."""
    from powerinfer.kernels import triton_ffn as T
    from powerinfer.sparsity.synthetic import PRESETS

    dim, ffn = PRESETS[preset].dim, PRESETS[preset].n_ff
    g, _, x, recs = one_layer(dim, ffn, device)
    masks = {sh: torch.rand(ffn, generator=g, device=device) < sh for sh in shares}
    default = (dict(T.SPLIT_TILES), T.SPLIT_COLS, T.DOWN_PER_SM)
    rows = []
    try:
        for gu, down, cols, per_sm in SPLIT_SWEEP:
            T.SPLIT_TILES = {True: (gu, down), False: (gu, down)}
            T.SPLIT_COLS, T.DOWN_PER_SM = cols, per_sm
            for fmt, rec in recs.items():
                for sh, mask in masks.items():
                    def call(rec=rec, fmt=fmt, mask=mask):
                        with decode_split(True):
                            return T.neuron_ffn(x, rec, mask, None, None, 0.0, "swiglu", fmt)
                    r = {"gate_up": gu, "down": down, "cols": cols, "down_per_sm": per_sm,
                         "fmt": fmt, "selection": sh}
                    try:
                        t, tg = _timed(call, device, 20), _timed(graphed(call, device), device, 20)
                    except Exception as e:  # a tile the compiler refuses (registers, shared memory)
                        rows.append({**r, "error": str(e)[:200]})
                        continue
                    read = int(mask.sum()) * rec.shape[1]
                    r.update(us=t * 1e6, graphed_us=tg * 1e6, of_copy=read / t / 1e9 / copy,
                             graphed_of_copy=read / tg / 1e9 / copy)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    finally:
        T.SPLIT_TILES, T.SPLIT_COLS, T.DOWN_PER_SM = default
    return rows


def kernel_device_times(fn, reps: int = 10) -> dict[str, float]:
    """Microseconds of device time a call of fn spends in each kernel it launches
    (torch.profiler's CUDA activity, averaged over reps calls)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    fn(), fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            out[e.key[:60]] = round(t / reps, 2)
    return out


def plot_kernels(runs: dict[str, dict], path: str):
    """GB/s of the rows each path had to read against the share of neurons selected, one line
    per path and format, for each labelled `--kernels` result (the copy bandwidth drawn)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = ["-", "--", ":"]
    for (label, res), ls in zip(runs.items(), styles):
        paths = sorted({(r["path"], r["fmt"]) for r in res["rows"] if r["selection"] is not None})
        for p, fmt in paths:
            if p == "torch dense" and ls != "-":
                continue  # the same on every run
            pts = sorted((r["selection"], r["gb_s"]) for r in res["rows"]
                         if (r["path"], r["fmt"]) == (p, fmt) and r["selection"] is not None)
            ax.plot([x * 100 for x, _ in pts], [y for _, y in pts], ls, marker="o",
                    label=f"{p} {fmt} ({label})")
        ax.axhline(res["copy_gb_s"], color="grey", lw=0.8)
    ax.axhline(0.7 * res["copy_gb_s"], color="grey", lw=0.8, ls=":", label="70% of the copy rate")
    ax.set_xlabel("neurons selected (%)")
    ax.set_ylabel("GB/s of the rows read")
    ax.set_xscale("log")
    ax.set_title(f"one FFN layer, {res['dim']} x {res['ffn_dim']}, a decode row")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_attention(res: dict, path: str):
    """us per decode step's attention against the context, one sequence (lines) and 8 (the
    same paths' markers at their context), for torch's ops and the kernel unsplit and split:
    graphed (solid) and launched one by one (dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["attention"] if not r["path"].startswith("triton split")]
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, p in enumerate(dict.fromkeys(r["path"] for r in rows)):
        color = f"C{i}"
        for key, ls, how in (("graphed_us", "-", "graphed"), ("us", "--", "eager")):
            one = sorted((r["context"], r[key]) for r in rows if r["path"] == p and r["sequences"] == 1)
            ax.plot([c for c, _ in one], [u for _, u in one], ls, color=color, marker="o",
                    label=f"{p}, {how}")
            eight = [(r["context"], r[key]) for r in rows if r["path"] == p and r["sequences"] == 8]
            ax.plot([c for c, _ in eight], [u for _, u in eight], "s" if how == "graphed" else "x",
                    color=color, ms=8, linestyle="none")
    h = rows[0]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (positions); squares and crosses: 8 sequences")
    ax.set_ylabel("us per call")
    ax.set_title(f"a decode step's attention, one layer ({h['heads']} query, {h['kv_heads']} KV "
                 f"heads of {h['head_dim']}), bf16")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


ROWS = ("layer_offload", "all_gpu", "hybrid", "hybrid_eager", "hybrid_hot_cores_even",
        "hybrid_predictor_cpu", "layer_offload_int4", "all_gpu_int4", "hybrid_int4", "kernels")


def int4_parts(path: Path) -> tuple[str | None, dict[str, int] | None]:
    """What `Config(weights="int4")` keeps of a file on a GPU, as its placement counts it: the
    4-bit records of the hot neurons and the parts held in the file's blocks
    (`partial.device_fixed_bytes`), read from the kernel-ready copy (a K-quant file's converted
    one); (None, None) for a file without 4-bit FFN blocks."""
    from powerinfer.engine.budget import gpu_neuron_format
    from powerinfer.model.convert import kernel_ready
    from powerinfer.formats.loader import load_checkpoint
    from powerinfer.engine.partial import device_fixed_bytes

    config = Config(dtype="bfloat16", weights="int4")
    ck = kernel_ready(load_checkpoint(str(path), with_weights=False), config)
    fmt = gpu_neuron_format(config, ck.info)
    if fmt not in ("q4_0", "q4_1"):
        return None, None
    return fmt, device_fixed_bytes(ck.source, ck.args, 2)


def pipeline(path: Path, bundle_path: Path, a) -> tuple:
    """The model file, its profile and its trained layer-input predictors in --workdir, each step
    made only where an earlier run did not complete it (the file appears under its name only
    once written; a bundle's parts are marked as each completes; a bundle whose profile did not
    complete is made again): (the bundle, the steps reused)."""
    from powerinfer.formats.bundle import Bundle

    done = []
    if path.exists():
        done.append("file")
    else:
        write_synthetic(path, a.preset, n_layers=a.layers, quant=a.quant)
    b = None
    if done and (bundle_path / "manifest.json").exists():
        b = Bundle.open(bundle_path)
        if not b.has("stats"):  # (marked after the samples: the profile completed)
            b = None
    if b is None:
        if bundle_path.exists():
            import shutil
            shutil.rmtree(bundle_path)
        b = profile(str(path), CORPUS, bundle_path,
                    ProfileOptions(tokens=a.profile_tokens, window=256, samples=4000),
                    dtype="bfloat16", device=a.device)
    else:
        done.append("samples")
    if b.has("predictors.layer"):
        done.append("predictors")
    else:
        train_predictors(b, "layer", device=a.device)
    if done:
        print(f"reused from an earlier run in the work directory: {', '.join(done)}", flush=True)
    return b, done


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="70b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget-share", type=float, default=0.3)
    ap.add_argument("--cold", type=int, default=2, help="cold executors of the hybrid runtime")
    ap.add_argument("--quant", choices=["q4_0", "q4_k_m", "q8_0"],
                    help="write the model's matrices in these GGUF blocks (default bf16): the "
                         "host keeps them (layer offload's host blocks, the cold executors), the "
                         "GPU widens them")
    ap.add_argument("--budget-gb", type=float, default=0.0,
                    help="the VRAM budget in GiB (default: --budget-share of the file's bytes)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile-tokens", type=int, default=4096)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--workdir", default=None,
                    help="keep the synthetic file and its bundle here (not in a temporary "
                         "directory), and reuse them when an earlier run completed them")
    ap.add_argument("--kernels", action="store_true", help="only the kernel rows")
    ap.add_argument("--kernel-part", choices=["all", "ffn", "attention"], default="all",
                    help="with --kernels: the FFN and predictor rows, the attention rows, or both")
    ap.add_argument("--plot", nargs="+", metavar=("PNG", "LABEL=JSON"),
                    help="draw --kernels results (LABEL=FILE ...) into PNG, and exit (a "
                         "--kernel-part attention result: its attention rows)")
    ap.add_argument("--sweep", choices=["fused", "split", "attention"],
                    help="with --kernels: time the Triton FFN kernel's tile sizes too, those of "
                         "the one-launch kernel (fused) or of the split decode row's two; or the "
                         "attention kernel's split constants")
    ap.add_argument("--rows", default=",".join(ROWS),
                    help="the configurations to run, comma-separated and in that order, of " +
                         ", ".join(ROWS) + " (default: all; `kernels`: the kernel rows after "
                         "them)")
    ap.add_argument("--profile-hot", type=int, default=0, metavar="STEPS",
                    help="a diagnostic beside the rows: after each hybrid row's measured "
                         "requests, a torch.profiler table of its hot executor's next STEPS "
                         "decode steps (the row's hot_profile)")
    a = ap.parse_args()
    want = set(a.rows.split(","))
    if want - set(ROWS):
        ap.error(f"--rows: unknown {', '.join(sorted(want - set(ROWS)))} (of {', '.join(ROWS)})")
    if a.plot:
        runs = {k: json.loads(Path(v).read_text()) for k, v in (x.split("=", 1) for x in a.plot[1:])}
        if all("rows" not in r for r in runs.values()):  # --kernel-part attention results
            return plot_attention(next(iter(runs.values())), a.plot[0])
        return plot_kernels(runs, a.plot[0])
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs one (--device cpu only checks the flow); "
                 "the Triton kernel rows are skipped too")
    device = torch.device(a.device)
    from powerinfer.kernels import triton_ffn
    runs_kernels = triton_ffn.available(device)
    if not runs_kernels:
        print(f"Triton kernel rows skipped: {'triton is not installed' if triton_ffn.triton is None else 'no GPU (set TRITON_INTERPRET=1 to check them on the CPU)'}",
              flush=True)
    if a.kernels:
        if runs_kernels:
            result = {} if a.kernel_part == "attention" else kernel_rows(a.preset, device)
            if a.kernel_part != "ffn":
                result["attention"] = attention_rows(a.preset, device,
                                                     sweep=a.sweep == "attention")
            if a.sweep in ("fused", "split"):
                sweep = sweep_rows if a.sweep == "fused" else split_sweep_rows
                result["sweep"] = sweep(a.preset, device, result["copy_gb_s"])
            if a.out:
                Path(a.out).write_text(json.dumps(result, indent=1))
        return
    import ray  # (the kernel rows run where Ray is not installed)

    result = {"date": str(datetime.date.today()), "host": platform.processor() or platform.machine(),
              "cores": len(os.sched_getaffinity(0)),
              "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
              "preset": a.preset, "layers": a.layers, "budget_share": a.budget_share,
              "quant": a.quant or "bf16", "budget_gb": a.budget_gb}
    dense = dict(dtype="bfloat16", max_seq_len=MAX_SEQ, max_batch=MAX_BATCH)
    # what the pipeline needs, checked before it writes a file of gigabytes: the profile's
    # corpus, and the work directory
    from powerinfer.sparsity.corpus import CorpusError, load_corpus
    try:
        load_corpus(CORPUS, "calibration")
    except CorpusError as e:
        sys.exit(f"the profile's corpus: {e}")
    if a.workdir:
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(a.workdir) if a.workdir else tempfile.TemporaryDirectory()) as d:
        t0 = time.perf_counter()
        path = Path(d) / f"synthetic-{a.preset}-{a.layers}-{a.quant or 'bf16'}.gguf"
        bundle, result["reused_pipeline"] = pipeline(path, Path(d) / f"{path.stem}.bundle", a)
        weights = weight_bytes(path)
        # (a 4-bit file widens to bf16 on the GPU: a share of its own bytes would not hold the
        # attention; --budget-gb gives the budget outright)
        budget = int(a.budget_gb * 2**30) if a.budget_gb else int(a.budget_share * weights)

        # the hot neurons, attention (and the baselines' matrices) in the file's 4-bit blocks
        # on the device: the int4 rows (a 4-bit file)
        four_bit, int4_fixed = int4_parts(path)

        def place(int4: bool = False):  # the bundle's placement for this budget, the hot
            # neurons (and attention) in the model's type, or as `Config(weights="int4")` keeps
            # them on a GPU
            return solve_bundle(bundle, budget / 2**30, batch=MAX_BATCH + 1, context=MAX_SEQ,
                                dtype_bytes=2, predictor_input="layer",
                                neuron_fmt=four_bit if int4 else None,
                                fixed_bytes=int4_fixed if int4 else None,
                                predictor_fmt=device_format(device))

        try:
            placement = place().report()
        except ConfigError as e:  # a budget below what the bf16 model must hold besides its
            placement = {"error": str(e)}  # neurons: the int4 rows still run
            print(f"no bf16 placement: {e}", flush=True)
        result.update(weight_bytes=weights, budget_bytes=budget, pipeline_s=time.perf_counter() - t0,
                      placement=placement)
        print(json.dumps({k: result[k] for k in ("weight_bytes", "budget_bytes", "pipeline_s")}),
              flush=True)

        def save():  # what is measured so far survives a run cut short
            if a.out:
                Path(a.out).write_text(json.dumps(result, indent=1))

        # (the int4 baselines' blocks need the Triton kernels on the device)
        blocks_run = four_bit is not None and runs_kernels
        if four_bit is not None and not runs_kernels and want & {"layer_offload_int4", "all_gpu_int4"}:
            print("layer_offload_int4, all_gpu_int4 skipped: the Triton kernels do not run here",
                  flush=True)

        def offload_row(name: str, blocks: bool):
            if blocks and not blocks_run:
                return  # (its blocks need the Triton kernels on the device)
            pi = PowerInfer.from_pretrained(str(path), Config(**dense))
            k = (layers_that_fit_blocks(path, pi.model.args, budget) if blocks
                 else layers_that_fit(pi.model.args, budget, 2))
            offload_layers(pi, k, device, path, blocks)
            tok_s, first_ms = decode_speed(pi, a.tokens)
            result[name] = {"layers_on_device": k, "tok_s": tok_s, "first_token_ms": first_ms}
            print(name, json.dumps(result[name]), flush=True)
            save()

        def all_gpu_row(name: str, weights: dict):
            if weights and not blocks_run:
                return
            pi = PowerInfer.from_pretrained(str(path), Config(**dense, device=a.device, **weights))
            tok_s, first_ms = decode_speed(pi, a.tokens)
            result[name] = {"tok_s": tok_s, "first_token_ms": first_ms}
            if not weights:
                # the step's index work done once for its layers (KVTables.memo) against each
                # layer doing it again, in turns on the same engine
                result[name]["step_memo_ratios"] = memo_ratios(pi, a.tokens)
            print(name, json.dumps(result[name]), flush=True)
            del pi
            if a.device == "cuda":
                torch.cuda.empty_cache()
            save()

        # the predictor on the hot executor's GPU (device buffers, CUDA IPC), then on the CPU
        # (host channels): the hop's cost in the same run; and the hot executor on an even
        # share of the cores (the plan before `group.GPU_HOT_CORES`): what its cores are worth;
        # the hot neurons in the file's 4-bit records (a 4-bit file), on its own placement
        from actors import group
        hybrids = {"hybrid": ("auto", group.GPU_HOT_CORES, True)}
        if a.device == "cuda":
            hybrids.update(hybrid_eager=("auto", group.GPU_HOT_CORES, False),
                           hybrid_hot_cores_even=("auto", 1 << 20, True),
                           hybrid_predictor_cpu=("cpu", group.GPU_HOT_CORES, True))
        if four_bit is not None:
            hybrids["hybrid_int4"] = ("auto", group.GPU_HOT_CORES, True)
        default_hot = group.GPU_HOT_CORES
        # (the bf16 rows: the hot neurons widened, a 4-bit file's cold ones in its blocks, as
        # `weights="auto"` chose on a GPU before it kept the blocks there too)
        bf16_hot = dict(weights="dense", cold_weights="int4" if four_bit else "auto")

        def hybrid_row(name: str):
            if name not in hybrids:
                return
            where, hot_cores, graphs = hybrids[name]
            int4 = name == "hybrid_int4"
            if not int4 and "error" in placement:
                result[name] = {"error": "no bf16 placement for this budget"}
                print(name, json.dumps(result[name]), flush=True)
                return
            pi, group.GPU_HOT_CORES = None, hot_cores
            try:
                if int4:
                    result["placement_int4"] = place(int4=True).report()
                pi = PowerInfer.from_pretrained(str(path), Config(
                    **dense, device=a.device, runtime="actors", cold_executors=a.cold,
                    bundle=str(bundle.path), predictor="layer", predictor_device=where,
                    cuda_graphs=graphs, **({"weights": "int4"} if int4 else bf16_hot)))
                tok_s, first_ms = decode_speed(pi, a.tokens)
                st = pi.engine.stats()
                result[name] = dict(tok_s=tok_s, first_token_ms=first_ms, cores=st["cores"],
                                    weights=pi.config.weights, cold_weights=pi.config.cold_weights,
                                    neuron_format=st["actors"]["hot"].get("neuron_format"),
                                    graphs=st["actors"]["hot"].get("graphs"),
                                    **breakdown(st["actors"], budget))
                # the same counters over one more request's decode steps alone (no prefill)
                result[name]["decode_step_ms"] = step_breakdown(pi, a.tokens)
                if a.profile_hot:  # (a hot executor without torch has no profile: the
                    hot = pi.engine.group.actors["hot"]  # row keeps what it measured)
                    try:
                        ray.get(hot.profile.remote(a.profile_hot))
                    except ray.exceptions.RayTaskError as e:
                        result[name]["hot_profile"] = f"none: {e.cause}"
                    else:
                        pi.generate(PROMPT, max_new_tokens=a.profile_hot + 4, temperature=0,
                                    ignore_eos=True)
                        result[name]["hot_profile"] = ray.get(hot.profile_table.remote())
                    print(result[name]["hot_profile"], flush=True)
            finally:  # (an error is the row's, recorded by the loop below; the rest run)
                group.GPU_HOT_CORES = default_hot
                if pi is not None:
                    pi.close()
                if int4 and "error" not in placement:  # (a later row, or run reusing
                    place()  # --workdir, finds the model type's placement)
            print(name, json.dumps({k: v for k, v in result[name].items() if k != "hot_profile"}),
                  flush=True)
            save()

        # in --rows' order: a device's short lease measures the rows it needs first
        for name in dict.fromkeys(a.rows.split(",")):
            try:
                if name in ("layer_offload", "layer_offload_int4"):
                    offload_row(name, name.endswith("_int4"))
                elif name in ("all_gpu", "all_gpu_int4"):
                    all_gpu_row(name, {"weights": "int4"} if name.endswith("_int4") else {})
                elif name != "kernels":
                    hybrid_row(name)
            except Exception as e:  # a row that fails is its error; the rest run
                result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                print(name, json.dumps(result[name]), flush=True)
                save()
                if a.device == "cuda":
                    torch.cuda.empty_cache()
    ok = [k for k in ("hybrid", "hybrid_predictor_cpu") if "tok_s" in result.get(k, {})]
    int4 = "tok_s" in result.get("hybrid_int4", {})
    if not ok and not int4:
        save()
        sys.exit("no hybrid configuration ran: " + json.dumps({k: result[k] for k in result
                                                               if k.startswith("hybrid")}))
    result["ratios"] = {"hybrid_row": ok[0] if ok else None}
    h = result[ok[0]]["tok_s"] if ok else None
    for base in ("layer_offload", "all_gpu"):
        if ok and "tok_s" in result.get(base, {}):
            result["ratios"][f"hybrid_vs_{base}"] = h / result[base]["tok_s"]
    for other, key in (("hybrid_predictor_cpu", "predictor_on_gpu_vs_cpu"),
                       ("hybrid_eager", "cuda_graphs_vs_eager"),
                       ("hybrid_hot_cores_even", "hot_cores_few_vs_even")):
        if ok and ok[0] == "hybrid" and "tok_s" in result.get(other, {}):
            result["ratios"][key] = h / result[other]["tok_s"]
    if int4:  # against the baselines in the same blocks
        h4 = result["hybrid_int4"]["tok_s"]
        if ok and ok[0] == "hybrid":
            result["ratios"]["int4_vs_bf16"] = h4 / h
        for base in ("layer_offload_int4", "all_gpu_int4"):
            if "tok_s" in result.get(base, {}):
                result["ratios"][f"hybrid_int4_vs_{base}"] = h4 / result[base]["tok_s"]
    print(json.dumps(result["ratios"]), flush=True)
    save()
    if runs_kernels and "kernels" in want:
        result["kernels"] = kernel_rows(a.preset, device)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
