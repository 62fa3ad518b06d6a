"""Activation predictors trained on samples taken from a real (random, tiny) ReGLU model."""
import json

import numpy as np
import pytest
import torch

from powerinfer.formats.bundle import Bundle, BundleError
from powerinfer.formats.args import ModelArgs
from powerinfer.model.transformer import Transformer
from powerinfer.model.predictor import Predictors, load_predictors
from powerinfer.sparsity.train import (format_table, layer_metrics, layer_samples, search_rank,
                                        train_layer, train_predictors)

DIM, FFN, LAYERS, HELD_OUT = 64, 256, 3, 600
RANKS = [4, 8, 16, 32, 64]
EPOCHS = 30  # a small bundle takes few steps per epoch: more epochs than the default


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    a = ModelArgs(arch="llama", vocab_size=300, dim=DIM, n_layers=LAYERS, n_heads=4, n_kv_heads=2,
                  ffn_dim=FFN, ffn_act="reglu", max_seq_len=128)
    m = Transformer(a)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m.eval().requires_grad_(False)


def make_samples(path, batch=48, seq=64) -> Bundle:
    """Run the model over random tokens and write what the profiler writes: per layer the block
    input, the residual entering the FFN, the fired mask and |activation| of the held-out rows."""
    m = tiny_model()
    m.setup_cache(batch, seq)
    got = [{"x_layer": [], "x_ffn": [], "act": []} for _ in range(LAYERS)]
    for i, b in enumerate(m.layers):
        b.register_forward_pre_hook(lambda mod, args, i=i: got[i]["x_layer"].append(args[0]))

        def after_norm(mod, args, out, i=i, ffn=b.ffn):  # args[0]: the residual; out: ffn_norm(h)
            got[i]["x_ffn"].append(args[0])
            got[i]["act"].append(ffn.neurons(out))
        b.ffn_norm.register_forward_hook(after_norm)
    tokens = torch.randint(0, 300, (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        m(tokens, torch.arange(seq).expand(batch, seq))
    bundle = Bundle.create(path, {"file": "tiny", "n_layers": LAYERS, "dim": DIM, "ffn_dim": FFN,
                                  "ffn_act": "reglu"})
    order = np.random.default_rng(0).permutation(batch * seq)  # held-out rows: any tokens
    for i, g in enumerate(got):
        x_layer, x_ffn, act = (torch.cat(g[k]).reshape(batch * seq, -1).numpy()[order]
                               for k in ("x_layer", "x_ffn", "act"))
        bundle.save_tensors(f"samples/layer_{i:03d}.safetensors", {
            "x_layer": x_layer.astype(np.float16), "x_ffn": x_ffn.astype(np.float16),
            "fired": np.packbits(act != 0, axis=1),
            "mag": np.abs(act[-HELD_OUT:]).astype(np.float16)})
    bundle.manifest.settings["samples"] = {"held_out": HELD_OUT, "rows": batch * seq}
    bundle.mark("samples")
    return bundle


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits
    bundle = make_samples(tmp_path_factory.mktemp("bundle"))
    rows = {inp: train_predictors(bundle, inp, ranks=RANKS, epochs=EPOCHS, progress=False)
            for inp in ("ffn", "layer")}
    yield bundle, rows
    torch.set_num_threads(threads)


@pytest.mark.parametrize("inp", ["ffn", "layer"])
def test_trained_predictors_reach_high_recall(trained, inp):
    bundle, rows = trained
    print(f"\n{inp} input\n" + format_table(rows[inp]))
    for r in rows[inp]:
        assert 0.3 < r["positive_rate"] < 0.7  # ReGLU on random weights: about half fire
        assert r["recall_mass"] >= (0.99 if inp == "ffn" else 0.97), r
        assert r["active_share"] < (0.8 if inp == "ffn" else 0.95), r  # not "all are active"
        assert r["rank"] in RANKS and r["reached"] == (r["recall_mass"] >= 0.99)
    assert all(r["reached"] for r in rows["ffn"])


def numpy_metrics(fc1, fc2, x, fired, mag):
    pred = np.maximum(x @ fc1.T, 0) @ fc2.T >= 0
    tp = pred & fired
    return {"recall_count": tp.sum() / fired.sum(),
            "recall_mass": (mag * tp).sum() / (mag * fired).sum(),
            "precision": tp.sum() / pred.sum(),
            "active_share": pred.mean(), "positive_rate": fired.mean()}


def test_recall_matches_a_direct_computation(trained):
    bundle, _ = trained
    x, fired, mag = layer_samples(bundle, 1, "ffn")
    xv, fv, mv = x[-HELD_OUT:].astype(np.float64), fired[-HELD_OUT:], mag.astype(np.float64)
    g = np.random.default_rng(3)  # a fixed, untrained predictor
    fc1, fc2 = g.normal(size=(16, DIM)), g.normal(size=(FFN, 16))
    want = numpy_metrics(fc1, fc2, xv, fv, mv)
    pred = torch.from_numpy(np.maximum(xv @ fc1.T, 0) @ fc2.T >= 0)
    got = layer_metrics(pred, torch.from_numpy(fv), torch.from_numpy(mv))
    assert 0.2 < want["recall_count"] < 0.8 and want["recall_mass"] != want["recall_count"]
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9), k
    # train_layer's metrics are those of the weights it returns, applied to the raw inputs (the
    # normalising constant folded into fc1 changes no mask)
    fc1, fc2, m = train_layer(x, fired, mag, 16, epochs=3)
    want = numpy_metrics(fc1.astype(np.float64), fc2.astype(np.float64), xv, fv, mv)
    for k, v in want.items():
        assert m[k] == pytest.approx(v, abs=2e-3), k


def test_rank_search_picks_a_smaller_rank_for_a_lower_target(trained):
    bundle, rows = trained
    x, fired, mag = layer_samples(bundle, 2, "layer")
    # a fixed weight of the positives and no FFN cost: the first rank reaching the target
    kw = dict(pos_weight=1.0, neuron_macs=0)
    high = search_rank(x, fired, mag, RANKS, recall_target=0.95, **kw)[2]
    low = search_rank(x, fired, mag, RANKS, recall_target=0.85, **kw)[2]
    assert low["reached"] and low["rank"] < high["rank"], (low, high)
    # the default search keeps the reaching predictor of least work per token
    for r in rows["layer"]:
        assert r["cost"] == r["rank"] * (DIM + FFN) + round(r["active_share"] * FFN * 3 * DIM)


def test_files_written_and_reloadable(trained):
    bundle, rows = trained
    for inp in ("ffn", "layer"):
        assert bundle.has(f"predictors.{inp}")
        assert bundle.manifest.settings[f"predictors.{inp}"]["ranks"] == RANKS
        assert bundle.manifest.settings[f"predictors.{inp}"]["device"] == \
            ("cuda" if torch.cuda.is_available() else "cpu")  # ("auto")
        table = json.loads((bundle.path / f"predictors.{inp}.json").read_text())
        assert table == rows[inp]
        assert {"layer", "rank", "recall_count", "recall_mass", "precision", "active_share",
                "positive_rate", "reached", "seconds"} <= set(table[0])
        p = load_predictors(Bundle.open(bundle.path), inp)
        assert isinstance(p, Predictors) and p.input == inp
        assert p.ranks == [r["rank"] for r in table]
        for i, r in enumerate(table):
            assert p.fc1[i].shape == (r["rank"], DIM) and p.fc2[i].shape == (FFN, r["rank"])
            assert p.fc1[i].dtype == torch.float32
    half = load_predictors(bundle, "ffn", dtype=torch.bfloat16)
    assert half.fc2[0].dtype == torch.bfloat16
    assert half.mask(0, torch.randn(2, 3, DIM)).shape == (FFN,)


def test_mask_matches_the_training_metrics(trained):
    bundle, rows = trained
    for inp in ("ffn", "layer"):
        p = load_predictors(bundle, inp)
        for i in range(LAYERS):
            x, fired, mag = layer_samples(bundle, i, inp)
            xv = torch.from_numpy(x[-HELD_OUT:].astype(np.float32))
            pred = torch.stack([p.mask(i, row[None]) for row in xv])  # one token at a time
            m = layer_metrics(pred, torch.from_numpy(fired[-HELD_OUT:]), torch.from_numpy(mag))
            for k in ("recall_count", "recall_mass", "precision", "active_share"):
                assert m[k] == pytest.approx(rows[inp][i][k], abs=1e-6), (inp, i, k)
            # a batch (B, T, dim): the union of its rows' masks
            batch = xv[:12].reshape(3, 4, DIM)
            assert torch.equal(p.mask(i, batch), pred[:12].any(0))


def test_a_device_predictors_cannot_train_on_is_named(trained):
    # before any layer trains, and the bundle's predictors stay as they were
    from powerinfer.errors import ConfigError
    bundle, _ = trained
    before = (bundle.path / "predictors.ffn.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="'meta': predictors train on the CPU or on a GPU"):
        train_predictors(bundle, "ffn", device="meta", progress=False)
    with pytest.raises(ConfigError, match="'nowhere'"):
        train_predictors(bundle, "ffn", device="nowhere", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"'cuda': .* \(none here\)"):
            train_predictors(bundle, "ffn", device="cuda", progress=False)
    assert (bundle.path / "predictors.ffn.safetensors").read_bytes() == before


def test_bundle_without_samples_says_to_profile(tmp_path):
    bundle = Bundle.create(tmp_path, {"file": "tiny", "n_layers": LAYERS, "dim": DIM,
                                      "ffn_dim": FFN})
    with pytest.raises(BundleError, match="powerinfer profile"):
        train_predictors(bundle, "ffn", progress=False)
    with pytest.raises(BundleError, match="train-predictors"):
        load_predictors(bundle, "ffn")
    with pytest.raises(ValueError, match="ffn, layer"):
        train_predictors(bundle, "attn", progress=False)


@pytest.mark.parametrize("source", ["ffn", "layer"])
def test_bf16_predictors_run_on_8bit_groups_as_their_rounded_matrices(monkeypatch, source):
    # bf16 predictors on the CPU kernel (the default beside a bf16 model) hold each matrix as
    # Q8_0 blocks in 16-row groups (q8x16), about half the bytes a decode step reads; their
    # logits are those of the blocks' weights over the input rounded to 8 bits a block, both
    # GEMVs; the masks the modules compute are the native loops' (`pred_logits`); with
    # POWERINFER_PREDICTOR_ROWS=model the bf16 rows run as before; float32 predictors and shapes
    # the groups cannot hold (neurons not a multiple of 16) keep their own rows
    from powerinfer import kernels
    from powerinfer.model import predictor as P
    if not kernels.available():
        pytest.skip("the kernel library is not built here")
    g = torch.Generator().manual_seed(1)
    fc1 = [(torch.randn(64, 96, generator=g) / 8).bfloat16() for _ in range(2)]
    fc2 = [torch.randn(208, 64, generator=g).bfloat16() for _ in range(2)]
    preds = Predictors(fc1, fc2, source, threshold=0.1)
    assert preds.held_x16 and preds.kernel_format(1) == "q8x16"
    w1, w2, fmt = preds.kernel_rows(1)
    assert fmt == "q8x16" and w1.dtype == torch.uint8 and w1.shape == (64 // 16, 96 // 32 * 544)
    assert w1.nbytes + w2.nbytes < 0.55 * (fc1[1].nbytes + fc2[1].nbytes)
    x = torch.randn(5, 96, generator=g).bfloat16()
    d1 = kernels.dequantize_rows(kernels.quantize_rows(fc1[1], "q8_0"), "q8_0", 96)
    d2 = kernels.dequantize_rows(kernels.quantize_rows(fc2[1], "q8_0"), "q8_0", 64)
    # (each GEMV against its own reference: the first's floats, rounded to 8 bits for the
    # second, could round a value at a half step either way)
    h = kernels.linear_x16(x.float(), w1, 64, "q8x16")
    assert (h - kernels.quantize_input(x) @ d1.T).abs().max() <= 1e-5 * h.abs().max()
    want = kernels.quantize_input(torch.relu(h)) @ d2.T
    got = preds.logits(1, x)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(preds.active(1, x), got >= 0.1)
    # the bf16 rows' logits are near: the decisions differ only near the threshold
    exact = torch.relu(x.double() @ fc1[1].double().T) @ fc2[1].double().T
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()
    near = (exact - 0.1).abs() < 0.02 * exact.abs().max()
    assert torch.equal(preds.active(1, x)[~near], (exact >= 0.1)[~near])
    # what a process holds counts them, and a decode step reads them, not the bf16 rows
    from powerinfer.model.transformer import held_bytes
    bf16 = sum(t.nbytes for t in (*fc1, *fc2))
    assert held_bytes(preds) == bf16 + sum(w.nbytes for i in range(2) for w in preds.kernel_rows(i)[:2])
    assert preds.decode_bytes() < 0.55 * bf16
    monkeypatch.setattr(P, "ROWS", "model")  # the switch: the bf16 rows
    plain = Predictors(fc1, fc2, source, threshold=0.1)
    assert not plain.held_x16 and plain.kernel_format(1) == "bf16" and plain.decode_bytes() == bf16
    assert torch.equal(plain.logits(1, x), kernels.pred_logits(x, fc1[1], fc2[1], "bf16"))
    monkeypatch.setattr(P, "ROWS", "q8x16")
    assert Predictors([w.float() for w in fc1], [w.float() for w in fc2], source).kernel_format(0) == "f32"
    odd = Predictors([torch.randn(64, 96).bfloat16()], [torch.randn(200, 64).bfloat16()], source)
    assert not odd.held_x16 and odd.kernel_format(0) == "bf16"


def test_a_rows_masks_do_not_depend_on_its_batch_past_64_rows():
    # decode rows on the kernel's GEMV compute each row alone; past 64 rows (a batch of 64
    # sequences and the health probe's) they run 64 at a time on it too, not through torch's
    # matmul: a row's logits and masks are the ones it gets alone, in any batch, in process and
    # in the predictor actor's native loop alike
    from powerinfer import kernels
    if not kernels.available():
        pytest.skip("the kernel library is not built here")
    g = torch.Generator().manual_seed(2)
    fc1 = [(torch.randn(64, 96, generator=g) / 8).bfloat16()]
    fc2 = [torch.randn(208, 64, generator=g).bfloat16()]
    for preds in (Predictors(fc1, fc2, "layer", threshold=0.1),
                  Predictors([w.float() for w in fc1], [w.float() for w in fc2], "layer", threshold=0.1)):
        x = torch.randn(70, 96, generator=g).bfloat16()
        whole = preds.logits(0, x)
        alone = torch.cat([preds.logits(0, x[i:i + 1]) for i in range(70)])
        assert torch.equal(whole, alone)
        assert torch.equal(preds.active(0, x), alone >= 0.1)
