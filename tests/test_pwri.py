"""The original PowerInfer's layout: export checked field by field against what the original reads
(see powerinfer/pwri.py), import round trip, PWRI files loading as ordinary models, errors."""
import struct

import gguf
import numpy as np
import pytest
import torch

import checkpoints as C
from powerinfer.formats import pwri
from powerinfer.formats.bundle import Bundle, BundleError, file_sha256
from powerinfer.compat import gguf_reader
from powerinfer.errors import ConfigError, ModelLoadError
from powerinfer.formats.gguf import dequantize
from powerinfer.formats.loader import load_checkpoint
from powerinfer.model.transformer import Transformer

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
DIM, FFN, RANKS = 64, 128, (8, 16)  # ranks differ per layer, as the original allows
THRESHOLD, VRAM = 0.25, 123_456_789


def make_bundle(path, model_file, ranks=RANKS, seed=0) -> Bundle:
    """Random predictors (per-layer ranks) and a random placement, for `model_file`."""
    b = Bundle.create(path, model={
        "file": model_file.name, "sha256": file_sha256(model_file),
        "size": model_file.stat().st_size, "arch": "llama", "n_layers": len(ranks), "dim": DIM,
        "ffn_dim": FFN, "ffn_act": "reglu"})
    rng = np.random.default_rng(seed)
    fc = {}
    for i, r in enumerate(ranks):
        fc[f"fc1.{i}"] = rng.standard_normal((r, DIM)).astype(np.float32)
        fc[f"fc2.{i}"] = rng.standard_normal((FFN, r)).astype(np.float32)
    b.save_tensors("predictors.ffn.safetensors", fc)
    b.save_json("predictors.ffn.json", [{"layer": i, "rank": r} for i, r in enumerate(ranks)])
    b.mark("predictors.ffn", {"made": "by hand"})
    hot = [rng.random(FFN) < 0.3 for _ in ranks]
    hot[-1][:] = False  # a layer with nothing on the GPU: an empty gpu_bucket
    b.save_tensors("placement.safetensors",
                   {f"hot.{i}": h.astype(np.uint8) for i, h in enumerate(hot)})
    b.mark("placement", {"made": "by hand"})
    return b


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A ReLU LLaMA (tied embeddings, Q8_0 weights), a bundle for it, its PWRI export + split."""
    d = tmp_path_factory.mktemp("pwri")
    model = C.build_hf_model(C.llama_family_config(hidden_act="relu", tied=True), seed=5)
    src = d / "relu.gguf"
    C.write_llama_gguf(src, model, ffn_activation="reglu", qtype=Q.Q8_0)
    bundle = make_bundle(d / "bundle", src)
    out = pwri.export_pwri(src, bundle, d / "relu.powerinfer.gguf", threshold=THRESHOLD)
    split = pwri.export_gpu_index(bundle, pwri.split_path(out), VRAM)
    return {"dir": d, "src": src, "bundle": bundle, "out": out, "split": split}


def stock_reader(path, tmp_path):
    """The gguf package's own reader on the file with the GGUF magic put back."""
    raw = path.read_bytes()
    copy = tmp_path / (path.name + ".as-gguf")
    copy.write_bytes(b"GGUF" + raw[4:])
    return gguf.GGUFReader(copy)


def raw_field(reader, name) -> bytes:
    f = reader.fields[name]
    return bytes(reader.data[f.offset:f.offset + sum(p.nbytes for p in f.parts)])


# ------------------------------------------------------------------------- the model file

