#!/usr/bin/env python3
"""Prefill and decode throughput of PowerInfer beside llama.cpp in one run (default model, or --model).

    .venv/bin/python benchmarks/decode.py [--model NAME|FILE] [--tokens 128] [--prompt-tokens 128]
        [--threads N] [--configs default fp32 bf16 bf16+int4 ... bf16+int4+compile] [--skip-llama]
        [--cpu-isa avx2|avx512|avx512bf16] [--llama-isa match|native|avx2|avx512]
        [--turns N] [--bundle B] [--input-sparsity B] [--out FILE]

Ours, per config: prefill tok/s is the timed forward over the whole prompt (median over runs; the prefix
cache off, so no run reuses the one before); decode
tok/s is what a user sees through `Engine.run` with greedy sampling and ignore_eos (sampling,
detokenizing, Python bookkeeping included), and "step" is the model call alone, timed inside the
same runs. The first run of each config is a warm-up (torch.compile happens there), reported apart.
llama.cpp runs through llama-cpp-python (installed into benchmarks/.llama-venv on first use) in a
subprocess on the same token ids, thread count and token count, greedy.
A per-token profile of our decode (module breakdown and top torch ops) is printed for one config.
With --turns N each config is also measured against llama.cpp in N alternating turns (one
generation of ours, then one llama.cpp run, each turn) while it is loaded: on a shared VM whose
speed drifts by more than the difference looked for between runs minutes apart, the median of
the turns' ratios is the figure to quote.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from powerinfer import Config, PowerInfer, kernels
from powerinfer.cpu import cpu_name, machine_jiffies
from powerinfer.engine.params import sampling_params
from powerinfer.formats.loader import load_checkpoint, resolve_model

ROOT = Path(__file__).resolve().parent.parent

LLAMA_VENV = ROOT / "benchmarks" / ".llama-venv"
LLAMA_VERSION = "0.3.36"
TEXT = ("The history of computing is a story of ideas that took decades to mature. Early machines "
        "filled rooms, consumed enormous power and were programmed by rewiring panels by hand. ")

LLAMA_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np
import llama_cpp, llama_cpp.llama_cpp as C
from llama_cpp import Llama
cfg = json.load(sys.stdin)
ids, n, t = cfg["ids"], cfg["tokens"], cfg["threads"]
# its extra buffer types (weights repacked for this CPU's dot products, e.g. Q4_K rows 8 at a
# time) as llama.cpp's own default, unless asked otherwise (`--llama-no-repack`). Llama() silently
# swallows unknown kwargs, so the choice goes into the model params it builds (llama.py calls
# C.llama_model_default_params). (An AMX build's AMX buffer type crashed on Xeons with AMX: our
# builds leave AMX out, NO_AMX.)
default_params = C.llama_model_default_params
def with_choice():
    p = default_params()
    p.use_extra_bufts = cfg["extra_bufts"]
    return p
C.llama_model_default_params = with_choice
llm = Llama(cfg["model"], n_ctx=len(ids) + n + 16, n_batch=512, n_ubatch=512, n_threads=t,
            n_threads_batch=t, verbose=False)
C.llama_model_default_params = default_params
assert llm.model_params.use_extra_bufts == cfg["extra_bufts"]
ctx, vocab = llm._ctx.ctx, llm.n_vocab()
def greedy():  # argmax of the last evaluated token's logits
    return int(np.argmax(np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, -1), shape=(vocab,))))
runs = []
for _ in range(cfg["runs"] + 1):  # the first run is a warm-up
    llm.reset()
    C.llama_perf_context_reset(ctx)
    t0 = time.perf_counter()
    llm.eval(ids)
    out = [greedy()]
    t1 = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([out[-1]])
        out.append(greedy())
    t2 = time.perf_counter()
    perf = C.llama_perf_context(ctx)
    runs.append(dict(prefill_s=t1 - t0, decode_s=(t2 - t1) / (n - 1),
                     step_s=perf.t_eval_ms / 1e3 / max(perf.n_eval, 1), out=out))
med = lambda k: statistics.median(r[k] for r in runs[1:])
print(json.dumps(dict(prefill_s=med("prefill_s"), decode_s=med("decode_s"), step_s=med("step_s"),
                      out=runs[1]["out"], version=llama_cpp.__version__)))
"""


