"""The GPU path's Triton kernels (`powerinfer.triton_ffn`) against torch references of the same
math. Where no GPU is present they run on the CPU under Triton's interpreter: the environment
variable is set here, before anything imports triton, so every machine checks them."""
import contextlib
import os
import signal
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated (at import)

pytest.importorskip("triton", reason="the Triton kernels need the triton package (`gpu` extra)")

from powerinfer import kernels
from powerinfer.kernels import triton_ffn as T
from powerinfer.formats.args import ModelArgs
from powerinfer.model.transformer import Transformer
from powerinfer.model.predictor import Predictors
from powerinfer.model.sparse import activate, apply_hybrid_ffn
from powerinfer.sparsity.synthetic import PRESETS

# the tiny shape with a quarter of its FFN, for the engine tests under the interpreter: its time
# is the FFN's programs (49 s -> 30 s for a two-layer engine's greedy decode)
SMALL_FFN = replace(PRESETS["tiny"], n_ff=256)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GATED = ("swiglu", "reglu", "dreglu", "geglu")
ACTS = (*GATED, "relu", "gelu")


def records(fmt: str, act: str, k: int, dim: int, g: torch.Generator):
    """Random neuron records in `fmt` (the CPU kernel's packing) and the float32 rows they hold."""
    gate = torch.randn(k, dim, generator=g) if act in GATED else None
    up, down = torch.randn(k, dim, generator=g), torch.randn(k, dim, generator=g) / 8
    if fmt == "f16":  # (a GPU format: the CPU kernel's packing has no float16)
        rows = [r for r in (gate, up, down) if r is not None]
        rec = torch.cat(rows, 1).half().view(torch.uint8)
    else:
        rec = kernels.pack(gate, up, down, fmt)
    ref = kernels.unpack(rec.cpu(), fmt, dim, act in GATED) if fmt != "f16" else \
        tuple(None if r is None else r.half().float() for r in (gate, up, down))
    return rec.to(DEV), tuple(None if r is None else r.float() for r in ref)


def reference(x, rows, act, sel_mask, keep, bias, threshold):
    # the FFN over float32 rows: the selected neurons, each row keeping its own, in float64
    gate, up, down = (None if r is None else r.double() for r in rows)
    x = x.double()
    u = x @ up.T + (0 if bias is None else bias.double())
    score, h = activate(act, None if gate is None else x @ gate.T, u)
    if threshold > 0:
        h = h * (score > threshold)
    h = h * sel_mask[None]
    if keep is not None:
        h = h * keep
    return h @ down


@contextlib.contextmanager
def split_as(split: bool, cols: int):
    # the decode row's path (`T.DECODE_SPLIT`) and its programs' columns, tiles of 32 columns a
    # step so that `cols` holds several
    saved = T.DECODE_SPLIT, T.SPLIT_COLS, T.SPLIT_TILES
    T.DECODE_SPLIT, T.SPLIT_COLS = {True: split, False: split}, cols
    T.SPLIT_TILES = {p: ((16, 32, 4), (16, 32, 4)) for p in (True, False)}
    try:
        yield
    finally:
        T.DECODE_SPLIT, T.SPLIT_COLS, T.SPLIT_TILES = saved


