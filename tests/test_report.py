"""The report of a sparsity bundle: PNGs written and readable, optional parts skipped, numbers right."""
from __future__ import annotations

import matplotlib.image as mpimg
import numpy as np
import pytest

from powerinfer.formats.bundle import Bundle, BundleError
from powerinfer.sparsity.report import DPI, SIZES, summary_text, write_report

L, FFN, TOKENS = 4, 512, 2000
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_bundle(path, *, placement=True, predictors=True, quality=False) -> Bundle:
    rng = np.random.default_rng(0)
    b = Bundle.create(path, model={"file": "toy-relu.gguf", "n_layers": L, "dim": 64, "ffn_dim": FFN})
    tensors = {}
    for i in range(L):
        # power law: neuron of rank r fires with probability ~ r^-a, in random neuron order
        p = np.minimum(1.0, 0.9 * np.arange(1, FFN + 1) ** -(0.6 + 0.1 * i))
        count = rng.binomial(TOKENS, rng.permutation(p)).astype(np.int64)
        tensors[f"count.{i}"] = count
        tensors[f"mass.{i}"] = count * rng.uniform(0.5, 1.5, FFN)
    b.save_tensors("stats.safetensors", tensors)
    b.manifest.corpus = {"name": "toy-corpus", "tokens": TOKENS}
    b.mark("stats")
    if placement:
        hot = {f"hot.{i}": (tensors[f"mass.{i}"] >= np.quantile(tensors[f"mass.{i}"], 0.75)).astype(np.uint8)
               for i in range(L)}
        b.save_tensors("placement.safetensors", hot)
        b.save_json("placement.json", {"budget_bytes": 3 * 2**30, "objective": 0.81})
        b.mark("placement")
    if predictors:
        b.save_json("predictors.ffn.json", [
            {"layer": i, "rank": 16 * (i + 1), "recall_count": 0.85, "recall_mass": 0.97, "precision": 0.5}
            for i in range(L)])
        b.save_json("predictors.layer.json", [{"layer": i, "rank": 32, "recall_mass": 0.9} for i in range(L)])
        b.mark("predictors.ffn")
    if quality:
        b.save_json("quality.json", [{"sparsity": s, "ppl": 10 + 20 * s ** 3, "label": "dense->sparse"}
                                     for s in (0.0, 0.5, 0.8, 0.9)] + [{"label": "broken"}])
    return b


def check_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    img = mpimg.imread(path)
    w, h = SIZES[path.name]
    assert img.shape[:2] == (round(h * DPI), round(w * DPI))
    assert img.std() > 0.05  # something was drawn


def test_full_report(tmp_path):
    b = make_bundle(tmp_path / "b", quality=True)
    paths = write_report(b)
    assert [p.name for p in paths] == ["firing_frequency.png", "mass_cdf.png", "placement.png",
                                       "predictor_recall.png", "quality.png"]
    for p in paths:
        assert p.parent == b.path / "report"
        check_png(p)


def test_optional_parts_skipped(tmp_path):
    b = make_bundle(tmp_path / "b", placement=False, predictors=False)
    paths = write_report(b, tmp_path / "out")
    assert [p.name for p in paths] == ["firing_frequency.png", "mass_cdf.png"]
    for p in paths:
        check_png(p)
    assert "GPU" not in summary_text(b)


def test_summary_numbers(tmp_path):
    b = make_bundle(tmp_path / "b")
    text = summary_text(b)
    assert "toy-relu.gguf" in text and "toy-corpus" in text
    counts, masses, _ = b.stats()
    hot = b.placement()
    rows = text.splitlines()[2:]
    assert len(rows) == L
    for i, row in enumerate(rows):
        m = np.sort(masses[i])[::-1]
        top10 = m[: int(np.ceil(0.1 * FFN))].sum() / m.sum()
        sp = 1 - counts[i].sum() / (TOKENS * FFN)
        gpu_mass = masses[i][hot[i]].sum() / masses[i].sum()
        layer, ffn, *shares = row.split()
        assert (int(layer), int(ffn)) == (i, FFN)
        assert [float(s.rstrip("%")) for s in shares] == pytest.approx(
            [100 * sp, 100 * top10, 100 * hot[i].mean(), 100 * gpu_mass], abs=0.006)
        assert 0.3 < top10 < 0.95  # a power law, not uniform


def test_without_stats_says_run_profile(tmp_path):
    b = Bundle.create(tmp_path / "b", model={"file": "toy.gguf", "n_layers": 2})
    with pytest.raises(BundleError, match="powerinfer profile"):
        write_report(b)
    with pytest.raises(BundleError, match="powerinfer profile"):
        summary_text(b)