def machine_info(threads: int) -> str:
    cpu = f"{cpu_name()} (kernel classes: up to {kernels.best_isa()})"
    return (f"{cpu} · {os.cpu_count()} cores, {threads} threads used · "
            f"torch {torch.__version__} · Python {platform.python_version()} · "
            f"load average {os.getloadavg()[0]:.2f} at start")


def cpu_seconds() -> tuple[float, float, float]:
    """(busy, total) CPU seconds of the machine, and this process's own (children included)."""
    busy, every = machine_jiffies()
    tick = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return busy / tick, every / tick, t.user + t.system + t.children_user + t.children_system


def others_share(since: tuple) -> float:
    """Percent of the machine's CPU time other processes used since `since` (a cpu_seconds())."""
    busy, total, own = (b - a for a, b in zip(since, cpu_seconds()))
    return 100 * max(busy - own, 0) / max(total, 1e-9)


# ---------------------------------------------------------------- llama.cpp
# -march=native without AMX: on Xeons with AMX, ggml's AMX path runs `tilezero` without asking
# Linux for the tile state and dies with "Illegal instruction" (benchmarks/serve.py builds its
# llama-server the same way); on CPUs without AMX the flags change nothing
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CMAKE_ARGS = (f'-DLLAMA_CURL=OFF -DGGML_NATIVE=ON "-DCMAKE_C_FLAGS={NO_AMX}" '
                    f'"-DCMAKE_CXX_FLAGS={NO_AMX}"')
# llama.cpp held to an older class, as our kernel is with --cpu-isa (the class's own CPU would
# build these with GGML_NATIVE): avx2 an EPYC Rome/Milan's, avx512 a Cascade Lake's (AVX-512
# F/BW/VL with VNNI, no BF16); each its own venv (`--llama-isa`)
_OLDER = "-DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
LLAMA_BUILDS = {"native": LLAMA_CMAKE_ARGS, "avx2": _OLDER,
                "avx512": _OLDER + " -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON"}
LLAMA_ISA = "native"  # --llama-isa
LLAMA_REPACK = True  # --llama-no-repack: False


def llama_python(isa: str | None = None) -> Path:
    """The python of benchmarks/.llama-venv (-<isa> for a build held to an older class),
    creating it (a ~4 minute source build) if missing or built with other flags."""
    isa = isa or LLAMA_ISA
    venv = LLAMA_VENV if isa == "native" else LLAMA_VENV.with_name(f"{LLAMA_VENV.name}-{isa}")
    args = LLAMA_BUILDS[isa]
    py = venv / "bin" / "python"
    stamp = venv / "powerinfer-cmake-args"
    built = stamp.read_text() if stamp.exists() else ""
    if built == args and not subprocess.run(
            [py, "-c", "import llama_cpp"], capture_output=True).returncode:
        return py
    print(f"installing llama-cpp-python=={LLAMA_VERSION} into benchmarks/{venv.name} (a source build, "
          f"CMAKE_ARGS={args}) ...", flush=True)
    if not py.exists():
        subprocess.run(["python3", "-m", "venv", venv], check=True)
    env = dict(os.environ, CMAKE_ARGS=args)  # scikit-build-core splits it with shlex
    # (pip's own output, which carries the installing host's configuration, only on a failure)
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--force-reinstall", "--no-cache-dir",
                        f"llama-cpp-python=={LLAMA_VERSION}"], env=env, capture_output=True,
                       text=True)
    if r.returncode:
        raise RuntimeError(f"pip could not build llama-cpp-python=={LLAMA_VERSION}:\n"
                           f"{(r.stdout + r.stderr)[-3000:]}")
    stamp.write_text(args)
    return py


