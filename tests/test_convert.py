"""A GGUF file with K-quants (block types the CPU kernel cannot read) is converted once to the
nearest types it can read, cached beside the model's bundle with the conversion's error, and
loaded from there: real files, real loads, the gguf package's dequantizer as the reference."""
import json
import os

import gguf
import numpy as np
import pytest
import torch

from powerinfer import Config, ModelLoadError, PowerInfer
from powerinfer.model.convert import converted, needs_conversion
from powerinfer.formats.loader import load_checkpoint
from powerinfer.formats.gguf import open_gguf
from powerinfer.formats.pwri import raw_field, write_gguf
from powerinfer.formats.source import tensor_types
from powerinfer.sparsity.synthetic import write_synthetic

from greedy import last_logits

Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K


def k_blocks(shape: tuple[int, int], kind, rng) -> np.ndarray:
    """Random blocks of `kind` for a (rows, cols) tensor, with sane fp16 super-block scales."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    if kind == Q4_K:  # d, dmin (f16) lead the block
        raw[..., 0:2] = np.frombuffer(np.float16(2e-3).tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    else:  # Q6_K: d (f16) ends it
        raw[..., -2:] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    return raw.reshape(shape[0], -1)


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    """The tiny synthetic model with its FFN and attention weights as Q4_K (ffn_down: Q6_K)."""
    d = tmp_path_factory.mktemp("kq")
    write_synthetic(d / "tiny.gguf", "tiny", progress=False)
    reader = open_gguf(d / "tiny.gguf")
    rng = np.random.default_rng(0)
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in t.shape)
        role = t.name.split(".")[-2]
        if role.startswith(("ffn_", "attn_")) and role != "attn_norm" and role != "ffn_norm":
            kind = Q6_K if role == "ffn_down" else Q4_K
            tensors[t.name] = (shape, int(kind), k_blocks(tuple(reversed(shape)), kind, rng))
        else:
            tensors[t.name] = (shape, int(t.tensor_type), t.data.view(np.uint8).reshape(-1))
    kvs = [raw_field(reader, f) for k, f in reader.fields.items() if not k.startswith("GGUF.")]
    out = d / "kq.gguf"
    write_gguf(out, b"GGUF", kvs, tensors, int(reader.alignment))
    return out


def test_a_k_quant_file_is_converted_once_and_loads_quantized(kquant_file):
    info = load_checkpoint(kquant_file, with_weights=False).info
    assert needs_conversion(info) and set(info["tensor_types"]) >= {"Q4_K", "Q6_K"}
    cfg = Config(dtype="bfloat16", weights="int4", max_seq_len=64)
    pi = PowerInfer.from_pretrained(kquant_file, cfg)
    path = pi.checkpoint.path
    assert path == kquant_file.parent / "kq.gguf.bundle" / "kernel-formats.gguf"
    assert pi.config.weights == "int4" and pi.generate("hello", max_new_tokens=4, temperature=0)

    # the copy: Q4_K became Q4_1 and Q6_K Q8_0, and it holds those alone with every record;
    # the model reads its other tensors from the original's bytes
    src, out = open_gguf(kquant_file), open_gguf(path)
    got = {t.name: t for t in out.tensors}
    kept = [t for t in src.tensors if t.tensor_type.name not in ("Q4_K", "Q6_K")]
    assert kept and not {t.name for t in kept} & set(got)
    for t in src.tensors:
        if t.name in got:
            want = {"Q4_K": "Q4_1", "Q6_K": "Q8_0"}[t.tensor_type.name]
            assert got[t.name].tensor_type.name == want, t.name
    assert out.fields["tokenizer.ggml.tokens"].contents() == src.fields["tokenizer.ggml.tokens"].contents()
    def beside_data(f, r):  # header and padding
        return f.stat().st_size - sum(int(t.n_bytes) for t in r.tensors)
    assert beside_data(path, out) < beside_data(kquant_file, src) + 64 * len(got)
    ck = load_checkpoint(path, with_weights=False)
    table, norm = ck.source.table, "0.attn_norm"
    assert table[norm].file == 1 and ck.source.files[1] == kquant_file
    whole = load_checkpoint(kquant_file, with_weights=False).source
    assert torch.equal(ck.source.get(norm, torch.float32), whole.get(norm, torch.float32))
    assert table["0.up"].file == 0 and ck.source.kind("0.up") == "Q4_1"
    assert not needs_conversion(ck.info) and ck.info["file_bytes"] == path.stat().st_size + sum(
        int(t.n_bytes) for t in kept)
    # what a load logs: the copy's types, and the original's blocks read as they are
    said = tensor_types(ck.info)
    assert said.startswith("Q4_1 24, ") and "; from kq.gguf, whose Q4_K 24, Q6_K 4 " in said

    # the report: each converted tensor's error, as the dequantized weights say
    report = json.loads(path.with_suffix(".json").read_text())
    assert report["types"] == {"Q4_K": "Q4_1", "Q6_K": "Q8_0"}
    for name in ("blk.0.ffn_up.weight", "blk.0.ffn_down.weight"):
        a = gguf.quants.dequantize(src.tensors[[t.name for t in src.tensors].index(name)].data,
                                   {"blk.0.ffn_up.weight": Q4_K}.get(name, Q6_K))
        b = gguf.quants.dequantize(got[name].data, got[name].tensor_type)
        err = np.linalg.norm(b - a) / np.linalg.norm(a)
        assert report["tensors"][name] == pytest.approx(err, rel=1e-3)
        # a Q4_K sub-block is a Q4_1 block up to rounding; 6 bits in 8 lose little
        assert err < (1e-3 if "up" in name else 0.01), (name, err)

    # made once: a second load reads the cache; a changed source is converted again
    stamp = path.stat().st_mtime_ns
    PowerInfer.from_pretrained(kquant_file, cfg)
    assert path.stat().st_mtime_ns == stamp
    os.utime(kquant_file, ns=(stamp + 10**9, stamp + 10**9))
    assert converted(kquant_file, progress=False) == path and path.stat().st_mtime_ns != stamp


def test_a_copy_whose_original_is_gone_says_so_and_an_older_whole_copy_is_remade(kquant_file,
                                                                                tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(kquant_file.read_bytes())
    path = converted(model, progress=False)
    model.rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(ModelLoadError, match=r"m\.gguf\) is no longer beside it"):
        load_checkpoint(path, with_weights=False)
    (tmp_path / "elsewhere.gguf").rename(model)
    assert load_checkpoint(path, with_weights=False).source.files[1] == model

    # a copy an earlier version made (the whole file, its report without a layout) is made again
    report = path.with_suffix(".json")
    old = json.loads(report.read_text())
    del old["layout"]
    report.write_text(json.dumps(old))
    stamp = path.stat().st_mtime_ns
    assert converted(model, progress=False) == path and path.stat().st_mtime_ns != stamp
    assert json.loads(report.read_text())["layout"] == "converted-only"


def test_the_converted_model_computes_what_the_original_does(kquant_file):
    """Dense float32 from each file: the same logits up to the conversion's error."""
    cfg = Config(dtype="float32", weights="dense", max_seq_len=64)
    ref = PowerInfer.from_pretrained(kquant_file, cfg)
    path = converted(kquant_file, progress=False)
    conv = PowerInfer.from_pretrained(path, cfg)
    ids = ref.tokenize("hello world, this is a test")
    a, b = last_logits(ref, ids), last_logits(conv, ids)
    assert torch.isfinite(a).all() and a.std() > 0
    assert (b - a).norm() / a.norm() < 0.05, float((b - a).norm() / a.norm())
    # weights="dense" reads the file as it is: no copy is involved
    assert ref.checkpoint.path == kquant_file


