"""Input sparsity in every projection (TEAL's method) on the real default model: thresholds from
the calibration text give about the asked-for share of zeros on text the calibration did not
see, a zero threshold changes nothing, a prompt's rows stay dense, and the quality it costs
rises with the sparsity; TEAL's block-wise greedy allocation reaches its targets where a block
loses least; WINA's criterion zeroes by |x| times its column's weight norm. The pipeline's step writes the thresholds and their quality into a bundle, and the
engine's decode steps then read only the kept channels' weights (the q4c kernel), giving the
tokens of the dense 4-bit projections over the same zeroed inputs."""
import pytest
import torch

from greedy import assert_same_or_near_tie, greedy_ids
from powerinfer import Config, PowerInfer
from powerinfer.engine.params import sampling_params
from powerinfer.errors import ConfigError
from powerinfer.formats.bundle import Bundle, BundleError
from powerinfer.model.load import load_model
from powerinfer.model.quant import Q4Linear
from powerinfer.sparsity import input_sparsity as isp
from powerinfer.sparsity.corpus import load_corpus, token_windows
from powerinfer.sparsity.input_sparsity import (PARTS, Sparsifier, calibrate, greedy_allocation,
                                                held_out_quality, model_wide, projections,
                                                sample_magnitudes, share_under, weights_of)


@pytest.fixture(scope="module")
def smol(default_model_path):
    model, tok, _ = load_model(default_model_path)
    calib = token_windows(tok, load_corpus("lee", "calibration"), 128, 1024)
    held = token_windows(tok, load_corpus("lee", "held_out"), 128, 512)
    return model, tok, sample_magnitudes(model, calib, progress=False), held


def test_thresholds_reach_their_sparsity_on_held_out_text(smol):
    model, _, hists, held = smol
    assert set(hists) == {(i, p) for i in range(model.args.n_layers) for p in PARTS}
    th = calibrate(hists, 0.4)
    assert all(t > 0 for t in th.values())
    s = Sparsifier(model, th)
    with torch.inference_mode(), s:
        for w in held:
            model(torch.tensor([w]), torch.arange(len(w))[None])
    per = {k: z / n for k, (z, n) in s.counts.per_key.items()}
    assert set(per) == set(th)
    # each input's own share near its target on other text than the calibration's (the output
    # projection's input moves most with the text: 0.38-0.52 seen), and the model-wide figure,
    # which weighs each by the weights it saves, nearer still
    far = sorted(per.items(), key=lambda kv: -abs(kv[1] - 0.4))[:3]
    assert all(abs(v - 0.4) < 0.15 for v in per.values()), far
    assert abs(s.realised(weights_of(model)) - 0.4) < 0.05
    w = weights_of(model)
    assert w[(0, "gate_up")] == 2 * w[(0, "down")]  # (SmolLM2: gated, gate and up in one)
    assert model_wide({(0, "qkv"): 1.0, (0, "down"): 0.0}, w) == pytest.approx(
        w[(0, "qkv")] / (w[(0, "qkv")] + w[(0, "down")]))


def test_zero_thresholds_change_nothing_and_a_prompt_stays_dense(smol):
    model, tok, hists, _ = smol
    ids = tok.encode("The capital of France is Paris, and the capital of Italy is",
                     parse_special=False)
    x, pos = torch.tensor([ids]), torch.arange(len(ids))[None]
    with torch.inference_mode():
        model.setup_cache(1, len(ids))
        dense = model(x, pos)[0]
        with Sparsifier(model, calibrate(hists, 0.0)):
            assert torch.equal(model(x, pos)[0], dense)
        P = len(ids) - 3  # the prompt's rows dense, the last three as decode steps
        with Sparsifier(model, calibrate(hists, 0.5), dense_rows=P) as s:
            got = model(x, pos)[0]
    assert torch.equal(got[:P], dense[:P])  # (causal: the prompt's rows see only dense rows)
    assert not torch.allclose(got[P:], dense[P:], atol=1e-3)
    n = len(projections(model))
    assert s.counts.entries == sum(3 * m.weight.shape[1] for m in projections(model).values())
    assert n == 4 * model.args.n_layers


