"""The offline pipeline on real parts: profiler statistics against an independent recount,
SwiGLU threshold calibration, interruption safety, and evaluation against transformers."""
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import checkpoints as C
from powerinfer import Config, PowerInfer
from powerinfer.formats.bundle import Bundle, BundleError
from powerinfer.sparsity.corpus import CorpusError, load_corpus, token_windows
from powerinfer.sparsity.evaluate import evaluate
from powerinfer.sparsity.profile import ProfileOptions, profile


@pytest.fixture(scope="module")
def relu_folder(tmp_path_factory):
    model = C.build_hf_model(C.llama_family_config(hidden_act="relu", max_position_embeddings=256),
                             seed=5)
    return C.save_hf(model, tmp_path_factory.mktemp("m") / "reglu"), model


@pytest.fixture(scope="module")
def relu_bundle(relu_folder, tmp_path_factory):
    folder, _ = relu_folder
    opts = ProfileOptions(tokens=1500, window=128, samples=300)
    return profile(str(folder), "lee", tmp_path_factory.mktemp("b") / "bundle", opts, progress=False)


def test_corpus_splits_are_disjoint_real_text():
    cal, held = load_corpus("lee", "calibration"), load_corpus("lee", "held_out")
    assert len(cal.documents) > 250 and len(held.documents) > 40
    assert not set(cal.documents) & set(held.documents)
    assert "gensim" in cal.source and " the " in held.documents[0]
    with pytest.raises(CorpusError, match="neither a file nor a built-in"):
        load_corpus("no-such-corpus")


def test_profile_counts_match_an_independent_recount(relu_folder, relu_bundle):
    folder, _ = relu_folder
    b = relu_bundle
    assert b.has("stats") and b.has("samples") and b.has("thresholds")
    counts, mass, tokens = b.stats()
    # recount with a plain forward hook on the FFN's down projection (its input is the activation)
    pi = PowerInfer.from_pretrained(folder, Config(dtype="float32", max_batch=1, max_seq_len=128))
    windows = token_windows(pi.tokenizer, load_corpus("lee"), 128, 1500)
    assert tokens == sum(map(len, windows)) == 1500
    ref_c = [torch.zeros(128, dtype=torch.float64) for _ in pi.model.layers]
    ref_m = [torch.zeros(128, dtype=torch.float64) for _ in pi.model.layers]
    for i, blk in enumerate(pi.model.layers):
        def hook(mod, args, i=i):
            h = args[0][0]
            ref_c[i] += (h != 0).sum(0)
            ref_m[i] += h.abs().sum(0)
        blk.ffn.w2.register_forward_pre_hook(hook)
    with torch.inference_mode():
        for w in windows:
            pi.engine.logits(w, every=True)
    for i in range(len(ref_c)):
        assert np.array_equal(counts[i], ref_c[i].numpy().astype(np.int64))
        np.testing.assert_allclose(mass[i], ref_m[i].numpy(), rtol=1e-5)
    sparsity = 1 - sum(c.sum() for c in counts) / (tokens * 128 * len(counts))
    assert 0.3 < sparsity < 0.7  # ReLU(gate) on random weights fires about half the time


