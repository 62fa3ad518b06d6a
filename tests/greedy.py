"""Comparing greedy decodes of two implementations that sum in different orders: tokens agree
until a near-tie, judged on the logits the reference chose from."""
import torch

from powerinfer import PowerInfer


# The near-tie tolerance for an actor group that splits a layer's neurons and heads over
# several executors, against the in-process engine, with the 4-bit kernel's 8-bit activations
# (the int4 weights' default, bf16 or float32): each executor sums its share, and a last-bit
# difference in a layer's input moves some values to another 8-bit step, which the next layers
# carry on. Measured on SmolLM2 (benchmarks/logit_spread.py --cores 0,1: a hot and a cold
# executor on two cores, 24 prompts of 24 tokens): a step's log-probabilities 0.16-0.18 apart
# (median), 0.52-0.62 (99th percentile), 1.0 at most; 14 of 24 prompts parted, where the
# in-process engine's own two choices lay up to 0.43 (float32) and 0.5 (bf16) apart. A parting
# on a clear choice (a head or a share lost: several logits) still fails. A group on one core
# (its hot executor holds every neuron and head) computes the in-process floats: 1e-3 there.
SPLIT_8BIT_TOL = 1.0


def greedy_tokens(m: PowerInfer, prompt: str, n: int) -> list[int]:
    """The n token ids m decodes greedily after `prompt` (either runtime)."""
    return greedy_ids(m, m.tokenize(prompt), n)


def greedy_ids(m: PowerInfer, ids: list[int], n: int) -> list[int]:
    """The n token ids m decodes greedily after the token ids `ids` (either runtime)."""
    events = m._run([ids], n, dict(temperature=0, ignore_eos=True))
    return [ev.token for ev in events if ev.token >= 0]


def last_logits(m: PowerInfer, ids: list[int]) -> torch.Tensor:
    """The model's logits (V,) after `ids`, from a fresh prefill."""
    return m.engine.logits(ids)


def chosen_logits(m: PowerInfer, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]] | None:
    """The logits (n, V) an in-process engine chose its first n greedy tokens after `ids` from,
    and those tokens: its prefill's for the first, its decode steps' after (a sparse engine's
    prefill computes every neuron, its decode steps the predicted ones); None for the actor
    runtime."""
    eng = m.engine
    if m.model is None or not hasattr(eng, "_step"):
        return None
    rows, step, own = [], eng._step, eng.__dict__.get("_step")

    def record(part):
        out = step(part)
        rows.append(out)
        return out

    eng._step = record  # this instance only
    try:
        tokens = greedy_ids(m, ids, n)
    finally:
        if own is None:
            del eng._step
        else:
            eng._step = own
    logits = torch.cat(rows)
    assert len(logits) == n and logits.argmax(-1).tolist() == tokens, "not the greedy choices"
    return logits, tokens


def assert_same_or_near_tie(ref: PowerInfer, prompt: list[int], want: list[int], got: list[int],
                            tol: float):
    """Greedy tokens agree up to the first difference, and there the reference's logits hold the
    two choices within `tol` of each other: a near-tie that rounding may flip on another CPU.
    The logits are those the reference chose that token from (a sparse engine's decode step, not
    a fresh prefill, which computes every neuron); where they cannot be had (the reference is
    the actor runtime), a fresh prefill's."""
    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if k is None:
        return
    chosen = chosen_logits(ref, prompt, k + 1)
    if chosen is None:
        logits = last_logits(ref, prompt + want[:k])
    else:
        assert chosen[1] == want[:k + 1], "the reference decodes otherwise on a second run"
        logits = chosen[0][k]
    margin = float(logits[want[k]] - logits[got[k]])
    assert margin <= tol, f"token {k}: {want[k]} against {got[k]}, margin {margin:.4f} > {tol}"


def assert_same_until_a_close_call(want: list[dict], got: list[dict], tol: float):
    """Two runs' token events (with logprobs) agree token for token until a close call: where
    they part, each run's own distribution gives both tokens log-probabilities within `tol` of
    the other run's (the runs saw the same distribution, up to rounding, and a greedy pick or a
    seeded draw fell the other way). Each run's events must carry the two tokens among their
    top_logprobs there."""
    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a["token"] != b["token"]), None)
    if k is None:
        assert len(got) == len(want), (len(got), len(want))
        return
    a, b = want[k], got[k]
    lp_a, lp_b = dict(a["top_logprobs"]), dict(b["top_logprobs"])
    for t in (a["token"], b["token"]):
        assert t in lp_a and t in lp_b, f"token {k}: {t} is not among both runs' most likely"
        assert abs(lp_a[t] - lp_b[t]) <= tol, f"token {k}: {t} at {lp_a[t]:.4f} and {lp_b[t]:.4f}"
