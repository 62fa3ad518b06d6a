"""Neuron placement: which FFN neurons live on the GPU under a VRAM budget.

The budget counts every byte the GPU holds (`gpu_bytes`): attention weights and biases, every
norm, the KV cache for the configured batch and context, the fp32 RoPE tables, the predictors,
the embeddings and lm_head where placed (once when tied), OPT's learned positions, and the FFN's
down-projection bias; what is left holds hot neurons at `neuron_bytes` each (the neuron's gate,
up and down rows, and its gate/up biases; in the 4-bit records the Triton kernels read where the
GPU keeps a 4-bit file's neurons in its blocks, `Config(weights="int4")`, which keeps attention's
matrices and an untied head in them too: `solve_for_bundle`'s fixed_bytes).

Formulation (an integer program solved by HiGHS through `scipy.optimize.milp`):

- Per layer, neurons are sorted by mass (descending, ties by index) and cut into groups of
  `group`. All neurons cost the same bytes, so a layer's best choice is always a prefix of that
  order: groups are taken in order (x[l, g+1] <= x[l, g]). Exact when `group` divides ffn_dim;
  otherwise only the smaller last group could have been preferred alone.
- The paper's communication constraint, which the original solver left out in practice (its
  threshold defaulted to 0): a layer either keeps no neuron on the GPU or at least k of them,
  k = ceil(min_share * ffn_dim) rounded up to whole groups, because a GPU part costs its kernel
  launches and merge however small it is. The paper's per-layer binary (C_l: "layer l has GPU
  neurons") is the layer's first variable, which stands for its first k neurons as one item; the
  layer's further groups follow it in the prefix chain. Given the prefix order this is the same
  set of solutions as `sum_g n_g x[l, g] >= k C_l, x[l, g] <= C_l`, with fewer variables and no
  big-M rows, and an LP relaxation at least as tight.
- Optionally a hard floor (`floor_share`): every layer keeps at least that share on the GPU
  (C_l fixed to 1; its first item grows to the floor if that is larger than k).
- One memory row: neuron counts of the chosen items <= (budget - fixed bytes) // neuron_bytes,
  integer coefficients, so the byte budget holds exactly.
- Objective: maximise the activation mass on the GPU (given to HiGHS in millionths of the total
  mass, so that its absolute gap tolerance of 1e-6 cannot stop it short of the greedy answer).

Defaults: `group=64` (660 binaries for the 135M default, ~5000 for 7B shapes, each solved to
optimality in a second or two; the original's 256 also works). `min_share=0.1`: the break-even
size of a GPU part is its fixed launch-and-merge time (an estimated ~15 us) over the CPU time
one hot neuron saves (its bytes at ~25 GB/s times its firing rate): tens of neurons on 7B
shapes, where one group already pays, and on the order of a tenth of a layer on the 135M
default; with power-law mass a layer worth any GPU neurons is nearly always worth a tenth of
them, so the rule only bites where the GPU would get a sliver. `floor_share=0` (off): the
objective already minimises the total CPU work. Output is deterministic for the same inputs
unless the time limit stops HiGHS.

A greedy baseline (items by mass per neuron, each taken if it fits and its layer's previous item
was taken, the floor items first) always satisfies the same constraints; it is reported next to
the MILP and returned instead if the MILP, stopped by its time limit, found nothing better.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import ConfigError
from ..formats.args import ModelArgs
from ..kernels import record_bytes
from ..model.predictor import held_bytes as predictor_held_bytes

_MILP_STATUS = {0: "optimal", 1: "time limit", 2: "infeasible", 3: "unbounded", 4: "error"}


def neuron_bytes(args: ModelArgs, dtype_bytes: int = 2, fmt: str | None = None) -> int:
    """Bytes of one FFN neuron: its gate (gated FFNs), up and down rows, and its gate/up biases;
    with `fmt` a block format ("q4_0", "q4_1", "q8_0": `Config(weights="int4")` on a GPU) the
    rows as its record holds them (`kernels.record_bytes`: 4-bit gate/up rows, 8-bit down rows),
    the biases in the model's type."""
    rows = 3 if args.gated else 2
    biases = (2 if args.gated else 1) if args.ffn_bias else 0
    if fmt is not None:
        return record_bytes(fmt, args.dim, args.gated) + biases * dtype_bytes
    return (rows * args.dim + biases) * dtype_bytes


