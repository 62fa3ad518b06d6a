"""The offline pipeline on real parts: profiler statistics against an independent recount,
SwiGLU threshold calibration, interruption safety, and evaluation against transformers."""
import math

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
                                                                       tmp_path):
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


def test_bundle_errors_name_the_cause(tmp_path, relu_bundle, default_model_path):
    with pytest.raises(BundleError, match="no manifest.json"):
        Bundle.open(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        Bundle.open(tmp_path)
    with pytest.raises(BundleError, match="was made for"):
        relu_bundle.check_model(default_model_path)
