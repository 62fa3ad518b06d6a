"""The synthetic ReLU model generator: the planted firing profile holds in the dense model on fresh
tokens, the file loads and generates end to end, and the bytes depend only on the arguments."""
import hashlib

import numpy as np
import pytest
import torch

from powerinfer import Config, PowerInfer
from powerinfer.engine.params import sampling_params
from powerinfer.formats.loader import load_checkpoint
from powerinfer.model.transformer import Transformer
from powerinfer.sparsity.synthetic import (PRESETS, firing_rates, main, planted_profile,
                                            random_tokens, rank_correlation, write_synthetic)
from powerinfer.sparsity.profile import top_share


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic") / "tiny.gguf"
    return write_synthetic(path, "tiny", seed=0, progress=False)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_planted_profile_is_a_clipped_power_law():
    p = planted_profile(11008, 2, sparsity=0.9, alpha=1.3, seed=0)
    assert p.shape == (2, 11008)
    assert abs(p.mean(1) - 0.1).max() < 1e-6
    assert p.max() == pytest.approx(0.9) and p.min() > 0
    assert 0.55 < top_share(p[0], 0.1) < 0.65  # 10% of neurons make ~60% of firings
    assert np.array_equal(np.sort(p[0]), np.sort(p[1]))  # same law, another order per layer
    assert not np.array_equal(p[0], p[1])
    with pytest.raises(ValueError):
        planted_profile(1024, 1, sparsity=0.05)


def test_file_describes_the_shape(tiny):
    ck = load_checkpoint(tiny.path, with_weights=False)
    s = PRESETS["tiny"]
    a = ck.args
    assert (a.dim, a.ffn_dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size) == \
        (s.dim, s.n_ff, s.n_layers, s.n_heads, s.n_kv_heads, s.vocab)
    assert a.ffn_act == "reglu" and not a.tie_embeddings
    assert ck.info["tensor_types"] == {"BF16": 2 + 7 * s.n_layers, "F32": 1 + 2 * s.n_layers}
    meta = ck.tokenizer_source[1]
    assert meta["powerinfer.synthetic.sparsity"] == pytest.approx(0.9)
    assert tiny.file_bytes == tiny.path.stat().st_size


def test_planted_sparsity_and_skew_hold_on_fresh_tokens(tiny):
    ck = load_checkpoint(tiny.path, torch.float32)
    model = Transformer.from_weights(ck.args, ck.weights, torch.float32, "cpu")
    rates = firing_rates(model, random_tokens(ck.args.vocab_size, 8, 128, seed=7))  # 1024 tokens
    assert rates.shape == tiny.planted.shape
    for i, (planted, measured) in enumerate(zip(tiny.planted, rates)):
        assert abs((1 - measured.mean()) - 0.9) < 0.015, (i, 1 - measured.mean())
        assert top_share(measured, 0.1) > 0.5, i  # planted: 0.60; uniform rates would give 0.10
        assert rank_correlation(planted, measured) > 0.85, i
    assert abs(1 - tiny.calib_firing.mean(1) - 0.9).max() < 0.005  # in-sample, while writing