def test_quality_falls_as_sparsity_rises(smol):
    model, _, hists, held = smol
    rows = held_out_quality(model, held[:2], {f"{s}": calibrate(hists, s, ("qkv", "o", "gate_up"))
                                              for s in (0.25, 0.5)}, progress=False)
    assert rows["dense"]["ppl_delta"] == 0 and rows["dense"]["top1"] == 1.0
    lo, hi = rows["0.25"], rows["0.5"]
    assert 0 < lo["kl"] < hi["kl"] and lo["top1"] > hi["top1"]
    assert lo["ppl"] < hi["ppl"]
    assert 0.2 < lo["realised"] < 0.3 and 0.45 < hi["realised"] < 0.55


def test_the_greedy_allocation_reaches_each_target_where_a_block_loses_least(smol):
    # TEAL's block-wise greedy allocation on two layers over one short window: each block at
    # (or a step past) each target, its inputs at unequal shares, and its output further from
    # the dense block's under the uniform allocation than under the greedy one
    model, tok, hists, _ = smol
    window = [tok.encode("The capital of France is Paris. " * 12, parse_special=False)[:96]]
    parts, layers = ("qkv", "o", "gate_up"), [1, 20]
    got = greedy_allocation(model, window, hists, [0.25, 0.4], parts, layers=layers,
                            progress=False)
    w = weights_of(model)
    captured = {}
    hooks = [model.layers[i].register_forward_pre_hook(
        lambda _m, a, i=i: captured.setdefault(i, (a[0].clone(), *a[1:]))) for i in layers]
    with torch.inference_mode():
        model.setup_cache(1, len(window[0]))
        model(torch.tensor(window), torch.arange(len(window[0]))[None])
    for h in hooks:
        h.remove()
    for target, th in got.items():
        assert set(th) == {(i, p) for i in layers for p in parts}
        for i in layers:
            shares = {p: share_under(hists[(i, p)], th[(i, p)]) for p in parts}
            block = model_wide({(i, p): s for p, s in shares.items()}, w)
            assert target - 0.01 <= block < target + 0.1, (target, i, shares)
            assert max(shares.values()) - min(shares.values()) > 0.05, shares  # not uniform

            def error(thresholds, i=i):
                with torch.inference_mode(), Sparsifier(model, thresholds):
                    y = model.layers[i](*captured[i])
                with torch.inference_mode():
                    ref = model.layers[i](*captured[i])
                return float((y - ref).pow(2).sum())
            uniform = {(i, p): t for (j, p), t in calibrate(hists, block, parts).items() if j == i}
            assert error({(i, p): th[(i, p)] for p in parts}) < error(uniform), (target, i)


