#!/usr/bin/env python3
"""Decode tokens/s of the dense model and the sparse one (predicted masks) in one run, next to the
bandwidth floor of the bytes each actually touches per token.

    .venv/bin/python benchmarks/sparse_cpu.py --model M --bundle B [--model M2 --bundle B2 ...]
        [--tokens 32] [--dtype float32] [--threads N] [--input ffn] [--llama] [--out FILE]

Per model, four configurations decode the same prompt greedily, token by token as the engine
steps (no sampling), after a warm-up; the median token time is reported: the dense
model; the hybrid FFN (every neuron cold, thresholds from the bundle) with masks from the bundle's
predictors; the hybrid FFN replaying the oracle's masks recorded on the same tokens (the sparse
operators at the true sparsity, as with a perfect predictor that costs nothing); and the same
replay on the torch path (gathered gate/up rows, an embedding-bag over down rows), the operator
the CPU kernel replaced (a 4-bit file's sparse model is the engine's own, loaded with the bundle:
its neuron sets in the file's 4-bit blocks, down rows 8-bit). Sparse decode otherwise runs the CPU kernel (`powerinfer.kernels`),
which reads each computed neuron's gate/up rows and, when it fires, its down row, in place;
with predicted masks each layer's predictor and neurons are one kernel call
(`kernels.predicted_ffn`). A decode step runs its layer loop in C++ where the engine's does
(`native.NativeDecode`: the dense model, and the sparse one with predicted masks, each layer's
predictor and neurons inside the loop); two last rows time the predicted configuration with the
layers run by the model's modules (`modules' loop`), and with the modules' ops one at a time
as well (`op by op`, `sparse.FUSED_DECODE` off). Each configuration first decodes once counting
what is computed (the modules' path), then is timed with nothing counted.
Bytes per token: every weight read (attention, norms, lm_head, the predictors, the embedding
row), the KV cache read at the mean context, and for the FFN the three rows of each neuron
computed (recorded per step; for predicted masks this counts down rows the kernel skips, so the
floor is an upper bound there). The floor is those bytes at the read bandwidth measured in the
same run (a large tensor reduction, best of 5). A second pass of each configuration times the
FFN modules alone (hooks around each block's FFN, the predictors inside them; the modules' loop,
where hooks see each layer), the part sparsity changes; attention and lm_head stay dense. The FFN's own floor counts the bytes it cannot do
without: each computed neuron's gate row, the up and down rows of those that fire (the kernel
skips the others' after the gate; with predicted masks the neurons that fire among those
computed are the oracle's share times the predictors' recall by count, from the bundle), and
the predictors' weights; the torch path gathers every row of every computed neuron. With --llama, llama.cpp's `llama-server` (built as benchmarks/serve.py does)
decodes the same prompt's tokens with the same thread count on the same file: its dense decode
is the baseline, and its FFN time is estimated as its token time times the FFN's share of the
dense model's bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from powerinfer import Config, PowerInfer
from powerinfer.model import sparse
from powerinfer.formats.bundle import Bundle
from powerinfer.engine.native import NativeDecode
from powerinfer.model.predictor import load_predictors, run_dtype
from powerinfer.sparsity.solver import neuron_bytes
from powerinfer.model.sparse import LayerStats, apply_hybrid_ffn, hybrid_layers

WARMUP = 16  # tokens decoded before timing
PROMPT = ("The history of computing is a story of ideas that took decades to mature. Early machines "
          "filled rooms, consumed enormous power and were programmed by rewiring panels by hand.")


def read_bandwidth(dtype) -> float:
    """Bytes/s of a reduction over a 1 GiB tensor (best of 5)."""
    x = torch.ones(2**30 // dtype.itemsize, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * dtype.itemsize / best


def decode(model, ids: list[int], n: int, step=None,
           before_steps=None) -> tuple[list[float], list[int]]:
    """Greedy decode n tokens after a prefill, each step through `step` (a NativeDecode of the
    model) or the model's modules; returns per-token seconds and the tokens. `before_steps` is
    called between the prefill and the first decode step (`phases.py` starts its count there)."""
    times, out = [], []
    model.setup_cache(1, len(ids) + n)  # one sequence in its own blocks (the model alone)
    step = step or model
    with torch.inference_mode():
        T = len(ids)
        logits = model(torch.tensor([ids]), torch.arange(T)[None], last=torch.tensor([T - 1]))
        tok = int(logits[0, -1].argmax())
        one = torch.tensor([0])
        if before_steps is not None:
            before_steps()
        for s in range(n):
            t = time.perf_counter()
            logits = step(torch.tensor([[tok]]), torch.tensor([[T + s]]), model.row_tables(1, 1), one)
            tok = int(logits[0, -1].argmax())
            times.append(time.perf_counter() - t)
            out.append(tok)
    return times, out


def module_bytes(m) -> int:
    """Bytes of a module's weights as it holds them (parameters, and the kernel's records),
    the KV cache excluded."""
    return sum(t.numel() * t.element_size() for n, t in [*m.named_parameters(), *m.named_buffers()]
               if "cache" not in n)


def dense_bytes(model, kv_len: float) -> dict[str, float]:
    a = model.args
    el = model.norm.weight.element_size()
    attn = sum(module_bytes(b.attn) for b in model.layers)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n) * el
    head = module_bytes(model.output)
    kv = 2 * a.n_layers * kv_len * a.n_kv_heads * a.head_dim * el
    return {"attention": attn, "norms": norms, "lm_head": head, "kv_cache": kv,
            "embedding row": a.dim * el}


class Replay:
    """A mask source that hands back masks recorded from a run with oracle masks, in order: the
    sparse operators at the true sparsity, with no predictor cost (an ideal predictor)."""

    def __init__(self):
        self.masks: list[torch.Tensor] = []
        self.pos = 0

    def record(self, ffn):
        oracle = ffn.active

        def active(*inputs):  # (h, x, layer_input), as HybridFFN.active
            m = oracle(*inputs)
            self.masks.append(m)
            return m
        return active

    def __call__(self, layer, x):
        m = self.masks[self.pos]
        self.pos += 1
        return m


def ffn_timer(model) -> tuple[list[float], list]:
    """Seconds spent inside the FFN modules in decode steps (hooks around each block's ffn; the
    prompt's pass is not counted), and the handles."""
    spent, start = [0.0], [None]

    def pre(mod, args):
        start[0] = time.perf_counter() if args[0].shape[1] == 1 else None

    def post(mod, args, out):
        if start[0] is not None:
            spent[0] += time.perf_counter() - start[0]
    handles = [h for b in model.layers for h in (b.ffn.register_forward_pre_hook(pre),
                                                 b.ffn.register_forward_hook(post))]
    return spent, handles


def counting_pass(model, ids: list[int], n: int) -> tuple[list, list[LayerStats]]:
    """The model's sparse FFNs and what each computed over n greedy tokens through the modules
    (a pass with their `stats` recording)."""
    ffns = hybrid_layers(model)
    stats = [LayerStats() for _ in ffns]
    for f, s in zip(ffns, stats):
        f.stats = s
    decode(model, ids, n)
    for f in ffns:
        f.stats = None
    return ffns, stats


def measure(label: str, pi, ids: list[int], n: int, extra: dict | None = None, native: bool = True) -> dict:
    # decode steps as the engine's: its layer loop in C++ where the model allows it (native)
    step = NativeDecode.of(pi.model) if native else None
    decode(pi.model, ids, WARMUP, step)  # warm-up: the first calls after loading run several times slower
    ffns, stats = counting_pass(pi.model, ids, n)
    times, toks = decode(pi.model, ids, n, step)  # timed as the engine runs it, with nothing counted
    spent, handles = ffn_timer(pi.model)  # a third pass, timing the FFNs alone
    decode(pi.model, ids, n)
    for h in handles:
        h.remove()
    a = pi.model.args
    b = dense_bytes(pi.model, len(ids) + n / 2)
    # bytes of one neuron's rows as held: a neuron set's records (4-bit gate/up, 8-bit down
    # from a 4-bit file), rows of the model's dtype on the torch path, or the dense FFN's share
    if ffns:
        s0 = ffns[0].hot if len(ffns[0].hot.idx) else ffns[0].cold
        row_bytes = (s0.records.shape[1] if s0.records is not None
                     else neuron_bytes(a, pi.model.norm.weight.element_size()))
    else:
        row_bytes = sum(module_bytes(blk.ffn) for blk in pi.model.layers) / (a.n_layers * a.ffn_dim)
    if ffns:
        computed = sum(s.computed for s in stats) / max(1, stats[0].rows)  # per token, all layers
        b["ffn rows (computed)"] = computed * row_bytes
        density = computed / (a.n_layers * a.ffn_dim)
    else:
        b["ffn rows (all)"] = a.n_layers * a.ffn_dim * row_bytes
        density = 1.0
    b.update(extra or {})
    t = statistics.median(times)
    return {"model": pi.checkpoint.path.name, "config": label, "ms_per_token": t * 1e3,
            "layer_loop": "native" if step is not None else "modules",
            "row_bytes": row_bytes,
            "ffn_ms_per_token": spent[0] / n * 1e3,
            "tok_s": 1 / t, "bytes": b, "bytes_total": sum(b.values()), "ffn_density": density,
            "tokens": toks}


def llama_decode(path, ids: list[int], n: int, threads: int, dense: dict) -> dict:
    """llama-server's greedy decode of n tokens after `ids` (its own timing, the second of two
    requests), as a row beside ours; its FFN time estimated from the dense model's byte shares."""
    import subprocess
    import urllib.request

    import serve as sb  # benchmarks/serve.py: it builds and drives llama-server

    port = sb.free_port()
    log = Path(tempfile.mkdtemp()) / "llama-server.log"  # its output, quoted if it fails to start
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(sb.llama_server_binary()), "-m", str(path), "-t", str(threads),
                                 "-c", str(len(ids) + n + 64), "--host", "127.0.0.1", "--port",
                                 str(port), "--no-webui", "--parallel", "1"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        sb.wait_http(url + "/health", proc, log)
        body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        for _ in range(2):
            req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            timings = json.load(urllib.request.urlopen(req, timeout=600))["timings"]
    finally:
        sb.stop(proc)
    ms = timings["predicted_ms"] / timings["predicted_n"]
    b = dense["bytes"]
    ffn_share = b["ffn rows (all)"] / dense["bytes_total"]
    return {"model": dense["model"], "config": "llama.cpp dense (llama-server)", "ms_per_token": ms,
            "ffn_ms_per_token": ms * ffn_share, "tok_s": 1e3 / ms, "bytes": dict(b),
            "bytes_total": dense["bytes_total"], "ffn_density": 1.0, "tokens": [],
            "ffn_estimated": True}


def run_model(name: str, bundle_path: str, args) -> list[dict]:
    """Dense, then sparse with predicted masks, then sparse replaying oracle masks (on the kernel,
    then on the torch path), then llama-server (--llama); one model in memory at a time."""
    config = Config(dtype=args.dtype, max_batch=1, max_seq_len=512, cpu_threads=args.threads)
    pi = PowerInfer.from_pretrained(name, config)
    bundle = Bundle.open(bundle_path)
    bundle.check_model(pi.checkpoint.path)
    ids = pi.tokenize(PROMPT)[:64]
    rows = [measure("dense", pi, ids, args.tokens)]
    # as the engines run them: bf16 on the kernel's GEMV with a bf16 model, else float32
    preds = load_predictors(bundle, args.input, run_dtype(pi.model.norm.weight.dtype))
    pred_bytes = sum(p.numel() * p.element_size() for p in preds.parameters())
    if pi.config.weights == "int4":  # a 4-bit file: the sparse engine as it loads with the bundle
        del pi                       # (its neuron sets in the file's 4-bit blocks)
        pi = PowerInfer.from_pretrained(name, dataclasses.replace(config, bundle=bundle_path,
                                                                  predictor=args.input))
    else:
        apply_hybrid_ffn(pi.model, preds.active, predictor_input=args.input,
                         thresholds=bundle.thresholds())
    rows.append(measure(f"sparse, predicted ({args.input} input)", pi, ids, args.tokens,
                        {"predictors": pred_bytes}))
    modules_loop = measure(f"sparse, predicted ({args.input} input), modules' loop", pi, ids, args.tokens,
                           {"predictors": pred_bytes}, native=False)
    sparse.FUSED_DECODE = False  # the same, each layer's predictor and neurons op by op
    by_op = measure(f"sparse, predicted ({args.input} input), op by op", pi, ids, args.tokens,
                    {"predictors": pred_bytes}, native=False)
    sparse.FUSED_DECODE = True
    replay = Replay()
    for f in hybrid_layers(pi.model):  # record the oracle's masks on the calls `measure` makes
        f.masks, f.active = None, replay.record(f)
    for n in (WARMUP, args.tokens, args.tokens, args.tokens):  # (the calls `measure` makes)
        decode(pi.model, ids, n)
    for f in hybrid_layers(pi.model):
        del f.active
        f.masks = replay
    rows.append(measure("sparse, oracle masks replayed", pi, ids, args.tokens))
    for f in hybrid_layers(pi.model):  # the operator the kernel replaced, on the same masks
        f.hot, f.cold = f.hot.reformat(None), f.cold.reformat(None)
    replay.pos = 0  # the same calls again
    rows.append(measure("sparse, oracle masks replayed, torch path", pi, ids, args.tokens))
    if args.llama:
        # (the file as given: llama.cpp reads K-quants itself, where ours reads a converted copy)
        rows.append(llama_decode(Path(name), ids, args.tokens, torch.get_num_threads(), rows[0]))
    rows += [modules_loop, by_op]  # (last: the rows above are read by position)
    for r in rows[1:]:
        r["same_tokens_as_dense"] = sum(x == y for x, y in zip(rows[0]["tokens"], r["tokens"]))
    # the FFN's bytes a token cannot do without (see the module docstring), per configuration
    a, n = pi.model.args, pi.model.args.n_layers * pi.model.args.ffn_dim
    row = rows[0]["row_bytes"] / (3 if a.gated else 2)  # one row
    fired = rows[2]["ffn_density"]  # the oracle's: what fires
    recall = statistics.mean(r["recall_count"] for r in bundle.load_json(f"predictors.{args.input}.json"))
    rows[0]["ffn_bytes"] = n * rows[0]["row_bytes"]
    for r, fire in ((rows[1], fired * recall), (rows[2], fired)):
        lead = r["ffn_density"] * n * row  # gate rows (up rows for plain ReLU) of the computed
        r["ffn_bytes"] = lead + fire * n * row * (2 if a.gated else 1) + r["bytes"].get("predictors", 0)
    rows[3]["ffn_bytes"] = rows[3]["ffn_density"] * n * rows[3]["row_bytes"]
    if args.llama:
        rows[4]["ffn_bytes"] = rows[0]["ffn_bytes"]
    for r in rows[-2:]:  # (the modules' loop, op by op: the predicted row's bytes)
        r["ffn_bytes"] = rows[1]["ffn_bytes"]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--bundle", action="append", required=True)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--input", default="ffn", choices=["ffn", "layer"])
    ap.add_argument("--llama", action="store_true", help="llama-server's dense decode beside ours")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    assert len(args.model) == len(args.bundle), "one --bundle per --model"
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for m, b in zip(args.model, args.bundle):
        results += run_model(m, b, args)
    bw = read_bandwidth(torch.float32)  # measured after loading, in the same process
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, read bandwidth "
          f"{bw / 1e9:.1f} GB/s, {args.dtype}, {args.tokens} tokens, predictor input {args.input}")
    print("| model | config | layer loop | decode tok/s | ms/token | FFN rows computed | MB/token | "
          "floor ms | % of floor | vs dense | FFN ms/token | FFN vs dense |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        base = next(b for b in results if b["model"] == r["model"] and b["config"] == "dense")
        floor = r["bytes_total"] / bw * 1e3
        r["floor_ms"], r["pct_of_floor"] = floor, floor / r["ms_per_token"]
        r["speedup"] = base["ms_per_token"] / r["ms_per_token"]
        print(f"| {r['model']} | {r['config']} | {r.get('layer_loop', '-')} | {r['tok_s']:.1f} | "
              f"{r['ms_per_token']:.2f} | "
              f"{r['ffn_density']:.1%} | {r['bytes_total'] / 1e6:.1f} | {floor:.2f} | "
              f"{r['pct_of_floor']:.0%} | {r['speedup']:.2f}x | {r['ffn_ms_per_token']:.2f} | "
              f"{base['ffn_ms_per_token'] / r['ffn_ms_per_token']:.2f}x"
              + (" (estimated)" if r.get("ffn_estimated") else "") + " |")
    print("\n| model | config | FFN MB/token | FFN ms/token | FFN GB/s | FFN % of floor |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        gbs = r["ffn_bytes"] / r["ffn_ms_per_token"] / 1e6
        r["ffn_pct_of_floor"] = gbs * 1e9 / bw
        print(f"| {r['model']} | {r['config']} | {r['ffn_bytes'] / 1e6:.1f} | "
              f"{r['ffn_ms_per_token']:.2f} | {gbs:.1f} | {r['ffn_pct_of_floor']:.0%}"
              + (" (estimated)" if r.get("ffn_estimated") else "") + " |")
    for r in results:  # the kernel's sparse FFN against llama.cpp's dense one
        llama = next((b for b in results if b["model"] == r["model"] and b.get("ffn_estimated")), None)
        if llama and r["config"].startswith("sparse"):
            print(f"{r['model']}: {r['config']}: FFN {llama['ffn_ms_per_token'] / r['ffn_ms_per_token']:.2f}x "
                  f"llama.cpp's (estimated), whole token {llama['ms_per_token'] / r['ms_per_token']:.2f}x")
    for r in results:
        if r.get("tokens") and "same_tokens_as_dense" in r:
            print(f"{r['model']}: sparse greedy tokens equal to dense for "
                  f"{r['same_tokens_as_dense']}/{len(r['tokens'])}")
    if args.out:
        Path(args.out).write_text(json.dumps({"bandwidth": bw, "results": results}, indent=1))


if __name__ == "__main__":
    main()
