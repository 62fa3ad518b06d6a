"""Quality of the sparse model (`powerinfer eval`): held-out perplexity of the dense model, the
oracle-sparse model (every fired neuron, nothing else) and the predicted-sparse model (fired and
predicted), their top-1 agreement with the dense model, the KL divergence of their next-token
distributions from the dense one, the realised sparsity (neurons not computed) and the recall of
the fired neurons, by count and by activation mass, per layer.

Each held-out window is run once through the dense model and once per variant through the sparse
model with per-token masks (`HybridFFN.token_masks`), which computes exactly what decoding each
token alone would. One copy of the model is held where the dense log-probabilities of every
held-out token take less memory than a second copy would (a 7B's 13.5 GB in bf16 against 0.7 GB of
log-probabilities): the dense pass runs first, its log-probabilities kept (in memory up to
`profile.SAMPLE_MEMORY`, else in a file in the bundle's folder, removed at the end), and the same
model's FFNs are then swapped for the sparse ones. A small model with a large vocabulary (Gemma 3
270M: 1.1 GB of float32 weights against 5.2 GB of log-probabilities) keeps two copies instead.

For SwiGLU models, the curve adds oracle variants at other target sparsities, with thresholds read
from the profile's quantiles, so the operating point can be chosen without profiling again.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..errors import ConfigError
from ..formats.bundle import Bundle
from ..model.load import load_model
from ..model.predictor import load_predictors
from ..model.sparse import LayerStats, apply_hybrid_ffn, hybrid_layers
from .corpus import load_corpus, token_windows
from .profile import threshold_at

CURVE = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


@dataclass
class Variant:
    label: str
    kind: str  # dense | oracle | predicted
    thresholds: np.ndarray | None = None
    predictors: object | None = None  # predictor.Predictors
    target: float | None = None  # the calibrated sparsity the thresholds were set for
    # accumulated over the held-out text
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    tokens: int = 0
    layers: list[LayerStats] = field(default_factory=list)
    ffn_dim: int = 0

    def row(self, dense_ppl: float) -> dict:
        ppl = math.exp(self.nll / self.tokens)
        out = {"label": self.label, "kind": self.kind, "target": self.target, "ppl": ppl,
               "ppl_delta": ppl / dense_ppl - 1, "top1": self.top1 / self.tokens,
               "kl": self.kl / self.tokens}
        if self.layers:
            L = self.layers
            n = sum(s.rows for s in L)
            out["sparsity"] = 1 - sum(s.computed for s in L) / (n * self.ffn_dim)
            out["fired"] = sum(s.fired for s in L) / (n * self.ffn_dim)
            out["recall_count"] = sum(s.hit for s in L) / max(1, sum(s.fired for s in L))
            out["recall_mass"] = sum(s.mass_hit for s in L) / max(1e-30, sum(s.mass_fired for s in L))
            out["per_layer"] = [{"layer": i, **asdict(s),
                                 "recall_count": s.hit / max(1, s.fired),
                                 "recall_mass": s.mass_hit / max(1e-30, s.mass_fired)}
                                for i, s in enumerate(L)]
        else:
            out["sparsity"] = 0.0
        return out


def evaluate(model_name: str, bundle: Bundle, tokens: int = 0, window: int = 256,
             curve: tuple[float, ...] = CURVE, progress: bool = True,
             corpus: str | None = None, dtype: str = "float32",
             copies: int | None = None) -> list[dict]:
    """Held-out perplexity of the dense model and of each sparse variant the bundle allows, on
    `corpus` (default: the corpus the bundle was profiled on; "lee" for an imported bundle).
    `dtype`: the model's type while it runs (bfloat16 holds a 7B in half the memory); the
    log-probabilities are taken in float32 either way. `copies`: of the model held, 1 or 2
    (default: whichever takes less memory, see the module's note); the same results either way."""
    from ..config import torch_dtype

    tdtype = torch_dtype(dtype)
    model, tokenizer, path = load_model(model_name, tdtype)
    bundle.check_model(path)
    model.setup_cache(1, window)
    text = load_corpus(corpus or bundle.manifest.corpus.get("name") or "lee", "held_out")
    windows = token_windows(tokenizer, text, window, tokens)
    if sum(len(w) - 1 for w in windows) < 1:  # (a ZeroDivisionError at the end)
        raise ConfigError(f"{tokens} held-out tokens leave none to predict: give at least 2")
    with _DenseLogProbs(model, windows, window, bundle.path, path, tdtype, progress, copies) as dense:
        return _evaluate(dense, bundle, windows, text, window, curve, progress)


def _evaluate(dense: "_DenseLogProbs", bundle: Bundle, windows: list, text, window: int,
              curve: tuple[float, ...], progress: bool) -> list[dict]:
    sparse = dense.sparse
    hot = ([torch.from_numpy(h) for h in bundle.placement()] if bundle.has("placement") else None)
    apply_hybrid_ffn(sparse, hot=hot)
    ffns = hybrid_layers(sparse)
    n = sparse.args.ffn_dim

    th = bundle.load_tensors("thresholds.safetensors", {"threshold": (len(ffns),)}) \
        if bundle.has("thresholds") else {}
    base = th.get("threshold", np.zeros(len(ffns), np.float32))
    target = bundle.manifest.settings.get("thresholds", {}).get("sparsity")
    variants = [Variant("dense", "dense"), Variant("oracle", "oracle", base, target=target)]
    for inp in ("ffn", "layer"):
        if bundle.has(f"predictors.{inp}"):
            variants.append(Variant(f"predicted ({inp} input)", "predicted", base,
                                    load_predictors(bundle, inp), target=target))
    if "quantiles" in th:
        variants += [Variant(f"oracle @ {s:.0%}", "oracle", threshold_at(th["quantiles"], s), target=s)
                     for s in curve]
    for v in variants:
        v.ffn_dim = n
        if v.kind != "dense":
            v.layers = [LayerStats() for _ in ffns]

    with torch.inference_mode():
        for i, w in enumerate(tqdm(windows, desc="evaluating", unit="window", disable=not progress)):
            ids = torch.tensor([w])
            pos = torch.arange(len(w))[None]
            ref_logp = dense.window(i)  # (T-1, vocab)
            target_ids = ids[0, 1:]
            for v in variants:
                if v.kind == "dense":
                    logp = ref_logp
                else:
                    _configure(ffns, v)
                    logp = F.log_softmax(sparse(ids, pos)[0, :-1].float(), -1)
                v.nll -= float(logp.gather(-1, target_ids[:, None]).sum())
                v.kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
                v.top1 += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
                v.tokens += len(w) - 1
    dense_ppl = math.exp(variants[0].nll / variants[0].tokens)
    rows = [v.row(dense_ppl) for v in variants]
    bundle.save_json("eval.json", {"tokens": variants[0].tokens, "window": window,
                                   "corpus": text.describe(), "rows": rows})
    bundle.save_json("quality.json", [{k: r[k] for k in ("label", "sparsity", "ppl", "kind", "target")}
                                      for r in rows])
    bundle.mark("eval", {"tokens": variants[0].tokens, "window": window})
    return rows


class _DenseLogProbs:
    """The dense model's log-probabilities of each window's next tokens (`window(i)`, (T-1,
    vocab) float32), and the model the sparse variants run on (`sparse`): the same model, its
    FFNs swapped after a first pass that keeps every window's log-probabilities, where those
    take less memory than a second copy of the model; else a second copy, and the dense model
    runs beside it window by window. A context manager: the kept log-probabilities' file (past
    `SAMPLE_MEMORY`, checked first against the disk's room: a full disk under a map's pages
    would end the process) is removed on leaving, a killed eval's by the next."""

    def __init__(self, model, windows: list, window: int, where, path, dtype: torch.dtype,
                 progress: bool, copies: int | None = None):
        from .profile import SAMPLE_MEMORY, disk_room

        self.windows, self.folder = windows, None
        vocab = model.args.vocab_size
        rows = sum(len(w) - 1 for w in windows)
        kept = rows * vocab * 4
        weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        if copies not in (None, 1, 2):
            raise ConfigError(f"copies: 1 or 2 of the model, not {copies!r}")
        if copies == 2 or (copies is None and weights <= kept):  # a second copy holds less
            self.model, self.logp = model, None
            self.sparse = load_model(path, dtype)[0]
            self.sparse.setup_cache(1, window)
            return
        self.model, self.sparse = None, model
        self.start = np.cumsum([0] + [len(w) - 1 for w in windows])
        if kept <= SAMPLE_MEMORY:
            self.logp = np.empty((rows, vocab), np.float32)
        else:
            import tempfile

            room = disk_room(where, ".eval-")  # (a killed eval's folder removed first)
            if room < kept:
                raise ConfigError(f"the dense log-probabilities of {rows:,} held-out tokens need "
                                  f"{kept / 1e9:.1f} GB of disk beside the bundle, "
                                  f"{room / 1e9:.1f} GB free: give fewer --tokens, or copies=2")
            self.folder = Path(tempfile.mkdtemp(prefix=".eval-", dir=where))
            self.logp = np.lib.format.open_memmap(self.folder / "dense-logp.npy", "w+",
                                                  np.float32, (rows, vocab))
        try:
            with torch.inference_mode():
                for i, w in enumerate(tqdm(windows, desc="dense pass", unit="window",
                                           disable=not progress)):
                    self.logp[self.start[i]:self.start[i + 1]] = self._run(model, w).numpy()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _run(model, w: list) -> torch.Tensor:
        ids, pos = torch.tensor([w]), torch.arange(len(w))[None]
        return F.log_softmax(model(ids, pos)[0, :-1].float(), -1)

    def window(self, i: int) -> torch.Tensor:
        if self.logp is None:
            return self._run(self.model, self.windows[i])
        return torch.from_numpy(np.asarray(self.logp[self.start[i]:self.start[i + 1]]))

    def close(self):
        import shutil

        self.logp = None  # (the last reference to the file's map: it closes here)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _configure(ffns, v: Variant):
    p = v.predictors
    masks = None if p is None else p.active  # per row
    for i, f in enumerate(ffns):
        f.token_masks = True
        f.masks, f.threshold, f.stats = masks, float(v.thresholds[i]), v.layers[i]
        f.predictor_input = v.predictors.input if v.predictors is not None else "ffn"


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'variant':<24} {'ppl':>8} {'Δppl':>7} {'top-1':>6} {'KL':>7} {'sparsity':>8} "
             f"{'recall#':>7} {'recall$':>7}"]
    for r in rows:
        rc = f"{r['recall_count']:.3f}" if "recall_count" in r else "-"
        rm = f"{r['recall_mass']:.3f}" if "recall_mass" in r else "-"
        lines.append(f"{r['label']:<24} {r['ppl']:>8.3f} {r['ppl_delta']:>+7.1%} {r['top1']:>6.1%} "
                     f"{r['kl']:>7.4f} {r['sparsity']:>8.1%} {rc:>7} {rm:>7}")
    return "\n".join(lines)


def per_layer_table(row: dict) -> str:
    lines = [f"{row['label']}: layer  fired  computed  recall#  recall$"]
    for p in row.get("per_layer", []):
        n = max(1, p["rows"])
        lines.append(f"  {p['layer']:>5}  {p['fired'] / n:>6.0f}  {p['computed'] / n:>8.0f}  "
                     f"{p['recall_count']:>7.3f}  {p['recall_mass']:>7.3f}")
    return "\n".join(lines)
