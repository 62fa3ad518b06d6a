#!/usr/bin/env python3
"""Where the kernel's weight walks ask for the lines they read next (`kernels.prefetch_level`:
"l1", into every level of the caches, or "l2", into L2 and again 8 KiB further), in turns in
one process: the dense 16-row GEMVs' read rate from memory, and a model's decode step and
prompt step; and (`--records`) whether the records kernel's walks also ask for the rows two
passes ahead (`kernels.far_prefetch`).

    .venv/bin/python benchmarks/prefetch.py [--quants q4_k q4_0 q6_k q5_k q8_0]
        [--models FILE_OR_NAME ...] [--turns 7] [--tokens 32] [--out FILE.json]
        [--records q4_0 q4_1] [--shares 0.01 0.05 0.1 0.2 0.5] [--layers 16] [--steps 1000]

Records: `--layers` 7B-shape ReGLU layers (4096 x 11008, random weights, every computed neuron
fires) held as the kernel's records in each format, a decode step at a time over a new layer
and a new random selection of the share's neurons (from 64 drawn), `--steps` steps a setting
in each turn, the four settings ("none", "acts", "downs", "both") in turns; the median time of
a step (a call from Python, as a model makes it) and the records' bytes over it.

GEMVs: a 7B layer's fused q/k/v (12288 x 4096) and gate/up (22016 x 4096) in the layout a
file's blocks are held in (q4x16, q4kx16, q6kx16, q5kx16, q8x16), as many copies as fill twice
the last level cache so that each call reads from memory; each turn times every copy once at
each level, and the table shows the median rate (GB/s) and the ratio to "l1". Models:
`PowerInfer.from_pretrained(M, Config(...defaults, max_batch=1))`, a 64-token prompt and
`--tokens` greedy tokens through the engine at each level in turns; the median time of the
model's decode call and of its prompt call. The level the CPU's vendor picks (the default) is
printed first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import decode  # noqa: E402  (the decode benchmark's load and timed generation)
import input_sparse_gemv  # noqa: E402  (its random matrices in each layout)
from gemv import last_level_cache  # noqa: E402

from powerinfer import kernels  # noqa: E402

LEVELS = ("l1", "l2")
LAYOUT = {"q4_0": "q4x16", "q4_k": "q4kx16", "q6_k": "q6kx16", "q5_k": "q5kx16", "q8_0": "q8x16"}
SHAPES = (("q/k/v", 12288), ("gate/up", 22016))


def matrix(quant: str, n: int, k: int) -> torch.Tensor:
    """A random (n, k) matrix held in `quant`'s 16-row layout."""
    if quant in ("q4_0", "q4_k", "q6_k"):
        input_sparse_gemv.QUANT = quant
        return input_sparse_gemv.matrices(n, k)[0]
    from gguf import GGMLQuantizationType, quantize

    from powerinfer.formats.kquants import quantize as kquantize
    w = torch.randn(n, k).numpy()
    data = kquantize(w, "Q5_K") if quant == "q5_k" else quantize(w, GGMLQuantizationType.Q8_0)
    return kernels.pack_kquant(torch.from_numpy(data), quant.upper())


