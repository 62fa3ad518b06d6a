#!/usr/bin/env python3
"""What a cheaper down-row axpy could save the records kernel, on one core with its rows in
the caches (where the kernel is bound by its instructions, not its reads).

    .venv/bin/python benchmarks/down_axpy.py

Two timings in one run:
- the kernel's whole step (`kernels.neuron_ffn`, 7B-shape Q4_0 and Q4_1 records, ReGLU, every
  computed neuron firing, one row, one thread) over 55, 110 and 275 of 512 records held in the
  caches: its time a record;
- `down_axpy.cpp` (built here with g++ -march=native; needs AVX512_VNNI): the down rows alone
  as the kernel adds them (int8 widened to float, four neurons a load and store of the sums)
  against a prototype in 16-bit integers (activation times block scale rounded to int16, pairs
  of neurons summed into int32 by vpdpwssd), and the prototype's error.

The share of a record's time the float axpy takes, and what the prototype would take off it,
bound what a 16-bit down row could gain the kernel (its pipeline, prefetches and calls aside).
"""
import datetime
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from powerinfer import kernels  # noqa: E402


def record_times(d: int = 4096, held: int = 512) -> dict[tuple[str, int], float]:
    """us a record of the kernel's step over m of `held` records in the caches, one thread."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(held, d, generator=g).abs_().mul_(0.02).bfloat16()
    up = torch.randn(held, d, generator=g).abs_().mul_(0.02).bfloat16()
    down = torch.randn(held, d, generator=g).mul_(0.02).bfloat16()
    x = torch.rand(1, d, generator=g) + 0.1  # every gate and up positive: every neuron fires
    out = {}
    for fmt in ("q4_0", "q4_1"):
        rec = kernels.pack(gate, up, down, fmt)
        for m in (55, 110, 275):
            sel = torch.arange(0, held, held // m)[:m].contiguous()

            def step():
                return kernels.neuron_ffn(x, rec, sel, None, None, 0.0, "reglu", fmt)
            for _ in range(200):
                step()
            turns = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(300):
                    step()
                turns.append((time.perf_counter() - t) / 300)
            out[fmt, m] = sorted(turns)[3] * 1e6 / m
    return out


def axpy_times() -> dict[str, float]:
    src = Path(__file__).with_name("down_axpy.cpp")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "down_axpy"
        subprocess.run(["g++", "-O3", "-march=native", str(src), "-o", str(exe)], check=True)
        text = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    got = {}
    for line in text.splitlines():
        words = line.split()
        got[words[0]] = float(words[1] if words[0] != "largest" else words[2])
    return got


def main():
    assert kernels.available(), "the CPU FFN kernel cannot run here"
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        sys.exit("the prototype needs AVX512_VNNI (vpdpwssd); this CPU has none")
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, kernel ISA "
          f"{kernels.best_isa()}, 1 thread, torch {torch.__version__}")
    axpy = axpy_times()
    rec = record_times()
    print(f"down row alone (64 rows in L2): float {axpy['float']:.4f} us a neuron, int16 "
          f"{axpy['int16']:.4f} us ({axpy['float'] / axpy['int16']:.2f}x); the int16 sums' "
          f"largest error {axpy['largest']:.2g} of the largest sum\n")
    print("| records | kernel us a record | float axpy's share | the record with the int16 "
          "axpy (bound) |")
    print("|---|---:|---:|---:|")
    for (fmt, m), t in rec.items():
        saved = axpy["float"] - axpy["int16"]
        print(f"| {fmt}, {m} of 512 | {t:.3f} | {axpy['float'] / t:.0%} | {t - saved:.3f} "
              f"({t / (t - saved):.2f}x) |")


if __name__ == "__main__":
    main()
