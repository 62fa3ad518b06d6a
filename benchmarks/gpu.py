#!/usr/bin/env python3
"""The hybrid runtime on a GPU against layer offload and the whole model on the GPU, one run.

    .venv/bin/python benchmarks/gpu.py [--preset 70b] [--layers 8] [--budget-share 0.3]
        [--cold 2] [--tokens 64] [--device cuda] [--out FILE]

One command does everything, in a temporary directory:

1. writes a synthetic ReLU model of a real shape (`powerinfer.synthetic`, bf16, a planted
   power-law activation profile), by default the first 8 blocks of a LLaMA-70B shape: with
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
     in its own actor;
   and the hybrid hot executor's peak device memory against the budget.

Targets (PowerInfer's claim, scaled): hybrid at least 3x layer offload and at least 50% of
all-GPU. `--device cpu` runs the same flow with every "device" part on the host: a check of the
script and of the runtime's wiring, not a measurement.

Then the kernels alone (`--kernels` runs only these): one FFN layer of the preset's width as
neuron records in bf16 and in Q4_0 (Q8_0 down rows), a decode row, selections from 5% to 100%
of its neurons. Each row gives the time of a call and the GB/s of the rows it had to read,
against the device's measured copy bandwidth (a 1 GiB device-to-device copy):
- `triton`: `triton_ffn.neuron_ffn` with a mask (compacted on the device, then the index list);
- `torch dense`: two matmuls over every row (what the dense model reads whatever fires);
- `torch gathered`: the rows gathered with index_select, then the same math (the path the
  GPU took before the Triton kernels);
- `predictor`: `triton_ffn.predict` for a rank-1024 predictor of the layer (its rows read).
Target: the Triton kernel at 70% of the copy bandwidth or better at 10% selection. Without a GPU
the kernel rows are skipped, saying so; under TRITON_INTERPRET=1, `--kernels --device cpu` runs
them on a small shape on the CPU, a check of the script, not a measurement.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from powerinfer import Config, PowerInfer
from powerinfer.predictor import train_predictors
from powerinfer.profile import ProfileOptions, profile
from powerinfer.solver import gpu_bytes, solve_bundle
from powerinfer.synthetic import write_synthetic
from runtime import decode_speed

MAX_SEQ, MAX_BATCH = 512, 1


def _to(device):
    def move(a):
        if isinstance(a, torch.Tensor):
            return a.to(device, non_blocking=True)
        if isinstance(a, tuple):
            return tuple(move(x) for x in a)
        return a
    return move


def offload_layers(pi: PowerInfer, k: int, device: torch.device) -> PowerInfer:
    """llama.cpp's -ngl k on the in-process engine: blocks [0, k) with their KV cache on
    `device`; embeddings, the other blocks, the final norm and the output head on the host. Each
    block's inputs follow it to its device (a copy only where the device changes)."""
    model = pi.model
    for b in model.layers[:k]:
        b.to(device)
    for b in list(model.layers) + [model.norm]:
        dev = next(b.parameters()).device
        b.register_forward_pre_hook(lambda mod, args, m=_to(dev): m(args))
    return pi