def gpu_bytes(args: ModelArgs, *, dtype_bytes: int = 2, batch: int = 1, context: int = 2048,
              predictor_ranks: list[int] | None = None, embeddings_on_gpu: bool = True,
              lm_head_on_gpu: bool = True, predictor_fmt: str | None = None) -> dict[str, int]:
    """Bytes of everything the GPU holds besides hot neurons, by part (predictor_fmt "q8_0":
    the predictors' matrices as a GPU holds them, `predictor.device_format`)."""
    a, L, d = args, args.n_layers, args.dim
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    attention = d * (q + 2 * kv) + q * d + (q + 2 * kv) * a.qkv_bias + d * a.o_bias
    norm = 2 * d if a.layer_norm else d
    table = a.vocab_size * d
    ranks = predictor_ranks or []
    if predictor_ranks is not None and len(ranks) != L:
        raise ConfigError(f"predictor_ranks has {len(ranks)} entries for {L} layers")
    tied_elsewhere = a.tie_embeddings and embeddings_on_gpu
    parts = {
        "attention": L * attention,
        "norms": (2 * L + 1) * norm,
        "ffn_bias": L * d if a.ffn_bias else 0,  # the down bias, added once after the merge
        "kv_cache": 2 * L * batch * context * kv,
        # fc1 (r, d), fc2 (ffn_dim, r), in the model's type on a GPU, 16-bit or float32
        # (`predictor.run_dtype`), in their own process (with predictor_device="cpu" they do not
        # sit there: the placement then leaves this unused)
        "predictors": sum(r * (d + a.ffn_dim) for r in ranks),
        "embeddings": table + a.position_rows * d if embeddings_on_gpu else 0,
        "lm_head": table if lm_head_on_gpu and not tied_elsewhere else 0,
    }
    out = {k: v * dtype_bytes for k, v in parts.items()}
    if predictor_fmt is not None:
        out["predictors"] = predictor_held_bytes(ranks, d, a.ffn_dim, dtype_bytes, predictor_fmt)
    out["rope"] = 0 if a.learned_pos else 2 * context * a.head_dim * 4  # fp32 cos/sin tables
    return out