def test_model_file_fields(files, tmp_path):
    out, src, bundle = files["out"], files["src"], files["bundle"]
    raw = out.read_bytes()
    assert raw[:4] == b"PWRI" and struct.unpack("<I", raw[4:8]) == (3,)  # GGUF v3 header
    r, s = stock_reader(out, tmp_path), gguf.GGUFReader(src)
    got, orig = {t.name: t for t in r.tensors}, {t.name: t for t in s.tensors}
    L = len(RANKS)
    downs = {f"blk.{i}.ffn_down.weight" for i in range(L)}
    added = {f"blk.{i}.{n}.weight" for i in range(L) for n in ("fc1", "fc2", "ffn_down_t")}
    assert set(got) == (set(orig) - downs) | added | {"output.weight"}

    for name, t in orig.items():  # every original tensor: same type, shape, bytes
        if name not in downs:
            assert got[name].tensor_type == t.tensor_type and list(got[name].shape) == list(t.shape)
            assert np.asarray(got[name].data).tobytes() == np.asarray(t.data).tobytes(), name
    assert orig["blk.0.ffn_up.weight"].tensor_type == Q.Q8_0  # copied quantized, not re-quantized
    # the original requires output.weight [n_embd, n_vocab]; a tied model gets token_embd's bytes
    emb, outw = orig["token_embd.weight"], got["output.weight"]
    assert outw.tensor_type == emb.tensor_type and list(outw.shape) == [DIM, C.VOCAB_SIZE]
    assert np.asarray(outw.data).tobytes() == np.asarray(emb.data).tobytes()

    pred = bundle.load_tensors("predictors.ffn.safetensors")
    for i, rank in enumerate(RANKS):
        fc1, fc2, dt = (got[f"blk.{i}.{n}.weight"] for n in ("fc1", "fc2", "ffn_down_t"))
        assert [t.tensor_type for t in (fc1, fc2, dt)] == [Q.F16] * 3
        # ggml shapes (gguf-py reports them reversed from numpy): fc1 [n_embd, r],
        # fc2 [r, n_ff], ffn_down_t [n_embd, n_ff]
        assert [list(t.shape) for t in (fc1, fc2, dt)] == [[DIM, rank], [rank, FFN], [DIM, FFN]]
        np.testing.assert_array_equal(fc1.data, pred[f"fc1.{i}"].astype(np.float16))
        np.testing.assert_array_equal(fc2.data, pred[f"fc2.{i}"].astype(np.float16))
        down = dequantize(orig[f"blk.{i}.ffn_down.weight"])  # numpy (dim, ffn_dim)
        np.testing.assert_array_equal(dt.data, down.T.astype(np.float16))

    for name in s.fields:  # every original key, byte for byte
        if not name.startswith("GGUF."):
            assert raw_field(r, name) == raw_field(s, name), name
    th = r.fields["powerinfer.sparse_threshold"]
    assert th.types == [V.FLOAT32] and th.contents() == THRESHOLD
    assert r.fields["powerinfer.ffn_activation"].contents() == "reglu"
    assert r.fields["general.architecture"].contents() == "llama"


def test_split_file_fields(files):
    split, bundle = files["split"], files["bundle"]
    assert split.name == "relu.powerinfer.gguf.generated.gpuidx"  # where the original looks
    raw = split.read_bytes()
    assert raw[:4] == b"PWRI" and struct.unpack("<I", raw[4:8]) == (3,)
    r = gguf_reader(split)
    assert r.fields["general.architecture"].contents() == "generic.gpu_index"
    assert r.fields["generic.gpu_index.block_count"].types == [V.UINT32]
    assert r.fields["generic.gpu_index.block_count"].contents() == len(RANKS)
    assert r.fields["split.vram_capacity"].types == [V.UINT64]  # the original type-checks it
    assert r.fields["split.vram_capacity"].contents() == VRAM
    # read by position in the original: gpu_idx of layer N at 2N, its gpu_bucket at 2N+1
    assert [t.name for t in r.tensors] == [f"blk.{i}.{n}" for i in range(len(RANKS))
                                           for n in ("gpu_idx", "gpu_bucket")]
    for t in r.tensors:  # the type as stored: 18, GGML_TYPE_I32 of the original's ggml
        type_at = t.field.offset + sum(p.nbytes for p in t.field.parts[:4])
        assert struct.unpack_from("<I", raw, type_at) == (18,)
        assert t.tensor_type == Q.I32 and len(t.shape) == 1
    for i, h in enumerate(bundle.placement()):
        idx, bucket = r.tensors[2 * i], r.tensors[2 * i + 1]
        assert list(idx.shape) == [FFN]
        np.testing.assert_array_equal(idx.data, h.astype(np.int32))
        np.testing.assert_array_equal(bucket.data, np.flatnonzero(h))
    assert r.tensors[-1].n_elements == 0  # the all-CPU layer


# ------------------------------------------------------------------------------ round trip