def layers_that_fit(args, budget: int, dtype_bytes: int) -> int:
    """Whole blocks (weights and their KV cache) that fit `budget` bytes."""
    per = gpu_bytes(args, dtype_bytes=dtype_bytes, batch=MAX_BATCH + 1, context=MAX_SEQ,
                    embeddings_on_gpu=False, lm_head_on_gpu=False)
    block = (per["attention"] + per["norms"] + per["kv_cache"]) // args.n_layers \
        + 3 * args.dim * args.ffn_dim * dtype_bytes
    return min(args.n_layers, budget // block)


def weight_bytes(pi: PowerInfer) -> int:
    return sum(t.numel() * t.element_size() for t in
               {id(p): p for p in pi.model.parameters()}.values())


SELECTIONS = (0.05, 0.10, 0.25, 0.50, 1.00)


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


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a device-to-device copy (bytes read plus bytes written)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / _timed(lambda: b.copy_(a), device, 10) / 1e9


def kernel_rows(preset: str, device: torch.device) -> dict:
    """The hot-FFN kernels alone on one layer of `preset`'s width (see the module's text)."""
    from powerinfer import kernels, triton_ffn
    from powerinfer.synthetic import PRESETS

    small = device.type == "cpu"  # the interpreter: a check of the script only
    dim, ffn = (128, 256) if small else (PRESETS[preset].dim, PRESETS[preset].n_ff)
    reps = 2 if small else 20
    out = {"dim": dim, "ffn_dim": ffn, "interpreted": small,
           "copy_gb_s": copy_bandwidth(device, (1 << 20) if small else (1 << 30)), "rows": []}
    g = torch.Generator(device=device).manual_seed(0)
    gate, up, down = (torch.randn(ffn, dim, generator=g, device=device, dtype=torch.bfloat16)
                      for _ in range(3))
    x = torch.randn(1, dim, device=device, dtype=torch.bfloat16)
    recs = {"bf16": kernels.pack(gate, up, down, "bf16")}
    recs["q4_0"] = kernels.pack(gate.cpu(), up.cpu(), down.cpu(), "q4_0").to(device)
    w1 = torch.cat([gate, up])

    def torch_ffn(w1, down_t):  # w1 (2m, dim) gate and up rows; down_t (m, dim)
        g_, u_ = (x @ w1.T).chunk(2, -1)
        return (torch.nn.functional.silu(g_) * u_) @ down_t

    for share in SELECTIONS:
        mask = torch.rand(ffn, generator=g, device=device) < share
        m = int(mask.sum())
        idx = mask.nonzero().squeeze(-1)
        for fmt, rec in recs.items():
            t = _timed(lambda: triton_ffn.neuron_ffn(x, rec, mask, None, None, 0.0, "swiglu", fmt),
                       device, reps)
            read = m * rec.shape[1]
            out["rows"].append({"path": "triton", "fmt": fmt, "selection": share, "neurons": m,
                                "us": t * 1e6, "gb_s": read / t / 1e9})
        t = _timed(lambda: torch_ffn(w1, down), device, reps)
        out["rows"].append({"path": "torch dense", "fmt": "bf16", "selection": share,
                            "neurons": ffn, "us": t * 1e6, "gb_s": 3 * ffn * dim * 2 / t / 1e9})
        t = _timed(lambda: torch_ffn(torch.cat([gate.index_select(0, idx), up.index_select(0, idx)]),
                                     down.index_select(0, idx)), device, reps)
        out["rows"].append({"path": "torch gathered", "fmt": "bf16", "selection": share,
                            "neurons": m, "us": t * 1e6, "gb_s": 3 * m * dim * 2 / t / 1e9})
    rank = 32 if small else 1024
    fc1 = torch.randn(rank, dim, generator=g, device=device) / dim ** 0.5
    fc2 = torch.randn(ffn, rank, generator=g, device=device) / rank ** 0.5
    t = _timed(lambda: triton_ffn.predict(x.float(), fc1, fc2), device, reps)
    out["rows"].append({"path": "predictor", "fmt": "f32", "selection": None, "neurons": ffn,
                        "us": t * 1e6, "gb_s": (fc1.numel() + fc2.numel()) * 4 / t / 1e9})
    for r in out["rows"]:
        r["of_copy"] = r["gb_s"] / out["copy_gb_s"]
        print(json.dumps(r), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="70b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget-share", type=float, default=0.3)
    ap.add_argument("--cold", type=int, default=2, help="cold executors of the hybrid runtime")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile-tokens", type=int, default=4096)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernels", action="store_true", help="only the kernel rows")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark needs one (--device cpu only checks the flow); "
                 "the Triton kernel rows are skipped too")
    device = torch.device(a.device)
    from powerinfer import triton_ffn
    runs_kernels = triton_ffn.available(device)
    if not runs_kernels:
        print(f"Triton kernel rows skipped: {'triton is not installed' if triton_ffn.triton is None else 'no GPU (set TRITON_INTERPRET=1 to check them on the CPU)'}",
              flush=True)
    if a.kernels:
        if runs_kernels:
            result = kernel_rows(a.preset, device)
            if a.out:
                Path(a.out).write_text(json.dumps(result, indent=1))
        return
    result = {"date": str(datetime.date.today()), "host": platform.processor() or platform.machine(),
              "cores": len(os.sched_getaffinity(0)),
              "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
              "preset": a.preset, "layers": a.layers, "budget_share": a.budget_share}
    dense = dict(dtype="bfloat16", max_seq_len=MAX_SEQ, max_batch=MAX_BATCH)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        path = Path(d) / f"synthetic-{a.preset}.gguf"
        write_synthetic(path, a.preset, n_layers=a.layers)
        bundle = profile(str(path), "lee", Path(d) / "bundle",
                         ProfileOptions(tokens=a.profile_tokens, window=256, samples=4000),
                         dtype="bfloat16")
        train_predictors(bundle, "layer")
        pi = PowerInfer.from_pretrained(str(path), Config(**dense))
        weights, args = weight_bytes(pi), pi.model.args
        budget = int(a.budget_share * weights)
        placement = solve_bundle(bundle, budget / 2**30, batch=MAX_BATCH + 1, context=MAX_SEQ,
                                 dtype_bytes=2, predictor_input="layer")
        result.update(weight_bytes=weights, budget_bytes=budget, pipeline_s=time.perf_counter() - t0,
                      placement=placement.report())
        print(json.dumps({k: result[k] for k in ("weight_bytes", "budget_bytes", "pipeline_s")}),
              flush=True)

        k = layers_that_fit(args, budget, 2)
        offload_layers(pi, k, device)
        result["layer_offload"] = {"layers_on_device": k, "tok_s": decode_speed(pi, a.tokens)}
        print("layer_offload", json.dumps(result["layer_offload"]), flush=True)
        del pi

        pi = PowerInfer.from_pretrained(str(path), Config(**dense, device=a.device))
        result["all_gpu"] = {"tok_s": decode_speed(pi, a.tokens)}
        print("all_gpu", json.dumps(result["all_gpu"]), flush=True)
        del pi
        if a.device == "cuda":
            torch.cuda.empty_cache()

        pi = PowerInfer.from_pretrained(str(path), Config(
            **dense, device=a.device, runtime="actors", cold_executors=a.cold,
            bundle=str(bundle.path), predictor="layer"))
        try:
            tok_s = decode_speed(pi, a.tokens)
            st = pi.engine.stats()
            hot = st["actors"]["hot"]
            result["hybrid"] = {
                "tok_s": tok_s, "cores": st["cores"], "hot_neurons": hot["hot_neurons"],
                "device_peak_bytes": hot.get("device_peak_bytes"),
                "within_budget": (hot["device_peak_bytes"] <= budget
                                  if "device_peak_bytes" in hot else None),
                "mask_wait_ms_per_step": hot.get("mask_wait_s", 0) / max(hot["steps"], 1) * 1e3,
                "part_wait_ms_per_step": hot["part_wait_s"] / max(hot["steps"], 1) * 1e3}
        finally:
            pi.close()
        print("hybrid", json.dumps(result["hybrid"]), flush=True)
    h = result["hybrid"]["tok_s"]
    result["ratios"] = {"hybrid_vs_layer_offload": h / result["layer_offload"]["tok_s"],
                        "hybrid_vs_all_gpu": h / result["all_gpu"]["tok_s"]}
    print(json.dumps(result["ratios"]), flush=True)
    if runs_kernels:
        result["kernels"] = kernel_rows(a.preset, device)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