def selections(k: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    one = torch.zeros(k, dtype=torch.bool)
    one[k // 3] = True
    some = torch.rand(k, generator=g) < 0.1
    some[-1] = True  # never none: a few neurons, the last program's tail among them
    return {"none": torch.zeros(k, dtype=torch.bool), "one": one,
            "10%": some, "all": torch.ones(k, dtype=torch.bool)}


@pytest.mark.parametrize("fmt,dim,acts", [("f32", 150, ACTS), ("bf16", 150, ("swiglu", "gelu")),
                                          ("f16", 150, ("reglu", "relu")),
                                          ("q4_0", 160, ("swiglu", "relu")),
                                          ("q4_1", 160, ("dreglu", "gelu")),
                                          ("q8_0", 160, ("geglu", "relu"))])
def test_ffn_kernel_equals_torch_on_its_rows(fmt, dim, acts):
    # dim past one 128-column step (a tail of 22 columns for plain rows, of one 32-block for
    # blocks); k = 40 neurons, past two programs of 16; every activation in float32, each
    # other format with a gated and an ungated one; selections of none, one neuron, about 10%
    # and all, as a mask (the about-10% one also as positions and through the mask path);
    # batch 1 (split over the width, and in one launch), and batch 5 where each row keeps its
    # own neurons
    g = torch.Generator().manual_seed(len(fmt) * 100 + dim)
    k = 40
    tol = 1e-4
    for act in acts:
        rec, rows = records(fmt, act, k, dim, g)
        bias = torch.randn(k, generator=g) if act in ("relu", "gelu") else None
        threshold = 0.05 if act in ("swiglu", "geglu") else 0.0
        for B in (1, 5):
            x = torch.randn(B, dim, generator=g)
            keep = None if B == 1 else torch.rand(B, k, generator=g) < 0.6
            for name, mask in selections(k, g).items():
                want = reference(x, rows, act, mask, keep, bias, threshold)
                scale = max(float(want.abs().max()), 1.0)
                idx = mask.nonzero().squeeze(-1)
                d = lambda t: None if t is None else t.to(DEV)  # noqa: E731
                got = {"mask": T.neuron_ffn(d(x), rec, d(mask), d(keep), d(bias), threshold, act, fmt)}
                if name == "10%":
                    got["mask path"] = T.neuron_ffn(d(x), rec, d(mask), d(keep), d(bias),
                                                    threshold, act, fmt, mask_path=True)
                    got["positions"] = T.neuron_ffn(d(x), rec, d(idx),
                                                    None if keep is None else d(keep[:, idx]),
                                                    d(bias), threshold, act, fmt)
                if name == "all":
                    got["every neuron"] = T.neuron_ffn(d(x), rec, None, None if keep is None else
                                                       d(keep), d(bias), threshold, act, fmt)
                if B == 1 and name in ("10%", "all"):
                    # a decode row in one launch, and split over the width (its gate and up
                    # over several column slices of a program each)
                    for how, split, cols in (("one launch", False, T.SPLIT_COLS),
                                             ("split, 64-column slices", True, 64)):
                        with split_as(split, cols):
                            got[how] = T.neuron_ffn(d(x), rec, d(mask), None, d(bias), threshold,
                                                    act, fmt)
                if B == 1 and name == "10%":  # a decode row keeping only some of its neurons,
                    # by neuron (with the mask) and by position (with positions), split
                    mine = torch.rand(1, k, generator=g) < 0.5
                    want_kept = reference(x, rows, act, mask, mine, bias, threshold)
                    with split_as(True, 64):
                        kept = {"by neuron": T.neuron_ffn(d(x), rec, d(mask), d(mine), d(bias),
                                                          threshold, act, fmt),
                                "by position": T.neuron_ffn(d(x), rec, d(idx), d(mine[:, idx]),
                                                            d(bias), threshold, act, fmt)}
                    for how, y in kept.items():
                        err = float((y.cpu().double() - want_kept).abs().max())
                        assert err <= tol * scale, (fmt, act, how, err)
                for how, y in got.items():
                    assert y.shape == (B, dim) and y.dtype == torch.float32
                    err = float((y.cpu().double() - want).abs().max())
                    assert err <= tol * scale, (fmt, act, B, name, how, err, scale)
                if name == "none":
                    assert all(float(y.abs().max()) == 0 for y in got.values())


def test_ffn_kernel_in_bfloat16_rounds_once():
    # bf16 rows and a bf16 input: summed in float32, one rounding to bf16 at the end
    g = torch.Generator().manual_seed(3)
    rec, rows = records("bf16", "swiglu", 100, 256, g)
    x = torch.randn(3, 256, generator=g).bfloat16()
    mask = torch.rand(100, generator=g) < 0.5
    y = T.neuron_ffn(x.to(DEV), rec, mask.to(DEV), None, None, 0.0, "swiglu", "bf16")
    want = reference(x.float(), rows, "swiglu", mask, None, None, 0.0)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.cpu(), want.float().bfloat16()) or \
        float((y.cpu().double() - want).abs().max()) <= 2 ** -7 * float(want.abs().max())


def test_compaction_lists_every_set_position_once():
    g = torch.Generator().manual_seed(0)
    n = 3000  # three programs of 1024
    for mask in selections(n, g).values():
        idx, count = T.compact(mask.to(DEV))
        got = sorted(idx[:int(count)].tolist())
        assert got == mask.nonzero().squeeze(-1).tolist()


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_widened_records_equal_the_cpu_dequantization(fmt):
    g = torch.Generator().manual_seed(1)
    rec, rows = records(fmt, "swiglu", 37, 160, g)
    wide = T.widen(rec, fmt, 3, 160).cpu()
    for j in range(3):
        assert torch.equal(wide[:, j], rows[j])
    plain = T.widen(kernels.quantize_rows(rows[1], fmt).to(DEV), fmt, 1, 160).cpu()  # one matrix
    assert torch.equal(plain[:, 0], rows[1])


@pytest.mark.parametrize("B", [1, 5])
def test_predictor_kernels_select_as_the_torch_predictor(B):
    # rank 40 and 300 neurons: tails past the kernels' blocks
    g = torch.Generator().manual_seed(B)
    dim, r, n = 96, 40, 300
    fc1, fc2 = torch.randn(r, dim, generator=g) / 8, torch.randn(n, r, generator=g)
    x = torch.randn(B, dim, generator=g)
    preds = Predictors([fc1], [fc2], "ffn", threshold=0.25)
    logits = preds.logits(0, x)  # torch's forward, on the CPU
    keep, idx, count, got_logits = T.predict(x.to(DEV), fc1.to(DEV), fc2.to(DEV), 0.25,
                                             store_logits=True)
    assert float((got_logits.cpu() - logits).abs().max()) <= 1e-4 * float(logits.abs().max())
    near = (logits - 0.25).abs() < 1e-4 * float(logits.abs().max())  # near-ties may go either way
    assert not near.all()
    assert torch.equal(keep.cpu()[~near], preds.active(0, x)[~near])
    union = keep.cpu().any(0)
    assert sorted(idx[:int(count)].cpu().tolist()) == union.nonzero().squeeze(-1).tolist()
    assert 0 < int(count) < n
    # each row's top 17 as torch.topk keeps them (on the same logits)
    keep_k, idx_k, count_k, lg = T.predict(x.to(DEV), fc1.to(DEV), fc2.to(DEV), top_k=17)
    kth = torch.topk(lg.cpu(), 17, dim=1).values[:, -1:]
    assert torch.equal(keep_k.cpu(), lg.cpu() >= kth) and (keep_k.sum(1) == 17).all()
    assert sorted(idx_k[:int(count_k)].cpu().tolist()) == \
        keep_k.cpu().any(0).nonzero().squeeze(-1).tolist()
    # an edge: k = n keeps everything
    assert bool(T.predict(x.to(DEV), fc1.to(DEV), fc2.to(DEV), top_k=n)[0].all())
    # bf16 matrices (`predictor.run_dtype` beside a bf16 model on a GPU): the kernels widen each
    # weight and sum in float32, the logits of the widened matrices
    w1, w2 = fc1.bfloat16(), fc2.bfloat16()
    want = torch.relu(x.bfloat16().double() @ w1.double().T) @ w2.double().T
    keep16, _, _, lg16 = T.predict(x.bfloat16().to(DEV), w1.to(DEV), w2.to(DEV), 0.25,
                                   store_logits=True)
    assert float((lg16.cpu() - want).abs().max()) <= 1e-4 * float(want.abs().max())
    near = (want - 0.25).abs() < 1e-4 * float(want.abs().max())
    assert torch.equal(keep16.cpu()[~near], (want >= 0.25)[~near])


@pytest.mark.parametrize("B", [1, 6])
def test_predictor_kernels_read_q8_0_rows(B):
    # a GPU's predictors hold their matrices as Q8_0 rows (`kernels.quantize_rows`): the kernels
    # widen each weight as they read it, the logits of the widened matrices, in both kernels
    from powerinfer.formats.kquants import widen_rows
    g = torch.Generator().manual_seed(10 + B)
    dim, r, n = 96, 64, 300  # (300 neurons: a tail past the logits kernel's block)
    fc1, fc2 = torch.randn(r, dim, generator=g) / 8, torch.randn(n, r, generator=g)
    q1, q2 = kernels.quantize_rows(fc1, "q8_0"), kernels.quantize_rows(fc2, "q8_0")
    assert q1.shape == (r, dim // 32 * 34) and q2.shape == (n, r // 32 * 34)
    w1, w2 = widen_rows(q1, "Q8_0", dim), widen_rows(q2, "Q8_0", r)
    assert 0 < float((w1 - fc1).abs().max()) <= float(fc1.abs().max()) / 127  # (8-bit codes)
    x = torch.randn(B, dim, generator=g)
    want = torch.relu(x.double() @ w1.double().T) @ w2.double().T
    for a, b in ((q1, q2), (q1, fc2), (fc1.bfloat16(), q2)):  # either matrix in either form
        keep, idx, count, lg = T.predict(x.to(DEV), a.to(DEV), b.to(DEV), 0.25, store_logits=True)
        ref = torch.relu(x.double() @ (w1 if a is q1 else a).double().T) @ \
            (w2 if b is q2 else b).double().T
        assert float((lg.cpu() - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
        near = (ref - 0.25).abs() < 1e-4 * float(ref.abs().max())
        assert torch.equal(keep.cpu()[~near], (ref >= 0.25)[~near])
        assert sorted(idx[:int(count)].cpu().tolist()) == keep.cpu().any(0).nonzero().squeeze(-1).tolist()
    assert float((want - ref).abs().max()) > 0  # (the last pair read fc1 in bf16: not the same)


def test_predictors_dispatch_to_the_kernels(monkeypatch):
    # Predictors.active on the Triton path (a GPU, here TRITON_ON_CPU) runs `predict` over the
    # matrices as Q8_0 rows (`predictor.device_format`), the masks of torch's predictor over the
    # widened rows; a prompt's rows run on the kernels too, 64 a call (the matrices are never
    # widened whole); POWERINFER_PREDICTOR_ROWS=model keeps the 16-bit matrices
    from powerinfer.formats.kquants import widen_rows
    from powerinfer.model import predictor as P
    g = torch.Generator().manual_seed(7)
    fc1, fc2 = torch.randn(32, 64, generator=g) / 8, torch.randn(200, 32, generator=g)
    x = torch.randn(2, 1, 64, generator=g)
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)
    assert P.device_format(DEV) == "q8_0"
    preds = Predictors([fc1.to(DEV)], [fc2.to(DEV)], "ffn")
    assert preds.fc1[0].dtype == preds.fc2[0].dtype == torch.uint8 and preds.ranks == [32]
    assert preds.dtype == torch.float32
    assert sum(w.nbytes for w in (preds.fc1[0], preds.fc2[0])) == \
        P.held_bytes([32], 64, 200, 4, "q8_0") == (32 * 64 + 200 * 32) // 32 * 34
    w1, w2 = (widen_rows(kernels.quantize_rows(w, "q8_0"), "Q8_0", c) for w, c in ((fc1, 64), (fc2, 32)))
    with monkeypatch.context() as m:
        m.setattr(kernels, "TRITON_ON_CPU", False)  # (torch's predictor over the widened rows)
        torch_preds = Predictors([w1], [w2], "ffn")
        want, logits = torch_preds.active(0, x), torch_preds.logits(0, x)
    calls = []
    real = T.predict
    monkeypatch.setattr(T, "predict", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = preds.active(0, x.to(DEV)).cpu()
    assert calls and got.shape == want.shape
    near = logits.abs() < 1e-4 * float(logits.abs().max())
    assert torch.equal(got[~near], want[~near])
    prompt = torch.randn(1, T.MAX_ROWS + 3, 64, generator=g)  # past one call's rows
    calls.clear()
    got = preds.logits(0, prompt.to(DEV)).cpu()
    assert len(calls) == 2 and torch.allclose(got, torch.relu(prompt @ w1.T) @ w2.T, atol=1e-5)
    monkeypatch.setattr(P, "ROWS", "model")
    assert P.device_format(DEV) is None
    assert Predictors([fc1.to(DEV)], [fc2.to(DEV)], "ffn").fc1[0].dtype == torch.float32


@pytest.mark.parametrize("dtype,splits", [(torch.float32, None), (torch.bfloat16, None),
                                          (torch.float32, 3), (torch.bfloat16, 5)])
def test_decode_attention_equals_torch_paged_attention(dtype, splits):
    # one launch for a decode step's attention (`triton_attention`) against torch's
    # `paged_attention` on the same pools: three sequences at positions in their first, third
    # and seventh blocks; query heads grouped 3 to a KV head (SmolLM2's), one to one, and 4 to
    # one with a sliding window; with RoPE and without. The token's key and value land in its
    # block (the kernel's store is the cache's), and the heads' outputs agree: float32 to its
    # rounding, bfloat16 to a few of its steps (the interpreter rounds to bfloat16 by
    # truncation, a GPU to nearest). Split over 3 and 5 programs a sequence and head (the
    # first sequence's one block leaves all but one split empty; 5 splits over the window's 4
    # blocks, one), merged by the last split to finish, twice in a row (the counters it
    # zeroes serve the next call)
    from powerinfer.kernels import triton_attention as TA
    from powerinfer.model.transformer import KVCache, KVTables, paged_attention
    g = torch.Generator().manual_seed(5)
    bs, nb, S, M = 16, 40, 3, 8
    pos = torch.tensor([5, 37, 100])
    tables = torch.randperm(nb, generator=g)[:S * M].view(S, M).int()
    for H, hkv, D, window, rope in ((9, 3, 64, 0, True), (4, 4, 32, 0, False), (8, 2, 64, 40, True)):
        pools = (torch.randn(nb, hkv, D, bs, generator=g).to(dtype),
                 torch.randn(nb, hkv, bs, D, generator=g).to(dtype))
        caches = [KVCache(nb, hkv, bs, D, dtype, "cpu") for _ in range(2)]
        for c in caches:
            c.k.copy_(pools[0]), c.v.copy_(pools[1])
        qkv = torch.randn(S, (H + 2 * hkv) * D, generator=g).to(dtype)
        r = (torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)) if rope else None
        want = paged_attention(qkv, r, pos, KVTables(torch.arange(S + 1), tables, None), caches[0],
                               H, window, D ** -0.5)
        d = lambda t: t.to(DEV)  # noqa: E731
        k_dev, v_dev = d(caches[1].k), d(caches[1].v)
        for _ in range(1 if splits is None else 2):
            got = TA.decode_attention(d(qkv), None if r is None else tuple(map(d, r)), d(pos),
                                      d(tables), k_dev, v_dev, H, window, D ** -0.5,
                                      splits).cpu()
        assert got.shape == want.shape and got.dtype == dtype
        scale = float(want.float().abs().max())
        err = float((got.float() - want.float()).abs().max())
        assert err <= (1e-5 if dtype == torch.float32 else 2 ** -5) * scale, (H, hkv, window, err)
        for mine, theirs in ((k_dev.cpu(), caches[0].k), (v_dev.cpu(), caches[0].v)):
            # (a GPU fuses RoPE's multiply-adds: a float32 key may differ in its last bit)
            diff = (mine.float() - theirs.float()).abs()
            step = 2 ** -22 if dtype == torch.float32 else 2 ** -7
            assert diff.max() <= (0 if not rope else step * float(theirs.float().abs().max()))
            assert (diff > 0).sum() <= S * hkv * D  # only the step's keys and values moved
    assert not TA.fits(80, 16) and not TA.fits(64, 8) and TA.fits(128, 16)
    cpu = torch.device("cpu")  # (the interpreter's 8 multiprocessors: 16 programs in all)
    assert TA.splits_for(1, 2, 64, cpu) == 8 and TA.splits_for(1, 2, 8, cpu) == 2
    assert TA.splits_for(8, 8, 512, cpu) == 1 and TA.splits_for(1, 1, 3, cpu) == 1


def random_model(seed: int) -> Transformer:
    # a dReLU model: its FFN is exactly sparse, so an oracle's masks reproduce the dense output
    torch.manual_seed(seed)
    a = ModelArgs(arch="llama", vocab_size=300, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=256,
                  ffn_act="dreglu", max_seq_len=128)
    m = Transformer(a)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    m.setup_cache(2, 64)
    return m.eval().requires_grad_(False).to(DEV)


def test_layers_with_the_ffn_on_triton_equal_the_dense_model(monkeypatch):
    # decode steps' attention on its Triton kernel, each FFN's hot and cold sets on the FFN
    # kernel (records in f32),
    # with the oracle's per-row masks given as predictions: two sequences, each keeping its own
    # neurons, equal the dense model
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)
    dense, sparse = random_model(0), random_model(0)

    def oracle(layer, h):  # the neurons that fire for each row, from the dense model's FFN
        f, x = dense.layers[layer].ffn, dense.layers[layer].ffn_norm(h)
        gate, up = (x @ f.w1.weight.T).chunk(2, -1)
        return (gate > 0) & (up > 0)

    g = torch.Generator().manual_seed(1)
    hot = [torch.rand(256, generator=g) < 0.3 for _ in range(3)]
    apply_hybrid_ffn(sparse, oracle, [h.to(DEV) for h in hot], fmt="auto")
    assert all(b.ffn.hot.fmt == "f32" and b.ffn.cold.fmt == "f32" for b in sparse.layers)
    calls, attention = [], []
    real = T.neuron_ffn
    monkeypatch.setattr(T, "neuron_ffn", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    from powerinfer.kernels import triton_attention as TA
    real_attention = TA.decode_attention
    monkeypatch.setattr(TA, "decode_attention",
                        lambda *a, **kw: attention.append(1) or real_attention(*a, **kw))
    prompts = torch.tensor([[1, 5, 9, 13], [4, 200, 17, 99]], device=DEV)
    out = []
    with torch.inference_mode():
        for m in (dense, sparse):
            m(prompts, torch.arange(4, device=DEV).expand(2, 4))
            steps = []
            for s in range(4):
                tok = torch.tensor([[7 * s + 1], [11 * s + 3]], device=DEV)
                steps.append(m(tok, torch.full((2, 1), 4 + s, device=DEV))[:, 0])
            out.append(torch.stack(steps).cpu())
    a, b = out
    assert len(calls) == 4 * 3 * 2  # every decode step, layer and set ran on the kernel
    assert len(attention) == 4 * 3 * 2  # and each decode step's attention, in both models
    assert all(c is not None and c.dtype == torch.bool for c in calls)  # (a mask: compacted)
    shares = [float(c.float().mean()) for c in calls]
    assert 0 < min(shares) and max(shares) < 0.9  # the oracle leaves neurons out
    assert a.abs().max() > 0.5  # logits with a spread, so the tolerance means something
    assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())


def test_block_linear_equals_the_files_matrix(monkeypatch):
    # a fused projection of parts in Q4_0, Q4_1 and Q8_0 blocks (`triton_linear.BlockLinear`):
    # x W^T + b over the weights the blocks hold, for a decode row (split over the width), a
    # batch's rows (2 and MAX_ROWS: `_linear_kernel`), and a prompt (widened a few rows at a
    # time, slices that do not divide the rows)
    from powerinfer.kernels import triton_linear as TL
    monkeypatch.setattr(TL, "WIDEN_BYTES", 4 * 160 * 16)  # (16 rows a slice: 3 of the 48)
    g = torch.Generator().manual_seed(2)
    dim, parts, ref = 160, [], []
    for fmt, n in (("q4_0", 40), ("q4_0", 8), ("q4_1", 33), ("q8_0", 19)):
        raw = kernels.quantize_rows(torch.randn(n, dim, generator=g), fmt)
        parts.append((raw, fmt))
        ref.append(kernels.dequantize_rows(raw, fmt, dim))
    bias = torch.randn(100, generator=g)
    m = TL.BlockLinear(parts, dim, bias).to(DEV)
    assert m.fmts == ["q4_0", "q4_1", "q8_0"]  # (the two Q4_0 parts: one matrix, one launch)
    w = torch.cat(ref).double()
    for shape in ((1, 1, dim), (2, dim), (TL.MAX_ROWS, dim), (2, 40, dim)):
        x = torch.randn(*shape, generator=g)
        want = x.double() @ w.T + bias.double()
        got = m(x.to(DEV)).cpu()
        assert got.shape == (*shape[:-1], 100) and got.dtype == torch.float32
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), shape
    y = m(torch.randn(1, dim, generator=g).bfloat16().to(DEV))  # rounded once to the input's type
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_block_linear_with_input_sparsity_reads_only_the_kept_channels(fmt, monkeypatch):
    # input sparsity on the GPU (`triton_linear.q4c_linear`): a projection's one-row step takes
    # the input with every entry at or under the threshold zeroed, and its q4c copy's kernel
    # loads only the kept channels' codes (and the scales of blocks with one kept). It equals the
    # dense product over the zeroed input, for rows that are not a multiple of 64 and for
    # inputs past one program's channels; a batch's rows stay dense; the channels kept are
    # counted; nothing kept gives zeros; a mixed projection takes none
    from powerinfer.kernels import triton_linear as TL
    monkeypatch.setattr(TL, "Q4C_CHUNK", 64)  # (three programs over the input's channels)
    g = torch.Generator().manual_seed(3)
    dim, n = 2 * TL.Q4C_CHUNK + 64, 100
    raw = kernels.quantize_rows(torch.randn(n, dim, generator=g), fmt)
    w = kernels.dequantize_rows(raw, fmt, dim).double()
    bias = torch.randn(n, generator=g)
    m = TL.BlockLinear([(raw, fmt)], dim, bias).to(DEV)
    assert m.sparsifiable
    stats = torch.zeros(2, dtype=torch.long, device=DEV)
    t = 0.7
    m.sparsify_input(t, stats)
    assert m.sparse[1] == kernels.Q4C_KINDS.index(fmt) and m.sparse[0].device.type == DEV
    seen = kept = 0
    for shape in ((1, 1, dim), (1, dim)):
        x = torch.randn(*shape, generator=g)
        zeroed = torch.where(x.abs() > t, x, torch.zeros_like(x))
        want = zeroed.double() @ w.T + bias.double()
        got = m(x.to(DEV)).cpu()
        assert got.shape == (*shape[:-1], n) and got.dtype == torch.float32
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), shape
        seen, kept = seen + dim, kept + int((x.abs() > t).sum())
    assert 0.3 < kept / seen < 0.7 and stats.tolist() == [kept, seen]
    quiet = torch.full((1, dim), 0.5 * t)  # every channel under the threshold: the bias alone
    assert torch.allclose(m(quiet.to(DEV)).cpu(), bias.unsqueeze(0), atol=1e-6)
    if fmt == "q4_0":  # (the dense kernels' own test has both types; interpreted, they are slow)
        x = torch.randn(2, dim, generator=g)  # a batch's step: dense, nothing skipped
        assert torch.allclose(m(x.to(DEV)).cpu().double(), x.double() @ w.T + bias.double(),
                              rtol=1e-5, atol=1e-4)
        assert stats.tolist() == [kept, seen + dim]  # (quiet: seen, none kept)
        m.sparsify_input(None)  # dense again
        x = torch.randn(1, dim, generator=g)
        assert torch.allclose(m(x.to(DEV)).cpu().double(), x.double() @ w.T + bias.double(),
                              rtol=1e-5, atol=1e-4)
    mixed = TL.BlockLinear([(raw, fmt), (kernels.quantize_rows(torch.randn(8, dim), "q8_0"),
                                         "q8_0")], dim)
    assert not mixed.sparsifiable


