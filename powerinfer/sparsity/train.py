"""Training the activation predictors: per layer a low-rank MLP that guesses which FFN neurons
will fire (run by `model.predictor`).

    logits = fc2 @ relu(fc1 @ x)      x: (dim,) the raw pre-norm residual
    active = logits >= 0              fc1: (r, dim), fc2: (ffn_dim, r)

This is PowerInfer's run-time rule (no bias, no sigmoid), so the weights export to its GGUF
layout as they are. x is the residual entering the FFN (input "ffn") or the layer input (input
"layer": Deja Vu's lookahead, which lets the mask be computed while attention runs).

Training, per layer (`powerinfer train-predictors`): weighted binary cross-entropy and AdamW, as
in Deja Vu, adapted to bundles, which hold thousands of samples per layer rather than hundreds
of thousands, and to a rule with no threshold to lower after training:
- the weight of the positives starts at Deja Vu's (1 - p) / p (p the layer's firing rate) and is
  steered after every epoch until recall by activation mass on the held-out rows sits at the
  target; the loss's balance is the only knob that moves the exported operating point;
- smaller batches and a larger, cosine-decayed learning rate;
- inputs are divided by one per-layer constant (the median RMS of the training rows; raw
  residuals grow with depth), folded into fc1 afterwards.
The last `held_out` rows of each layer's samples are never trained on: they steer the weight,
choose the epoch kept and give the reported metrics. Ranks are tried in increasing order and the
predictor kept is the one reaching the recall target at the least work per token (its own plus
the FFN rows it leaves active). A layer no rank brings to the target is kept at its best and
flagged (`reached` false).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import named_device
from ..errors import ConfigError
from ..formats.bundle import Bundle, BundleError
from ..model.predictor import INPUTS, predict

RECALL_TARGET = 0.99  # share of the held-out activation mass the predicted neurons must cover


EPOCHS = 10  # an upper bound: training stops earlier once the held-out metrics stop improving


PATIENCE = 3  # epochs without improvement before stopping


LR, WEIGHT_DECAY, BATCH = 1e-2, 0.01, 256  # lr decays to 0 over `epochs` (cosine)


POS_WEIGHT_RANGE = (0.1, 1000.0)  # bounds of the steered weight of the positives


STEER = 1.5  # per epoch, the positives' weight grows (shrinks) by up to this factor


FLAT = 0.75  # rank search gives up when a rank left this share of the previous rank's recall gap


def default_ranks(dim: int, ffn_dim: int) -> list[int]:
    """Five powers of two ending at the largest one <= min(dim, ffn_dim): 32..512 for 576/1536."""
    top = 1 << (min(dim, ffn_dim).bit_length() - 1)
    return sorted({max(top >> k, 1) for k in range(5)})


def layer_metrics(pred: torch.Tensor, fired: torch.Tensor, mag: torch.Tensor) -> dict:
    """Held-out quality of a mask. pred, fired: (H, ffn_dim) bool; mag: (H, ffn_dim) |activation|.

    recall_count: predicted and fired / fired; recall_mass: the same weighted by |activation|;
    precision: predicted and fired / predicted; active_share: predicted / all (the share of
    neurons the engine will compute); positive_rate: fired / all (what an oracle would compute).
    """
    tp = pred & fired
    mag = mag.double()
    n_fired, n_pred = int(fired.sum()), int(pred.sum())
    fired_mass = float((mag * fired).sum())
    return {"recall_count": int(tp.sum()) / max(n_fired, 1),
            "recall_mass": float((mag * tp).sum()) / fired_mass if fired_mass > 0 else 1.0,
            "precision": int(tp.sum()) / max(n_pred, 1),
            "active_share": n_pred / pred.numel(),
            "positive_rate": n_fired / fired.numel()}


def train_layer(x, fired, mag, rank: int, *, epochs: int = EPOCHS, lr: float = LR,
                weight_decay: float = WEIGHT_DECAY, batch: int = BATCH,
                pos_weight: float | None = None, recall_target: float = RECALL_TARGET,
                patience: int = PATIENCE, seed: int = 0,
                on_epoch: Callable[[int, dict], None] | None = None,
                device: str | torch.device = "cpu"):
    """Train one layer's predictor; returns (fc1 (rank, dim), fc2 (ffn_dim, rank), metrics).

    x: (N, dim) inputs; fired: (N, ffn_dim) bool labels; mag: (H, ffn_dim) |activation| of the
    last H rows, which are held out. After every epoch the predictor is scored on the held-out
    rows; the epoch kept is the one with the lowest active share among those reaching
    `recall_target` by mass, or, if none does, the one with the highest recall by mass; training
    stops after `patience` epochs without a better one. pos_weight: the weight of the positives
    in the loss; None starts at (1 - p) / p (p the training rows' firing rate) and steers it
    after every epoch towards just above the recall target (multiplied by up to STEER while
    recall by mass is short of it, divided by up to STEER while above it). The metrics (see
    `layer_metrics`, plus the `epochs` run and the `pos_weight` the kept weights were trained
    with) are those of the returned weights on the raw held-out rows. device: where the steps
    run (a GPU's are some ten times a 16-core host's; the initial weights, the batches' order and
    so the epochs' sequence are drawn on the CPU either way, the sums differ in rounding).
    """
    device = torch.device(device)
    x = torch.as_tensor(np.asarray(x), dtype=torch.float32).to(device)
    fired = torch.as_tensor(np.asarray(fired), dtype=torch.bool).to(device)
    mag = torch.as_tensor(np.asarray(mag), dtype=torch.float32).to(device)
    (N, dim), (H, ffn_dim) = x.shape, mag.shape
    n_train = N - H
    assert 0 < H < N and fired.shape == (N, ffn_dim), (x.shape, fired.shape, mag.shape)
    # one constant per layer, folded into fc1 at the end (a per-row scale would not fold)
    scale = x[:n_train].pow(2).mean(1).sqrt().median().clamp_min(1e-12)
    xs = x / scale
    xt, yt, xv, yv = xs[:n_train], fired[:n_train], xs[n_train:], fired[n_train:]
    steer = pos_weight is None
    if steer:
        p = float(yt.float().mean())
        pos_weight = min(max((1 - p) / max(p, 1e-9), POS_WEIGHT_RANGE[0]), POS_WEIGHT_RANGE[1])
    g = torch.Generator().manual_seed(seed)
    # nn.Linear's default initialisation, drawn from our generator
    fc1 = ((torch.rand(rank, dim, generator=g) * 2 - 1) * dim ** -0.5).to(device).requires_grad_()
    fc2 = ((torch.rand(ffn_dim, rank, generator=g) * 2 - 1) * rank ** -0.5).to(device).requires_grad_()
    opt = torch.optim.AdamW([fc1, fc2], lr=lr, weight_decay=weight_decay, fused=True)
    steps = epochs * -(-n_train // batch)  # cosine decay to 0 over all epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt,
                                              lambda s: (1 + math.cos(math.pi * s / steps)) / 2)
    pw = torch.tensor(float(pos_weight), device=device)

    def score(m):  # reaching the target first, then fewer active neurons, else more recall
        reached = m["recall_mass"] >= recall_target
        return (reached, -m["active_share"] if reached else m["recall_mass"])

    best, since, epoch = None, 0, 0
    for epoch in range(1, epochs + 1):
        for idx in torch.randperm(n_train, generator=g).to(device).split(batch):
            logits = F.relu(xt[idx] @ fc1.T) @ fc2.T
            loss = F.binary_cross_entropy_with_logits(logits, yt[idx].float(), pos_weight=pw)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        with torch.no_grad():
            m = {**layer_metrics(predict(fc1, fc2, xv), yv, mag), "pos_weight": float(pw)}
        if steer:  # the exported rule has no threshold to lower: move the loss's balance instead
            gap = max(1 - recall_target, 1e-3)  # aim a tenth of it above the target
            miss = (recall_target + 0.1 * gap - m["recall_mass"]) / gap
            pw.mul_(STEER ** min(max(miss, -1.0), 1.0)).clamp_(*POS_WEIGHT_RANGE)
        if on_epoch is not None:
            on_epoch(epoch, m)
        if best is None or score(m) > score(best[2]):
            best, since = (fc1.detach().clone(), fc2.detach().clone(), m), 0
        else:
            since += 1
            if since >= patience:
                break
    fc1, fc2 = best[0] / scale, best[1]
    metrics = layer_metrics(predict(fc1, fc2, x[n_train:]), yv, mag)  # the exported form, raw x
    return fc1.cpu().numpy(), fc2.cpu().numpy(), {**metrics, "epochs": epoch,
                                      "pos_weight": round(best[2]["pos_weight"], 4)}


def search_rank(x, fired, mag, ranks: list[int], *, recall_target: float = RECALL_TARGET,
                neuron_macs: int | None = None,
                on_epoch: Callable[[int, int, dict], None] | None = None, **train_kw):
    """Try `ranks` in increasing order and keep, among the predictors reaching `recall_target` by
    mass, the cheapest per token: its own weights (rank * (dim + ffn_dim) multiply-adds) plus the
    FFN work it leaves (active share * ffn_dim * neuron_macs; default 3 * dim, a gate, an up and a
    down row per neuron; 0 keeps the first rank reaching the target). Stops once the cost rose or
    a larger rank's weights alone would cost more than the best. If no rank reaches the target,
    keeps the highest recall by mass, giving up when a rank closed less than 1 - FLAT of the
    previous rank's gap to the target. Returns (fc1, fc2, metrics) with `rank`, `reached` and
    `cost` added to the metrics; on_epoch(rank, epoch, metrics) reports progress; train_kw go to
    `train_layer`."""
    dim, ffn_dim = np.shape(x)[1], np.shape(mag)[1]
    neuron_macs = 3 * dim if neuron_macs is None else neuron_macs
    best = prev = None
    for r in sorted(ranks):
        if best is not None and best[2]["reached"] and r * (dim + ffn_dim) >= best[2]["cost"]:
            break
        cb = None if on_epoch is None else (lambda e, m, r=r: on_epoch(r, e, m))
        fc1, fc2, m = train_layer(x, fired, mag, r, recall_target=recall_target, on_epoch=cb,
                                  **train_kw)
        m = {"rank": r, **m, "reached": m["recall_mass"] >= recall_target,
             "cost": r * (dim + ffn_dim) + round(m["active_share"] * ffn_dim * neuron_macs)}
        if best is None or _better(m, best[2]):
            best = fc1, fc2, m
        elif best[2]["reached"]:
            break  # the cost rose
        if not m["reached"] and prev is not None and (
                recall_target - m["recall_mass"] > FLAT * (recall_target - prev["recall_mass"])):
            break  # recall is flat in the rank: no larger one will reach the target
        prev = m
    return best


def _better(m: dict, old: dict) -> bool:
    if m["reached"] != old["reached"]:
        return m["reached"]
    return m["cost"] < old["cost"] if m["reached"] else m["recall_mass"] > old["recall_mass"]


def layer_samples(bundle: Bundle, layer: int, input: str, max_samples: int | None = None):
    """Layer `layer`'s samples as (x (N, dim) f16, fired (N, ffn_dim) bool, mag (H, ffn_dim) f16);
    max_samples caps the training rows (an evenly spaced subset), the held-out rows are all kept.
    Raises BundleError when the samples do not fit the bundle's model."""
    s = bundle.samples(layer)
    held_out = int(bundle.manifest.settings["samples"]["held_out"])
    dim, ffn_dim = int(bundle.manifest.model["dim"]), int(bundle.manifest.model["ffn_dim"])
    name = f"samples/layer_{layer:03d}.safetensors"
    missing = {f"x_{input}", "fired", "mag"} - set(s)
    if missing:
        raise BundleError(bundle.path, f"{name} lacks {', '.join(sorted(missing))}")
    x, packed, mag = s[f"x_{input}"], s["fired"], s["mag"]
    N = x.shape[0]
    if (x.shape != (N, dim) or packed.shape != (N, (ffn_dim + 7) // 8)
            or mag.shape != (held_out, ffn_dim) or not 0 < held_out < N):
        raise BundleError(bundle.path, f"{name} has x_{input} {x.shape}, fired {packed.shape}, "
                                       f"mag {mag.shape}; expected ({N}, {dim}), "
                                       f"({N}, {(ffn_dim + 7) // 8}), ({held_out}, {ffn_dim}) "
                                       f"with fewer than {N} held out")
    fired = np.unpackbits(packed, axis=1, count=ffn_dim).astype(bool)
    n_train = N - held_out
    if max_samples is not None and max_samples < n_train:
        keep = np.r_[np.linspace(0, n_train - 1, max_samples).round().astype(int),
                     np.arange(n_train, N)]
        x, fired = x[keep], fired[keep]
    return x, fired, mag


def train_predictors(bundle: Bundle, input: str = "ffn", recall_target: float = RECALL_TARGET,
                     ranks: list[int] | None = None, epochs: int = EPOCHS,
                     max_samples: int | None = None, progress: bool = True,
                     device: str = "auto", **train_kw) -> list[dict]:
    """Train every layer's predictor from the bundle's samples, write
    predictors.{input}.safetensors (fc1.{i} (r_i, dim), fc2.{i} (ffn_dim, r_i), f32) and
    predictors.{input}.json (one row per layer: layer, rank, recall_count, recall_mass,
    precision, active_share, positive_rate, reached, seconds, epochs, pos_weight, cost), mark
    the part `predictors.{input}` and return the rows. Needs the "samples" part (BundleError
    otherwise). ranks default to `default_ranks`; device: where the steps run ("auto": a GPU
    where torch sees one, else the CPU); train_kw go to `train_layer` (lr, batch,
    pos_weight...)."""
    if input not in INPUTS:
        raise ValueError(f"predictor input {input!r}: one of {', '.join(INPUTS)}")
    bundle.require("samples", "profile")
    dim, ffn_dim = int(bundle.manifest.model["dim"]), int(bundle.manifest.model["ffn_dim"])
    gated = bundle.manifest.model.get("ffn_act", "swiglu") != "relu"
    ranks = sorted(ranks or default_ranks(dim, ffn_dim))
    if ranks[0] < 1 or ranks[-1] > min(dim, ffn_dim):  # (a rank past both took hours to train
        # a predictor larger than the layer it predicts)
        raise ConfigError(f"predictor ranks must be in 1..{min(dim, ffn_dim)} (the smaller of "
                          f"the model's width and FFN width), got {ranks}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    named_device(device, "predictors train")
    tensors, rows = {}, []
    bar = tqdm(range(bundle.n_layers), desc=f"predictors ({input} input, {device})",
               unit="layer", disable=not progress)
    for i in bar:
        x, fired, mag = layer_samples(bundle, i, input, max_samples)
        t0 = time.perf_counter()
        fc1, fc2, m = search_rank(
            x, fired, mag, ranks, recall_target=recall_target, epochs=epochs,
            neuron_macs=(3 if gated else 2) * dim,
            on_epoch=lambda r, e, m: bar.set_postfix(rank=r, epoch=e,
                                                     recall=f"{m['recall_mass']:.4f}"),
            device=device, **train_kw)
        rows.append({"layer": i, **m, "seconds": round(time.perf_counter() - t0, 2)})
        tensors[f"fc1.{i}"], tensors[f"fc2.{i}"] = fc1, fc2
    bundle.save_tensors(f"predictors.{input}.safetensors", tensors)
    bundle.save_json(f"predictors.{input}.json", rows)
    bundle.mark(f"predictors.{input}", {
        "input": input, "recall_target": recall_target, "ranks": ranks, "epochs": epochs,
        "max_samples": max_samples, "lr": LR, "batch": BATCH, "weight_decay": WEIGHT_DECAY,
        "device": str(device), **train_kw})
    return rows


def format_table(rows: list[dict]) -> str:
    """The per-layer rows of `train_predictors` as a printable table with a summary line."""
    head = (f"{'layer':>5} {'rank':>5} {'recall':>7} {'by mass':>8} {'precision':>9} "
            f"{'active':>7} {'fired':>7} {'epochs':>6} {'seconds':>8}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['layer']:>5} {r['rank']:>5} {r['recall_count']:>7.2%} "
                     f"{r['recall_mass']:>8.2%} {r['precision']:>9.2%} {r['active_share']:>7.2%} "
                     f"{r['positive_rate']:>7.2%} {r['epochs']:>6} {r['seconds']:>8.1f}"
                     + ("" if r["reached"] else "  below target"))
    if rows:
        missed = [r["layer"] for r in rows if not r["reached"]]
        lines.append(f"mean active share {np.mean([r['active_share'] for r in rows]):.2%} "
                     f"(oracle {np.mean([r['positive_rate'] for r in rows]):.2%}), "
                     f"mean recall by mass {np.mean([r['recall_mass'] for r in rows]):.2%}, "
                     f"{sum(r['seconds'] for r in rows):.0f} s; "
                     + (f"below target: layers {', '.join(map(str, missed))}" if missed
                        else "every layer reached the target"))
    return "\n".join(lines)
