#!/usr/bin/env python3
"""What the activations' type costs in quality on the real models: the defaults (`dtype="auto"`,
bf16 activations where the file's 4-bit blocks run on the CPU kernel) against float32
activations over the same 4-bit weights, both measured against the float32 dense model.

    .venv/bin/python benchmarks/dtype_quality.py [--models smollm2-135m-instruct gemma3-270m]
        [--tokens 5120] [--window 256] [--greedy 32] [--bundle DIR] [--out FILE]

For each model, three loads side by side: `default` (what `Config()` resolves to here; the line
says what), `fp32+int4` (`Config(dtype="float32", weights="int4")`) and the reference `fp32`
(`Config(dtype="float32", weights="dense")`, the float32 model, which the tests check against
transformers). Measured:
- held-out perplexity on the Lee corpus's held-out part (`--tokens` in windows of `--window`,
  each window one forward pass of the model, as a prompt is computed), and each load's top-1
  agreement with the reference's next token and KL divergence from its distribution;
- greedy decoding through the engine (the decode path: the KV cache in the load's type) of 12
  prompts (6 chat questions, 6 plain openings) for `--greedy` tokens: the tokens before the first
  difference from the reference's, and how many prompts agree throughout.

With `--bundle` (one model's sparsity bundle) a fourth load, `default+bundle` (`Config(bundle=DIR)`,
the defaults otherwise): its held-out windows are prompts, which a sparse model computes over
every neuron's record (`kernels.records_rows`), so that row measures the sparse load's prompt
path; its greedy tokens are its prompt and then its sparse decode steps.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from powerinfer import Config, PowerInfer  # noqa: E402
from powerinfer.sparsity.corpus import load_corpus, token_windows  # noqa: E402

CONFIGS = {
    "default": {},
    "fp32+int4": {"dtype": "float32", "weights": "int4"},
    "fp32": {"dtype": "float32", "weights": "dense"},  # the reference
}
CHATS = ["What is the capital of France?", "Name three primary colors.",
         "How many legs does a spider have?", "What is 12 times 12?",
         "Who wrote Romeo and Juliet?", "Give me a synonym for happy."]
PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The largest planet in the solar system", "Water boils at a temperature of",
         "import numpy as np\n\ndef softmax(x):"]


def describe(m: PowerInfer) -> str:
    sparse = ", sparse by its bundle" if m.config.bundle else ""
    return f"{m.config.dtype} activations, {m.config.weights} weights{sparse}"


@torch.inference_mode()
def held_out(models: dict[str, PowerInfer], windows: list[list[int]]) -> dict[str, dict]:
    stats = {k: {"nll": 0.0, "kl": 0.0, "top1": 0, "tokens": 0} for k in models}
    for m in models.values():  # (the engine's pool replaced by one row's: greedy() ran first)
        m.model.rows = None
        m.model.setup_cache(1, max(map(len, windows)))
    for i, w in enumerate(windows):
        ids, pos = torch.tensor([w]), torch.arange(len(w))[None]
        target = ids[0, 1:]
        logp = {k: F.log_softmax(m.model(ids, pos)[0, :-1].float(), -1) for k, m in models.items()}
        r = logp["fp32"]
        for k, lp in logp.items():
            s = stats[k]
            s["nll"] -= float(lp.gather(-1, target[:, None]).sum())
            s["kl"] += float((r.exp() * (r - lp)).sum())
            s["top1"] += int((lp.argmax(-1) == r.argmax(-1)).sum())
            s["tokens"] += len(w) - 1
        print(f"  window {i + 1}/{len(windows)}", end="\r", flush=True)
    base = math.exp(stats["fp32"]["nll"] / stats["fp32"]["tokens"])
    out = {}
    for k, s in stats.items():
        ppl = math.exp(s["nll"] / s["tokens"])
        out[k] = {"ppl": ppl, "ppl_delta": ppl / base - 1, "top1": s["top1"] / s["tokens"],
                  "kl": s["kl"] / s["tokens"], "tokens": s["tokens"]}
    return out


def greedy(models: dict[str, PowerInfer], n: int) -> tuple[dict[str, dict], dict]:
    """Each load's greedy tokens for the prompts, through its engine (the decode path), and how
    long each stays equal to the reference's."""
    prompts = [[{"role": "user", "content": q}] for q in CHATS] + PLAIN
    outs = {k: [[ev.token for ev in m._run([m._ids(p)], n, {"temperature": 0, "ignore_eos": True})]
                for p in prompts] for k, m in models.items()}
    res = {}
    for k in models:
        same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(outs[k], outs["fp32"])]
        res[k] = {"before_first_difference": same, "mean": statistics.mean(same),
                  "whole": sum(d >= n for d in same), "prompts": len(same)}
    return res, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    ap.add_argument("--tokens", type=int, default=5120)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--greedy", type=int, default=32)
    ap.add_argument("--bundle", default=None,
                    help="also load the model with this sparsity bundle (one model's)")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    a = ap.parse_args()
    if a.bundle and len(a.models) != 1:
        ap.error("--bundle is one model's: give that model alone with --models")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"# {stamp} {platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    results = {}
    for name in a.models:
        t0 = time.time()
        configs = dict(CONFIGS, **({"default+bundle": {"bundle": a.bundle}} if a.bundle else {}))
        models = {k: PowerInfer.from_pretrained(name, config=Config(**kw))
                  for k, kw in configs.items()}
        windows = token_windows(models["fp32"].tokenizer, load_corpus("lee", "held_out"),
                                a.window, a.tokens)
        g, _ = greedy(models, a.greedy)  # (first: held_out takes the engines' KV pools)
        q = held_out(models, windows)
        results[name] = {k: {"config": describe(models[k]), **q[k], **g[k]} for k in models}
        for m in models.values():
            m.close()
        print(f"\n## {name} ({time.time() - t0:.0f} s; {q['fp32']['tokens']} held-out "
              f"tokens, {g['fp32']['prompts']} greedy prompts of {a.greedy} tokens)\n")
        print("| load | held-out ppl | against float32 | top-1 agreement | KL | greedy: "
              "tokens before the first difference (mean) | prompts equal throughout |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for k, r in results[name].items():
            print(f"| {k} ({r['config']}) | {r['ppl']:.3f} | {100 * r['ppl_delta']:+.2f}% | "
                  f"{100 * r['top1']:.1f}% | {r['kl']:.4f} | {r['mean']:.1f} | "
                  f"{r['whole']} of {r['prompts']} |")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
