#!/usr/bin/env python3
"""A predictor's decode-step GEMVs on the CPU kernel from bf16 rows or from 8-bit q8x16 groups
(`Predictors.kernel_rows`, POWERINFER_PREDICTOR_ROWS), in one run.

    .venv/bin/python benchmarks/predictor_rows.py [--dim 4096 --ffn 11008 --rank 128]
        [--layers 32] [--rounds 30] [--model M --bundle B --tokens 2048 --decode 64]
        [--token-model M --token-bundle B --turns 6] [--json FILE]

Speed: `--layers` distinct rank-r predictors of a shape (the default: a 7B model's, 4096 -> 128
-> 11008), enough that their matrices come from memory as a token's do; one bf16 decode row
through every layer's two GEMVs, the two ways alternating round by round; the median ms a
layer, and the bytes a layer reads over it.

Masks (`--model`, `--bundle`: a real model and its trained predictors): the layer inputs (or FFN
inputs, the bundle's predictor input) that the model computes over `--tokens` held-out tokens of
the bundle's corpus, through both ways, in 64-row calls: the share of neuron decisions alike, and
the share of neurons each picks. Then `--decode` greedy tokens of the sparse model (the bundle's
predictors choosing its neurons, the defaults otherwise) from a few prompts, loaded each way:
the tokens alike.

Token (`--token-model`, `--token-bundle`): the sparse model loaded twice in one process, its
predictors held each way, decoding 32 greedy tokens after a prompt in alternating turns: the
decode tok/s of each (the median of the turns) and their ratio, so that the memory's state,
which moves between processes on some VMs, is the same for both.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from powerinfer import kernels
from powerinfer.model import predictor as P

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "Explain how a CPU cache works.", "List three uses of copper."]


def speed(dim: int, ffn: int, rank: int, layers: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    fc1 = [(torch.randn(rank, dim, generator=g) / dim ** 0.5).bfloat16() for _ in range(layers)]
    fc2 = [(torch.randn(ffn, rank, generator=g) / rank ** 0.5).bfloat16() for _ in range(layers)]
    ways = {"bf16 rows": [(a, b, "bf16") for a, b in zip(fc1, fc2)]}
    ways["q8x16"] = [(kernels.pack_q8x16(kernels.quantize_rows(a, "q8_0")),
                      kernels.pack_q8x16(kernels.quantize_rows(b, "q8_0")), "q8x16")
                     for a, b in zip(fc1, fc2)]
    x = torch.randn(1, dim, generator=g).bfloat16()
    times = {k: [] for k in ways}
    for _ in range(rounds):
        for k, mats in ways.items():
            t0 = time.perf_counter()
            for a, b, fmt in mats:
                kernels.pred_logits(x, a, b, fmt)
            times[k].append((time.perf_counter() - t0) / layers)
    out = {}
    for k, mats in ways.items():
        t = statistics.median(times[k][2:])
        nbytes = mats[0][0].nbytes + mats[0][1].nbytes
        out[k] = dict(ms=t * 1e3, mb=nbytes / 1e6, gbs=nbytes / t / 1e9)
    return out


def masks(model: str, bundle: str, tokens: int, decode: int) -> dict:
    from powerinfer import Config, PowerInfer
    from powerinfer.formats.bundle import Bundle
    from powerinfer.sparsity.corpus import load_corpus

    b = Bundle.open(bundle)
    source = "layer" if (b.path / "predictors.layer.safetensors").exists() else "ffn"
    P.ROWS = "q8x16"
    preds = P.load_predictors(b, source, torch.bfloat16)
    assert preds.held_x16, "these predictors' shapes do not take q8x16 groups"
    dense = PowerInfer.from_pretrained(model, config=Config(dtype="bfloat16"))
    m = dense.model
    corpus = load_corpus(b.manifest.corpus["name"], "held_out")
    ids = dense.tokenize("\n\n".join(corpus.documents))[:tokens]
    got = {i: [] for i in range(len(m.layers))}
    hooks = []
    for i, blk in enumerate(m.layers):  # the predictor's input: the block's, or the FFN's residual
        if source == "layer":
            hooks.append(blk.register_forward_pre_hook(lambda mod, a, i=i: got[i].append(a[0])))
        else:
            hooks.append(blk.ffn_norm.register_forward_pre_hook(lambda mod, a, i=i: got[i].append(a[0])))
    m.setup_cache(1, len(ids) + 1)
    with torch.inference_mode():
        for s in range(0, len(ids), 256):
            chunk = ids[s:s + 256]
            m(torch.tensor([chunk]), torch.arange(s, s + len(chunk))[None])
    for h in hooks:
        h.remove()
    same = picked_bf16 = picked_q8 = total = 0
    with torch.inference_mode():
        for i, xs in got.items():
            x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).bfloat16()
            w1, w2 = preds.fc1[i], preds.fc2[i]
            q1, q2, _ = preds.kernel_rows(i)
            for r in range(0, x.shape[0], kernels.MAX_ROWS):
                rows = x[r:r + kernels.MAX_ROWS].contiguous()
                a = kernels.pred_logits(rows, w1, w2, "bf16") >= preds.threshold
                q = kernels.pred_logits(rows, q1, q2, "q8x16") >= preds.threshold
                same += int((a == q).sum())
                picked_bf16 += int(a.sum())
                picked_q8 += int(q.sum())
                total += a.numel()
    out = dict(source=source, rows=len(ids), decisions=total, alike=same / total,
               picked_bf16=picked_bf16 / total, picked_q8x16=picked_q8 / total)
    if decode:
        def tokens(pi):
            return [[ev.token for ev in pi._run([pi._ids(p)], decode, dict(temperature=0.0, ignore_eos=True))]
                    for p in PROMPTS]

        def compare(a, b):  # tokens alike, and each prompt's first position that differs
            return (sum(sum(x == y for x, y in zip(u, v)) for u, v in zip(a, b)),
                    [next((j for j, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a, b)])

        runs = {"dense": tokens(dense)}
        for rows in ("model", "q8x16"):
            P.ROWS = rows
            sp = PowerInfer.from_pretrained(model, config=Config(dtype="bfloat16", bundle=bundle,
                                                                 predictor=source))
            runs[rows] = tokens(sp)
            del sp
        out.update(decode_tokens=decode * len(PROMPTS))
        for name, (x, y) in {"q8x16_vs_bf16_rows": ("model", "q8x16"),
                             "bf16_rows_vs_dense": ("dense", "model"),
                             "q8x16_vs_dense": ("dense", "q8x16")}.items():
            alike, first = compare(runs[x], runs[y])
            out[name] = dict(alike=alike, first_difference=first)
    del dense
    return out


def token(model: str, bundle: str, turns: int, n: int = 32) -> dict:
    from powerinfer import Config, PowerInfer
    runs = {}
    for rows in ("model", "q8x16"):
        P.ROWS = rows
        runs[rows] = PowerInfer.from_pretrained(model, config=Config(bundle=bundle, predictor="ffn"))
    prompt = PROMPTS[2]
    rates = {k: [] for k in runs}
    for t in range(turns + 1):
        for k, pi in runs.items():
            stamps = [time.perf_counter() for _ in pi._run([pi._ids(prompt)], n,
                                                             dict(temperature=0.0, ignore_eos=True))]
            if t:  # (the first turn warms up)
                rates[k].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    out = {k: dict(tok_s=statistics.median(v), turns=v) for k, v in rates.items()}
    out["ratio"] = out["q8x16"]["tok_s"] / out["model"]["tok_s"]
    out["each_turn"] = [q / m for q, m in zip(rates["q8x16"], rates["model"])]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--model")
    ap.add_argument("--bundle")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--token-model")
    ap.add_argument("--token-bundle")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--json")
    a = ap.parse_args()
    assert kernels.available(), "the CPU kernel cannot run here"
    res = {"isa": kernels.isa(), "threads": torch.get_num_threads()}
    res["speed"] = s = speed(a.dim, a.ffn, a.rank, a.layers, a.rounds)
    print(f"kernel {res['isa']}, {res['threads']} threads; {a.layers} layers of {a.dim} -> {a.rank} -> "
          f"{a.ffn}, one bf16 row, {a.rounds} rounds in turns (median)\n")
    print("| predictor held as | MB a layer | ms a layer | GB/s |")
    print("|---|---:|---:|---:|")
    for k, v in s.items():
        print(f"| {k} | {v['mb']:.2f} | {v['ms']:.4f} | {v['gbs']:.1f} |")
    print(f"\nq8x16 / bf16 rows: {s['q8x16']['ms'] / s['bf16 rows']['ms']:.2f}x the time")
    if a.model and a.bundle:
        res["masks"] = r = masks(a.model, a.bundle, a.tokens, a.decode)
        print(f"\n{a.model} with {a.bundle} ({r['source']} predictors), {r['rows']} held-out rows: "
              f"{r['alike']:.3%} of {r['decisions']:,} neuron decisions alike; picked "
              f"{r['picked_bf16']:.2%} (bf16 rows) and {r['picked_q8x16']:.2%} (q8x16)")
        if "decode_tokens" in r:
            print(f"greedy decode, {len(PROMPTS)} prompts x {a.decode} tokens (the sparse model with "
                  "either rows, and the dense model):")
            for name in ("q8x16_vs_bf16_rows", "bf16_rows_vs_dense", "q8x16_vs_dense"):
                print(f"  {name.replace('_', ' ')}: {r[name]['alike']} of {r['decode_tokens']} tokens "
                      f"alike, first difference at {r[name]['first_difference']}")
    if a.token_model and a.token_bundle:
        res["token"] = r = token(a.token_model, a.token_bundle, a.turns)
        print(f"\n{a.token_model} sparse ({a.token_bundle}), 32 greedy tokens, {a.turns} turns: "
              f"bf16 rows {r['model']['tok_s']:.1f} tok/s, q8x16 {r['q8x16']['tok_s']:.1f} tok/s: "
              f"{r['ratio']:.3f}x (turns {', '.join(f'{x:.3f}' for x in r['each_turn'])})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