def test_loads_and_generates(tiny):
    pi = PowerInfer.from_pretrained(tiny.path, Config(dtype="float32", max_seq_len=64, max_batch=1))
    assert pi.tokenizer.bos_id == 1
    assert pi.detokenize(pi.tokenize("hello world")) == "hello world"
    params = sampling_params(max_tokens=5, temperature=0, ignore_eos=True)
    events = list(pi.engine.run([pi.engine.new_sequence(pi.tokenize("the quick brown fox"), params)]))
    assert [ev.token >= 0 for ev in events] == [True] * 5
    assert events[-1].finish_reason == "length"
    sampled = dict(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)
    runs = [[ev.token for ev in pi.engine.run([pi.engine.new_sequence(
        pi.tokenize("hello"), sampling_params(**sampled))])] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 6  # a seed gives the same six tokens


def test_same_seed_same_bytes(tiny, tmp_path, capsys):
    again = tmp_path / "again.gguf"
    assert main(["--preset", "tiny", "--seed", "0", "--quiet", "--out", str(again)]) == 0
    assert "calib_sparsity" in capsys.readouterr().out
    assert sha256(again) == sha256(tiny.path)
    other = write_synthetic(tmp_path / "other.gguf", "tiny", seed=1, progress=False)
    assert sha256(other.path) != sha256(tiny.path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.gguf", "other.gguf"]  # no .partial


def test_subspace_gates_make_firing_predictable(tmp_path):
    # gate rows in a rank-16 subspace: a rank-32 predictor keeps 99% of the activation mass while
    # marking under 2x the neurons that fire; isotropic gates (the default) cost it more marks,
    # and a residual stream of rank 64 holding the gates' subspace fewer still
    from powerinfer.sparsity.train import train_predictors
    from powerinfer.sparsity.profile import ProfileOptions, profile

    marked = {}
    for r, R in ((0, 0), (16, 0), (16, 64)):
        m = write_synthetic(tmp_path / f"tiny{r}-{R}.gguf", "tiny", subspace=r, residual_rank=R,
                            progress=False)
        assert np.allclose(m.calib_firing.mean(1), 0.1, atol=0.01)  # the planted profile holds
        b = profile(str(m.path), "lee", tmp_path / f"b{r}-{R}",
                    ProfileOptions(tokens=5120, window=256, samples=4000), progress=False)
        rows = train_predictors(b, "ffn", ranks=[32], epochs=10, progress=False)
        assert min(x["recall_mass"] for x in rows) >= 0.99
        marked[r, R] = max(x["active_share"] / x["positive_rate"] for x in rows)
    assert marked[16, 0] <= 2.0 and marked[0, 0] > marked[16, 0] > marked[16, 64], marked
    with pytest.raises(ValueError, match="residual_rank"):
        write_synthetic(tmp_path / "bad.gguf", "tiny", subspace=16, residual_rank=8, progress=False)


@pytest.mark.parametrize("quant", ["q4_0", "q4_k_m", "q8_0"])
def test_quantized_synthetic_files_hold_the_bf16_weights_within_their_formats_error(tmp_path, quant):
    """`--quant` writes llama.cpp's type per tensor (our own Q4_K/Q6_K quantizers where `gguf`
    has none), each matrix within its format's error of the bf16 file's, and the file loads."""
    import gguf

    from powerinfer.sparsity.synthetic import quant_type

    ref = write_synthetic(tmp_path / "bf16.gguf", preset="tiny", seed=3, progress=False)
    q = write_synthetic(tmp_path / f"{quant}.gguf", preset="tiny", seed=3, progress=False,
                        quant=quant)
    assert q.dtype == quant and q.file_bytes < ref.file_bytes
    bf16 = {t.name: t for t in gguf.GGUFReader(ref.path).tensors}
    # the format's error: what the reference quantizer of the same grid makes on the same
    # weights (gguf's own for Q8_0 and Q4_0; for Q4_K, Q4_1's 4-bit grid with a min per 32
    # values and exact scales where Q4_K rounds them to 6 bits; for Q6_K, half of Q5_0's)
    reference = {"Q8_0": ("Q8_0", 1.0), "Q4_0": ("Q4_0", 1.0), "Q4_K": ("Q4_1", 1.15),
                 "Q6_K": ("Q5_0", 0.75)}
    seen = set()
    for t in gguf.GGUFReader(q.path).tensors:
        if len(t.shape) < 2:
            continue
        rows = int(t.shape[1])
        want = quant_type(quant, t.name, int(t.shape[0]), ref.shape.n_layers)
        assert t.tensor_type.name == want, t.name
        seen.add(want)
        x = torch.from_numpy(bf16[t.name].data.copy()).view(torch.bfloat16).float().numpy()
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(rows, -1)
        x = x.reshape(rows, -1)
        ref_type, slack = reference[want]
        T = gguf.GGMLQuantizationType[ref_type]
        floor = np.linalg.norm(gguf.quants.dequantize(gguf.quants.quantize(x, T), T) - x)
        # the file quantizes the float32 weights, x is their bf16 rounding (relative error at
        # most 2^-9 an element): the two errors add at most
        assert np.linalg.norm(got - x) <= slack * floor * 1.02 + np.linalg.norm(x) * 2.0 ** -9, \
            (t.name, want)
    assert seen == {"q8_0": {"Q8_0"}, "q4_0": {"Q4_0", "Q6_K"},
                    "q4_k_m": {"Q4_K", "Q6_K"}}[quant]
    pi = PowerInfer.from_pretrained(q.path, Config(dtype="float32"))
    assert len(pi.generate("a b c", max_new_tokens=4, temperature=0, ignore_eos=True)) > 0


def test_a_bundle_of_a_k_quant_file_serves_its_converted_copy(tmp_path):
    """Most files people have are Q4_K_M: a bundle profiled on one loads with the file for the
    sparse engine, which reads the copy converted to the kernel's block types (the bundle is
    checked through the original beside it), and is still refused for another file."""
    from powerinfer.formats.bundle import Bundle, BundleError
    from powerinfer.sparsity.train import train_predictors
    from powerinfer.sparsity.profile import ProfileOptions, profile

    q = write_synthetic(tmp_path / "k.gguf", preset="tiny", seed=4, progress=False, quant="q4_k_m")
    b = profile(str(q.path), "lee", tmp_path / "k.bundle",
                ProfileOptions(tokens=256, window=64, samples=256), progress=False)
    train_predictors(b, "ffn", ranks=[16], epochs=1, progress=False)
    pi = PowerInfer.from_pretrained(q.path, Config(dtype="bfloat16", weights="int4",
                                                   bundle=str(b.path), predictor="ffn"))
    assert pi.checkpoint.path.name == "kernel-formats.gguf"  # the converted copy is what runs
    assert len(pi.generate("a b c", max_new_tokens=4, temperature=0, ignore_eos=True)) > 0
    other = write_synthetic(tmp_path / "other.gguf", preset="tiny", seed=5, progress=False)
    with pytest.raises(BundleError, match="was made for k.gguf"):
        Bundle.open(b.path).check_model(other.path)


def test_a_large_tensor_draws_its_chunks_in_parallel_the_same_on_any_cores(monkeypatch):
    # a tensor of more than DRAW values: its row chunks come from their own generators on the
    # pool's threads; the values depend on the seed and name alone, not on how many threads
    from concurrent.futures import ThreadPoolExecutor
    from powerinfer.sparsity import synthetic

    shape = (3000, 1000)  # chunks of 1,048, 1,048 and 904 rows
    many = synthetic._randn(0, "blk.0.ffn_up.weight", shape, 0.5, in_col0=0.0)
    monkeypatch.setattr(synthetic, "_POOL", ThreadPoolExecutor(1))
    one = synthetic._randn(0, "blk.0.ffn_up.weight", shape, 0.5, in_col0=0.0)
    assert torch.equal(many, one)
    assert (many[:, 0] == 0).all() and abs(many[:, 1:].std().item() - 0.5) < 0.01
    chunks = synthetic._chunks(shape[0], shape[1], synthetic.DRAW)
    assert len(chunks) == 3 and chunks[-1][1] == shape[0]
    assert not torch.equal(many[:8, 1:], many[chunks[1][0]:chunks[1][0] + 8, 1:])  # own streams
    assert not torch.equal(many, synthetic._randn(1, "blk.0.ffn_up.weight", shape, 0.5, in_col0=0.0))