@dataclass
class Placement:
    """A solved placement: `hot[l]` is layer l's (ffn_dim,) bool mask in the model's order."""
    hot: list[np.ndarray]
    layer_mass: np.ndarray  # (n_layers,) total mass of each layer
    layer_gpu_mass: np.ndarray  # (n_layers,) mass of each layer's hot neurons
    budget_bytes: int
    fixed: dict[str, int]  # gpu_bytes breakdown
    neuron_bytes: int
    objective: float  # mass on the GPU
    bound: float  # upper bound on the objective: HiGHS's dual bound, or the top-`cap` masses
    gap: float  # (bound - objective) / objective; HiGHS's mip_gap when the MILP's answer is used
    greedy_objective: float
    solve_s: float
    status: str  # "optimal", "time limit", ... or "all fit" when no solve was needed
    source: str  # "milp", "greedy" or "all"
    group: int
    min_neurons: int  # a layer holds 0 or at least this many GPU neurons (floor: exactly >=)
    n_binaries: int

    @property
    def total_mass(self) -> float:
        return float(self.layer_mass.sum())

    @property
    def share(self) -> float:
        return self.objective / self.total_mass if self.total_mass > 0 else 1.0

    @property
    def hot_counts(self) -> list[int]:
        return [int(h.sum()) for h in self.hot]

    @property
    def used_bytes(self) -> int:
        return sum(self.fixed.values()) + self.neuron_bytes * sum(self.hot_counts)

    def report(self) -> dict:
        """JSON-ready summary (what the bundle's placement.json records)."""
        t = self.total_mass or 1.0
        return {
            "budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes,
            "fixed_bytes": dict(self.fixed), "neuron_bytes": self.neuron_bytes,
            "hot_neuron_bytes": self.neuron_bytes * sum(self.hot_counts),
            "hot_counts": self.hot_counts, "objective": self.objective, "share": self.share,
            "greedy_objective": self.greedy_objective, "greedy_share": self.greedy_objective / t,
            "bound": self.bound, "gap": self.gap, "solve_s": self.solve_s, "status": self.status,
            "source": self.source, "group": self.group, "min_neurons": self.min_neurons,
            "n_binaries": self.n_binaries,
        }

    def table(self) -> str:
        """Printable per-layer table and totals."""
        ffn = len(self.hot[0])
        lines = [f"{'layer':>5} {'hot':>13} {'hot%':>6} {'mass%':>6}"]
        for i, (n, m, g) in enumerate(zip(self.hot_counts, self.layer_mass, self.layer_gpu_mass)):
            lines.append(f"{i:>5} {f'{n}/{ffn}':>13} {100 * n / ffn:>5.1f}% "
                         f"{100 * g / m if m > 0 else 100.0:>5.1f}%")
        n, total = sum(self.hot_counts), ffn * len(self.hot)
        lines.append(f"{'all':>5} {f'{n}/{total}':>13} {100 * n / total:>5.1f}% "
                     f"{100 * self.share:>5.1f}%")
        parts = ", ".join(f"{k} {_mib(v)}" for k, v in self.fixed.items() if v)
        lines.append(f"GPU bytes: {parts}, hot neurons {_mib(self.neuron_bytes * n)}; "
                     f"{_mib(self.used_bytes)} of {_mib(self.budget_bytes)}")
        greedy = self.greedy_objective / (self.total_mass or 1.0)
        lines.append(f"mass on GPU: {100 * self.share:.3f}% ({self.source}, {self.status}); "
                     f"greedy {100 * greedy:.3f}%; gap {100 * self.gap:.4f}%; "
                     f"{self.solve_s:.3f} s; {self.n_binaries} binaries, group {self.group}, "
                     f"GPU layers hold 0 or >= {self.min_neurons} neurons")
        return "\n".join(lines)


