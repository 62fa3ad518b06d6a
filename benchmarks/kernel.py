#!/usr/bin/env python3
"""The CPU FFN kernel's achieved read bandwidth over the share of active neurons, beside the
machine's read bandwidth and the torch path it replaces, in one run.

    .venv/bin/python benchmarks/kernel.py [--dim 4096] [--ffn 11008] [--layers 4] [--rows 1]
        [--formats bf16 i8 q4_0 q4_1] [--threads N] [--consecutive] [--also-isa avx512]
        [--cpu-isa CLASS] [--reads] [--call-cost] [--runs N] [--plot FILE] [--out FILE]

One FFN layer of the given shape per `--layers` (random weights, ReGLU: gate, up and down rows),
rotated through so that no step finds its rows in the caches. For each share of active neurons
(1% to 100%, random sorted subsets, the same for every method: a new one each turn over the
layers, so that a layer's next step reads other records, as a model's next token reads its
layers after every other layer's bytes) and each weight format, the
median time of one decode step over `--rows` input rows; every computed neuron fires (its
activation is non-zero), so the kernel reads all three of its rows and the bytes are exact.
Baselines in the same run, on the same neurons: the torch path (`sparse.NeuronSet` without a
format: gathered gate/up rows, an embedding-bag over down rows) in bf16, and the dense bf16
FFN as torch's matmuls (`dense`, every neuron). Bandwidth: `sparse_cpu.read_bandwidth` (a
reduction over 1 GiB, best of 5).

`--reads`: for each format, the same selected records read and nothing computed (every byte
loaded once, XORed), by K records at a time per thread (K = 1, 2, 4, 8 streams side by side,
the next K records prefetched over the pass with prefetcht0, as the kernel asks for its rows),
compiled here: what the memory gives for records of that size scattered as the selection
scatters them, beside what the kernel gets from them; and the kernel's steps as a native caller
makes them (`native caller`: a turn over the layers in one call, each step through torch's
dispatcher with no Python between, as a cold executor's `cold_serve` loop runs them), whose time
per step leaves out the 5-10 us a call from Python costs the module's column, timed in turns
with the same reads made the same way (a turn over the layers in one call, for each stream
count): the ratio "native caller / best reads in turns" compares two timings of the same
minutes, where a 2-core VM's read bandwidth moved between 48 and 80 GB/s within minutes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from powerinfer import kernels
from powerinfer.model.sparse import NeuronSet
from gemv import last_level_cache  # the other benchmarks' reading of the cache's size
from sparse_cpu import read_bandwidth  # the same reading as the sparse decode benchmark

SHARES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
# selections drawn for each share, a new one each turn over the layers: with one selection for
# every turn, a share's records for all the layers (83 MB at 10% of 8 7B layers in Q4_0) came
# back from the last level cache, read faster than the machine's read bandwidth. At least
# SUBSETS, and as many as make one cycle through them read twice the last level cache
# (`subsets`): a server CPU's L3 holds hundreds of MiB (300 MiB on an Emerald Rapids Xeon), and
# four selections of 8 layers at 1-5% (8-170 MB) came back from it, at up to twice the read
# bandwidth.
SUBSETS = 4
STREAMS = (1, 2, 4, 8)

READS = r"""
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
// Records sel[j] of w (k, bytes), K at a time per thread: their lines loaded side by side and
// XORed; the next K records prefetched over the same pass (prefetcht0, as the kernel does: on a
// Zen 5 VM t1 read 1.1-1.4x slower). Returns the XOR (kept).
template <int K>
int64_t reads_k(const uint8_t* w, int64_t rb, const int64_t* sel, int64_t m) {
  std::vector<int64_t> part(at::get_num_threads(), 0);
  at::parallel_for(0, (m + K - 1) / K, 1, [&](int64_t g0, int64_t g1) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t g = g0; g < g1; g++) {
      const uint8_t *r[K], *pf[K];
      for (int k = 0; k < K; k++) {
        const int64_t j = std::min(g * K + k, m - 1), jn = (g + 1) * K + k;
        r[k] = w + sel[j] * rb;
        pf[k] = g + 1 < g1 && jn < m ? w + sel[jn] * rb : nullptr;
      }
      for (int64_t o = 0; o + 64 <= rb; o += 64)
        for (int k = 0; k < K; k++) {
          if (pf[k]) _mm_prefetch((const char*)(pf[k] + o), _MM_HINT_T0);
          acc = _mm256_xor_si256(acc, _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(r[k] + o)),
                                                       _mm256_loadu_si256((const __m256i*)(r[k] + o + 32))));
        }
    }
    alignas(32) int64_t v[4];
    _mm256_store_si256((__m256i*)v, acc);
    part[at::get_thread_num()] ^= v[0] ^ v[1] ^ v[2] ^ v[3];
  });
  int64_t x = 0;
  for (int64_t p : part) x ^= p;
  return x;
}
// The kernel library's ops through the dispatcher, as its native loops call the kernel
using T = const at::Tensor&;
using Opt = const std::optional<at::Tensor>&;
using NeuronFFN = at::Tensor(T, T, T, Opt, Opt, double, int64_t, int64_t);  // x w sel keep bias ...
using MaskedRecords = at::Tensor(T, T, T, T, Opt, double, int64_t, int64_t);  // x w idx mask bias ...
template <typename Sig>
c10::TypedOperatorHandle<Sig> kernel_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
// One turn over the layers as a native caller makes it (a cold executor's loop, `cold_serve`):
// each layer's step through the dispatcher, with no Python between them
void steps(torch::Tensor x, std::vector<torch::Tensor> recs, torch::Tensor sel, int64_t act, int64_t fmt) {
  static auto op = kernel_op<NeuronFFN>("powerinfer::neuron_ffn");
  for (const auto& w : recs) op.call(x, w, sel, std::nullopt, std::nullopt, 0.0, act, fmt);
}
// A shard's step as a cold executor makes it: the masks over the layer's neurons, the shard's
// (ascending) indices, n steps; and the same as it was made before (the masks' columns gathered
// at the shard's indices with index_select, then the kernel by mask), for the same-run ratio
void shard_steps(torch::Tensor x, torch::Tensor w, torch::Tensor idx, torch::Tensor mask, int64_t n,
                 int64_t act, int64_t fmt, bool gathered) {
  static auto op = kernel_op<NeuronFFN>("powerinfer::neuron_ffn");
  static auto masked = kernel_op<MaskedRecords>("powerinfer::masked_records");
  for (int64_t i = 0; i < n; i++)
    if (gathered)
      op.call(x, w, mask.index_select(1, idx)[0].contiguous(), std::nullopt, std::nullopt, 0.0, act, fmt);
    else
      masked.call(x, w, idx, mask, std::nullopt, 0.0, act, fmt);
}
int64_t reads(torch::Tensor w, torch::Tensor sel, int64_t k);
// The reads above over the layers in one call (as `steps` calls the kernel)
int64_t reads_steps(std::vector<torch::Tensor> recs, torch::Tensor sel, int64_t k) {
  int64_t x = 0;
  for (const auto& w : recs) x ^= reads(w, sel, k);
  return x;
}
int64_t reads(torch::Tensor w, torch::Tensor sel, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.is_contiguous() && w.size(1) % 64 == 0);
  const uint8_t* p = w.data_ptr<uint8_t>();
  const int64_t* s = sel.data_ptr<int64_t>();
  switch (k) {
    case 1: return reads_k<1>(p, w.size(1), s, sel.numel());
    case 2: return reads_k<2>(p, w.size(1), s, sel.numel());
    case 4: return reads_k<4>(p, w.size(1), s, sel.numel());
    default: return reads_k<8>(p, w.size(1), s, sel.numel());
  }
}
"""


def reads_op():
    """The record reader and the native caller above, compiled for this machine (AVX2)."""
    import tempfile
    from torch.utils.cpp_extension import load_inline
    return load_inline("kernel_reads", cpp_sources=[READS],
                       functions=["reads", "steps", "reads_steps", "shard_steps"],
                       extra_cflags=["-O3", "-mavx2", "-fopenmp"], build_directory=tempfile.mkdtemp(),
                       verbose=False)


def subsets(layers: int, active: int, record: int, llc: int) -> int:
    """Selections of `active` neurons for one share: at least SUBSETS, and enough that a cycle
    over them and the layers reads twice the last level cache (`llc` bytes) in records of
    `record` bytes, so that no timed step finds its records still cached from the last cycle."""
    return max(SUBSETS, -(-2 * llc // (layers * active * record)))


def firing_layers(count: int, n: int, d: int, fmt: str) -> list[NeuronSet]:
    """`count` ReGLU layers of n neurons over inputs of d (random weights from torch's generator)
    held as the kernel's records in `fmt`, whose every computed neuron fires on a positive
    input (their gate rows positive): a step over them reads all three rows of each."""
    layers = []
    for _ in range(count):
        w1 = torch.randn(2 * n, d) * 0.02
        w1[:n].abs_()
        layers.append(NeuronSet("reglu", w1, None, torch.randn(d, n) * 0.02, torch.arange(n), fmt))
    return layers


def random_masks(n: int, share: float, count: int = 64) -> list[torch.Tensor]:
    """`count` masks over n neurons, each a random `share` of them (torch's generator)."""
    masks = []
    for _ in range(count):
        m = torch.zeros(n, dtype=torch.bool)
        m[torch.randperm(n)[:round(share * n)]] = True
        masks.append(m)
    return masks


def timed(fn, layers: int, reps: int, turns: int) -> float:
    """The median time of fn(i), i counting the steps (layer i % layers, turn i // layers),
    after `turns` warm-up turns over the layers (one a selection): every selection's records
    read once before (a record's first read since the weights were written took up to 3x as
    long here), and the timed steps' the longest ago."""
    warm = layers * turns
    for i in range(warm):
        fn(i)
    times = []
    for r in range(warm, warm + reps):
        t = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--formats", nargs="+", default=["bf16", "i8", "q4_0", "q4_1"],
                    help="kernel formats (4-bit ones keep down rows int8, see kernels.down_format)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--consecutive", action="store_true",
                    help="the first neurons instead of a random subset (one stream, no jumps)")
    ap.add_argument("--also-isa", default=None, choices=kernels.ISAS,
                    help="time every kernel format under this instruction set as well (an A/B "
                         "in the same run: avx512 has no VNNI, avx512bf16 does)")
    ap.add_argument("--cpu-isa", default="auto", choices=("auto", *kernels.ISAS),
                    help="hold the kernel to this class for the whole run (as Config.cpu_isa)")
    ap.add_argument("--reads", action="store_true",
                    help="beside each format, the same records read with nothing computed")
    ap.add_argument("--call-cost", action="store_true",
                    help="only what a call costs apart from its records: one neuron's step, its "
                         "record in cache, by index and by mask, from Python and from a native "
                         "caller (median of 20,000 each)")
    ap.add_argument("--runs", type=int, default=1,
                    help="the whole measurement in this many processes, one after another, and "
                         "each ratio's median and range over them (on a 2-core VM single runs "
                         "minutes apart gave 43-87%% at the same share)")
    ap.add_argument("--fire", type=float, default=1.0,
                    help="the share of the computed neurons whose gate opens (the others' gate "
                         "rows negated: they read their gate row alone, as a predictor's false "
                         "positives do); a step's bytes are counted so; under 1 the ratios to "
                         "the reads, which read whole records, are left out")
    ap.add_argument("--shares", type=float, nargs="+", default=list(SHARES),
                    help="the shares of active neurons to run (default: 1%% to 100%%)")
    ap.add_argument("--plot", default=None, help="write the plot (PNG)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    if args.runs > 1:
        return over_runs(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    assert kernels.available(), "the CPU FFN kernel cannot run here"
    kernels.hold(args.cpu_isa)
    d, n, L, B = args.dim, args.ffn, args.layers, args.rows
    g = torch.Generator().manual_seed(0)
    # (L, 2n, d) [gate; up] and (L, d, n) down, bf16; the input makes every gate and up positive
    # on the computed neurons' rows (rows of |N(0, 1)|, x > 0), so each computed neuron fires
    w1 = [torch.randn(2 * n, d, generator=g).abs_().mul_(0.02).bfloat16() for _ in range(L)]
    shut = [torch.rand(n, generator=g) >= args.fire for _ in range(L)]  # (--fire: none by default)
    for i in range(L):
        w1[i][:n][shut[i]] *= -1
    w2 = [torch.randn(d, n, generator=g).mul_(0.02).bfloat16() for _ in range(L)]
    x = torch.rand(B, 1, d, generator=g) + 0.1
    everyone = torch.arange(n)
    sets = {"torch": [NeuronSet("reglu", w1[i], None, w2[i], everyone) for i in range(L)]}
    for f in args.formats:
        sets[f] = [NeuronSet("reglu", w1[i], None, w2[i], everyone, f) for i in range(L)]
    if args.call_cost:
        return call_cost(sets, x.reshape(B, d), args)
    dense = [torch.cat([w1[i], w2[i].t()]) for i in range(L)]  # the same bytes as one matmul
    del w1, w2
    results = []
    ext = reads_op() if args.reads else None
    reads = ext.reads if ext else None
    llc = last_level_cache()
    smallest = min(kernels.record_bytes(f, d, gated=True)
                   for f in args.formats)
    with torch.inference_mode():
        xb = x.bfloat16()
        t = timed(lambda i: (torch.relu(xb @ dense[i % L][:n].t()) * (xb @ dense[i % L][n:2 * n].t()))
                  @ dense[i % L][2 * n:], L, args.reps, SUBSETS)
        dense_bytes = 3 * n * d * 2
        results.append({"method": "dense bf16 (torch matmul)", "share": 1.0, "ms": t * 1e3,
                        "gbs": dense_bytes / t / 1e9})
        for share in args.shares:
            m = max(1, round(share * n))
            sels = [torch.arange(m)] if args.consecutive else \
                [torch.randperm(n, generator=g)[:m].sort().values
                 for _ in range(subsets(L, m, smallest, llc))]

            def sel(i):  # step i's selection: a new one each turn over the layers
                return sels[i // L % len(sels)]
            runs = [(name, ss, None) for name, ss in sets.items()]
            runs += [(name, ss, args.also_isa) for name, ss in sets.items()
                     if args.also_isa and name != "torch"]
            for name, ss, isa in runs:
                fmt = ss[0].fmt or "bf16"
                xin = xb if name == "torch" else x
                before = torch.ops.powerinfer.use_isa(isa) if isa else None
                try:
                    t = timed(lambda i: ss[i % L](xin, sel(i)), L, args.reps, len(sels))
                finally:
                    if isa:
                        torch.ops.powerinfer.use_isa(before)
                nbytes = step_bytes(fmt, d, m, shut, sels)
                method = "torch path bf16" if name == "torch" else f"kernel {fmt}"
                gbs = nbytes / t / 1e9
                results.append({"method": method + (f" ({isa})" if isa else ""),
                                "share": share, "ms": t * 1e3, "gbs": gbs})
                if reads is None or name == "torch" or isa:
                    continue
                recs = [s.records for s in ss]
                rb = recs[0].shape[1]
                if rb % 64:  # (the reader takes whole lines)
                    continue
                # the same steps with no Python between them, as a cold executor's native loop
                # calls the kernel (a turn over the layers in one call, its time per step), in
                # turns with the reads of each stream count, so that both see the same memory
                x2 = x.reshape(B, d)
                act, fid = kernels.ACTS.index("reglu"), kernels.FORMATS.index(fmt)
                fns = [lambda s: ext.steps(x2, recs, s, act, fid)]
                fns += [lambda s, k=k: ext.reads_steps(recs, s, k) for k in STREAMS]
                tn, *tr = (t / L for t in interleaved(fns, sels, max(10, args.reps)))
                results.append({"method": f"kernel {fmt}, native caller", "share": share,
                                "ms": tn * 1e3, "gbs": nbytes / tn / 1e9})
                if args.fire == 1:
                    results.append({"method": f"kernel {fmt}, native caller / best reads in turns",
                                    "share": share, "ratio": min(tr) / tn})
                best, whole = 0.0, m * kernels.record_bytes(fmt, d, gated=True)  # (all they read)
                for k in STREAMS:
                    t = timed(lambda i: reads(recs[i % L], sel(i), k), L, args.reps, len(sels))
                    best = max(best, whole / t / 1e9)
                    results.append({"method": f"reads {fmt}, {k} streams", "share": share,
                                    "ms": t * 1e3, "gbs": whole / t / 1e9})
                if args.fire == 1:
                    results.append({"method": f"kernel {fmt} / best reads", "share": share,
                                    "ratio": gbs / best})
    bw = read_bandwidth(torch.float32)
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, kernel ISA "
          f"{kernels.isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"read bandwidth {bw / 1e9:.1f} GB/s; d {d}, n_ff {n}, ReGLU, {B} row(s), {L} layers, "
          f"{'consecutive' if args.consecutive else 'random'} neurons")
    methods = list(dict.fromkeys(r["method"] for r in results if r["share"] < 1 or "dense" not in r["method"]))
    print("| active | " + " | ".join(methods) + " |")
    print("|---:|" + "---:|" * len(methods))
    for share in args.shares:
        cells = []
        for m in methods:
            r = next(r for r in results if r["method"] == m and r["share"] == share)
            if "ratio" in r:
                cells.append(f"{r['ratio']:.0%}")
                continue
            cells.append(f"{r['ms']:.2f} ms, {r['gbs']:.1f} GB/s ({r['gbs'] * 1e9 / bw:.0%})")
        print(f"| {share:.0%} | " + " | ".join(cells) + " |")
    dn = results[0]
    print(f"dense bf16 FFN (torch matmul, every neuron): {dn['ms']:.2f} ms, {dn['gbs']:.1f} GB/s "
          f"({dn['gbs'] * 1e9 / bw:.0%} of the read bandwidth)")
    if args.plot:
        plot(results, methods, bw, args, Path(args.plot))
    if args.out:
        Path(args.out).write_text(json.dumps({"bandwidth": bw, "isa": kernels.isa(),
                                              "results": results}, indent=1))


def step_bytes(fmt: str, d: int, m: int, shut, sels) -> float:
    """A step's bytes: the gate row of each of the m computed neurons, and the up and down rows
    of those whose gate opens (not `shut`), on average over the layers and selections."""
    if not any(s.any() for s in shut):
        return m * kernels.record_bytes(fmt, d, gated=True)
    row, down = kernels.row_bytes(fmt, d), kernels.row_bytes(kernels.down_format(fmt), d)
    fired = statistics.mean(float((~s[sel]).sum()) for s in shut for sel in sels)
    return m * row + fired * (row + down)


def over_runs(args):
    """`--runs N`: this script run N times as it was called (less --runs, --plot and --out), each
    process's tables printed, then each ratio's median (min-max) over the runs."""
    argv, given = [], iter(sys.argv[1:])
    for a in given:
        if a.split("=")[0] in ("--runs", "--plot", "--out"):
            if "=" not in a:
                next(given, None)  # its value
            continue
        argv.append(a)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}.json"
            print(f"## run {i + 1} of {args.runs}", flush=True)
            subprocess.run([sys.executable, __file__, *argv, "--out", str(out)], check=True)
            runs.append(json.loads(out.read_text()))
    ratios = {}
    for run in runs:
        for r in run["results"]:
            if "ratio" in r:
                ratios.setdefault(r["method"], {}).setdefault(r["share"], []).append(r["ratio"])
    methods = list(ratios)
    if methods:  # (none with --fire under 1: the reads in turns read whole records)
        print(f"# each ratio over {args.runs} processes: median (min-max)")
        print("| active | " + " | ".join(methods) + " |")
        print("|---:|" + "---:|" * len(methods))
        for share in args.shares:
            cells = [f"{statistics.median(v):.0%} ({min(v):.0%}-{max(v):.0%})"
                     for v in (ratios[m].get(share, [float("nan")]) for m in methods)]
            print(f"| {share:.0%} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "ratios": {
            m: {str(k): v for k, v in by.items()} for m, by in ratios.items()}}, indent=1))