@pytest.mark.skipif(not kernels.available(), reason="the kernel library does not run here")
def test_the_in_process_engine_keeps_a_4bit_files_blocks_where_triton_runs(tmp_path, monkeypatch):
    # Config(weights="int4") where the Triton kernels run (a GPU; here the CPU, interpreted):
    # every projection of the model stays in the file's Q4_0 blocks (`BlockLinear`), the head
    # in the converted copy's Q8_0 ones (the file's Q6_K), the embedding in its Q4_0 rows
    # (`BlockEmbedding`: the bf16 table's values), and greedy decoding follows the dense bf16
    # engine's over the same file up to a near-tie
    from powerinfer import Config, PowerInfer
    from powerinfer.model.quant import BlockEmbedding
    from powerinfer.sparsity.synthetic import write_synthetic
    from powerinfer.kernels.triton_linear import BlockLinear

    from greedy import assert_same_or_near_tie, greedy_ids

    # (two layers: every part of a layer and the head)
    m = write_synthetic(tmp_path / "m.gguf", preset=SMALL_FFN, n_layers=2, seed=1, quant="q4_0",
                        progress=False)
    base = dict(dtype="bfloat16", max_seq_len=128, max_batch=1)
    dense = PowerInfer.from_pretrained(str(m.path), Config(weights="dense", **base))
    ids = [1, 5, 9, 13, 17, 21]
    want = greedy_ids(dense, ids, 4)
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)
    # (64 rows a program: an eighth of the interpreter's programs)
    monkeypatch.setattr(T, "SPLIT_TILES", {True: T.SPLIT_TILES[True],
                                           False: ((64, 256, 4), T.SPLIT_TILES[False][1])})
    pi = PowerInfer.from_pretrained(str(m.path), Config(weights="int4", **base))
    for i in range(pi.args.n_layers):
        mods = [getattr(owner, attr) for owner, attr, _ in pi.model.projections(i)]
        assert all(type(mod) is BlockLinear and set(mod.fmts) == {"q4_0"} for mod in mods), mods
    assert type(pi.model.output) is BlockLinear and pi.model.output.fmts == ["q8_0"]
    emb = pi.model.tok_embeddings  # (untied: its rows in the file's blocks too)
    assert type(emb) is BlockEmbedding and emb.kind == "Q4_0" and emb.dtype == torch.bfloat16
    assert torch.equal(emb(torch.tensor([ids])), dense.model.tok_embeddings(torch.tensor([ids])))
    got = greedy_ids(pi, ids, 4)
    assert_same_or_near_tie(dense, ids, want, got, 0.1)