def solve(mass: list[np.ndarray], args: ModelArgs, budget_bytes: int, *,
          fixed: dict[str, int] | None = None, dtype_bytes: int = 2, neuron_fmt: str | None = None,
          group: int = 64, min_share: float = 0.1, floor_share: float = 0.0,
          time_limit: float = 60.0, mip_rel_gap: float = 1e-4) -> Placement:
    """Choose the hot neurons of every layer. `mass[l]` is layer l's (ffn_dim,) activation mass
    (or count); `fixed` is the `gpu_bytes` breakdown (default: `gpu_bytes(args, dtype_bytes=...)`);
    `neuron_fmt` the block format the GPU keeps the neurons in (`neuron_bytes`; None: the model's
    type). Raises ConfigError when the fixed parts, or the per-layer floor, do not fit the budget."""
    L, n = args.n_layers, args.ffn_dim
    mass = _checked_mass(mass, L, n, group, min_share, floor_share)
    fixed = gpu_bytes(args, dtype_bytes=dtype_bytes) if fixed is None else dict(fixed)
    nb = neuron_bytes(args, dtype_bytes, neuron_fmt)
    fixed_total = sum(fixed.values())
    if fixed_total > budget_bytes:
        parts = ", ".join(f"{k} {v / 2**20:,.1f}" for k, v in fixed.items() if v)
        raise ConfigError(f"a GPU budget of {budget_bytes / 2**30:.3f} GiB ({budget_bytes:,} "
                          f"bytes) is below the {fixed_total / 2**30:.3f} GiB ({fixed_total:,} "
                          f"bytes) the GPU must hold besides the FFN's neurons (MiB: {parts}): "
                          f"give at least --vram-budget "
                          f"{math.ceil(fixed_total / 2**30 * 100) / 100:.2f}, and more for hot "
                          "neurons")
    cap = (budget_bytes - fixed_total) // nb  # neurons that fit
    group = min(group, n)
    it = _items(mass, n, group, min_share, floor_share)
    if it.mandatory and L * it.first > cap:
        raise ConfigError(f"the per-layer floor of {it.first} GPU neurons needs "
                          f"{L * it.first * nb} bytes but a budget of {budget_bytes} bytes leaves "
                          f"{budget_bytes - fixed_total} after the {fixed_total} fixed bytes")

    def placement(taken, **report) -> Placement:
        counts = it.bounds[taken]  # taken[l]: items of layer l on the GPU -> neurons
        hot = []
        for o, c in zip(it.order, counts):
            h = np.zeros(n, dtype=bool)
            h[o[:c]] = True
            hot.append(h)
        assert counts.sum() <= cap and all(c == 0 or c >= it.first for c in counts)
        gpu = np.array([m[h].sum() for m, h in zip(mass, hot)])
        return Placement(hot=hot, layer_mass=np.array([m.sum() for m in mass]),
                         layer_gpu_mass=gpu, budget_bytes=budget_bytes, fixed=fixed,
                         neuron_bytes=nb, objective=float(gpu.sum()), group=group,
                         min_neurons=it.first, **report)

    total = float(it.cums[:, -1].sum())
    if n * L <= cap:
        return placement(np.full(L, len(it.sizes)), bound=total, gap=0.0, greedy_objective=total,
                         solve_s=0.0, status="all fit", source="all", n_binaries=0)

    def value(taken):  # mass of the first taken[l] items of every layer
        return float(sum(it.item_mass[l, :t].sum() for l, t in enumerate(taken)))

    greedy = _greedy(it.item_mass, it.sizes, cap, it.mandatory)
    greedy_obj = value(greedy)
    t0 = time.perf_counter()
    scale = 1e6 / max(total, 1e-300)
    res = _milp(it.item_mass * scale, it.sizes, cap, it.mandatory, time_limit, mip_rel_gap)
    solve_s = time.perf_counter() - t0
    taken, source = greedy, "greedy"
    if res.x is not None:
        x = np.round(res.x).astype(bool).reshape(it.item_mass.shape)
        milp_taken = x.sum(1)
        assert (x == (np.arange(len(it.sizes)) < milp_taken[:, None])).all()  # prefixes
        if value(milp_taken) >= greedy_obj - 1e-9 * total:  # ties up to rounding: the MILP's
            taken, source = milp_taken, "milp"
    objective = value(taken)
    bound, gap = _bound_and_gap(mass, cap, res, scale, objective, source)
    return placement(taken, bound=bound, gap=gap, greedy_objective=greedy_obj, solve_s=solve_s,
                     status=_MILP_STATUS.get(res.status, "error"), source=source,
                     n_binaries=it.item_mass.size)


def _checked_mass(mass: list, L: int, n: int, group: int, min_share: float,
                  floor_share: float) -> list[np.ndarray]:
    """`mass` as float64 arrays, or ConfigError naming what is wrong with it or the options."""
    if len(mass) != L or any(np.shape(m) != (n,) for m in mass):
        raise ConfigError(f"mass must be {L} arrays of shape ({n},), "
                          f"got {[np.shape(m) for m in mass]}")
    mass = [np.asarray(m, dtype=np.float64) for m in mass]
    if any(not np.isfinite(m).all() or (m < 0).any() for m in mass):
        raise ConfigError("mass must be finite and non-negative")
    if group < 1 or not 0 <= min_share <= 1 or not 0 <= floor_share <= 1:
        raise ConfigError(f"need group >= 1 and shares in [0, 1], "
                          f"got group={group}, min_share={min_share}, floor_share={floor_share}")
    return mass