def test_import_round_trip(files, tmp_path):
    out, bundle = files["out"], files["bundle"]
    b = pwri.import_pwri(out, tmp_path / "imported")  # finds the split file next to the model
    b = Bundle.open(b.path)
    m = b.manifest.model
    assert (m["file"], m["sha256"], m["size"]) == (out.name, file_sha256(out), out.stat().st_size)
    assert (m["arch"], m["n_layers"], m["dim"], m["ffn_dim"], m["ffn_act"]) == \
        ("llama", len(RANKS), DIM, FFN, "reglu")
    b.check_model(out)
    assert set(b.manifest.parts) == {"thresholds", "predictors.ffn", "placement"}
    assert b.manifest.settings["predictors.ffn"]["threshold"] == THRESHOLD
    assert b.manifest.settings["placement"]["vram_capacity"] == VRAM
    pred, back = bundle.load_tensors("predictors.ffn.safetensors"), \
        b.load_tensors("predictors.ffn.safetensors")
    assert set(back) == set(pred)
    for k, v in pred.items():  # the same predictors, within f16 rounding
        assert back[k].dtype == np.float32
        np.testing.assert_array_equal(back[k], v.astype(np.float16).astype(np.float32))
    assert [row["rank"] for row in b.load_json("predictors.ffn.json")] == list(RANKS)
    for h0, h1 in zip(bundle.placement(), b.placement()):
        np.testing.assert_array_equal(h0, h1)

    elsewhere = tmp_path / "index.gpuidx"  # an explicit split file
    elsewhere.write_bytes(files["split"].read_bytes())
    b2 = pwri.import_pwri(out, tmp_path / "b2", gpu_index=elsewhere)
    assert b2.manifest.settings["placement"]["source"] == "index.gpuidx"


def test_import_without_split_file(files, tmp_path):
    lone = tmp_path / "lone.gguf"
    lone.write_bytes(files["out"].read_bytes())
    b = pwri.import_pwri(lone, tmp_path / "b")
    assert b.manifest.parts == ["thresholds", "predictors.ffn"]


def test_an_imported_model_runs_and_evaluates_in_one_step(files, tmp_path):
    """The original's main workflow: a published PowerInfer model, its predictors inside."""
    from powerinfer import Config, PowerInfer
    from powerinfer.sparsity.evaluate import evaluate
    from powerinfer.model.predictor import load_predictors

    out = files["out"]
    b = pwri.import_pwri(out, tmp_path / "b")
    preds = load_predictors(b, "ffn")
    assert preds.threshold == THRESHOLD  # the file's sparse_threshold is the firing rule
    x = torch.randn(3, DIM)
    assert torch.equal(preds.active(0, x), preds.logits(0, x) >= THRESHOLD)
    pi = PowerInfer.from_pretrained(out, Config(bundle=str(b.path), max_seq_len=64, max_batch=1))
    assert len(pi.engine.model.layers) == len(RANKS)
    seq = pi.engine.new_sequence([1, 2, 3], __import__("powerinfer").SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True))
    assert [ev.token >= 0 for ev in pi.engine.run([seq])] == [True] * 4
    rows = evaluate(str(out), b, tokens=64, window=32, progress=False)  # no corpus recorded: lee
    assert {r["kind"] for r in rows} >= {"dense", "oracle", "predicted"}


# ------------------------------------------------------------------ PWRI as an ordinary model

@torch.inference_mode()
def logits(args, weights) -> torch.Tensor:
    m = Transformer.from_weights(args, weights, torch.float32, "cpu")
    m.setup_cache(2, 32)
    ids = torch.randint(0, C.VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0))
    return m(ids, torch.arange(12).expand(2, 12))


def test_pwri_loads_as_model_with_same_logits(files):
    ref, ck = load_checkpoint(files["src"]), load_checkpoint(files["out"])
    assert ck.info["format"] == "PWRI" and ck.args.ffn_act == "reglu"
    assert not ck.args.tie_embeddings  # output.weight is in the file now
    names = ("fc1", "fc2", "ffn_down_t")
    assert {f"blk.{i}.{n}.weight" for i in range(len(RANKS)) for n in names} <= set(ck.extra)
    for name, w in ref.weights.items():  # everything but the down projection is read unchanged
        if not name.endswith(".down"):
            torch.testing.assert_close(ck.weights[name], w, rtol=0, atol=0)
    # the down projection is ffn_down_t, stored f16: the reference with its down rounded so
    want = logits(ref.args, {k: v.half().float() if k.endswith(".down") else v
                             for k, v in ref.weights.items()})
    got = logits(ck.args, ck.weights)
    assert want.abs().max() > 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dense = logits(ref.args, ref.weights)  # and the f16 rounding barely moves the dense model
    assert (got - dense).abs().max() < 1e-2 * dense.abs().max()