def assert_same_fields(ours, stock):
    """Field by field in the same order: offset, name, data indices, types, every part's dtype,
    shape and bytes, and the decoded contents."""
    assert list(ours.fields) == list(stock.fields)
    for name, a in ours.fields.items():
        b = stock.fields[name]
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types), name
        assert [(x.dtype, x.shape, x.tobytes()) for x in a.parts] == \
            [(y.dtype, y.shape, y.tobytes()) for y in b.parts], name
        assert a.contents() == b.contents(), name


def test_the_reader_gives_the_stock_readers_fields_part_for_part(default_model_path, tmp_path):
    # the project's reader slices an array's elements from one view (a vocabulary's tokens,
    # types and merges) where the stock reader reads them one call each; the same parts, dtypes
    # and values, field by field, on the real default model (its arrays of strings and of
    # int32); and a file cut inside its vocabulary is a load error naming it
    ours, stock = open_gguf(default_model_path), gguf.GGUFReader(default_model_path)
    assert_same_fields(ours, stock)
    kinds = {tuple(f.types) for f in ours.fields.values()}
    A, T = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType
    assert {(A, T.STRING), (A, T.INT32)} <= kinds, kinds
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset) for t in stock.tensors]
    tokens = stock.fields["tokenizer.ggml.tokens"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model_path.read_bytes()[:tokens.offset + 1000])
    with pytest.raises(ModelLoadError, match="cut.gguf: corrupt or truncated GGUF"):
        open_gguf(cut)


def test_the_reader_gives_the_stock_readers_fields_for_every_value_type(tmp_path):
    # every kind of field, arrays of each element type among them: float32 (a SentencePiece
    # vocabulary's scores), bools, int8, strings with empty and non-ASCII ones, arrays of
    # arrays (the stock walk, with the fast path inside), and an empty array
    import struct

    w = gguf.GGUFWriter(tmp_path / "w.gguf", "llama")
    w.add_array("t.f32", [1.5, -2.0, 3.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.i8", [1, -2, 3])
    w.add_array("t.strs", ["a", "", "\u00fcn\u00ef"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_bool("t.b", True)
    w.add_float64("t.f64", 0.5)
    w.add_tensor("w", np.zeros((2, 32), np.float32))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        write()
    w.close()
    src = gguf.GGUFReader(tmp_path / "w.gguf")
    empty = struct.pack("<Q", 7) + b"t.empty" + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY,
                                                              gguf.GGUFValueType.UINT32, 0)
    kvs = [raw_field(src, f) for k, f in src.fields.items() if not k.startswith("GGUF.")]
    t = src.tensors[0]
    write_gguf(tmp_path / "all.gguf", b"GGUF", [*kvs, empty],
               {"w": (tuple(int(x) for x in t.shape), int(t.tensor_type), np.asarray(t.data))})
    ours, stock = open_gguf(tmp_path / "all.gguf"), gguf.GGUFReader(tmp_path / "all.gguf")
    assert_same_fields(ours, stock)
    assert "t.empty" in ours.fields
    assert ours.fields["t.strs"].contents() == ["a", "", "\u00fcn\u00ef"]
    assert ours.fields["t.nested"].contents() == stock.fields["t.nested"].contents()
    assert ours.fields["t.empty"].contents() == []