class _Items(NamedTuple):
    """The solver's items, the same in every layer: its neurons by mass, the first item (at
    least the minimum share, whole groups) then single groups."""
    first: int  # neurons of a layer's first item: the fewest a layer holds on the GPU, if any
    mandatory: bool  # every layer must take its first item (a floor share)
    bounds: np.ndarray  # (I + 1,) item boundaries in neurons
    sizes: np.ndarray  # (I,) neurons per item
    order: list  # per layer, its neurons by mass, largest first
    cums: np.ndarray  # (L, n + 1) cumulative mass in that order
    item_mass: np.ndarray  # (L, I)


def _items(mass: list[np.ndarray], n: int, group: int, min_share: float,
           floor_share: float) -> _Items:
    floor = math.ceil(floor_share * n)
    first = min(n, group * max(1, math.ceil(max(math.ceil(min_share * n), floor) / group)))
    bounds = np.array([0, *range(first, n, group), n])
    order = [np.argsort(-m, kind="stable") for m in mass]
    cums = np.stack([np.concatenate([[0.0], np.cumsum(m[o])]) for m, o in zip(mass, order)])
    return _Items(first, floor > 0, bounds, np.diff(bounds), order, cums,
                  cums[:, bounds[1:]] - cums[:, bounds[:-1]])


def _bound_and_gap(mass: list[np.ndarray], cap: int, res, scale: float, objective: float,
                   source: str) -> tuple[float, float]:
    """An upper bound on the mass any placement reaches (the solver's dual bound, and the `cap`
    largest masses of the whole model), and the chosen placement's gap to it (the MILP's own
    where it was chosen)."""
    bound = float(np.sort(np.concatenate(mass))[::-1][:cap].sum())
    dual = res.get("mip_dual_bound")  # of the scaled minimisation
    if dual is not None and np.isfinite(dual):
        bound = min(bound, -dual / scale)
    bound = max(bound, objective)
    if source == "milp" and res.get("mip_gap") is not None:
        return bound, float(res.mip_gap)
    return bound, (bound - objective) / objective if objective > 0 else 0.0


def _greedy(item_mass: np.ndarray, sizes: np.ndarray, cap: int, mandatory: bool) -> np.ndarray:
    """Items by mass per neuron (ties by layer, then position); each taken when it fits and its
    layer's previous item is taken. Returns the number of items taken per layer."""
    L, I = item_mass.shape
    taken = np.full(L, int(mandatory))
    used = int(mandatory) * L * int(sizes[0])
    layer, item = np.divmod(np.arange(L * I), I)
    for v in np.lexsort((item, layer, -(item_mass / sizes).ravel())):
        l, i = layer[v], item[v]
        if taken[l] == i and used + sizes[i] <= cap:
            taken[l] += 1
            used += int(sizes[i])
    return taken


def _milp(value: np.ndarray, sizes: np.ndarray, cap: int, mandatory: bool, time_limit: float,
          mip_rel_gap: float):
    # imported here: every process that plans a placement imports this module, few solve one
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array
    # value: (L, I) scaled mass of each item; variable l * I + i is item i of layer l
    L, I = value.shape
    N = L * I
    lb = np.zeros((L, I))
    lb[:, 0] = float(mandatory)  # the floor: every layer's first item is on the GPU
    # prefix chain: x[l, i] - x[l, i-1] <= 0
    rows = np.arange(L * (I - 1))
    cur = (np.arange(L)[:, None] * I + np.arange(1, I)).ravel()
    chain = csr_array((np.r_[np.ones(len(rows)), -np.ones(len(rows))],
                       (np.r_[rows, rows], np.r_[cur, cur - 1])), shape=(len(rows), N))
    memory = np.tile(sizes.astype(np.float64), L)[None, :]
    constraints = [LinearConstraint(memory, -np.inf, cap)]
    if I > 1:
        constraints.append(LinearConstraint(chain, -np.inf, 0))
    return milp(-value.ravel(), integrality=np.ones(N), bounds=Bounds(lb.ravel(), np.ones(N)),
                constraints=constraints,
                options={"time_limit": time_limit, "mip_rel_gap": mip_rel_gap, "disp": False})