COMPILE = "test_kernels_compile_for_an_h100"


@pytest.fixture(scope="module", autouse=True)
def h100_compile(request, tmp_path_factory):
    """Triton's compiler lowering every kernel variant for sm_90 (PTX, then a cubin by the ptxas
    in the triton wheel), in a process without TRITON_INTERPRET, started with this module's first
    test: the interpreter's tests run on one core, and the compile (20 s on two cores) takes the
    other one meanwhile. Started only where its test is selected and no GPU runs the kernels."""
    import subprocess
    import sys
    from pathlib import Path
    if torch.cuda.is_available() or not any(i.name == COMPILE for i in request.session.items):
        yield None
        return
    d = tmp_path_factory.mktemp("h100")
    cache, out, err = d / "cache", d / "stdout", d / "stderr"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=str(Path(__file__).parent.parent))
    # its output to files (a pipe read only at the end would stall it once full); its own
    # session, so that the compilers it starts go with it
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "triton_compile.py"),
                                 "90"], env=env, stdout=o, stderr=e, start_new_session=True)
    yield proc, cache, out, err
    if proc.poll() is None:  # its test deselected by a failure before it, or interrupted
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above compile and run "
                    "the kernels themselves")
def test_kernels_compile_for_an_h100(h100_compile):
    # the interpreter never runs Triton's compiler: every kernel variant compiles for an H100
    import json
    proc, cache, out, err = h100_compile
    proc.wait(timeout=300)
    assert proc.returncode == 0, err.read_text()[-3000:]
    got = json.loads(out.read_text().splitlines()[-1])
    assert got["capability"] == 90 and got["kernels"] == 48
    assert len(list(cache.rglob("*.cubin"))) == 48  # one cubin a variant