def test_the_weighted_criterion_zeroes_by_x_times_its_columns_norm(smol):
    # WINA's criterion: an entry is zeroed where |x| times the norm of the weights its channel
    # multiplies is at most the threshold. Calibrated on two windows, it reaches about its share
    # on the other two, and it zeroes other entries than |x| alone does at the same share
    # (about 2% of the second layer's q/k/v entries are kept by one and zeroed by the other:
    # SmolLM2's q/k/v columns' norms spread over more than a factor of ten, but its large
    # entries are mostly in the channels of large norms)
    model, _, _, held = smol
    norms = isp.column_norms(model)
    key = (1, "qkv")
    m = projections(model)[key]
    assert norms[key].shape == (m.weight.shape[1],)
    assert torch.allclose(norms[key], m.weight.float().norm(dim=0))
    parts = ("qkv", "o", "gate_up")
    by_norm = calibrate(sample_magnitudes(model, held[:2], progress=False, scales=norms), 0.3,
                        parts)
    by_x = calibrate(sample_magnitudes(model, held[:2], progress=False), 0.3, parts)

    def run(thresholds, scales):
        raw, zeroed = [], []
        first = m.register_forward_pre_hook(lambda _m, a: raw.append(a[0].clone()))
        try:
            with torch.inference_mode(), Sparsifier(model, thresholds, scales=scales) as s:
                last = m.register_forward_pre_hook(lambda _m, a: zeroed.append(a[0].clone()))
                try:
                    for w in held[2:]:
                        model(torch.tensor([w]), torch.arange(len(w))[None])
                finally:
                    last.remove()
        finally:
            first.remove()
        return torch.cat(raw, 1), torch.cat(zeroed, 1), s

    raw, zeroed, s = run(by_norm, norms)
    keep = raw.abs() * norms[key] > by_norm[key]
    assert torch.equal(zeroed, raw * keep)
    assert abs(s.realised(weights_of(model)) - 0.3) < 0.05
    raw_x, _, _ = run(by_x, None)
    keep_x = raw_x.abs() > by_x[key]
    assert (keep != keep_x).float().mean() > 0.005  # (not the same entries)


@pytest.fixture(scope="module")
def input_bundle(default_model_path, tmp_path_factory):
    """The pipeline's step on the default model, small: 1,024 calibration tokens, 512 held out."""
    path = tmp_path_factory.mktemp("input") / "bundle"
    isp.calibrate_bundle(str(default_model_path), str(path), 0.25, tokens=1024, held_out=512,
                         window=128, progress=False)
    return str(path)


def test_the_bundle_step_writes_thresholds_and_their_quality(input_bundle, tmp_path):
    th, rec = isp.bundle_thresholds(input_bundle)
    assert set(th) == {(i, p) for i in range(30) for p in isp.KERNEL_PARTS}
    assert all(t > 0 for t in th.values())
    q = rec["quality"]
    assert rec["target"] == 0.25 and rec["calibration"]["tokens"] >= 1024
    assert q["held_out_tokens"] >= 512 and q["ppl"] > q["dense_ppl"] > 1
    assert abs(q["realised"] - 0.25) < 0.06  # on text the calibration did not see
    assert q["ppl_increase"] == pytest.approx(q["ppl"] / q["dense_ppl"] - 1)
    Bundle.create(tmp_path / "b", {"file": "x.gguf", "size": 1, "sha256": "0", "n_layers": 30})
    with pytest.raises(BundleError, match="calibrate-input"):  # a bundle without the step
        isp.bundle_thresholds(str(tmp_path / "b"))


def test_a_calibration_in_bf16_finds_the_float32_ones_thresholds(default_model_path, input_bundle,
                                                                 tmp_path, capsys):
    """`calibrate-input --dtype bfloat16` (a 7B's model in half of float32's memory) runs the
    model in bf16 and records it; its thresholds are those of the float32 calibration over the
    corpus within bf16's drift over 30 layers and the CLI's longer windows (2-5% at the median
    where measured, at most 9%), and its held-out quality is measured in float32 over the bf16
    model's logits."""
    from powerinfer.cli import main

    out = tmp_path / "bf16.bundle"
    assert main(["calibrate-input", "--model", str(default_model_path), "--bundle", str(out),
                 "--tokens", "1024", "--held-out", "512", "--dtype", "bfloat16"]) == 0
    assert "held-out perplexity" in capsys.readouterr().out
    th, rec = isp.bundle_thresholds(str(out))
    ref, _ = isp.bundle_thresholds(input_bundle)
    assert rec["calibration"]["dtype"] == "bfloat16"
    assert set(th) == set(ref)
    ratios = torch.tensor([th[k] / ref[k] for k in ref])
    assert (ratios - 1).abs().median() < 0.05 and (ratios - 1).abs().max() < 0.2, ratios
    q = rec["quality"]
    assert q["ppl"] > q["dense_ppl"] > 1 and abs(q["realised"] - 0.25) < 0.06


