"""What a runtime needs from a sparsity bundle: per-layer thresholds, the hot/cold placement,
the predictors and the input they read. Both runtimes (in-process and actors) build from it, so
they compute with the same masks.

Without a bundle every neuron is active: the FFN is exact, split between the hot side and the
cold executors.

A plan is made, checked and dealt out without torch (numpy and the bundle's files): the process
that starts an actor group (a served model's replica) never imports it. Only the methods that
build a process's tensors (masks, shards, predictors, the in-process model) do.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError
from ..formats.args import ModelArgs
from ..formats.bundle import Bundle, BundleError

if TYPE_CHECKING:
    import torch

    from ..model.transformer import Transformer

log = logging.getLogger("powerinfer")

BLOCK = 32  # weights in a GGUF block: a dense split cuts neurons at whole blocks of down's rows


@dataclass
class SparsePlan:
    n_layers: int
    ffn_dim: int
    thresholds: list[float]
    hot: list[np.ndarray] | None  # per layer (ffn_dim,) bool from the solver; None: not solved
    mass: list[np.ndarray] | None  # per layer activation mass from the profile (shard balance)
    bundle: Path | None = None
    predictor_input: str | None = None  # "layer" (lookahead), "ffn" (same layer); None: all active
    block: int = BLOCK  # a dense split's cuts, in neurons (256: whole K-quant super-blocks of down)
    active_share: float | None = None  # the predictors' average share of a layer's neurons, held out
    # input sparsity (`input_thresholds`): each input's threshold ((layer, part) -> magnitude),
    # the smallest projection (output rows) that skips channels, the bundle's target share and
    # whether each size is timed sparse against dense at load (`input_sparsity.attach`, which
    # takes the four in this order); None: off
    inputs: tuple[dict, int, float | None, bool] | None = None

    @classmethod
    def dense(cls, args: ModelArgs, block: int = BLOCK) -> "SparsePlan":
        """Every neuron computed at every step, split at multiples of `block` neurons."""
        return cls(args.n_layers, args.ffn_dim, [0.0] * args.n_layers, None, None, block=block)

    @classmethod
    def layer_offload(cls, args: ModelArgs, k: int) -> "SparsePlan":
        """The first k FFN layers hot (all their neurons), the others cold; no predictor."""
        hot = [np.full(args.ffn_dim, i < k) for i in range(args.n_layers)]
        return cls(args.n_layers, args.ffn_dim, [0.0] * args.n_layers, hot, None)

    @classmethod
    def from_bundle(cls, path: str | Path, args: ModelArgs, model_path: Path,
                    predictor: str = "auto", max_ppl_increase: float = 0.02) -> "SparsePlan":
        """predictor: "layer", "ffn", or "auto" (lookahead when trained, else same layer);
        max_ppl_increase: the held-out perplexity over dense above which loading warns."""
        b = Bundle.open(path)
        b.check_model(model_path)
        predictor = b.predictor_input(predictor)
        b.require(f"predictors.{predictor}", "train-predictors")
        check_quality(b, predictor, max_ppl_increase)
        share = check_share(b, predictor)[1]
        th = [float(t) for t in b.thresholds()]
        hot = b.placement() if b.has("placement") else None
        mass = b.stats()[1] if b.has("stats") else None
        return cls(args.n_layers, args.ffn_dim, th, hot, mass, Path(path), predictor, active_share=share)

    def load_predictors(self, dtype: torch.dtype | None = None, device="cpu"):
        import torch

        from ..model.predictor import load_predictors
        if self.predictor_input is None:
            raise BundleError(self.bundle or "-", "no predictors in a dense plan")
        return load_predictors(Bundle.open(self.bundle), self.predictor_input,
                               torch.float32 if dtype is None else dtype, device)

    def hot_mask(self, layer: int, share: float) -> torch.Tensor:
        """Layer's (ffn_dim,) bool hot set: the solver's placement (or a CPU group's, `dealt`),
        or else the `share` of the neurons with the most activation mass, or without a profile
        the first `share` of them in whole blocks."""
        import torch
        if self.hot is not None:
            return torch.from_numpy(self.hot[layer].copy())
        order = self.by_mass(layer)
        out = torch.zeros(self.ffn_dim, dtype=torch.bool)
        k = round(share * self.ffn_dim)
        if self.mass is None:  # neurons in order: a whole number of 4-bit blocks of down's rows
            k = min(self.ffn_dim, round(k / self.block) * self.block)
        out[order[:k]] = True
        return out

    def dealt(self, share: float) -> "SparsePlan":
        """The plan as a group of CPU executors runs it, the hot executor doing `share` of each
        layer's FFN work (its cores' share): with a profile, each layer's neurons dealt out by
        descending activation mass, the neuron of rank r to the hot executor where
        floor((r + 1) share) passes floor(r share), so that each side expects its share of the
        neurons that fire (the most active neurons all on one side left the other waiting);
        without one, every neuron alike (`hot_mask`'s block-aligned share). A solved
        placement, what a GPU's memory holds, places nothing on a CPU and is dropped."""
        if self.mass is None:
            return replace(self, hot=None)
        ranks = np.arange(self.ffn_dim)
        pick = np.floor((ranks + 1) * share) > np.floor(ranks * share)  # the ranks it takes
        hot = []
        for i in range(self.n_layers):
            h = np.zeros(self.ffn_dim, dtype=bool)
            h[self.order_by_mass(i)[pick]] = True
            hot.append(h)
        return replace(self, hot=hot)

    def order_by_mass(self, layer: int) -> np.ndarray:
        """Layer's neurons by descending activation mass (stable), or in order without a profile."""
        if self.mass is None:
            return np.arange(self.ffn_dim)
        return np.argsort(-self.mass[layer], kind="stable")

    def by_mass(self, layer: int) -> torch.Tensor:
        import torch
        return torch.from_numpy(self.order_by_mass(layer).copy())

    def shards(self, layer: int, cold: torch.Tensor, n: int) -> list[torch.Tensor]:
        """Deal the cold neurons out to n executors by descending mass, so that each shard
        expects the same work; each shard's indices sorted."""
        order = self.by_mass(layer)
        ranked = order[cold[order]]
        if self.mass is None:  # every neuron alike: n ranges of whole blocks, in order
            cuts = [min(len(ranked), round(len(ranked) * k / n / self.block) * self.block)
                    for k in range(n)]
            return [ranked[lo:hi] for lo, hi in zip(cuts, cuts[1:] + [len(ranked)])]
        return [ranked[k::n].sort().values for k in range(n)]

    def apply(self, model: Transformer, fmt: str | None = "auto") -> Transformer:
        """The in-process sparse engine: swap every FFN for a HybridFFN under this plan, its
        neuron sets in kernel format `fmt` (see `apply_hybrid_ffn`). Every neuron of a layer is
        in one set: in one process they all sit where the model does, so a placement (which
        splits them between a GPU and the host in the actor runtime) would only split a decode
        step's kernel call in two, and keep it from the one-call step and the native layer loop
        (SmolLM2 with a solved placement: 1.33-1.60x the decode speed, BENCHMARKS.md)."""
        import torch

        from ..model.predictor import run_dtype
        from ..model.sparse import apply_hybrid_ffn
        if self.predictor_input is not None:
            w = model.norm.weight
            preds = self.load_predictors(run_dtype(w.dtype, w.device), w.device)
            masks = preds.active
        else:
            masks = lambda i, x: torch.ones(*x.shape[:-1], self.ffn_dim, dtype=torch.bool,  # noqa: E731
                                            device=x.device)
        return apply_hybrid_ffn(model, masks, None, self.predictor_input or "ffn", self.thresholds, fmt)


# the share of a layer's neurons a bundle's predictors pick, on average, above which loading
# warns: a sparse step computing more than half its FFN's neurons, plus its predictor, saves less
# than half the FFN's reads, and on a narrow FFN the neuron kernel costs more per neuron than the
# dense GEMVs (SmolLM2: its predictors pick about 80%, and it decodes at 0.52-0.63x dense)
MOSTLY_DENSE = 0.5


def check_share(b: Bundle, predictor: str) -> tuple[str | None, float | None]:
    """Warn (one line, logger "powerinfer") when the bundle's predictors pick more than
    MOSTLY_DENSE of a layer's neurons on average (their training record's active share, on
    held-out calibration tokens); returns the line (None: no warning) and that share (None
    where the record has none)."""
    rows = b.load_json(f"predictors.{predictor}.json", {})
    shares = [r["active_share"] for r in rows if "active_share" in r]
    b.check_rows(f"predictors.{predictor}.json", [r for r in rows if "active_share" in r],
                 {"active_share": (int, float)})
    share = sum(shares) / len(shares) if shares else None
    if share is None or share <= MOSTLY_DENSE:
        return None, share
    line = (f"sparsity bundle {b.path}: its {predictor}-input predictors pick {share:.0%} of the FFN "
            f"neurons on average, so a sparse decode step computes most of them and gains little; "
            f"on a narrow FFN it is slower than the dense model (`benchmarks/sparse_layer.py` "
            f"takes a layer's step apart): compare with a load without the bundle")
    log.warning(line)
    return line, share


def check_quality(b: Bundle, predictor: str, max_ppl_increase: float) -> str | None:
    """Warn (one line, logger "powerinfer") when the bundle's recorded evaluation shows its
    predictors costing more perplexity than `max_ppl_increase`, or when it was never evaluated;
    returns the line."""
    label = f"predicted ({predictor} input)"
    rows = b.load_json("eval.json").get("rows", []) if b.has("eval") else []
    b.check_rows("eval.json 'rows'", rows, {"label": str})
    row = next((r for r in rows if r["label"] == label), None)
    if row is not None:
        b.check_rows(f"eval.json row {label!r}", [row], {"ppl_delta": (int, float)}, False)
    if row is None:
        line = (f"sparsity bundle {b.path}: its {predictor}-input predictors were never "
                f"evaluated, so what they cost in quality is unknown; run `powerinfer eval`")
    elif row["ppl_delta"] > max_ppl_increase:
        line = (f"sparsity bundle {b.path}: its {predictor}-input predictors raise held-out "
                f"perplexity by {row['ppl_delta']:+.1%} over the dense model (bound "
                f"{max_ppl_increase:+.0%}); profile more tokens or samples (`powerinfer profile "
                f"--tokens/--samples`), train for a higher recall (`train-predictors --recall`), "
                f"or run without predictors")
    else:
        return None
    log.warning(line)
    return line


def input_thresholds(config, model_path, int4: bool) -> tuple[dict, dict] | None:
    """Input sparsity as `config.input_sparsity` asks for it (see Config): the bundle's
    thresholds ((layer, part) -> magnitude) and its record of them (target, quality), or None
    where it is off. `int4`: whether the load's projections are 4-bit on the CPU, the only ones
    the q4c kernel reads. A bundle named for it that cannot serve it (made for another model, no
    thresholds, weights other than int4) is an error; "auto" passes over one without thresholds,
    or a load of other weights, with a log line at most. Warns where the bundle's calibration
    raised held-out perplexity over `config.max_ppl_increase`."""
    from ..sparsity import input_sparsity as isp

    choice = config.input_sparsity
    if choice == "off" or (choice == "auto" and not config.bundle):
        return None
    source = Bundle.open(input_source(config))
    if choice == "auto" and not source.has("input_sparsity"):
        return None
    source.check_model(model_path)  # (thresholds of another model's inputs)
    thresholds, rec = isp.bundle_thresholds(source)
    if not int4:
        if choice == "auto":
            log.info("input sparsity: the bundle's thresholds are for the 4-bit CPU path "
                     "(weights='int4'); this load runs %s weights, dense", config.weights)
            return None
        raise ConfigError("input_sparsity runs on the 4-bit CPU path: weights='int4' (or auto) "
                          f"with a Q4_0/Q4_1 or Q4_K_M file on the CPU; this load runs {config.weights} weights")
    q = rec.get("quality", {})
    if q.get("ppl_increase", 0.0) > config.max_ppl_increase:
        log.warning("input sparsity: the bundle's thresholds raised held-out perplexity by %.1f%% "
                    "in calibration, over max_ppl_increase (%.1f%%)", 100 * q["ppl_increase"],
                    100 * config.max_ppl_increase)
    return thresholds, rec


def input_source(config) -> str:
    """The bundle `config.input_sparsity` takes its thresholds from: `config.bundle` for "auto"."""
    return config.bundle if config.input_sparsity == "auto" else config.input_sparsity


def log_input_sparsity(rec: dict, taken: int, small: int, config, min_rows: int) -> None:
    """The load's line on input sparsity: how many projections read only the input channels
    over their thresholds (`taken`), how many stay dense for their size (`small`: under
    `min_rows` output rows, or measured at load as not faster than the dense product on this
    CPU: `input_sparsity.attach`); a ConfigError where no projection of the model reads the
    thresholds at all."""
    if taken == 0 and small == 0:
        raise ConfigError(f"input_sparsity: none of the model's projections reads the bundle's "
                          f"thresholds (4-bit Q4_0/Q4_1/Q4_K projections: {input_source(config)})")
    q = rec.get("quality", {})
    log.info(
        "input sparsity: %d projections read only the input channels over their thresholds "
        "(target %.0f%% of each input; held-out perplexity %+.1f%% in calibration); %d stay "
        "dense: under %d rows, where skipping channels saves no reads, or not faster sparse on "
        "this CPU", taken,
        100 * rec["target"], 100 * q.get("ppl_increase", float("nan")), small, min_rows)
