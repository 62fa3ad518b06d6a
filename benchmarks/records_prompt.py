#!/usr/bin/env python3
"""A prompt's rows over a layer's neuron records, the two ways a cold executor could run them.

    .venv/bin/python benchmarks/records_prompt.py --bundle B [--model M] [--rows 64 256 512]
        [--turns 5] [--threads 2] [--cpu-isa avx2|avx512|avx512bf16] [--no-amx]

`--cpu-isa` holds the kernel library to a lower class and `--no-amx` keeps records_rows off AMX's
tiles; torch's own matmuls are held with oneDNN's variable (e.g. ONEDNN_MAX_CPU_ISA=AVX2, or
AVX512_CORE_BF16 for a CPU with AVX-512 BF16 and no AMX) to measure what another class's CPU
would see.

Loads M with the bundle in process (bf16, the file's 4-bit blocks as the CPU kernel's neuron
records) and takes the layer whose neuron set is largest. For each row count T it times, in
turns, a prompt's T rows through every neuron of the set:
- widened: the records widened into bf16 rows a block at a time and multiplied by torch's
  matmuls (`NeuronSet.forward`, what a cold executor with torch runs);
- decode kernel: the decode kernel (`kernels.neuron_ffn`) 64 rows a call, every neuron
  selected;
- records_rows: the kernel library's product for a prompt's rows (`kernels.records_rows`: the
  records widened a block at a time and multiplied as matrices), what a cold executor with or
  without torch runs for a prompt step, and the in-process set's prompt path.
Prints the best time of each, their ratios to the widened matmuls, and the largest difference of
each kernel's answer from the widened matmuls' against the largest value.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from powerinfer import Config, PowerInfer, kernels
from powerinfer.model.sparse import NeuronSet


def best_of(fn, turns: int) -> float:
    out = []
    for _ in range(turns):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-isa", default="auto", help="hold the kernels to this class")
    ap.add_argument("--no-amx", action="store_true", help="records_rows off AMX's tiles")
    args = ap.parse_args()
    pi = PowerInfer.from_pretrained(args.model, Config(bundle=args.bundle, dtype="bfloat16",
                                                       weights="int4"))
    if args.cpu_isa != "auto":
        torch.ops.powerinfer.use_isa(args.cpu_isa)
    amx = torch.ops.powerinfer.rows_amx(0 if args.no_amx else 1)
    sets = [m for m in pi.engine.model.modules() if isinstance(m, NeuronSet) and m.records is not None]
    s = max(sets, key=lambda m: len(m.idx))
    torch.set_num_threads(args.threads)
    print(f"{args.model}: the largest neuron set, {len(s.idx)} neurons in {s.fmt}, dim {s.dim}; "
          f"{args.threads} threads, best of {args.turns} in turns; kernels {kernels.isa()}, "
          f"records_rows on AMX tiles: {amx}; ONEDNN_MAX_CPU_ISA="
          f"{os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}\n")
    print("| rows | widened, torch's bf16 matmul (ms) | decode kernel, 64 rows a call (ms) | "
          "records_rows (ms) | decode kernel / widened | records_rows / widened | "
          "max difference / max value (decode kernel, records_rows) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for T in args.rows:
        x = torch.randn(1, T, s.dim, generator=gen).to(torch.bfloat16)
        rows = x.reshape(T, -1)

        def widened():
            return s._widened_rows(x, 0.0, None).reshape(T, -1)

        def kernel():
            return torch.cat([kernels.neuron_ffn(rows[i:i + 64].contiguous(), s.records, s.all, None,
                                                 s.bias32, 0.0, s.act, s.fmt)
                              for i in range(0, T, 64)])

        def product():
            return kernels.records_rows(rows, s.records, s.bias32, 0.0, s.act, s.fmt)

        a, b, c = widened(), kernel(), product()
        top = a.float().abs().max().item()
        diff = [(a.float() - o.float()).abs().max().item() / top for o in (b, c)]
        tw, tk, tp = [], [], []
        for _ in range(args.turns):
            tw.append(best_of(widened, 1))
            tk.append(best_of(kernel, 1))
            tp.append(best_of(product, 1))
        print(f"| {T} | {1e3 * min(tw):.2f} | {1e3 * min(tk):.2f} | {1e3 * min(tp):.2f} | "
              f"{min(tk) / min(tw):.2f}x | {min(tp) / min(tw):.2f}x | {diff[0]:.4f}, {diff[1]:.4f} |")
    pi.close()


if __name__ == "__main__":
    main()