def test_a_profile_says_where_it_ran_and_names_a_device_it_cannot_use(relu_folder, relu_bundle,
                                                                       tmp_path, caplog):
    from powerinfer.errors import ConfigError
    folder, _ = relu_folder
    # ("auto": a GPU that holds the model, else the CPU)
    assert relu_bundle.manifest.settings["stats"]["device"] == \
        ("cuda" if torch.cuda.is_available() else "cpu")
    opts = ProfileOptions(tokens=256, window=128, samples=50)
    bad = ["meta", "nowhere"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in bad:
        with pytest.raises(ConfigError, match=f"device '{device}'"):
            profile(str(folder), "lee", tmp_path / device, opts, progress=False, device=device)
        assert not (tmp_path / device).exists()  # (before any bundle is made)
    with caplog.at_level("WARNING", logger="powerinfer"):  # a text too short to learn from
        profile(str(folder), "lee", tmp_path / "few", opts, progress=False, device="cpu")
    assert "profiling 256 tokens of lee: too few" in caplog.text
    assert "not used for a" not in caplog.text
    # SwiGLU's settings on a ReLU model (they were ignored without a word)
    with caplog.at_level("WARNING", logger="powerinfer"):
        profile(str(folder), "lee", tmp_path / "relu", replace(opts, sparsity=0.5),
                progress=False, device="cpu")
    assert "sparsity: not used for a reglu model, whose neurons' zeros are its own" in caplog.text


def test_samples_are_consistent_with_the_model(relu_folder, relu_bundle):
    folder, _ = relu_folder
    pi = PowerInfer.from_pretrained(folder, Config(dtype="float32", max_batch=1, max_seq_len=128))
    held = relu_bundle.manifest.settings["samples"]["held_out"]
    for i, blk in enumerate(pi.model.layers):
        s = relu_bundle.samples(i)
        assert s["x_ffn"].shape == s["x_layer"].shape == (300, 64) and s["mag"].shape == (held, 128)
        fired = np.unpackbits(s["fired"], axis=1, count=128).astype(bool)
        # the fired mask is the activation of the stored FFN input (up to its f16 rounding)
        with torch.inference_mode():
            h = blk.ffn.neurons(blk.ffn_norm(torch.from_numpy(s["x_ffn"]).float()))
        assert (fired == (h != 0).numpy()).mean() > 0.995
        assert np.array_equal(s["mag"] > 0, fired[-held:])
        assert not np.allclose(s["x_ffn"], s["x_layer"])  # attention changed the residual


def test_samples_past_memory_are_gathered_in_files_and_are_the_same(relu_folder, relu_bundle,
                                                                     tmp_path, monkeypatch, caplog):
    """Samples past SAMPLE_MEMORY are gathered in files beside the bundle (a 32-layer 7B's
    default 16,384 a layer were cut to 1,927 to fit in RAM): the same rows as the profile that
    held them in memory, every one asked for, and the folder gone afterwards, also where the
    profile is interrupted, and a killed profile's folder removed by the next. Where the disk
    holds fewer, fewer, with a warning, in RAM where it holds more of them."""
    import logging
    import shutil

    from collections import namedtuple

    from powerinfer.sparsity import profile as prof

    folder, _ = relu_folder
    opts = ProfileOptions(tokens=1500, window=128, samples=300)
    monkeypatch.setattr(prof, "SAMPLE_MEMORY", 1 << 16)  # (300 rows of 2 layers: 0.35 MB)
    with caplog.at_level(logging.INFO, logger="powerinfer"):
        b = profile(str(folder), "lee", tmp_path / "files", opts, progress=False)
    assert "gathered in files beside the bundle" in caplog.text
    assert b.manifest.settings["samples"] == relu_bundle.manifest.settings["samples"]
    for i in range(2):
        mine, ref = b.samples(i), relu_bundle.samples(i)
        assert set(mine) == set(ref)
        for k in ref:
            assert mine[k].dtype == ref[k].dtype and np.array_equal(mine[k], ref[k]), k
    assert not list((tmp_path / "files").glob(".samples-*"))

    calls = []
    original = Bundle.save_tensors

    def interrupted(self, name, tensors):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, name, tensors)
    monkeypatch.setattr(Bundle, "save_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        profile(str(folder), "lee", tmp_path / "cut", opts, progress=False)
    assert not list((tmp_path / "cut").glob(".samples-*"))
    monkeypatch.setattr(Bundle, "save_tensors", original)
    (tmp_path / "cut" / ".samples-killed").mkdir()  # a killed profile's folder: removed
    (tmp_path / "cut" / ".samples-killed" / "0.x_layer.npy").write_bytes(b"0" * 1000)
    profile(str(folder), "lee", tmp_path / "cut", opts, progress=False)
    assert not list((tmp_path / "cut").glob(".samples-*"))

    usage = namedtuple("usage", "total used free")
    row = math.ceil(2 * (2 * 64 * 4 + 16 + 0.1 * 128 * 4))  # (a sample row's bytes, two layers)
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: usage(1 << 40, 0, prof.DISK_MARGIN + 150 * row))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="powerinfer"):
        small = profile(str(folder), "lee", tmp_path / "small", opts, progress=False)
    assert "taking 150 a layer, held in files" in caplog.text, caplog.text
    assert small.manifest.settings["samples"]["rows"] == 150
    assert small.samples(0)["x_ffn"].shape == (150, 64)
    # a disk with less room than memory: as many as 2 GB (here 64 KiB) of RAM holds, in RAM
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, prof.DISK_MARGIN // 2))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="powerinfer"):
        full = profile(str(folder), "lee", tmp_path / "full", opts, progress=False)
    assert "taking 56 a layer, held in memory" in caplog.text, caplog.text
    assert full.manifest.settings["samples"] == {"rows": 56, "held_out": 5, "seed": 0}