def bench_llama(model: str, ids: list[int], n: int, threads: int, runs: int) -> dict:
    cfg = dict(model=model, ids=ids, tokens=n, threads=threads, runs=runs, extra_bufts=LLAMA_REPACK)
    proc = subprocess.run([llama_python(), "-c", LLAMA_SCRIPT], input=json.dumps(cfg),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp run failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- ours
INPUT_SPARSITY = "off"  # --input-sparsity: the bundle a config with "+input" takes it from
BUNDLE = ""  # --bundle: the FFN sparsity bundle a config with "+sparse" loads (its predictors)


def load(name: str, threads: int, model: str, isa: str = "auto") -> PowerInfer:
    dtype, *flags = name.split("+")
    # no prefix cache: each run prefills the same prompt, and a cached prefix would leave the
    # timed prefill a block's worth of tokens (what a new user's prompt costs is the whole of it)
    base = dict(cpu_threads=threads, max_batch=1, max_seq_len=2048, prefix_cache=False, cpu_isa=isa,
                input_sparsity=INPUT_SPARSITY if "input" in flags else "off",
                bundle=BUNDLE if "sparse" in flags else "")
    if dtype == "default":  # what a new user gets: dtype and weights "auto", decided here
        config = Config(compile="compile" in flags, **base)
    else:
        config = Config(dtype=dtype, compile="compile" in flags,
                        weights="int4" if "int4" in flags else "dense", **base)
    return PowerInfer.from_pretrained(model, config=config)


def timed(fn, log: list):
    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        log.append(time.perf_counter() - t)
        return out
    return wrapper


def generate_once(m: PowerInfer, ids: list[int], n: int) -> dict:
    """One greedy generation through Engine.run, with the model calls timed from inside."""
    eng, prefill, steps = m.engine, [], []
    prompt, dec = eng._prompt, eng._decode  # (the modules' or the native loop's prompt step)
    eng._prompt, eng._decode = timed(prompt, prefill), timed(dec, steps)
    try:
        seq = eng.new_sequence(ids, sampling_params(max_tokens=n, temperature=0, ignore_eos=True))
        t0 = time.perf_counter()
        stamps = [time.perf_counter() for _ in eng.run([seq])]
    finally:
        eng._prompt, eng._decode = prompt, dec
    return dict(wall_s=stamps[-1] - t0, prefill_s=prefill[0],
                decode_s=(stamps[-1] - stamps[0]) / (n - 1), step_s=sum(steps) / len(steps),
                out=seq.output)


def bench_ours(m: PowerInfer, ids: list[int], n: int, runs: int) -> dict:
    warm = generate_once(m, ids, n)
    rs = [generate_once(m, ids, n) for _ in range(runs)]
    med = {k: statistics.median(r[k] for r in rs)
           for k in ("wall_s", "prefill_s", "decode_s", "step_s")}
    return dict(med, warmup_s=warm["wall_s"] - med["wall_s"], out=rs[0]["out"])


# ---------------------------------------------------------------- profile
def decode_tokens(m: PowerInfer, ids: list[int], n: int):
    """A generator over the decode steps of one greedy generation (prefill already done)."""
    seq = m.engine.new_sequence(ids, sampling_params(max_tokens=n, temperature=0, ignore_eos=True))
    it = m.engine.run([seq])
    next(it)  # prefill and the first token
    return it


def add_timer(mod: torch.nn.Module, label: str, spent: dict) -> list:
    start = 0.0

    def pre(*_):
        nonlocal start
        start = time.perf_counter()

    def post(*_):
        spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
    return [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]


def module_breakdown(m: PowerInfer, ids: list[int], n: int) -> str:
    """Per decode token: time in each kind of module (forward hooks; eager only), the rest of the
    model step, and the engine around it."""
    eng, model, spent, steps, handles = m.engine, m.model, {}, [], []
    groups = {"Attention": "attention (qkv, rope, kv cache, sdpa, wo)", "FFN": "FFN",
              "Norm": "norms", "Embedding": "embedding"}
    for mod in model.modules():
        label = "lm_head" if mod is model.output else groups.get(type(mod).__name__)
        if label:
            handles += add_timer(mod, label, spent)
    dec = eng._decode
    eng._decode = timed(dec, steps)
    try:
        it = decode_tokens(m, ids, n)
        spent.clear()
        t0 = time.perf_counter()
        for _ in it:
            pass
        total = (time.perf_counter() - t0) / (n - 1)
    finally:
        eng._decode = dec
        for h in handles:
            h.remove()
    step = sum(steps) / len(steps)
    rows = [(k, v / (n - 1)) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])]
    rows += [("rest of the model step (python, rope/mask setup, residual adds)",
              step - sum(v for _, v in rows)),
             ("engine outside the step (sampling, detokenize, bookkeeping)", total - step)]
    return "\n".join([f"Decode token breakdown ({n - 1} tokens, {total * 1e3:.2f} ms/token; the hooks "
                      "slow the step a little, so read the shares, not the sum):",
                      "", "| part | ms/token | share |", "|---|---:|---:|"]
                     + [f"| {k} | {v * 1e3:.3f} | {100 * v / total:.1f}% |" for k, v in rows])


