"""Plots of a sparsity bundle (`powerinfer report --bundle BUNDLE`): the power law of firing
frequency, the activation-mass CDF, the GPU/CPU placement map, predictor recall and the quality
curve, as PNGs in `bundle/report/`, plus a short printable table.

Figures are drawn on the Agg canvas directly (no pyplot, no display, no global state).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import ListedColormap, Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..formats.bundle import Bundle, BundleError
from .profile import top_share

DPI = 120


SIZES = {  # file -> figure size in inches; the PNG is SIZES * DPI pixels
    "firing_frequency.png": (9.0, 5.5),
    "mass_cdf.png": (8.0, 6.0),
    "placement.png": (13.0, 6.0),
    "predictor_recall.png": (10.0, 5.5),
    "quality.png": (8.0, 5.5),
}


GPU_COLOR, CPU_COLOR = "#d95f02", "#7570b3"


def sparsity(count: np.ndarray, tokens: int) -> float:
    """Mean fraction of neurons that did not fire per token."""
    return 1.0 - float(np.sum(count)) / (tokens * count.size)


def gpu_mass_share(mass: np.ndarray, hot: np.ndarray) -> float:
    """Share of the total mass carried by the neurons placed on the GPU."""
    return float(mass[hot].sum() / max(mass.sum(), 1e-300))


def _stats(bundle: Bundle):
    try:
        counts, masses, tokens = bundle.stats()
    except KeyError as e:
        raise BundleError(bundle.path, f"stats are incomplete (no {e}); run `powerinfer profile` again") from None
    if tokens <= 0:
        raise BundleError(bundle.path, "stats cover 0 tokens; run `powerinfer profile` again")
    return counts, masses, tokens


def _title(bundle: Bundle, what: str, tokens: int | None = None) -> str:
    c = bundle.manifest.corpus
    tokens = c.get("tokens") if tokens is None else tokens
    corpus = c.get("name", "corpus")
    on = f"{corpus}, {tokens:,} tokens" if isinstance(tokens, int) else corpus
    return f"{bundle.manifest.model.get('file', '?')}: {what}\n({on})"


def _fmt(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return f"{v / 2**30:.2f} GiB" if abs(v) >= 2**20 else f"{v:.4g}"


def _layer_colors(n_layers: int) -> ScalarMappable:
    return ScalarMappable(Normalize(0, max(n_layers - 1, 1)), "viridis")


def _figure(name: str) -> Figure:
    fig = Figure(figsize=SIZES[name], dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, out_dir: Path, name: str) -> Path:
    path = out_dir / name
    fig.savefig(path, dpi=DPI)
    return path


def _load_optional(bundle: Bundle, name: str):
    return bundle.load_json(name) if (bundle.path / name).is_file() else None


def plot_firing_frequency(bundle, counts, tokens, out_dir) -> Path:
    name = "firing_frequency.png"
    fig = _figure(name)
    ax = fig.add_subplot()
    sm = _layer_colors(len(counts))
    for i, c in enumerate(counts):
        f = np.sort(c / tokens)[::-1]
        rank = np.arange(1, f.size + 1)
        ax.plot(rank[f > 0], f[f > 0], color=sm.to_rgba(i), lw=1.0, alpha=0.8)  # log axes: drop zeros
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("neuron rank (by firing frequency)")
    ax.set_ylabel("firing frequency (fired tokens / tokens)")
    ax.grid(True, which="both", alpha=0.3)
    fig.colorbar(sm, ax=ax, label="layer", ticks=MaxNLocator(integer=True))
    mean_sp = float(np.mean([sparsity(c, tokens) for c in counts]))
    ax.set_title(_title(bundle, f"firing frequency per layer, mean sparsity {mean_sp:.1%}", tokens))
    return _save(fig, out_dir, name)


def plot_mass_cdf(bundle, masses, tokens, out_dir) -> Path:
    name = "mass_cdf.png"
    fig = _figure(name)
    ax = fig.add_subplot()
    sm = _layer_colors(len(masses))

    def cdf(m):
        m = np.sort(np.asarray(m, np.float64))[::-1]
        return np.arange(1, m.size + 1) / m.size, np.cumsum(m) / max(m.sum(), 1e-300)

    for i, m in enumerate(masses):
        ax.plot(*cdf(m), color=sm.to_rgba(i), lw=0.7, alpha=0.6)
    allm = np.concatenate(masses)
    ax.plot(*cdf(allm), color="black", lw=2.5, label="all layers")
    for frac in (0.1, 0.2):
        y = top_share(allm, frac)
        ax.plot([frac], [y], "o", color="crimson")
        ax.annotate(f"top {frac:.0%} of neurons carry {y:.1%} of the mass", (frac, y), xytext=(12, -4),
                    textcoords="offset points", va="top", fontsize=10,
                    bbox=dict(boxstyle="round", fc="white", ec="none", alpha=0.8))
    ax.plot([0, 1], [0, 1], ":", color="gray", label="uniform")
    ax.set(xlim=(0, 1), ylim=(0, 1.01), xlabel="fraction of neurons (sorted by mass, descending)",
           ylabel="cumulative fraction of activation mass")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.colorbar(sm, ax=ax, label="layer (thin lines)", ticks=MaxNLocator(integer=True))
    ax.set_title(_title(bundle, "who carries the activation mass", tokens))
    return _save(fig, out_dir, name)


def plot_placement(bundle, masses, hot, out_dir) -> Path:
    name = "placement.png"
    fig = _figure(name)
    ax, bx = fig.subplots(1, 2, width_ratios=[3, 1], sharey=True)
    L, n = len(hot), max(h.size for h in hot)
    grid = np.full((L, n), np.nan)  # (L, n): 1 = GPU, 0 = CPU, NaN = no neuron (shorter layer)
    gpu_n, gpu_m = np.zeros(L), np.zeros(L)
    for i, (h, m) in enumerate(zip(hot, masses)):
        order = np.argsort(-m, kind="stable")
        grid[i, :h.size] = h[order]
        gpu_n[i] = h.mean()
        gpu_m[i] = gpu_mass_share(m, h)
    ax.imshow(grid, aspect="auto", interpolation="nearest", origin="lower",
              cmap=ListedColormap([CPU_COLOR, GPU_COLOR]), vmin=0, vmax=1, extent=(0, n, -0.5, L - 0.5))
    ax.set(xlabel="neuron (sorted by activation mass, descending)", ylabel="layer")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(handles=[Patch(color=GPU_COLOR, label="GPU"), Patch(color=CPU_COLOR, label="CPU")],
              loc="upper right")
    y = np.arange(L)
    bx.barh(y - 0.2, gpu_n, height=0.4, color="gray", label="neurons on GPU")
    bx.barh(y + 0.2, gpu_m, height=0.4, color=GPU_COLOR, label="mass served by GPU")
    bx.set(xlim=(0, 1), xlabel="share")
    bx.grid(True, axis="x", alpha=0.3)
    bx.legend(loc="lower right", fontsize=8)
    info = _load_optional(bundle, "placement.json") or {}
    what = f"placement (budget {_fmt(info['budget_bytes'])})" if "budget_bytes" in info else "placement"
    total = sum(float(m.sum()) for m in masses)  # the whole model's shares, not the layers' mean
    on_gpu = sum(float(m[h].sum()) for m, h in zip(masses, hot))
    fig.suptitle(_title(bundle, f"{what}: GPU {sum(h.sum() for h in hot) / (n * L):.1%} of neurons, "
                                f"{on_gpu / total if total else 1:.1%} of activation mass"))
    return _save(fig, out_dir, name)


def plot_predictors(bundle, tables: dict[str, list[dict]], out_dir) -> Path:
    name = "predictor_recall.png"
    fig = _figure(name)
    ax = fig.add_subplot()
    rx = ax.twinx()
    styles = {"recall_mass": "-", "recall_count": "--", "precision": ":"}
    width = 0.8 / len(tables)
    for j, (kind, rows) in enumerate(tables.items()):
        color = f"C{j}"
        rows = [r for r in rows if "layer" in r]
        for key, ls in styles.items():
            pts = [(r["layer"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), ls, marker=".", color=color, label=f"{kind}: {key.replace('_', ' by ')}")
        ranks = [(r["layer"], r["rank"]) for r in rows if r.get("rank") is not None]
        if ranks:
            lx, rk = map(np.asarray, zip(*ranks))
            rx.bar(lx - 0.4 + width * (j + 0.5), rk, width=width, color=color, alpha=0.2,
                   label=f"{kind}: rank")
    ax.set(ylim=(0, 1.02), xlabel="layer", ylabel="recall / precision")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    rx.set_ylabel("predictor rank")
    ax.set_zorder(rx.get_zorder() + 1)  # lines over the bars
    ax.patch.set_visible(False)
    ax.grid(True, alpha=0.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = rx.get_legend_handles_labels()
    fig.legend(h1 + h2, l1 + l2, loc="outside right upper", fontsize=9)
    ax.set_title(_title(bundle, "activation predictors per layer"))
    return _save(fig, out_dir, name)


def plot_quality(bundle, points: list[dict], out_dir) -> Path:
    name = "quality.png"
    fig = _figure(name)
    ax = fig.add_subplot()
    curves: dict[str, list] = {}
    dense = None
    for p in points:
        if p.get("sparsity") is not None and p.get("ppl") is not None:
            kind = p.get("kind")
            if kind == "dense":
                dense = p["ppl"]
            # dense and the oracle points form one curve; each predicted variant is its own point
            key = "oracle masks (by threshold)" if kind in ("dense", "oracle") else str(p.get("label", ""))
            curves.setdefault(key, []).append((p["sparsity"], p["ppl"]))
    for label, pts in curves.items():
        ax.plot(*zip(*sorted(pts)), "o-", label=label or None)
    if dense is not None:
        ax.axhline(dense * 1.02, color="grey", ls="--", lw=1, label="dense + 2%")
    ax.set(xlabel="realised sparsity (fraction of FFN neurons skipped)", ylabel="perplexity")
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend()
    ax.set_title(_title(bundle, "quality vs sparsity"))
    return _save(fig, out_dir, name)


def write_report(bundle: Bundle, out_dir: Path | None = None) -> list[Path]:
    """Write the report PNGs of `bundle` (default into bundle/report/) and return their paths.

    Needs the "stats" part (raises BundleError otherwise); placement, predictor tables and the
    quality curve are drawn when present and skipped when not.
    """
    counts, masses, tokens = _stats(bundle)
    out_dir = Path(out_dir) if out_dir is not None else bundle.path / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_firing_frequency(bundle, counts, tokens, out_dir),
             plot_mass_cdf(bundle, masses, tokens, out_dir)]
    if bundle.has("placement"):
        paths.append(plot_placement(bundle, masses, bundle.placement(), out_dir))
    tables = {kind: t for kind in ("ffn", "layer")
              if (t := _load_optional(bundle, f"predictors.{kind}.json"))}
    if tables:
        paths.append(plot_predictors(bundle, tables, out_dir))
    quality = _load_optional(bundle, "quality.json")
    if isinstance(quality, dict):
        quality = quality.get("points")
    if quality:
        paths.append(plot_quality(bundle, quality, out_dir))
    return paths


def summary_text(bundle: Bundle) -> str:
    """A per-layer table: sparsity, top-10% mass share and, when placed, the GPU shares."""
    counts, masses, tokens = _stats(bundle)
    hot = bundle.placement() if bundle.has("placement") else None
    head = f"{'layer':>5} {'ffn':>6} {'sparsity':>9} {'top10% mass':>12}"
    if hot:
        head += f" {'GPU neurons':>12} {'GPU mass':>9}"
    lines = [_title(bundle, "sparsity summary", tokens).replace("\n", " "), head]
    for i, (c, m) in enumerate(zip(counts, masses)):
        row = f"{i:>5} {c.size:>6} {sparsity(c, tokens):>9.2%} {top_share(m, 0.1):>12.2%}"
        if hot:
            row += f" {hot[i].mean():>12.2%} {gpu_mass_share(m, hot[i]):>9.2%}"
        lines.append(row)
    return "\n".join(lines)