def test_swiglu_thresholds_reach_the_target_sparsity(tmp_path):
    model = C.build_hf_model(C.llama_family_config(max_position_embeddings=256), seed=2)
    folder = C.save_hf(model, tmp_path / "silu")
    opts = ProfileOptions(tokens=1200, window=128, samples=100, sparsity=0.3, calib_tokens=600)
    b = profile(str(folder), "lee", tmp_path / "bundle", opts, progress=False)
    t = b.load_tensors("thresholds.safetensors")
    assert t["quantiles"].shape == (2, 101) and (t["threshold"] > 0).all()
    counts, _, tokens = b.stats()
    for c in counts:  # calibrated on the first 600 tokens, measured on all 1200
        assert abs((1 - c.sum() / (tokens * 128)) - 0.3) < 0.05


def test_interrupted_profile_leaves_a_consistent_bundle(relu_folder, tmp_path, monkeypatch):
    folder, _ = relu_folder
    opts = ProfileOptions(tokens=300, window=128, samples=50)
    out = tmp_path / "bundle"
    profile(str(folder), "lee", out, opts, progress=False)
    calls = []

    def interrupted(self, name, tensors):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, name, tensors)
    original = Bundle.save_tensors
    monkeypatch.setattr(Bundle, "save_tensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        profile(str(folder), "lee", out, opts, progress=False)
    b = Bundle.open(out)  # still a readable bundle, and it does not claim the unfinished parts
    assert b.manifest.parts == []
    with pytest.raises(BundleError, match="run `powerinfer profile` first"):
        b.stats()
    assert not list(out.rglob("*.tmp"))


def test_eval_dense_perplexity_matches_transformers(relu_folder, relu_bundle):
    folder, hf = relu_folder
    rows = evaluate(str(folder), relu_bundle, tokens=600, window=128, progress=False)
    by = {r["label"]: r for r in rows}
    # transformers on the same held-out windows
    pi = PowerInfer.from_pretrained(folder, Config(dtype="float32", max_batch=1, max_seq_len=128))
    nll, n = 0.0, 0
    with torch.inference_mode():
        for w in token_windows(pi.tokenizer, load_corpus("lee", "held_out"), 128, 600):
            out = hf(torch.tensor([w]), labels=torch.tensor([w]))
            nll += float(out.loss) * (len(w) - 1)
            n += len(w) - 1
    assert by["dense"]["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    # ReLU-family oracle: skipping the zeros changes nothing, and skips about half the neurons
    o = by["oracle"]
    assert o["ppl"] == pytest.approx(by["dense"]["ppl"], rel=1e-5) and o["top1"] == 1.0
    assert o["kl"] < 1e-6 and 0.3 < o["sparsity"] < 0.7 and o["recall_mass"] == 1.0
    assert relu_bundle.has("eval") and relu_bundle.load_json("quality.json")[0]["label"] == "dense"


def test_eval_holds_one_copy_of_the_model_with_the_same_results(relu_folder, relu_bundle,
                                                                monkeypatch):
    # one copy (the dense pass first, its log-probabilities kept in memory, or in a file past
    # SAMPLE_MEMORY, then the same model's FFNs swapped) gives two copies' rows bit for bit,
    # and the file is gone at the end
    import tempfile
    from pathlib import Path

    import powerinfer.sparsity.profile as P
    from powerinfer.errors import ConfigError

    folder, _ = relu_folder

    def run(copies):
        return evaluate(str(folder), relu_bundle, tokens=300, window=64, progress=False,
                        copies=copies)
    two = run(2)
    assert {r["label"] for r in two} >= {"dense", "oracle"} and two[1]["sparsity"] > 0.3
    assert run(1) == two
    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(P, "SAMPLE_MEMORY", 0)
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    stale = relu_bundle.path / ".eval-killed"  # a killed eval's folder: removed by the next
    stale.mkdir()
    assert run(1) == two
    assert len(made) == 1 and Path(made[0]).parent == relu_bundle.path
    assert not Path(made[0]).exists() and not stale.exists()
    with pytest.raises(ConfigError, match="copies: 1 or 2"):
        run(3)
    # a disk without room for the file: a clear error before the dense pass (a full disk under
    # the map's pages would end the process)
    import shutil
    usage = shutil.disk_usage(relu_bundle.path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=P.DISK_MARGIN))
    with pytest.raises(ConfigError, match="GB of disk beside the bundle, 0.0 GB free"):
        run(1)
    assert len(made) == 1 and run(2) == two


def test_bundle_errors_name_the_cause(tmp_path, relu_bundle, default_model_path):
    with pytest.raises(BundleError, match="no manifest.json"):
        Bundle.open(tmp_path)
    with pytest.raises(BundleError, match="no such folder"):  # (it said "no manifest.json")
        Bundle.open(tmp_path / "smol-bundle")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        Bundle.open(tmp_path)
    with pytest.raises(BundleError, match="was made for"):
        relu_bundle.check_model(default_model_path)


def damaged(bundle: Bundle, where, edit_manifest=None) -> Bundle:
    """A copy of `bundle` in the folder `where`, its manifest passed through `edit_manifest`."""
    import json
    import shutil

    shutil.copytree(bundle.path, where)
    if edit_manifest is not None:
        f = where / "manifest.json"
        f.write_text(json.dumps(edit_manifest(json.loads(f.read_text()))))
    return where


@pytest.mark.parametrize("edit,needle", [
    (lambda m: [1, 2], "manifest.json: holds a list, not an object"),
    (lambda m: {k: v for k, v in m.items() if k != "model"}, "no 'model' field"),
    (lambda m: {**m, "model": {**m["model"], "n_layers": "four"}},
     "'model.n_layers' is a string, expected an integer"),
    (lambda m: {**m, "model": {k: v for k, v in m["model"].items() if k != "file"}},
     "'model.file' is missing"),
    (lambda m: {**m, "model": {**m["model"], "size": "big"}},
     "'model.size' is a string, expected an integer"),
    (lambda m: {**m, "settings": []}, "'settings' is a list, expected an object"),
    (lambda m: {**m, "parts": "stats"}, "'parts' is a string, expected a list"),
    (lambda m: {**m, "version": "1"}, "format version '1'"),
])
def test_a_damaged_manifest_is_named_field_by_field(tmp_path, relu_bundle, edit, needle):
    # (each was a KeyError, TypeError or AttributeError wherever the field was first read, or a
    # message that named another cause: "format version 1 (this build reads 1)")
    with pytest.raises(BundleError, match=needle.replace("(", r"\(")):
        Bundle.open(damaged(relu_bundle, tmp_path / "b", edit))


def test_a_damaged_part_is_named_and_a_later_writers_field_is_left_out(tmp_path, relu_bundle,
                                                                       relu_folder):
    from safetensors.numpy import load_file, save_file

    from powerinfer.model.predictor import load_predictors

    later = Bundle.open(damaged(relu_bundle, tmp_path / "later", lambda m: {**m, "extra": 1}))
    assert later.stats()[2] == relu_bundle.stats()[2]
    unsure = Bundle.open(damaged(relu_bundle, tmp_path / "unsure", lambda m: {
        **m, "model": {k: v for k, v in m["model"].items() if k != "sha256"}}))
    with pytest.raises(BundleError, match="records no size or sha256 of the model file"):
        unsure.check_model(relu_folder[0])  # (a KeyError)
    b = Bundle.open(damaged(relu_bundle, tmp_path / "b", lambda m: {
        **m, "corpus": {k: v for k, v in m["corpus"].items() if k != "tokens"}}))
    with pytest.raises(BundleError, match="'corpus.tokens' is missing"):
        b.stats()
    b = Bundle.open(damaged(relu_bundle, tmp_path / "c"))
    n = b.manifest.model["ffn_dim"]
    t = load_file(str(b.path / "stats.safetensors"))
    save_file({**t, "count.0": t["count.0"][: n // 2]}, str(b.path / "stats.safetensors"))
    with pytest.raises(BundleError, match=rf"stats.safetensors: count.0 has shape \({n // 2},\), "
                                          rf"expected \({n},\)"):
        b.stats()
    th = load_file(str(b.path / "thresholds.safetensors"))["threshold"]
    save_file({"threshold": np.full_like(th, np.nan)}, str(b.path / "thresholds.safetensors"))
    with pytest.raises(BundleError, match="threshold holds NaN or infinite values"):
        b.thresholds()  # (NaN passed every comparison: an evaluation of garbage, exit 0)
    # predictors of another shape: named, not a kernel's "bytes per group" later
    d, L = b.manifest.model["dim"], b.n_layers
    pred = {f"fc1.{i}": np.zeros((8, d), np.float32) for i in range(L)}
    pred |= {f"fc2.{i}": np.zeros((n, 16), np.float32) for i in range(L)}
    b.save_tensors("predictors.ffn.safetensors", pred)
    b.mark("predictors.ffn")
    with pytest.raises(BundleError, match=rf"fc2.0 has shape \({n}, 16\), expected \({n}, 8\)"):
        load_predictors(b, "ffn")
    (b.path / "eval.json").write_text("[1, 2]")
    with pytest.raises(BundleError, match="eval.json holds a list, expected an object"):
        b.load_json("eval.json")
    (b.path / "eval.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(BundleError, match="eval.json is not valid JSON"):
        b.load_json("eval.json")
    # a table's rows, hand-edited: the row and the key named (a KeyError or TypeError where
    # they were read)
    from powerinfer.engine.plan import check_quality
    from powerinfer.sparsity.input_sparsity import bundle_thresholds
    (b.path / "eval.json").write_text('{"rows": [{"label": "predicted (ffn input)"}]}')
    b.mark("eval")
    with pytest.raises(BundleError, match="eval.json row 'predicted \\(ffn input\\)': missing "
                                          "'ppl_delta'"):
        check_quality(b, "ffn", 0.02)
    (b.path / "predictors.ffn.json").write_text('[{"rank": 8}, {"rank": "8"}]')
    with pytest.raises(BundleError, match="predictors.ffn.json row 1: 'rank' is a string, "
                                          "expected an integer"):
        b.load_json("predictors.ffn.json", {"rank": int})
    (b.path / "input_sparsity.json").write_text('{"thresholds": [[0, "qkv", 0.1], [1, "o"]]}')
    b.mark("input_sparsity")
    with pytest.raises(BundleError, match=r"'thresholds' entry 1 is \[1, \"o\"\], expected "
                                          r"\[layer, part, magnitude\]"):
        bundle_thresholds(b)
    # the model it was made for, changed in place: said so, not "made for X, not for X"
    import shutil
    folder, _ = relu_folder
    copy = tmp_path / "m" / folder.name
    shutil.copytree(folder, copy)
    weights = next(copy.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="the same size, other contents: it changed, or was "
                                          "damaged or cut short"):
        relu_bundle.check_model(copy)


def test_a_models_sha256_is_read_once_and_again_when_the_file_changes(tmp_path, monkeypatch):
    import hashlib

    from powerinfer.formats import bundle as B

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 4096)
    assert B.file_sha256(f) == hashlib.sha256(b"a" * 4096).hexdigest()

    def unread(*_):
        raise AssertionError("read again")
    want = hashlib.sha256(b"a" * 4096).hexdigest()
    with monkeypatch.context() as m:  # (each load with a bundle read the whole model)
        m.setattr(B.hashlib, "sha256", unread)
        assert B.file_sha256(f) == want
    f.write_bytes(b"b" * 4096)  # the same size, other contents, in place
    assert B.file_sha256(f) == hashlib.sha256(b"b" * 4096).hexdigest()
    (tmp_path / "cache" / "powerinfer" / "sha256.json").write_text("{not json")
    assert B.file_sha256(f) == hashlib.sha256(b"b" * 4096).hexdigest()  # a damaged cache: read


def test_a_bundles_parts_are_readable_as_the_umask_says(tmp_path):
    # (safetensors wrote its files readable by their owner alone, the JSON parts by everyone: a
    # service running as another user could not read a bundle's tensors)
    import os

    b = Bundle.create(tmp_path / "b", {"file": "m.gguf", "n_layers": 1})
    old = os.umask(0o022)
    try:
        b.save_tensors("t.safetensors", {"x": np.zeros(3, np.float32)})
        b.save_json("t.json", {"a": 1})
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (b.path / "t.safetensors",
                                                         b.path / "t.json")}
    assert modes == {"t.safetensors": 0o644, "t.json": 0o644}, modes