def gemvs(quants: list[str], turns: int) -> list[dict]:
    rows, k, llc = [], 4096, last_level_cache()
    for quant in quants:
        for name, n in SHAPES:
            first = matrix(quant, n, k)
            copies = max(4, -(-2 * llc // first.numel()))
            mats = [first] + [first.clone() for _ in range(copies - 1)]
            x = torch.randn(1, k)
            times = {lv: [] for lv in LEVELS}
            for _ in range(turns):
                for lv in LEVELS:
                    kernels.prefetch_level(lv)
                    t = time.perf_counter()
                    for w in mats:
                        kernels.linear_x16(x, w, n, LAYOUT[quant])
                    times[lv].append((time.perf_counter() - t) / copies)
            gbs = {lv: first.numel() / statistics.median(v) / 1e9 for lv, v in times.items()}
            rows.append(dict(quant=quant, layout=LAYOUT[quant], matrix=name, rows=n, cols=k,
                             copies=copies, gbs=gbs))
            print(f"| {LAYOUT[quant]} | {name} ({n} x {k}) | {gbs['l1']:.1f} | {gbs['l2']:.1f} | "
                  f"**{gbs['l2'] / gbs['l1']:.2f}x** |", flush=True)
            del mats, first
    return rows


def models(names: list[str], turns: int, tokens: int) -> list[dict]:
    rows = []
    for name in names:
        m = decode.load("default", torch.get_num_threads(), name)
        ids = list(range(100, 164))
        decode.generate_once(m, ids, 8)  # warm-up
        step, prompt = {lv: [] for lv in LEVELS}, {lv: [] for lv in LEVELS}
        for _ in range(turns):
            for lv in LEVELS:
                kernels.prefetch_level(lv)
                r = decode.generate_once(m, ids, tokens)
                step[lv].append(r["step_s"])
                prompt[lv].append(r["prefill_s"])
        ms = {lv: statistics.median(v) * 1e3 for lv, v in step.items()}
        pms = {lv: statistics.median(v) * 1e3 for lv, v in prompt.items()}
        rows.append(dict(model=Path(name).name, step_ms=ms, prompt_ms=pms,
                         step_turns_ms={lv: [t * 1e3 for t in v] for lv, v in step.items()}))
        print(f"| {Path(name).name} | {ms['l1']:.2f} | {ms['l2']:.2f} "
              f"| **{ms['l1'] / ms['l2']:.2f}x** | {pms['l1']:.1f} | {pms['l2']:.1f} "
              f"| {pms['l1'] / pms['l2']:.2f}x |", flush=True)
        del m
    return rows


def records(formats: list[str], shares: list[float], layers: int, turns: int,
            steps: int) -> list[dict]:
    from kernel import firing_layers, random_masks  # (the kernel benchmark's records)
    dim, ffn, rows = 4096, 11008, []
    torch.manual_seed(0)
    x = torch.rand(1, 1, dim) + 0.1
    for fmt in formats:
        sets = firing_layers(layers, ffn, dim, fmt)
        nbytes = sets[0].records.shape[1]
        for share in shares:
            masks = random_masks(ffn, share)
            times = {w: [] for w in kernels.FAR_PREFETCH}
            for t in range(turns):
                for which in times:
                    kernels.far_prefetch(which)
                    start = time.perf_counter()
                    for i in range(steps):
                        sets[i % layers](x, masks[(7 * i + t) % 64])
                    times[which].append((time.perf_counter() - start) / steps)
            us = {w: statistics.median(v) * 1e6 for w, v in times.items()}
            gbs = round(share * ffn) * nbytes / us["none"] / 1e3
            rows.append(dict(format=fmt, share=share, step_us=us, none_gbs=gbs,
                             turns_us={w: [t * 1e6 for t in v] for w, v in times.items()}))
            print(f"| {fmt} | {share:.0%} | " + " | ".join(f"{us[w]:.1f}" for w in times)
                  + f" | **{us['both'] / us['none']:.3f}x** | {gbs:.1f} |", flush=True)
        del sets
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quants", nargs="*", default=["q4_k", "q4_0", "q6_k"], choices=list(LAYOUT))
    ap.add_argument("--models", nargs="*", default=[])
    ap.add_argument("--turns", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--records", nargs="*", default=[], choices=["q4_0", "q4_1", "i8"])
    ap.add_argument("--shares", type=float, nargs="+", default=[0.01, 0.05, 0.1, 0.2, 0.5])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    assert kernels.available(), "the CPU kernel cannot run here"
    default, far = kernels.prefetch_level(), kernels.far_prefetch()
    print(f"# {decode.machine_info(torch.get_num_threads())}; kernel ISA {kernels.isa()}; "
          f"this CPU's default level: {default}, far prefetch: {far}; {args.turns} turns, medians")
    out = dict(default=default, far_default=far, isa=kernels.isa())
    try:
        if args.quants:
            print("\n| layout | matrix | l1 GB/s | l2 GB/s | l2 vs l1 |\n|---|---|---:|---:|---:|")
            out["gemv"] = gemvs(args.quants, args.turns)
        if args.models:
            print("\n| model | decode call l1 ms | l2 ms | l2 vs l1 | prompt call l1 ms | l2 ms "
                  "| l2 vs l1 |\n|---|---:|---:|---:|---:|---:|---:|")
            out["models"] = models(args.models, args.turns, args.tokens)
        if args.records:
            print("\n| records | share | step us, none | acts | downs | both | both vs none "
                  "| none GB/s |\n|---|---:|---:|---:|---:|---:|---:|---:|")
            out["records"] = records(args.records, args.shares, args.layers, args.turns,
                                     args.steps)
    finally:
        kernels.prefetch_level(default)
        kernels.far_prefetch(far)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