def _mib(b: int) -> str:
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"


def solve_for_bundle(bundle, budget_gb: float, *, batch: int, context: int, dtype_bytes: int,
                     predictor_input: str, neuron_fmt: str | None = None,
                     fixed_bytes: dict[str, int] | None = None, predictor_fmt: str | None = None,
                     **options) -> tuple[Placement, list[int] | None]:
    """The placement for a bundle's profiled mass, counting the GPU's share of everything else
    (its `predictor_input` predictors' ranks included, when trained, in `predictor_fmt`'s rows
    where given), the hot neurons in `neuron_fmt`'s records (None: the model's type), and the
    parts `fixed_bytes` gives at those bytes (`partial.device_fixed_bytes`: attention, an
    untied head and embedding, where the GPU keeps them in the file's blocks); and those ranks."""

    _, mass, _ = bundle.stats()
    args = ModelArgs(**bundle.manifest.model["args"])
    ranks = None
    if bundle.has(f"predictors.{predictor_input}"):
        ranks = [r["rank"] for r in bundle.load_json(f"predictors.{predictor_input}.json",
                                                     {"rank": int})]
    fixed = gpu_bytes(args, dtype_bytes=dtype_bytes, batch=batch, context=context,
                      predictor_ranks=ranks, predictor_fmt=predictor_fmt)
    fixed.update(fixed_bytes or {})
    return solve(mass, args, int(budget_gb * 2**30), fixed=fixed, dtype_bytes=dtype_bytes,
                 neuron_fmt=neuron_fmt, **options), ranks


def solve_bundle(bundle, budget_gb: float, *, batch: int = 1, context: int = 2048,
                 dtype_bytes: int = 2, predictor_input: str = "auto", neuron_fmt: str | None = None,
                 fixed_bytes: dict[str, int] | None = None, predictor_fmt: str | None = None,
                 **options) -> Placement:
    """Solve for a bundle's profiled mass and write placement.safetensors/.json into it.
    predictor_input: whose predictors the GPU holds, "ffn", "layer", or "auto" (as the runtimes
    choose: the lookahead ones when trained); neuron_fmt, fixed_bytes: the block format the GPU
    keeps the hot neurons in and the parts it keeps in the file's blocks (a 4-bit file under
    `Config(weights="int4")`: `partial.device_fixed_bytes`; None: the model's type)."""
    predictor_input = bundle.predictor_input(predictor_input)
    p, ranks = solve_for_bundle(bundle, budget_gb, batch=batch, context=context,
                                dtype_bytes=dtype_bytes, predictor_input=predictor_input,
                                neuron_fmt=neuron_fmt, fixed_bytes=fixed_bytes,
                                predictor_fmt=predictor_fmt, **options)
    bundle.save_tensors("placement.safetensors",
                        {f"hot.{i}": h.astype(np.uint8) for i, h in enumerate(p.hot)})
    bundle.save_json("placement.json", {**p.report(), "vram_budget_gb": budget_gb, "batch": batch,
                                        "context": context, "dtype_bytes": dtype_bytes,
                                        "neuron_fmt": neuron_fmt,
                                        "predictor_input": predictor_input if ranks else None})
    bundle.mark("placement", {"vram_budget_gb": budget_gb, "batch": batch, "context": context})
    return p
