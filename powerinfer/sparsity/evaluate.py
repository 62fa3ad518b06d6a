"""Quality of the sparse model (`powerinfer eval`): held-out perplexity of the dense model, the
oracle-sparse model (every fired neuron, nothing else) and the predicted-sparse model (fired and
predicted), their top-1 agreement with the dense model, the KL divergence of their next-token
distributions from the dense one, the realised sparsity (neurons not computed) and the recall of
the fired neurons, by count and by activation mass, per layer.

Each held-out window is run once through the dense model and once per variant through the sparse
model with per-token masks (`HybridFFN.token_masks`), which computes exactly what decoding each
token alone would.

For SwiGLU models, the curve adds oracle variants at other target sparsities, with thresholds read
from the profile's quantiles, so the operating point can be chosen without profiling again.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

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
             corpus: str | None = None) -> list[dict]:
    """Held-out perplexity of the dense model and of each sparse variant the bundle allows, on
    `corpus` (default: the corpus the bundle was profiled on; "lee" for an imported bundle)."""

    dense, tokenizer, path = load_model(model_name)
    bundle.check_model(path)
    sparse = load_model(path)[0]
    for m in (dense, sparse):
        m.setup_cache(1, window)
    hot = ([torch.from_numpy(h) for h in bundle.placement()] if bundle.has("placement") else None)
    apply_hybrid_ffn(sparse, hot=hot)
    ffns = hybrid_layers(sparse)
    n = dense.args.ffn_dim

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

    text = load_corpus(corpus or bundle.manifest.corpus.get("name") or "lee", "held_out")
    windows = token_windows(tokenizer, text, window, tokens)
    if sum(len(w) - 1 for w in windows) < 1:  # (a ZeroDivisionError at the end)
        raise ConfigError(f"{tokens} held-out tokens leave none to predict: give at least 2")
    with torch.inference_mode():
        for w in tqdm(windows, desc="evaluating", unit="window", disable=not progress):
            ids = torch.tensor([w])
            pos = torch.arange(len(w))[None]
            ref = dense(ids, pos)[0, :-1]  # (T-1, vocab)
            ref_logp = F.log_softmax(ref, -1)
            target_ids = ids[0, 1:]
            for v in variants:
                if v.kind == "dense":
                    logp = ref_logp
                else:
                    _configure(ffns, v)
                    logp = F.log_softmax(sparse(ids, pos)[0, :-1], -1)
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
