#!/usr/bin/env python3
"""How far an actor group's logits stray from the in-process engine's on a real model, step by
step, and where their greedy tokens part: the measure behind the tests' near-tie tolerances for
a served model against its in-process engine.

    .venv/bin/python benchmarks/logit_spread.py [--model smollm2-135m-instruct]
        [--configs fp32+int4 default] [--prompts 24] [--tokens 24] [--cores 0] [--cold 1]
        [--out FILE]

For each configuration, the in-process engine on one thread and an actor group on `--cores`
(a hot executor and `--cold` cold executors: on one core the hot executor holds every neuron
and head, as the served SmolLM2 in tests/test_serve.py; on two it splits them with the cold
one) decode the same prompts greedily. The in-process engine's logits are those its decode
steps chose from; the group's are its events' log-probabilities (its chosen token and its top
5). Until their tokens part, each step's deviation is the largest |log-probability difference|
over the group's tokens. Where they part, the in-process engine's margin between its token and
the group's (in logits).

Both sides hold the same weights and the same kinds of arithmetic. With the 4-bit kernel's
8-bit activations (its integer products, the input quantized per block of 32) a last-bit
difference in a layer's input can move a value to the next 8-bit step, which the next layers
carry on: a split group, which sums each layer's shares apart, parts from the in-process engine
at near-ties; a group on one core runs every step (prompts too) in the layer loop the
in-process engine runs, and computes its floats.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from powerinfer import Config, PowerInfer  # noqa: E402
from powerinfer.engine.params import SamplingParams  # noqa: E402

CONFIGS = {"fp32+int4": dict(dtype="float32", weights="int4"), "default": {}}
CHAT = ["What is the capital of France?", "What is the capital of Germany?",
        "Name three primary colors.", "How do plants make food?", "Write a haiku about rain.",
        "What is 12 times 7?", "Who wrote Hamlet?", "Give me a tip for sleeping better.",
        "Why is the sky blue?", "Translate 'good morning' into Spanish.",
        "What is a prime number?", "Describe a cat in one sentence."]
PLAIN = ["Once upon a time", "The three primary colors are", "The capital of France is",
         "In 1492, Columbus", "The quick brown fox", "Water boils at", "def fibonacci(n):",
         "My favourite food is", "The best way to learn a language is", "Photosynthesis is",
         "The moon orbits", "Dear Sir or Madam,"]


def chosen_logits(pi: PowerInfer, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """The logits (n, V) the in-process engine chose its n greedy tokens from, and the tokens."""
    eng, rows = pi.engine, []
    step = eng._step

    def record(part):
        out = step(part)
        rows.append(out)
        return out
    eng._step = record
    try:
        events = pi._run([ids], n, dict(temperature=0, ignore_eos=True))
        tokens = [e.token for e in events if e.token >= 0]
    finally:
        del eng._step
    return torch.cat(rows).float(), tokens


def spread(local: PowerInfer, group: PowerInfer, prompts: list[list[int]], n: int) -> dict:
    devs, parted = [], []
    for ids in prompts:
        logits, want = chosen_logits(local, ids, n)
        events = [ev for ev in group.engine.generate(ids, SamplingParams(
            max_tokens=n, temperature=0, ignore_eos=True, logprobs=5)) if ev["token"] >= 0]
        got = [ev["token"] for ev in events]
        lps = torch.log_softmax(logits, -1)
        for k, ev in enumerate(events):
            if got[k] != want[k]:
                parted.append({"step": k, "margin": float(logits[k, want[k]] - logits[k, got[k]])})
                break
            theirs = dict(ev["top_logprobs"]) | {ev["token"]: ev["logprob"]}
            devs.append(max(abs(lp - float(lps[k, t])) for t, lp in theirs.items()))
    devs.sort()
    return {"steps": len(devs), "median": statistics.median(devs),
            "p99": devs[min(len(devs) - 1, int(0.99 * len(devs)))], "max": devs[-1],
            "parted": parted, "prompts": len(prompts)}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--cores", default="0", help="the actor group's cores (a cpulist)")
    ap.add_argument("--cold", type=int, default=1, help="the group's cold executors")
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args()
    results = {}
    print(f"# {datetime.date.today()} {platform.processor() or platform.machine()}, "
          f"{args.model}, {args.tokens} tokens a prompt, the group on cores {args.cores}")
    print("| configuration | steps compared | deviation median | p99 | max | prompts parted "
          "| the in-process margin where they parted |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in args.configs:
        cfg = dict(CONFIGS[name], max_seq_len=512, cpu_threads=1)
        local = PowerInfer.from_pretrained(args.model, Config(**cfg))
        group = PowerInfer.from_pretrained(args.model, Config(
            **cfg, runtime="actors", cold_executors=args.cold, cores=args.cores))
        try:
            chat = [local.tokenize(local.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}])) for q in CHAT]
            prompts = [*chat, *(local.tokenize(p) for p in PLAIN)][:args.prompts]
            r = results[name] = spread(local, group, prompts, args.tokens)
        finally:
            group.close()
        margins = ", ".join(f"{p['margin']:.3f} (token {p['step']})" for p in r["parted"])
        print(f"| {name} | {r['steps']} | {r['median']:.2g} | {r['p99']:.2g} | {r['max']:.2g} "
              f"| {len(r['parted'])} of {r['prompts']} | {margins or '-'} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"date": str(datetime.date.today()),
                                              "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
