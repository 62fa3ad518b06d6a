#!/usr/bin/env python3
"""What structured output costs a token: the in-process engine and the actor runtime (default
configuration) decoding free text and JSON-schema-constrained text in the same run, at batch 1
and 8, on SmolLM2 (49k vocabulary) and Gemma 3 270M (262k: a mask is 5x wider).

    .venv/bin/python benchmarks/structured.py [--models smollm2-135m-instruct gemma3-270m]
        [--runtimes local actors] [--batches 1 8] [--tokens 48] [--runs 3]

Per configuration: decode tok/s from the first token on (greedy, every row of the batch alike),
and in-process, inside the same runs, the time of the grammar work alone per decode step:
`grammar.masks` (the batch's masks in one parallel llguidance call), `grammar.apply` (-inf
written into the forbidden logits) and the matchers' token consumption. Constrained rows follow a schema of an object
with an array of up to 64 strings, long enough that no row finishes before --tokens.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from powerinfer import Config, PowerInfer
from powerinfer.engine import batching, grammar

SCHEMA = {"type": "object", "required": ["title", "items"], "additionalProperties": False,
          "properties": {"title": {"type": "string", "maxLength": 40},
                         "items": {"type": "array", "minItems": 64, "maxItems": 64,
                                   "items": {"type": "string", "maxLength": 30}}}}
ASK = [{"role": "user", "content": "List sixty-four fruits as JSON with a title and items."}]


class Timer:
    """Seconds spent in the grammar's code during an in-process run."""

    def __init__(self):
        self.masks = self.apply = self.consume = 0.0
        self._masks, self._apply, self._push = grammar.masks, grammar.apply, batching.Sequence.push

    def __enter__(self):
        timer = self

        def timed(fn, field):
            def run(*a):
                t0 = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    setattr(timer, field, getattr(timer, field) + time.perf_counter() - t0)
            return run

        class Timed:
            """The sequence's matcher while push() runs, its token consumption timed."""

            def __init__(self, m):
                self.m = m

            def consume_token(self, token):
                t0 = time.perf_counter()
                try:
                    return self.m.consume_token(token)
                finally:
                    timer.consume += time.perf_counter() - t0

            def __getattr__(self, name):
                return getattr(self.m, name)

        def push(seq, token):
            m = seq.matcher
            if m is None:
                return timer._push(seq, token)
            seq.matcher = Timed(m)  # only while push() runs: masks() needs the matcher itself
            try:
                return timer._push(seq, token)
            finally:
                seq.matcher = m

        grammar.masks, grammar.apply = timed(self._masks, "masks"), timed(self._apply, "apply")
        batching.Sequence.push = push
        return self

    def __exit__(self, *exc):
        grammar.masks, grammar.apply, batching.Sequence.push = self._masks, self._apply, self._push


def run(pi: PowerInfer, batch: int, tokens: int, g: grammar.Grammar | None) -> dict:
    ids = pi._ids(ASK)
    sampling = dict(temperature=0, ignore_eos=True, grammar=g)
    list(pi._run([ids], 1, dict(temperature=0)))  # the prompt's prefix is cached for every run
    produced, first = 0, None
    lengths = [0] * batch
    with Timer() as t:
        for ev in pi._run([ids] * batch, tokens, sampling):
            if first is None:
                first = time.perf_counter()  # decode starts after the prefill's first token
            produced += ev.token >= 0
            lengths[ev.index] += ev.token >= 0
        took = time.perf_counter() - first
    steps = max(1, produced // batch - 1)
    ms = lambda x: x / steps * 1e3  # noqa: E731
    return {"tok_s": (produced - batch) / took, "masks_ms": ms(t.masks), "apply_ms": ms(t.apply),
            "consume_ms": ms(t.consume), "step_ms": took / steps * 1e3,
            "finished_early": sum(n < tokens for n in lengths)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--runtimes", nargs="+", default=["local", "actors"],
                    help="the in-process engine, and the actor runtime the server uses (there "
                         "the scheduler computes a step's masks while the executors run it)")
    a = ap.parse_args()
    print(f"# {datetime.date.today()}  {platform.processor() or platform.machine()}  "
          f"torch threads {torch.get_num_threads()}")
    print("| model | runtime | batch | free tok/s | constrained tok/s | ratio | grammar ms/step "
          "(masks + apply + consume) | step ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    g = grammar.Grammar.json_schema(SCHEMA)
    for name in a.models:
        for runtime in a.runtimes:
            pi = PowerInfer.from_pretrained(name, Config(max_batch=max(a.batches), runtime=runtime))
            for b in a.batches:
                free = [run(pi, b, a.tokens, None) for _ in range(a.runs)]
                held = [run(pi, b, a.tokens, g) for _ in range(a.runs)]
                med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
                early = max(r["finished_early"] for r in held)
                work = (f"{med(held, 'masks_ms'):.2f} + {med(held, 'apply_ms'):.2f} + "
                        f"{med(held, 'consume_ms'):.2f}" if runtime == "local" else
                        "in the scheduler, not timed here")
                print(f"| {name} | {runtime} | {b} | {med(free, 'tok_s'):.1f} | "
                      f"{med(held, 'tok_s'):.1f} | {med(held, 'tok_s') / med(free, 'tok_s'):.2f} | "
                      f"{work} | {med(held, 'step_ms'):.1f} |"
                      + (f" ({early} rows ended early)" if early else ""), flush=True)
            pi.close()


if __name__ == "__main__":
    main()