@pytest.mark.skipif(not kernels.available(), reason="the kernel library does not run here")
def test_a_gpus_hot_model_keeps_a_4bit_files_neurons_in_its_blocks(tmp_path, monkeypatch):
    # Config(weights="int4") with the hot executor on a GPU (here the Triton kernels on CPU
    # tensors): the hot executor's model there keeps each hot neuron as the file's Q4_0 blocks
    # with a Q8_0 down row, and attention's matrices and the (untied) head in their blocks (the
    # head's Q6_K as the converted copy's Q8_0), at the bytes the placement counts, and widens
    # the embedding to the model's type (on the CPU kernel they all stay 4-bit); a decode step
    # of each layer's hot neurons runs on the kernel and equals the file's FFN over them, and
    # its projections (one input row, and a prompt's) equal the file's matrices, q and k in the
    # model's row order
    from powerinfer import Config
    from powerinfer.engine.budget import gpu_neuron_format
    from powerinfer.model.convert import kernel_ready
    from powerinfer.formats.loader import load_checkpoint
    from powerinfer.model.transformer import held_bytes
    from powerinfer.engine.partial import device_fixed_bytes, hot_formats, hot_model
    from powerinfer.kernels.triton_linear import BlockLinear
    from powerinfer.model.quant import BlockEmbedding
    from powerinfer.sparsity.solver import neuron_bytes
    from powerinfer.sparsity.synthetic import write_synthetic

    m = write_synthetic(tmp_path / "m.gguf", preset=SMALL_FFN, n_layers=2, quant="q4_0",
                        progress=False)
    ck = kernel_ready(load_checkpoint(m.path, with_weights=False),
                      Config(dtype="bfloat16", weights="int4"), progress=False)
    a, cpu = ck.args, torch.device("cpu")
    assert ck.path != m.path and ck.source.kind("output") == "Q8_0" and not a.tie_embeddings
    assert hot_formats("int4", ck.info, torch.bfloat16, cpu) == ("q4_0", True, False)  # the CPU's
    monkeypatch.setattr(kernels, "TRITON_ON_CPU", True)
    fmt, int4, blocks = hot_formats("int4", ck.info, torch.float32, cpu)
    assert (fmt, int4, blocks) == ("q4_0", False, True)
    assert hot_formats("dense", ck.info, torch.float32, cpu) == ("f32", False, False)
    assert fmt == gpu_neuron_format(Config(dtype="bfloat16", weights="int4"), ck.info)
    assert gpu_neuron_format(Config(dtype="bfloat16", weights="dense"), ck.info) is None
    from powerinfer.errors import ConfigError
    with pytest.raises(ConfigError, match="Triton kernels, and they do not run on meta"):
        hot_formats("int4", ck.info, torch.bfloat16, torch.device("meta"))  # (not a GPU of theirs)
    g = torch.Generator().manual_seed(0)
    hot = [torch.rand(a.ffn_dim, generator=g) < 0.4 for _ in range(a.n_layers)]
    model = hot_model(ck.model_file(), torch.float32, hot, "ffn", None, fmt, int4,
                      quantized_embedding=int4, device_blocks=blocks)
    # the untied embedding in the file's Q4_0 blocks too: a lookup widens the tokens' rows to
    # the values the model's type holds
    assert type(model.tok_embeddings) is BlockEmbedding and model.tok_embeddings.kind == "Q4_0"
    tokens = torch.tensor([[0, 5, a.vocab_size - 1], [7, 7, 2]])
    want_embed = load_checkpoint(ck.path, torch.float32).weights["embed"]
    assert torch.equal(model.tok_embeddings(tokens), want_embed[tokens])
    assert type(model.output) is BlockLinear and model.output.fmts == ["q8_0"]
    attention = [b.attn for b in model.layers]
    assert all(type(m) is BlockLinear and m.fmts == ["q4_0"]  # (q, k and v: one matrix)
               for at in attention for m in (at.wqkv, at.wo))
    fixed = device_fixed_bytes(ck.source, a, 4)
    assert held_bytes(*attention) == fixed["attention"] and held_bytes(model.output) == fixed["lm_head"]
    assert held_bytes(model.tok_embeddings) == fixed["embeddings"] == a.vocab_size * a.dim // 32 * 18
    dense = load_checkpoint(ck.path, torch.float32).weights
    for i in (0, a.n_layers - 1):
        wqkv = torch.cat([dense[f"{i}.{n}"] for n in "qkv"])
        for rows in (1, 7):  # the decode kernel, then widened rows and a matmul
            x = torch.randn(rows, a.dim, generator=g)
            mats = [(attention[i].wqkv, wqkv), (attention[i].wo, dense[f"{i}.o"])]
            for mod, w in mats + ([(model.output, dense["output"])] if i == 0 else []):
                x_in = x[:, :w.shape[1]]
                want = x_in.double() @ w.double().T
                got = mod(x_in)
                assert got.dtype == torch.float32 and got.shape == want.shape
                assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()), (i, rows)
    calls = []
    real = T.neuron_ffn
    monkeypatch.setattr(T, "neuron_ffn", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    union = torch.ones(a.ffn_dim, dtype=torch.bool)
    for i, block in enumerate(model.layers):
        s, idx = block.ffn.hot, hot[i].nonzero().squeeze(-1)
        assert s.fmt == "q4_0" and torch.equal(s.idx, idx)
        assert s.records.shape == (len(idx), neuron_bytes(a, 4, "q4_0"))
        x = torch.randn(1, 1, a.dim, generator=g)
        got = block.ffn.hot_part(x, union, None)
        gate, up = dense[f"{i}.gate"][idx], dense[f"{i}.up"][idx]
        want = activate(a.ffn_act, x @ gate.T, x @ up.T)[1] @ dense[f"{i}.down"][:, idx].T
        scale = float(want.abs().max())
        assert scale > 0 and float((got - want).abs().max()) <= 1e-2 * scale, i  # (Q8_0 down)
    assert len(calls) == a.n_layers  # every layer's step ran on the kernel