def test_original_pwri_llama_defaults_to_reglu(tmp_path):
    # a PWRI file from the original has no powerinfer.ffn_activation: it runs LLaMA as ReGLU
    model = C.build_hf_model(C.llama_family_config(hidden_act="relu"), seed=1)
    plain = tmp_path / "plain.gguf"
    C.write_llama_gguf(plain, model)
    assert load_checkpoint(plain, with_weights=False).args.ffn_act == "swiglu"
    patched = tmp_path / "patched.gguf"
    patched.write_bytes(b"PWRI" + plain.read_bytes()[4:])
    assert load_checkpoint(patched, with_weights=False).args.ffn_act == "reglu"


# ---------------------------------------------------------------------------------- errors

def test_not_gguf_nor_pwri(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    for call in (lambda: load_checkpoint(bad), lambda: pwri.import_pwri(bad, tmp_path / "b"),
                 lambda: pwri.read_gpu_index(bad)):
        with pytest.raises(ModelLoadError, match=r"bad.gguf: not a GGUF file \(magic b'NOPE'"):
            call()


def test_import_needs_pwri_with_predictors(files, tmp_path):
    with pytest.raises(ModelLoadError, match=r"relu.gguf: not a PowerInfer model file"):
        pwri.import_pwri(files["src"], tmp_path / "b")
    bare = tmp_path / "bare.gguf"  # PWRI magic, but no fc1/fc2
    bare.write_bytes(b"PWRI" + files["src"].read_bytes()[4:])
    with pytest.raises(ModelLoadError, match=r"bare.gguf: no predictor for layer 0"):
        pwri.import_pwri(bare, tmp_path / "b")
    assert not (tmp_path / "b").exists()  # nothing half-made


def test_split_file_wrong_architecture(files):
    with pytest.raises(ModelLoadError, match=r"relu.powerinfer.gguf: architecture 'llama', "
                                             r"expected 'generic.gpu_index'"):
        pwri.read_gpu_index(files["out"])
    with pytest.raises(ModelLoadError, match="expected 'generic.gpu_index'"):
        pwri.import_pwri(files["out"], files["dir"] / "never", gpu_index=files["out"])


def test_split_file_idx_bucket_disagree(files, tmp_path):
    raw = bytearray(files["split"].read_bytes())
    bucket = gguf_reader(files["split"]).tensors[1]  # blk.0.gpu_bucket
    first = int(bucket.data[0])
    other = next(j for j in range(FFN) if j not in set(bucket.data.tolist()))
    struct.pack_into("<i", raw, bucket.data_offset, other)
    bad = tmp_path / "bad.gpuidx"
    bad.write_bytes(bytes(raw))
    assert first != other
    with pytest.raises(ModelLoadError, match=r"bad.gpuidx: blk.0.gpu_idx and blk.0.gpu_bucket "
                                             r"disagree"):
        pwri.read_gpu_index(bad)


def test_export_checks_bundle_and_model(files, tmp_path):
    src = files["src"]
    other = tmp_path / "other.gguf"
    other.write_bytes(src.read_bytes() + b"\0" * 32)  # another file: size and hash differ
    with pytest.raises(BundleError, match="was made for relu.gguf"):
        pwri.export_pwri(other, files["bundle"], tmp_path / "x.gguf")
    wrong = make_bundle(tmp_path / "wrong", src)
    pred = wrong.load_tensors("predictors.ffn.safetensors")
    pred["fc2.1"] = pred["fc2.1"][:, :3]  # rank disagrees with fc1.1
    wrong.save_tensors("predictors.ffn.safetensors", pred)
    with pytest.raises(BundleError, match=r"layer 1 needs fc1.1 \(rank, 64\) and fc2.1 \(128, r"):
        pwri.export_pwri(src, wrong, tmp_path / "x.gguf")
    with pytest.raises(BundleError, match="has no 'predictors.layer'"):
        pwri.export_pwri(src, files["bundle"], tmp_path / "x.gguf", predictor_input="layer")
    assert not (tmp_path / "x.gguf").exists()


def test_export_refuses_what_the_original_cannot_run(tmp_path):
    model = C.build_hf_model(C.llama_family_config(), seed=2)  # SwiGLU
    src = tmp_path / "swiglu.gguf"
    C.write_llama_gguf(src, model)
    # (a ConfigError: "cannot load model", which it could, named another cause)
    with pytest.raises(ConfigError, match=r"swiglu.gguf cannot be written as a PWRI file: .*this "
                                          r"is llama with a swiglu FFN"):
        pwri.export_pwri(src, make_bundle(tmp_path / "b", src), tmp_path / "x.gguf")