def test_a_calibration_that_fails_leaves_no_bundle_behind(default_model_path, tmp_path):
    from powerinfer.sparsity.corpus import CorpusError

    out = tmp_path / "new.bundle"
    with pytest.raises(CorpusError):  # (before: a folder holding a bare manifest)
        isp.calibrate_bundle(str(default_model_path), str(out), 0.25,
                             corpus=str(tmp_path / "missing.txt"), progress=False)
    assert not out.exists()


# the 4-bit path asked for by name (what "auto" resolves to is not this test's business)
LOAD = dict(max_seq_len=256, max_batch=2, cpu_threads=1, weights="int4", dtype="bfloat16")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def zeroed_under(t: float):
    """A forward pre-hook zeroing a decode row's input entries at or under t (compared in float,
    as the kernel compares): a dense projection given what the sparse one reads."""
    def hook(mod, args):
        x = args[0]
        if x.numel() == mod.in_features:
            return (torch.where(x.float().abs() > t, x, torch.zeros_like(x)),)
    return hook


def assert_decodes_as_zeroed_dense(sparse: PowerInfer, ref: PowerInfer, n: int, per_step: int):
    """PROMPTS' n greedy tokens from `sparse` (its native loop) are those of `ref` (its modules,
    hooked by `zeroed_under`) and of `sparse`'s own modules, a near-tie allowed; its counter sees
    exactly `per_step` input channels a decode step (the prefill's rows stay dense), about three
    quarters of them kept."""
    for p in PROMPTS:
        ids = sparse.tokenize(p)
        before = sparse.input_sparsity_stats()
        got = greedy_ids(sparse, ids, n)
        kept, seen = (a - b for a, b in zip(sparse.input_sparsity_stats(), before))
        assert seen == (n - 1) * per_step  # decode steps only: the prefill's rows are dense
        assert 0.6 < kept / seen < 0.9, kept / seen  # about the bundle's 25% zeroed
        assert_same_or_near_tie(ref, ids, greedy_ids(ref, ids, n), got, 0.05)
        sparse.engine._decode = sparse.engine._forward  # its modules' path
        try:
            assert_same_or_near_tie(sparse, ids, got, greedy_ids(sparse, ids, n), 0.05)
        finally:
            sparse.engine._decode = sparse.engine.native


def test_decode_steps_read_only_the_kept_channels(input_bundle, monkeypatch):
    """The engine with the bundle's input sparsity (every projection: SmolLM2's are under the
    size where it pays, MIN_ROWS) decodes as the dense 4-bit projections do over the same zeroed
    inputs (forward pre-hooks on the modules): the q4c product gives the q4x16 product's floats,
    so the tokens agree (a near-tie allowed where another CPU's kernels round otherwise); its own
    modules' path gives the native loop's tokens; the prompt's rows stay dense: the counter sees
    exactly the decode steps' inputs, about three quarters of them kept."""
    monkeypatch.setattr(isp, "MIN_ROWS", 0)
    th, _ = isp.bundle_thresholds(input_bundle)
    sparse = PowerInfer.from_pretrained("smollm2-135m-instruct", Config(input_sparsity=input_bundle, **LOAD))
    assert sparse.config.weights == "int4" and sparse.engine.native.input_sparse[0]
    ref = PowerInfer.from_pretrained("smollm2-135m-instruct", Config(input_sparsity="off", **LOAD))
    ref.engine._decode = ref.engine._forward  # the modules, with hooks that zero a decode row's inputs
    hooks = []
    for i, b in enumerate(ref.model.layers):
        for part, m in (("qkv", b.attn.wqkv), ("o", b.attn.wo), ("gate_up", b.ffn.w1)):
            assert isinstance(m, Q4Linear)
            hooks.append(m.register_forward_pre_hook(zeroed_under(th[(i, part)])))
    try:
        assert_decodes_as_zeroed_dense(sparse, ref, 16, 30 * 3 * sparse.model.args.dim)
    finally:
        for h in hooks:
            h.remove()