def top_ops(m: PowerInfer, ids: list[int], n: int, top: int = 15) -> str:
    """Per decode token: the torch ops with the most self CPU time, under torch.profiler."""
    it = decode_tokens(m, ids, n)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in it:
            pass
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    all_us = sum(e.self_cpu_time_total for e in events)
    return "\n".join([f"Top {top} torch ops by self CPU time per decode token (under the profiler, "
                      f"{all_us / (n - 1) / 1e3:.2f} ms/token in all):", "",
                      "| op | self ms/token | share | calls/token |", "|---|---:|---:|---:|"]
                     + [f"| `{e.key}` | {e.self_cpu_time_total / (n - 1) / 1e3:.3f} | "
                        f"{100 * e.self_cpu_time_total / all_us:.1f}% | {e.count / (n - 1):.0f} |"
                        for e in events[:top]])


# ---------------------------------------------------------------- report
def in_turns(m: PowerInfer, model: str, ids: list[int], n: int, threads: int, turns: int) -> dict:
    """Ours and llama.cpp decoding alternately, `turns` times: a generation of ours (the median of
    two) then a llama.cpp run (its subprocess's warm-up, then one timed run), each turn's ratio,
    and the memory's read rate just before ours (`gemv.read_rate`: a VM's moves by 1.6x within
    minutes, and a token that reads half llama.cpp's bytes goes with it where llama.cpp's, bound
    by its arithmetic, does not)."""
    from gemv import read_rate
    rows = []
    for _ in range(turns):
        read_gbs = read_rate()[0] / 1e9
        ours = statistics.median(generate_once(m, ids, n)["decode_s"] for _ in range(2))
        theirs = bench_llama(model, ids, n, threads, 1)["decode_s"]
        rows.append(dict(ours_tok_s=1 / ours, llama_tok_s=1 / theirs, ratio=theirs / ours,
                         read_gbs=read_gbs))
    return dict(turns=rows, ratio=statistics.median(r["ratio"] for r in rows))


def turns_table(turns: dict) -> str:
    lines = ["In turns (ours, then llama.cpp, each turn; ratio: our decode tok/s over "
             "llama.cpp's; read: the memory's read rate in GB/s just before ours):",
             "", "| config | turns | ours tok/s (median) | llama.cpp tok/s (median) | ratio (median) | "
             "each turn (ratio @ read) |", "|---|---:|---:|---:|---:|---|"]
    for name, t in turns.items():
        rows = t["turns"]
        lines.append(f"| PowerInfer {t['label']} | {len(rows)} | "
                     f"{statistics.median(r['ours_tok_s'] for r in rows):.1f} | "
                     f"{statistics.median(r['llama_tok_s'] for r in rows):.1f} | **{t['ratio']:.2f}x** | "
                     + ", ".join(f"{r['ratio']:.2f} @ {r['read_gbs']:.0f}" for r in rows) + " |")
    return "\n".join(lines)