def interleaved(fns, sels, turns: int) -> list[float]:
    """The median time of each fn(selection), the fns called in turns: call c reads selection
    c % len(sels), each fn another one than the fn before it, after a warm-up that reads every
    selection once. Random selections share about the active share of their records, and with
    `--consecutive` there is one selection: those records may come from the caches, to every fn
    alike."""
    calls = 0

    def call(fn):
        nonlocal calls
        t = time.perf_counter()
        fn(sels[calls % len(sels)])
        calls += 1
        return time.perf_counter() - t

    for _ in range(-(-len(sels) // len(fns))):
        for fn in fns:
            call(fn)
    times = [[] for _ in fns]
    for _ in range(turns):
        for j, fn in enumerate(fns):
            times[j].append(call(fn))
    return [statistics.median(v) for v in times]


def call_cost(sets, x, args):
    """A step of one neuron (record 5 of the first layer, in cache after the first call) by
    each way a caller asks for it: what a call costs beside reading its records."""
    ext = reads_op()
    n = sets[args.formats[0]][0].records.shape[0]
    one, mask = torch.tensor([5]), torch.zeros(n, dtype=torch.bool)
    mask[5] = True
    act = kernels.ACTS.index("reglu")

    def median_us(fn, reps=20000):  # (after 1,000 calls)
        return timed(lambda i: fn(), 1, reps, 1000) * 1e6

    results = []
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, kernel ISA "
          f"{kernels.isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"one neuron's step of {x.shape[1]} inputs, its record in cache, median us")
    # a shard: the records held as the first n of a layer of 1.5 n neurons (its masks that wide)
    idx, wide = torch.arange(n), torch.zeros(1, n + n // 2, dtype=torch.bool)
    wide[0, 5] = True
    print("| format | kernel ISA | from Python, by index | by mask | native caller, by index "
          "| by mask | a shard's mask (a cold executor's step) "
          "| the same, its columns gathered first (before) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for isa in dict.fromkeys([kernels.isa(), args.also_isa or kernels.isa()]):
            before = torch.ops.powerinfer.use_isa(isa)
            for f in args.formats:
                w, fid = sets[f][0].records, kernels.FORMATS.index(f)
                row = {"format": f, "isa": isa}
                for how, sel in (("index", one), ("mask", mask)):
                    row[f"python {how}"] = median_us(
                        lambda: kernels.neuron_ffn(x, w, sel, None, None, 0.0, "reglu", f))
                    # a turn of 100 steps in one call, its time per step
                    row[f"native {how}"] = median_us(lambda: ext.steps(x, [w] * 100, sel, act, fid),
                                                     400) / 100
                for how, gathered in (("native shard mask", False),
                                      ("native shard gathered", True)):
                    row[how] = median_us(
                        lambda: ext.shard_steps(x, w, idx, wide, 100, act, fid, gathered), 400) / 100
                results.append(row)
                print(f"| {f} | {isa} | {row['python index']:.2f} | {row['python mask']:.2f} | "
                      f"{row['native index']:.2f} | {row['native mask']:.2f} | "
                      f"{row['native shard mask']:.2f} | {row['native shard gathered']:.2f} |")
            torch.ops.powerinfer.use_isa(before)
    if args.out:
        Path(args.out).write_text(json.dumps({"isa": kernels.isa(), "call_cost_us": results},
                                             indent=1))


def plot(results, methods, bw, args, path: Path):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    ax = fig.add_subplot()
    for m in methods:
        rs = [r for r in results if r["method"] == m]
        if m.startswith("reads") or "ratio" in rs[0]:
            continue
        line = ax.plot([r["share"] * 100 for r in rs], [r["gbs"] for r in rs], marker="o", label=m)
        fmt = m.removeprefix("kernel ")
        if any(r["method"].startswith(f"reads {fmt},") for r in results):  # --reads: its ceiling
            best = [max(r["gbs"] for r in results
                        if r["method"].startswith(f"reads {fmt},") and r["share"] == q["share"]) for q in rs]
            ax.plot([r["share"] * 100 for r in rs], best, linestyle="--", color=line[0].get_color(),
                    label=f"reads of the {fmt} records (best of {len(STREAMS)} stream counts)")
    ax.axhline(bw / 1e9, color="k", linestyle="--", label="read bandwidth")
    ax.axhline(results[0]["gbs"], color="gray", linestyle=":", label=results[0]["method"])
    ax.set_xscale("log")
    ax.set_xlabel("active neurons (%)")
    ax.set_ylabel("GB/s of weights read")
    ax.set_title(f"FFN decode step, d {args.dim}, n_ff {args.ffn}, {args.rows} row(s), "
                 f"{torch.get_num_threads()} threads")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