def test_a_k_quant_files_q4_k_projections_read_only_the_kept_channels(tmp_path, monkeypatch):
    """A Q4_K_M file (a synthetic model of the tiny shape: its thresholds calibrated on it, a
    speed-and-numerics check, no quality claim): each projection of Q4_K rows keeps the file's
    bits in its q4c copy (6-bit scales and minimums, f16 super-block scales: the bytes of its
    dense copy) and decodes as the dense Q4_K product does over the same zeroed inputs; a fused
    q/k/v with a Q6_K v (two of this file's layers, as llama.cpp's Q4_K_M mix does) takes its q
    and k from the copy and its v from a Q6_K copy of its own (the file's 6-bit codes and
    scales), the dense products over the same zeroed input, bit for bit.
    The native loop's tokens are its modules' tokens, and its counter sees exactly the sparse
    projections' decode-step inputs. The actor runtime's executors take copies of their shares
    and decode the in-process engine's tokens."""
    from powerinfer.model.quant import KQuantLinear
    from powerinfer.sparsity.synthetic import write_synthetic
    monkeypatch.setattr(isp, "MIN_ROWS", 0)
    m = write_synthetic(tmp_path / "m.gguf", preset="tiny", quant="q4_k_m", progress=False).path
    bundle = tmp_path / "bundle"
    isp.calibrate_bundle(str(m), str(bundle), 0.25, tokens=512, held_out=256, window=128,
                         progress=False)
    th, _ = isp.bundle_thresholds(str(bundle))
    sparse = PowerInfer.from_pretrained(str(m), Config(input_sparsity=str(bundle), **LOAD))
    ref = PowerInfer.from_pretrained(str(m), Config(input_sparsity="off", **LOAD))
    ref.engine._decode = ref.engine._forward  # the modules, with hooks that zero a decode row's inputs
    hooks, per_step, dense, mixed = [], 0, [], []
    for i, (b, mine) in enumerate(zip(ref.model.layers, sparse.model.layers)):
        for part, r, s in (("qkv", b.attn.wqkv, mine.attn.wqkv), ("o", b.attn.wo, mine.attn.wo),
                           ("gate_up", b.ffn.w1, mine.ffn.w1)):
            assert isinstance(s, KQuantLinear) and (s.sparse is not None) == s.sparsifiable
            if not s.sparsifiable:
                dense.append((i, part))
                continue
            if len(s.segments) > 1:
                mixed.append((i, part, s.sparse_rows, s.out_features))
                # the whole product is the dense one over the zeroed input, bit for bit (v's
                # too: over the input as given, it is not)
                t = th[(i, part)]
                x = torch.randn(1, s.in_features, generator=torch.Generator().manual_seed(i)) * 2 * t
                x = x.to(torch.bfloat16)
                zeroed = x.masked_fill(x.float().abs() <= t, 0)
                got, kept = s(x), s.sparse
                try:
                    s.sparse = None
                    assert torch.equal(got, s(zeroed))
                    assert not torch.equal(got[:, s.sparse_rows:], s(x)[:, s.sparse_rows:])
                finally:
                    s.sparse = kept
                # v's copy: the q6kx16 bytes a row (26 a block, a f16 a super-block)
                (w6, kind6), = s.sparse_rest
                n6, k = s.out_features - s.sparse_rows, s.in_features
                assert kind6 == 3 and w6.numel() == -(-n6 // 64) * 64 * (k // 32 * 26 + k // 256 * 2)
            # the q4kx16 bytes a row of its Q4_K run (18.5 a block), its rows padded to 64
            w, kind, _ = s.sparse
            n = s.sparse_rows
            k, rows64, rows16 = s.in_features, -(-n // 64) * 64, -(-n // 16) * 16
            assert kind == 2 and w.numel() == rows64 * (k // 32 * 18 + k // 256 * 4)
            assert w.numel() // rows64 == getattr(s, s.segments[0][0]).numel() // rows16
            per_step += s.in_features
            hooks.append(r.register_forward_pre_hook(zeroed_under(th[(i, part)])))
    assert dense == []
    a = sparse.model.args  # (the layers whose v is Q6_K: q and k rows from the copy, v after)
    q_k = (a.n_heads + a.n_kv_heads) * a.head_dim
    assert mixed == [(2, "qkv", q_k, q_k + a.n_kv_heads * a.head_dim),
                     (3, "qkv", q_k, q_k + a.n_kv_heads * a.head_dim)], mixed
    n = 12
    try:
        assert_decodes_as_zeroed_dense(sparse, ref, n, per_step)  # (the sparse projections' inputs)
    finally:
        for h in hooks:
            h.remove()
    # the native loop reads v from its own copy: with the copies' bytes zeroed (v = 0 in those
    # layers) its tokens move, and come back with the bytes
    ids = sparse.tokenize(PROMPTS[0])
    want = greedy_ids(sparse, ids, n)
    copies = [sparse.model.layers[i].attn.wqkv.sparse_rest[0][0] for i, *_ in mixed]
    kept = [c.clone() for c in copies]
    try:
        for c in copies:
            c.zero_()
        assert greedy_ids(sparse, ids, n) != want
    finally:
        for c, k in zip(copies, kept):
            c.copy_(k)
    assert greedy_ids(sparse, ids, n) == want
    # the actor runtime: each executor's Q4_K shares (its KV heads' q/k/v rows and output
    # columns, its neurons' gate+up rows) take copies, and it decodes the in-process engine's
    # tokens (in float32: see the test below)
    load = {**LOAD, "dtype": "float32"}
    local = PowerInfer.from_pretrained(str(m), Config(input_sparsity=str(bundle), **load))
    actors = PowerInfer.from_pretrained(str(m), Config(input_sparsity=str(bundle), runtime="actors",
                                                       **load))
    try:
        info = actors.engine.group.info
        # (every layer's q/k/v, output and gate+up share, the two with a Q6_K v included)
        assert info["hot"]["input_sparse"] == info["cold.0"]["input_sparse"] == [12, 0], info
        for p in PROMPTS:
            ids = local.tokenize(p)
            assert_same_or_near_tie(local, ids, greedy_ids(local, ids, n), greedy_ids(actors, ids, n), 0.05)
        stats = actors.engine.stats()["actors"]
        assert all(stats[r]["input_sparse_stats"][0] > 0 for r in ("hot", "cold.0")), stats
    finally:
        actors.close()


def test_input_sparsity_asks_for_the_4bit_cpu_path(input_bundle, tmp_path):
    from powerinfer.sparsity.synthetic import write_synthetic
    other = tmp_path / "tiny.gguf"  # another model: the bundle's thresholds are not its inputs'
    write_synthetic(other, preset="tiny", seed=0, progress=False, quant="q4_0")
    with pytest.raises(BundleError, match="was made for"):
        PowerInfer.from_pretrained(str(other), Config(input_sparsity=input_bundle, **LOAD))
    with pytest.raises(ConfigError, match="4-bit CPU path"):
        PowerInfer.from_pretrained("smollm2-135m-instruct",
                                   Config(input_sparsity=input_bundle, **{**LOAD, "weights": "dense"}))
    # the default: SmolLM2's projections are all under MIN_ROWS, so the bundle leaves them dense
    m = PowerInfer.from_pretrained("smollm2-135m-instruct", Config(input_sparsity=input_bundle, **LOAD))
    assert m.input_sparsity["target"] == 0.25
    assert not m.engine.native.input_sparse[0]
    m.generate("Hello", max_new_tokens=4, temperature=0)
    assert m.input_sparsity_stats() == (0, 0)


def test_the_actor_runtime_reads_only_the_kept_channels(input_bundle, monkeypatch):
    """The actor runtime with the bundle's input sparsity (every projection: MIN_ROWS 0 here, which
    the plan carries to the executors) on a dense split (a hot and a cold executor, each with some
    KV heads and some neurons, their q/k/v, output and gate+up shares read by input channel in
    their native loops) decodes the in-process engine's tokens with the same thresholds; both
    executors count the channels, about three quarters kept; a request's last event carries what
    its decode steps kept, and the server's metrics report it per request. In float32: a
    threshold is a step in the input, so the split's other order of sums, in bf16's coarse
    rounding, moves an entry near its threshold across it now and then, and a decode may part
    from the in-process one by more than a near-tie (seen on SmolLM2: a 0.375 margin)."""
    from serve_app.metrics import Metrics
    monkeypatch.setattr(isp, "MIN_ROWS", 0)
    load = {**LOAD, "dtype": "float32"}
    local = PowerInfer.from_pretrained("smollm2-135m-instruct", Config(input_sparsity=input_bundle, **load))
    actors = PowerInfer.from_pretrained("smollm2-135m-instruct",
                                        Config(input_sparsity=input_bundle, runtime="actors",
                                               cold_executors=1, **load))
    try:
        info = actors.engine.group.info
        assert info["hot"]["native"] and info["cold.0"]["native_attention"] == 30, info
        # each executor's q/k/v and output share and its gate+up rows of every layer
        assert info["hot"]["input_sparse"] == [90, 0] and info["cold.0"]["input_sparse"] == [90, 0]
        assert actors.input_sparsity["target"] == 0.25
        n = 12
        for p in PROMPTS:
            ids = local.tokenize(p)
            assert_same_or_near_tie(local, ids, greedy_ids(local, ids, n), greedy_ids(actors, ids, n), 0.05)
        stats = actors.engine.stats()["actors"]
        for name in ("hot", "cold.0"):
            kept, seen = stats[name]["input_sparse_stats"]
            assert seen > 0 and 0.6 < kept / seen < 0.9, (name, kept, seen)
        assert actors.input_sparsity_stats() == tuple(
            sum(stats[k]["input_sparse_stats"][j] for k in ("hot", "cold.0")) for j in (0, 1))
        events = list(actors.engine.generate(local.tokenize(PROMPTS[2]),
                                             sampling_params(max_tokens=8, temperature=0, ignore_eos=True)))
        assert all("input_sparsity" not in e for e in events[:-1])
        got = events[-1]["input_sparsity"]  # its 7 decode steps' inputs, the hot executor's
        per_step = 30 * (2 * 576 + 64 * 3 * (info["hot"]["kv_heads"][1] - info["hot"]["kv_heads"][0]))
        assert got["seen"] == 7 * per_step and 0.6 < got["kept"] / got["seen"] < 0.9, got
        metrics = Metrics()
        metrics.request("smol", 0.0).input_sparsity(got["kept"], got["seen"])
        text = metrics.render({}).decode()
        assert 'powerinfer:input_sparsity_realised_count{model_name="smol"} 1.0' in text
        share = float(text.split('powerinfer:input_sparsity_realised_sum{model_name="smol"} ')[1].split()[0])
        assert share == pytest.approx(1 - got["kept"] / got["seen"])
    finally:
        actors.close()


def test_a_size_not_faster_sparse_on_this_cpu_stays_dense(monkeypatch, caplog):
    """At load each size of projection that may skip channels (8,192-row Q4_0 matrices here,
    MIN_ROWS by default) is timed sparse against dense on inputs a share under their
    thresholds, and the load's log (or an executor's list) says what it found. A size whose
    sparse product is not faster stays dense (its q4c copies dropped, nothing counted); a size
    whose sparse product is faster reads by channel and counts from its first step on, not the
    timing's steps. The kernels are slowed here, the sparse one on 256-wide inputs and the
    dense one on 512-wide ones, so each verdict is known on any CPU. With MIN_ROWS 0 (every
    projection, to measure) or measuring off nothing is timed."""
    import logging
    import time

    from powerinfer import kernels
    g = torch.Generator().manual_seed(0)

    def q4(n, k):
        return Q4Linear(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                        torch.rand(n, k // 32, generator=g) * 0.01, torch.zeros(n, k // 32), None)

    def slowed(fn, width):
        def slow(x, *a, **kw):
            if x.shape[-1] == width:
                time.sleep(0.002)
            return fn(x, *a, **kw)
        return slow
    monkeypatch.setattr(kernels, "linear_q4c", slowed(kernels.linear_q4c, 256))
    monkeypatch.setattr(kernels, "linear_q4x16", slowed(kernels.linear_q4x16, 512))
    narrow, wide = [q4(8192, 256) for _ in range(3)], [q4(8192, 512) for _ in range(2)]
    parts = [(i, "qkv", m) for i, m in enumerate(narrow)] + \
        [(i, "gate_up", m) for i, m in enumerate(wide)]
    th = {(i, p): 0.5 for i in range(3) for p in ("qkv", "gate_up")}
    calls = []
    real = isp._sparse_pays
    monkeypatch.setattr(isp, "_sparse_pays",
                        lambda group, share, *rest: calls.append(share) or real(group, share, *rest))
    with caplog.at_level(logging.INFO, logger="powerinfer"):
        taken, dense, stats = isp.attach_parts(parts, th)
    assert (taken, dense, calls) == (2, 3, [isp.MEASURE_SHARE, isp.MEASURE_SHARE])
    assert all(m.sparse is None and m.sparse_stats is None for m in narrow)
    assert all(m.sparse is not None and m.sparse_stats is stats for m in wide)
    assert stats.tolist() == [0, 0]  # (the timing's steps not counted)
    assert "qkv, 8192 x 256 (3 timed): the sparse product at 25% of the input" in caplog.text
    assert "dense (sparse not 5% faster on this CPU)" in caplog.text
    assert "gate_up, 8192 x 512 (2 timed)" in caplog.text and "ms: sparse" in caplog.text
    x = torch.full((1, 512), 1.0)
    x[0, ::4] = 0.1  # a quarter under the threshold
    with torch.inference_mode():
        y = wide[0](x)
    assert stats.tolist() == [3 * 512 // 4, 512]
    wide[0].sparsify_input(None)
    with torch.inference_mode():
        assert torch.allclose(y, wide[0](x.masked_fill(x <= 0.5, 0)), rtol=1e-3, atol=1e-3)
    # an executor's list instead of the log, and the bundle's share
    lines = []
    assert isp.attach_parts(parts, th, None, 0.5, timings=lines)[:2] == (2, 3)
    assert calls[-1] == 0.5 and len(lines) == 2 and "at 50% of the input" in lines[0]
    # nothing timed: measuring off, or MIN_ROWS 0
    assert isp.attach_parts(parts, th, measure=False)[:2] == (5, 0) and len(calls) == 4
    monkeypatch.setattr(isp, "MIN_ROWS", 0)
    assert isp.attach_parts(parts, th)[:2] == (5, 0) and len(calls) == 4
    monkeypatch.setattr(isp, "MIN_ROWS", 8192)
    # a process whose weights are past the last level cache times each size from memory (the
    # caches filled with other bytes before each round); under it, as the matrices come
    monkeypatch.setattr(isp, "last_level_cache", lambda: 1 << 20)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="powerinfer"):
        isp.attach_parts(parts[3:], th, held_bytes=2 << 20)
        isp.attach_parts(parts[3:], th, held_bytes=1 << 19)
    assert caplog.text.count("gate_up, 8192 x 512, from memory (2 timed)") == 1, caplog.text
    assert caplog.text.count("gate_up, 8192 x 512 (2 timed)") == 1, caplog.text