def table(results: dict, llama: dict | None, p: int, n: int, file: str = "") -> str:
    ref = llama["decode_s"] if llama else None
    lines = [f"Prompt {p} tokens, {n} generated tokens (greedy, ignore_eos). decode: through the "
             "engine, sampling included; step: the model call alone; vs llama.cpp: our decode tok/s "
             "over llama.cpp's; others' CPU: the machine's CPU time other processes took meanwhile "
             "(timings are clean only near 0%).",
             "", "| engine / config | prefill tok/s | decode tok/s | step tok/s | ms/token | "
             "vs llama.cpp decode | warm-up s | others' CPU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    if llama:
        lines.append(f"| llama.cpp {llama['version']} (the file as it is{file}) | "
                     f"{p / llama['prefill_s']:.1f} | "
                     f"{1 / llama['decode_s']:.1f} | {1 / llama['step_s']:.1f} | "
                     f"{llama['decode_s'] * 1e3:.2f} | 1.00x | - | {llama['others']:.0f}% |")
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| PowerInfer {name} | failed: {r['error']} | | | | | | |")
            continue
        ratio = f"{ref / r['decode_s']:.2f}x" if ref else "-"
        lines.append(f"| PowerInfer {r['label']} | {p / r['prefill_s']:.1f} | {1 / r['decode_s']:.1f} | "
                     f"{1 / r['step_s']:.1f} | {r['decode_s'] * 1e3:.2f} | {ratio} | "
                     f"{r['warmup_s']:.1f} | {r['others']:.0f}% |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens to generate")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--configs", nargs="+",
                    default=["default", "fp32", "bf16", "bf16+int4", "fp32+compile", "bf16+compile",
                             "bf16+int4+compile"],
                    help="default (Config()'s auto choices for this machine and file), or a "
                         "dtype (fp32, bf16), optionally +int4 (4-bit weights kept); +compile; +input "
                         "(input sparsity from --input-sparsity); +sparse (the FFN's sparsity "
                         "from --bundle)")
    ap.add_argument("--cpu-isa", default="auto",
                    help="hold the CPU kernel to this class (avx2, avx512, avx512bf16: an older "
                         "CPU's paths; Config.cpu_isa)")
    ap.add_argument("--llama-isa", choices=["match", *LLAMA_BUILDS], default="match",
                    help="the class llama.cpp is built for: native (this CPU's, without AMX), "
                         "avx2 or avx512 (an older CPU's, each its own build); match (default): "
                         "--cpu-isa's class where it holds the kernel lower, else native")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="llama.cpp without its extra buffer types (no weights repacked for this "
                         "CPU: the baseline of runs before 2026-11-30)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per config, after one warm-up")
    ap.add_argument("--profile", nargs="+",
                    help="configs to profile (default: the first eager one and the last one)")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--turns", type=int, default=0,
                    help="also measure each config against llama.cpp in this many alternating turns")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a model file or an installed model's short name (gemma3-270m)")
    ap.add_argument("--out", help="also write the markdown section to this file")
    ap.add_argument("--input-sparsity", default="off", metavar="BUNDLE",
                    help="the bundle (powerinfer calibrate-input) a config with +input reads its "
                         "input sparsity from, e.g. --configs default default+input")
    ap.add_argument("--bundle", default="",
                    help="the sparsity bundle a config with +sparse loads (its FFNs compute the "
                         "neurons its predictors choose), e.g. --configs default default+sparse "
                         "default+sparse+input with --input-sparsity the same bundle calibrated "
                         "by `powerinfer calibrate-input`")
    a = ap.parse_args()
    global INPUT_SPARSITY, LLAMA_ISA, LLAMA_REPACK, BUNDLE
    INPUT_SPARSITY, BUNDLE = a.input_sparsity, a.bundle
    LLAMA_REPACK = not a.llama_no_repack
    LLAMA_ISA = a.llama_isa if a.llama_isa != "match" else (
        a.cpu_isa if a.cpu_isa in LLAMA_BUILDS and a.cpu_isa != kernels.best_isa() else "native")
    torch.set_num_threads(a.threads)
    info = machine_info(a.threads) + (f" · llama.cpp built for {LLAMA_ISA} ({LLAMA_BUILDS[LLAMA_ISA]}), "
                                      f"weights {'repacked' if LLAMA_REPACK else 'not repacked'}")
    print(datetime.datetime.now().isoformat(" ", "seconds"), info, flush=True)

    cpu0 = cpu_seconds()
    model_path = str(resolve_model(a.model))
    results, llama, turns = {}, None, {}
    prof_names = a.profile or {next((c for c in a.configs if "compile" not in c), None),
                               a.configs[-1]}
    profiles = []
    ids = None
    for name in a.configs:
        print(f"PowerInfer {name} ...", flush=True)
        c0 = cpu_seconds()
        try:
            t = time.perf_counter()
            m = load(name, a.threads, a.model, a.cpu_isa)
            load_s = time.perf_counter() - t
            if ids is None:  # the prompt, cut to an exact length with our tokenizer
                ids = m.tokenize(TEXT * (a.prompt_tokens // 20 + 2))[:a.prompt_tokens]
            results[name] = r = bench_ours(m, ids, a.tokens, a.runs)
            r["others"] = others_share(c0)
            c = m.config  # what it resolved to (a default's choices on this machine)
            r["label"] = (f"{name} ({c.dtype}, {c.weights} weights, kernel {kernels.isa()}"
                          f"{', FFN sparse by the bundle' if c.bundle else ''})")
            print(f"  load {load_s:.1f}s, warm-up {r['warmup_s']:.1f}s, "
                  f"decode {1 / r['decode_s']:.1f} tok/s", flush=True)
            if a.turns and not a.skip_llama:
                try:  # (a llama.cpp failure leaves this config's own results standing)
                    turns[name] = in_turns(m, model_path, ids, a.tokens, a.threads, a.turns)
                    turns[name]["label"] = r["label"]
                    print(f"  in turns with llama.cpp: {turns[name]['ratio']:.2f}x", flush=True)
                except RuntimeError as e:
                    print(f"  in turns: FAILED: {str(e).splitlines()[0][:200]}", flush=True)
            if name in prof_names:
                k = min(a.tokens, 64)
                parts = [] if m.config.compile else [module_breakdown(m, ids, k)]  # hooks: eager
                parts.append(top_ops(m, ids, k))
                profiles.append("\n\n".join(
                    [f"### Where a decode token's time goes: PowerInfer {name}"] + parts))
            del m
        except Exception as e:  # e.g. torch.compile failing: report it and go on
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            print(f"  FAILED: {results[name]['error']}", flush=True)
        torch._dynamo.reset()
    if not a.skip_llama and ids is not None:
        print("llama.cpp ...", flush=True)
        c0 = cpu_seconds()
        llama = bench_llama(model_path, ids, a.tokens, a.threads, a.runs)
        llama["others"] = others_share(c0)
    info += f" · other processes used {others_share(cpu0):.0f}% of the CPUs during the run"
    types = load_checkpoint(model_path, with_weights=False).info["tensor_types"]
    body = table(results, llama, len(ids or []), a.tokens,
                 ": " + ", ".join(f"{k} {v}" for k, v in sorted(types.items())))
    if llama:  # how long our greedy output stays identical to llama.cpp's
        same = {name: next((i for i, (x, y) in enumerate(zip(r["out"], llama["out"])) if x != y),
                           len(r["out"])) for name, r in results.items() if "out" in r}
        body += "\n\nGreedy tokens identical to llama.cpp's: " + ", ".join(
            f"{k} {v}/{a.tokens}" for k, v in same.items()) + "."
    if turns:
        body += "\n\n" + turns_table(turns)
    section = "\n\n".join(x for x in (
        f"## Decode benchmark ({datetime.date.today()})",
        f"- Machine: {info}\n- Model: {Path(model_path).name}", body, *profiles) if x)
    print("\n" + section)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(section + "\n")


if __name__ == "__main__":
    main()
