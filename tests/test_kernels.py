"""The CPU FFN kernel against the torch reference: every weight format, activation, batch size,
per-row masks, thresholds and biases, on both instruction sets this CPU offers; and the sparse
model with the kernel against the same model on the torch path."""
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from powerinfer import kernels as K
from powerinfer.formats.args import UNGATED
from powerinfer.formats.kquants import KQUANT_LAYOUTS
from powerinfer.model.sparse import activate, apply_hybrid_ffn

from test_sparse import random_model

pytestmark = pytest.mark.skipif(not K.available(), reason="the CPU FFN kernel cannot run here "
                                                          "(needs g++ and an AVX2 CPU)")
ISAS = K.ISAS[:K.ISAS.index(K.best_isa()) + 1]  # every instruction set this CPU runs


@pytest.fixture(params=ISAS)
def isa(request):
    before = torch.ops.powerinfer.use_isa(request.param)
    yield request.param
    torch.ops.powerinfer.use_isa(before)


def reference(x, gate, up, down_t, sel, keep, bias, threshold, act):
    # the torch path's arithmetic over the selected neurons: x (B, dim) -> (B, dim)
    g = None if gate is None else x @ gate[sel].t()
    u = x @ up[sel].t() + (0 if bias is None else bias[sel])
    score, h = activate(act, g, u)
    if threshold > 0:
        h = h * (score > threshold)
    if keep is not None:
        h = h * keep
    return h @ down_t[sel]


@pytest.mark.parametrize("fmt", K.FORMATS)
@pytest.mark.parametrize("act", K.ACTS)
@pytest.mark.parametrize("dim", [128, 160, 576])  # an odd number of blocks: the pairs' tail; 576: split 4-bit rows in a whole turn of 16 blocks and a tail of 2
def test_kernel_equals_reference(isa, fmt, act, dim):
    torch.manual_seed(0)
    k = 200
    gate = torch.randn(k, dim) if act not in UNGATED else None
    up, down_t = torch.randn(k, dim), torch.randn(k, dim)
    w = K.pack(gate, up, down_t, fmt)
    G, U, D = K.unpack(w, fmt, dim, act not in UNGATED)  # the weights the format holds
    G = None if G is None else G.float()
    U, D = U.float(), D.float()
    for B, use_keep, threshold, use_bias in [(1, False, 0.0, False), (3, True, 0.5, True),
                                             (6, True, 0.0, False), (5, False, 0.3, True)]:
        x = torch.randn(B, dim)
        sel = torch.randperm(k)[:90]
        keep = torch.rand(B, 90) > 0.3 if use_keep else None
        bias = torch.randn(k) if use_bias else None
        got = K.neuron_ffn(x, w, sel, keep, bias, threshold, act, fmt)
        xin = K.dot_input(x, fmt)  # what the dot products see
        want = reference(xin, G, U, D, sel, keep, bias, threshold, act)
        assert want.abs().max() > 1
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (B, threshold)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q4_0", "q4_1"])
def test_masks_and_bf16_rows_ask_for_the_same_as_indices(isa, fmt):
    # a (k,) bool mask selects what its indices do, with per-row masks over every record; a bf16
    # input is read as it is (the 4-bit records' 8-bit input quantized from its bf16 values, no
    # float copy) and answered in bf16, rounded once from the float32 answer
    torch.manual_seed(5)
    dim, k, B = 96, 150, 3
    w = K.pack(torch.randn(k, dim), torch.randn(k, dim), torch.randn(k, dim), fmt)
    x = torch.randn(B, dim).bfloat16().float()  # values a bf16 row holds exactly
    mask = torch.rand(k) < 0.4
    sel = mask.nonzero().squeeze(-1)
    rows = torch.rand(B, k) < 0.7
    by_index = K.neuron_ffn(x, w, sel, rows[:, sel].contiguous(), None, 0.0, "reglu", fmt)
    by_mask = K.neuron_ffn(x, w, mask, rows, None, 0.0, "reglu", fmt)
    assert by_index.abs().max() > 1
    assert torch.equal(by_mask, by_index)
    got = K.neuron_ffn(x.bfloat16(), w, mask, rows, None, 0.0, "reglu", fmt)
    assert got.dtype == torch.bfloat16 and torch.equal(got, by_index.bfloat16())
    with pytest.raises(RuntimeError, match="a mask of 149 for 150 neurons"):
        K.neuron_ffn(x, w, mask[1:], None, None, 0.0, "reglu", fmt)
    with pytest.raises(RuntimeError, match="keep"):
        K.neuron_ffn(x, w, mask, rows[:, sel], None, 0.0, "reglu", fmt)


@pytest.mark.parametrize("fmt,bound", [("bf16", 2**-8), ("i8", 0.5 / 127), ("q4_0", 1 / 8),
                                       ("q4_1", 0.5 / 15)])
def test_formats_hold_weights_within_their_rounding(fmt, bound):
    # per weight, half the format's step (a whole step at Q4_0's clamped end): relative to the
    # row's scale (int8) or to the 32-weight block's range (4-bit), to the value itself (bf16)
    torch.manual_seed(1)
    w = torch.randn(16, 256)
    back = K.dequantize_rows(K.quantize_rows(w, fmt), fmt, 256)
    if fmt == "bf16":
        assert ((back - w).abs() <= bound * w.abs()).all()
        return
    scale = (w.abs().amax(1, keepdim=True) if fmt == "i8" else
             w.view(16, 8, 32).abs().amax(-1).repeat_interleave(32, 1) * (2 if fmt == "q4_1" else 1))
    assert ((back - w).abs() <= bound * scale * 1.01 + 1e-3).all()


@pytest.mark.parametrize("fmt", K.FORMATS)
def test_widening_records_equals_the_gguf_dequantizer(isa, fmt):
    # the kernel's own widening (many-token steps) against the gguf package's dequantizer, per row
    torch.manual_seed(2)
    dim, gate, up, down_t = 96, *(torch.randn(50, 96) for _ in range(3))
    w = K.pack(gate, up, down_t, fmt)
    got = K.unpack(w, fmt, dim, gated=True)
    rb = K.row_bytes(fmt, dim)
    for i, g in enumerate(got):
        f = fmt if i < 2 else K.down_format(fmt)
        raw = w[:, i * rb:(i + 1) * rb] if i < 2 else w[:, 2 * rb:]
        if i < 2 and fmt in K.Q4_FORMATS:  # a record holds its 4-bit rows split
            raw = K.join_rows(raw, fmt)
        assert torch.equal(g.float(), K.dequantize_rows(raw, f, dim)), (fmt, i)


def test_kernel_rejects_bad_input():
    w = K.pack(None, torch.randn(4, 64), torch.randn(4, 64), "f32")
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="outside the 4 neurons"):
        K.neuron_ffn(x, w, torch.tensor([0, 4]), None, None, 0.0, "relu", "f32")
    with pytest.raises(RuntimeError, match="bytes per neuron"):
        K.neuron_ffn(x, w, torch.tensor([0]), None, None, 0.0, "reglu", "f32")
    with pytest.raises(RuntimeError, match="multiple of 32"):
        K.neuron_ffn(torch.randn(1, 48), w, torch.tensor([0]), None, None, 0.0, "relu", "f32")
    many = K.neuron_ffn(torch.randn(70, 64), w, torch.tensor([1, 2]), None, None, 0.0, "relu",
                        "f32")
    assert many.shape == (70, 64)  # over the kernel's row limit: split into calls


@pytest.mark.parametrize("act,threshold", [("reglu", 0.0), ("swiglu", 0.05)])
def test_sparse_model_on_the_kernel_equals_the_torch_path(isa, act, threshold):
    # predicted masks (random, per row), thresholds, hot and cold sets, batch of 3: the kernel
    # and the torch path compute the same logits, prefill and decode
    g = torch.Generator().manual_seed(2)
    hot = [torch.rand(256, generator=g) < 0.3 for _ in range(3)]

    def masks(layer, x):
        gen = torch.Generator().manual_seed(int(x.abs().sum() * 1000) % 2**31 + layer)
        return torch.rand(*x.shape[:-1], 256, generator=gen) < 0.6

    logits = []
    for fmt in (None, "f32"):
        m = random_model(act)
        m.setup_cache(3, 64)  # a batch of 3
        m = apply_hybrid_ffn(m, masks, hot, thresholds=[threshold] * 3, fmt=fmt)
        assert all((b.ffn.cold.records is None) == (fmt is None) for b in m.layers)
        out = []
        with torch.inference_mode():
            tokens = torch.tensor([[1, 5, 9, 13], [4, 4, 200, 17], [8, 6, 7, 5]])
            out.append(m(tokens, torch.arange(4).expand(3, 4))[:, -1])
            for s in range(6):
                tok = torch.tensor([[(7 * s + b) % 300] for b in range(3)])
                out.append(m(tok, torch.full((3, 1), 4 + s))[:, 0])
        logits.append(torch.stack(out))
    ref, got = logits
    assert ref.abs().max() > 1
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("fmt", K.FORMATS)
def test_kernel_linear_equals_a_matmul_over_its_weights(isa, fmt):
    # decode rows through the kernel's GEMV, many rows (prefill) through widened chunks: both
    # equal x W^T over the weights the format holds
    from powerinfer.model.quant import KernelLinear
    torch.manual_seed(3)
    w, b = torch.randn(300, 128), torch.randn(300)
    lin = KernelLinear(w, b, fmt)
    lin.WIDEN_BYTES = 128 * 128 * 4  # several chunks of float32 rows
    held = K.dequantize_rows(lin.records, fmt, 128)
    for shape in [(1, 1, 128), (5, 1, 128), (2, 40, 128)]:
        x = torch.randn(*shape)
        xin = K.dot_input(x, fmt) if shape[0] * shape[1] <= lin.KERNEL_ROWS else x
        want = xin @ held.t() + b
        got = lin(x)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), shape


def test_activations_round_half_away_from_zero(isa):
    # the 8-bit input of the integer dot products rounds x / d half away from zero, as ggml does:
    # one block whose max is 127 (d = 1) holding halves and the floats beside them, read back
    # through Q8_0 rows that each pick one value (q = 127 at its position, d = f16(1 / 127))
    half = float(np.float32(0.5))
    below = float(np.nextafter(np.float32(0.5), np.float32(0)))
    x = torch.tensor([127.0, 2.5, -2.5, 3.5, -3.5, half, -half, 1.5, -1.5, 126.5, -126.5, below, -below,
                      float(np.nextafter(np.float32(2.5), np.float32(0))), 0.0, -127.0]
                     + [0.25 * i - 4 for i in range(16)])
    want = torch.tensor([127, 3, -3, 4, -4, 1, -1, 2, -2, 127, -127, 0, 0, 2, 0, -127]
                        + [int(np.sign(v) * np.floor(abs(v) + 0.5)) for v in (0.25 * i - 4 for i in range(16))])
    w = K.quantize_rows(torch.eye(32), "q8_0")
    got = K.linear(x.unsqueeze(0), w, "q8_0")[0]
    scale = float(np.float16(1 / 127)) * 127  # each row's d times its one code
    assert torch.equal(torch.round(got / scale).long(), want)
    assert torch.equal(K.quantize_input(x.unsqueeze(0))[0], want.float())  # the torch reference's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_quantized_as_the_reference_on_every_row(isa, dtype):
    # every row's 8-bit codes, block scales d and block sums d * sum(q), bit for bit as the torch
    # reference's rule gives them, over wide rows of several magnitudes with a zero block and a
    # block of exact halves, read back exactly: Q8_0 rows of 127 at one place (d 1.0, code 127:
    # each output 127 q times the input block's d, one rounding) for the codes and scales, and
    # Q4_1 rows of ones over one block (d 0, m 1.0: each output the block's sum)
    torch.manual_seed(11)
    dim = 1024
    x = torch.randn(3, dim) * torch.tensor([1e-3, 1.0, 300.0]).unsqueeze(1)
    x[1, 64:96] = 0.0  # a zero block: d 0, codes 0
    x[2, :31] = torch.arange(31) - 15.5
    x[2, 31] = 127.0  # d = 1: every other value of the block a half, rounded away from zero
    x = x.to(dtype)
    b = x.float().reshape(3, -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    v = b * torch.where(d != 0, 1 / d, 0)
    t = torch.trunc(v)
    q = (t + (v - t >= 0.5).float() - (v - t <= -0.5).float()).to(torch.int32)
    assert (q[2, 0, :31].abs() == (torch.arange(31) - 15.5).abs().add(0.5).int()).all()
    got = K.linear(x, K.quantize_rows(127 * torch.eye(dim), "q8_0"), "q8_0")
    assert torch.equal(got, ((127 * q).float() * d).reshape(3, dim))
    ones = torch.zeros(dim // 32, dim)  # row i: ones over block i
    for i in range(dim // 32):
        ones[i, 32 * i:32 * i + 32] = 1.0
    got = K.linear(x, K.quantize_rows(ones, "q4_1"), "q4_1")
    assert torch.equal(got, d[..., 0] * q.sum(-1).float())


def test_a_shards_masked_records_are_the_masks_neurons_it_holds(isa):
    # a cold executor's step: the predictor's masks over the layer's neurons (one row a
    # sequence), its records a shard of them (ascending indices); the neurons any row selects
    # among those it holds, each row keeping its own, as the masks' columns gathered at the
    # shard's indices select them (the same sums in the same order)
    from powerinfer.model.sparse import NeuronSet
    torch.manual_seed(5)
    ffn, dim = 300, 64
    idx = torch.randperm(ffn)[:170].sort().values
    s = NeuronSet("reglu", torch.randn(2 * ffn, dim), None, torch.randn(dim, ffn), idx, "q4_0")
    act, fmt = K.ACTS.index("reglu"), K.FORMATS.index("q4_0")
    for rows, share in ((1, 0.1), (3, 0.1), (5, 0.6), (2, 0.0)):
        x = torch.randn(rows, dim)
        mask = torch.rand(rows, ffn) < share
        got = torch.ops.powerinfer.masked_records(x, s.records, idx, mask, None, 0.0, act, fmt)
        cols = mask[:, idx]
        want = K.neuron_ffn(x, s.records, cols.any(0), cols if rows > 1 else None, None, 0.0,
                            "reglu", "q4_0")
        assert torch.equal(got, want), (rows, share)
        if share:  # (some selected neurons held, some not)
            outside = torch.ones(ffn, dtype=torch.bool).index_fill_(0, idx, False)
            assert cols.any() and mask[:, outside].any()

@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "bf16"])
def test_a_rows_answer_does_not_depend_on_its_batch(isa, fmt):
    # a decode row computes the neurons any row of its batch selects, keeping its own: its
    # answer is the same floats alone (its mask the selection) or beside any other rows, on two
    # threads (the split of the work may not move with the batch's union), for a whole layer's
    # records and for a shard of them (a cold executor's, `masked_records`)
    torch.manual_seed(7)
    dim, ffn, B = 128, 512, 6
    w = K.pack(torch.randn(ffn, dim), torch.randn(ffn, dim), torch.randn(ffn, dim), fmt)
    idx = torch.randperm(ffn)[:300].sort().values
    shard = w[idx].contiguous()
    act, code = K.ACTS.index("swiglu"), K.FORMATS.index(fmt)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(B, dim).to(dtype)
            rows = torch.rand(B, ffn) < 0.3
            batched = K.neuron_ffn(x, w, rows.any(0), rows, None, 0.0, "swiglu", fmt)
            sharded = torch.ops.powerinfer.masked_records(x, shard, idx, rows, None, 0.0, act, code)
            assert batched.float().abs().max() > 1
            for r in range(B):
                alone = K.neuron_ffn(x[r:r + 1], w, rows[r], None, None, 0.0, "swiglu", fmt)
                assert torch.equal(alone, batched[r:r + 1]), (dtype, r)
                pair = [r, (r + 1) % B]
                two = K.neuron_ffn(x[pair], w, rows[pair].any(0), rows[pair].contiguous(), None,
                                   0.0, "swiglu", fmt)
                assert torch.equal(two[:1], alone), (dtype, r)
                one = torch.ops.powerinfer.masked_records(x[r:r + 1], shard, idx, rows[r:r + 1],
                                                          None, 0.0, act, code)
                assert torch.equal(one, sharded[r:r + 1]), (dtype, r)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_a_full_batchs_rows_each_answer_as_alone(isa, fmt):
    # the largest batch a call takes (64 rows) and an odd one, each row keeping its own third of
    # the neurons: their union is most of the layer, walked by the batched down rows 32 neurons a
    # group (and a last group not whole); every row's answer the same floats as alone
    torch.manual_seed(5)
    dim, ffn = 128, 488
    w = K.pack(torch.randn(ffn, dim), torch.randn(ffn, dim), torch.randn(ffn, dim), fmt)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype, B in ((torch.bfloat16, 64), (torch.float32, 37)):
            x = torch.randn(B, dim).to(dtype)
            rows = torch.rand(B, ffn) < 0.33
            batched = K.neuron_ffn(x, w, rows.any(0), rows, None, 0.0, "reglu", fmt)
            assert rows.any(0).sum() > 0.9 * ffn and batched.float().abs().max() > 1
            for r in range(B):
                alone = K.neuron_ffn(x[r:r + 1], w, rows[r], None, None, 0.0, "reglu", fmt)
                assert torch.equal(alone, batched[r:r + 1]), (dtype, B, r)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "bf16", "i8", "f32"])
def test_every_activation_answers_alone_in_a_batch(isa, fmt):
    # a batch reads each neuron's gate row for the rows that keep it and its up row for those
    # whose gate opened: with every activation, with and without a threshold and a bias, a row's
    # answer is the same floats alone, where rows keep different neurons and shut different
    # gates, some selected neurons are kept by no row, and rows are long enough for whole
    # 16-block chunks of the split 4-bit rows
    torch.manual_seed(13)
    dim, ffn, B = 1024, 96, 7
    rows3 = torch.randn(3, ffn, dim) / 8
    x = torch.randn(B, dim)
    rows = torch.rand(B, ffn) < 0.4
    sel = rows.any(0) | (torch.rand(ffn) < 0.5)
    assert (sel & ~rows.any(0)).any()
    for act in K.ACTS:
        gated = act not in ("relu", "gelu")
        w = K.pack(rows3[0] if gated else None, rows3[1], rows3[2], fmt)
        for threshold, bias in ((0.0, None), (0.4, torch.randn(ffn))):
            batched = K.neuron_ffn(x, w, sel, rows, bias, threshold, act, fmt)
            assert batched.float().abs().max() > 1, (act, threshold)
            for r in range(B):
                alone = K.neuron_ffn(x[r:r + 1], w, rows[r], None, bias, threshold, act, fmt)
                assert torch.equal(alone, batched[r:r + 1]), (act, threshold, r)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "bf16", "i8", "f32"])
def test_the_records_kernel_gives_the_same_floats_on_any_thread_count(isa, fmt):
    # the decode step's neurons split between threads by count and its down rows by columns:
    # each column sums the fired neurons in the selection's order, so one thread, two, or more
    # threads than cores (waiting on each other) give the same floats, every activation, one row
    # or a batch, a selection in any order, and a few neurons (one thread) or none
    torch.manual_seed(11)
    dim, ffn = 96, 200
    rows3 = torch.randn(3, ffn, dim)
    x = torch.randn(3, dim)
    threads = torch.get_num_threads()
    try:
        for act in K.ACTS:
            gated = act not in ("relu", "gelu")
            w = K.pack(rows3[0] if gated else None, rows3[1], rows3[2], fmt)
            for sel in (torch.randperm(ffn)[:70].sort().values, torch.randperm(ffn)[:70],
                        torch.tensor([5, 3, 150]), torch.zeros(0, dtype=torch.long)):
                for B in (1, 3):
                    got = []
                    for t in (1, 2, 5):
                        torch.set_num_threads(t)
                        got.append(K.neuron_ffn(x[:B], w, sel, None, None, 0.0, act, fmt))
                    assert got[0].shape == (B, dim)
                    assert all(torch.equal(g, got[0]) for g in got[1:]), (act, sel.numel(), B)
                    assert (got[0].abs().max() > 0) == (sel.numel() > 0), (act, B)
    finally:
        torch.set_num_threads(threads)


def test_reformat_keeps_the_neurons_and_their_weights():
    from powerinfer.model.sparse import NeuronSet
    torch.manual_seed(4)
    w1, w2, idx = torch.randn(2 * 64, 32), torch.randn(32, 64), torch.tensor([3, 9, 40, 63])
    ref = NeuronSet("reglu", w1, None, w2, idx)
    x, sel = torch.randn(2, 1, 32), torch.tensor([0, 2, 3])
    for fmt in ("f32", "q8_0"):
        s = ref.reformat(fmt)
        assert torch.equal(s.idx, idx) and s.fmt == fmt
        back = s.reformat(None)
        assert back.records is None and torch.equal(back.idx, idx)
        tol = 1e-5 if fmt == "f32" else 0.05
        for a, b in ((ref, s), (s, back)):
            want, got = a(x, sel), b(x, sel)
            assert (got - want).abs().max() <= tol * want.abs().max(), fmt


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "i8", "bf16"])
def test_widening_into_bf16_rounds_to_nearest_even(isa, fmt):
    # the kernel's own float32 -> bf16 rounding against torch's, every value equal; the values
    # include exact ties (a bf16 ulp's half) that truncation or rounding half up would get wrong
    torch.manual_seed(6)
    w = torch.randn(37, 3, 96) * 4
    w[0, 0, :8] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -1 - 2 ** -8, 3, 0.0, -0.0, 2 ** -9, 1e-30])
    rec = K.pack(w[:, 0], w[:, 1], w[:, 2], fmt)
    want = K.widen(rec, fmt, 3, 96).to(torch.bfloat16)
    out = torch.full((37 * 3 * 96,), float("nan"), dtype=torch.bfloat16)
    got = K.widen_into(rec, fmt, 3, 96, out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "i8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_token_steps_over_quantized_records(isa, fmt, dtype):
    # a prompt's step over quantized records: the rows widened a block at a time into one
    # reused buffer (here several blocks), the tokens PROMPT_ROWS at a time (here several
    # chunks, the last padded); it equals the torch path over the same rows, with a threshold
    # and per-token masks; and a token's answer is the same floats whatever tokens share its
    # step (alone in a step of two, or anywhere in a longer one)
    from powerinfer.model.sparse import NeuronSet
    torch.manual_seed(5)
    n, dim = 200, 64
    w1, w2 = torch.randn(2 * n, dim) * 0.3, torch.randn(dim, n) * 0.3
    idx = torch.arange(0, n, 2)
    s = NeuronSet("swiglu", w1.to(dtype), None, w2.to(dtype), idx, fmt)
    s.WIDEN_BYTES = 3 * dim * dtype.itemsize * 40  # blocks of 40 neurons: 40, 40, 20
    s.PROMPT_ROWS = 16
    ref = s.reformat(None)  # the same rows, held widened
    for B, T in ((1, 3), (2, 2), (1, 37), (3, 9)):
        x = torch.randn(B, T, dim).to(dtype)
        keep = torch.rand(B, T, len(idx)) > 0.3
        for th, k in ((0.0, None), (0.05, keep)):
            want, got = ref(x, None, th, k).float(), s(x, None, th, k).float()
            assert got.shape == want.shape == (B, T, dim)
            tol = 0.03 if dtype == torch.bfloat16 else 1e-4
            assert (got - want).abs().max() <= tol * want.abs().max(), (B, T, th)
        flat = x.reshape(1, B * T, dim)
        whole = s(flat, None, 0.05, None)
        for t in range(0, B * T, 5):
            pair = torch.stack([flat[0, t], torch.randn(dim).to(dtype)]).unsqueeze(0)
            assert torch.equal(s(pair, None, 0.05, None)[0, 0], whole[0, t]), (B, T, t)


@pytest.mark.parametrize("fmt", K.FORMATS)
@pytest.mark.parametrize("act", ["swiglu", "geglu", "reglu", "relu", "gelu"])
def test_a_prompts_rows_over_records_equal_the_reference(isa, fmt, act):
    # `records_rows` (a prompt step's product over every record, a block at a time, multiplied
    # as matrices: a bf16 input's 4-bit gate/up rows in integers over its 8-bit quantization, the
    # rest widened; on AMX's tiles where the CPU has them and they are allowed, and then off them
    # too) against the reference over the weights the format holds, with a bias and
    # a threshold; a row's answer the same floats alone, in a longer call at any place, and across
    # the tiles' and the calls' row boundaries, on two threads (the records split at fixed places)
    for amx in (1, 0) if torch.ops.powerinfer.rows_amx(1) else (1,):
        torch.ops.powerinfer.rows_amx(amx)
        prompt_rows_against_the_reference(fmt, act)


def prompt_rows_against_the_reference(fmt, act):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(11)
        k, dim = 203, 160  # (a last block of records and a last tile of columns not whole)
        gated = act not in UNGATED
        w = K.pack(torch.randn(k, dim) if gated else None, torch.randn(k, dim),
                   torch.randn(k, dim) * 0.2, fmt)
        G, U, D = K.unpack(w, fmt, dim, gated)
        G = None if G is None else G.float()
        bias = torch.randn(k) if act == "gelu" else None
        threshold = 0.4 if act in ("swiglu", "reglu") else 0.0
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(41, dim).to(dtype)
            got = K.records_rows(x, w, bias, threshold, act, fmt)
            assert got.dtype == dtype and got.shape == (41, dim)
            want = reference(x.float(), G, U.float(), D.float(), torch.arange(k), None, bias, threshold, act)
            tol = 0.03 if dtype == torch.bfloat16 else 1e-4
            assert (got.float() - want).abs().max() <= tol * want.abs().max(), (dtype, fmt, act)
            for lo, hi in ((0, 1), (7, 8), (40, 41), (3, 20), (16, 33), (5, 41)):
                part = K.records_rows(x[lo:hi].contiguous(), w, bias, threshold, act, fmt)
                assert torch.equal(part, got[lo:hi]), (dtype, lo, hi)
    finally:
        torch.set_num_threads(threads)
        torch.ops.powerinfer.rows_amx(1)


def test_a_prompts_rows_over_a_models_records_run_one_call(monkeypatch):
    # a neuron set's prompt step over records on the CPU is the one records_rows call (what a
    # torch-free cold executor runs too), its answer the same floats; per-token masks (an
    # evaluation's) keep the widened torch path
    from powerinfer.model.sparse import NeuronSet
    torch.manual_seed(3)
    n, dim = 96, 64
    w1, w2 = torch.randn(2 * n, dim) * 0.3, torch.randn(dim, n) * 0.3
    s = NeuronSet("swiglu", w1.to(torch.bfloat16), None, w2.to(torch.bfloat16), torch.arange(n), "q4_0")
    x = torch.randn(2, 9, dim).to(torch.bfloat16)
    calls = []
    real = K.records_rows
    monkeypatch.setattr(K, "records_rows", lambda *a: calls.append(a[0].shape) or real(*a))
    got = s(x)
    assert calls == [(18, dim)]
    assert torch.equal(got.view(18, dim), real(x.view(18, dim), s.records, None, 0.0, "swiglu", "q4_0"))
    s(x, None, 0.0, torch.rand(2, 9, n) > 0.5)
    assert len(calls) == 1


def decode_steps(m, slots: torch.Tensor, steps: int = 6) -> torch.Tensor:
    # prefill two prompts into the blocks of cache rows `slots`, then feed fixed tokens one at a time
    tokens = torch.tensor([[5, 9, 3, 1, 7], [2, 8, 4, 6, 0]])
    B, T = tokens.shape
    with torch.inference_mode():
        m(tokens, torch.arange(T).expand(B, T), m.row_tables(B, T, slots))
        out = []
        for s in range(steps):
            tok = torch.tensor([[(7 * s + b) % 300] for b in range(B)])
            out.append(m(tok, torch.full((B, 1), T + s), m.row_tables(B, 1, slots))[:, 0].float())
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["llama", "opt"])  # rope and shared KV heads; learned positions
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_ops_equal_the_torch_path(arch, dtype, monkeypatch):
    # a model's steps with its norms and attention (rope, the cache's update, softmax over the
    # blocks read in place) in the kernel library against torch's ops on the same model
    import powerinfer.model.transformer as M

    m = random_model("swiglu" if arch == "llama" else "relu").to(dtype)
    if arch == "llama":
        for b in m.layers:  # the window leaves out positions: fewer than the cache holds
            b.attn.window = 4
    slots = torch.tensor([1, 0])  # cache rows out of order
    fused = decode_steps(m, slots)
    monkeypatch.setattr(M, "_fused_cpu", lambda x: False)
    ref = decode_steps(m, slots)
    err = (fused - ref).abs().max().item() / ref.abs().max().item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err
    # the same greedy token where the reference's top two are not a near tie
    top2 = ref.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.05 * ref.abs().amax(-1)
    assert (fused.argmax(-1) == ref.argmax(-1))[clear].all()


def paged_step(seqs, block_size, n_blocks, seed=0):
    """A step of sequences given as (positions already cached, new tokens), their blocks dealt
    out of order: (tables, starts, pos)."""
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(-(-(c + n) // block_size) for c, n in seqs)
    tables, used = [], 0
    for c, n in seqs:
        k = -(-(c + n) // block_size)
        tables.append(order[used:used + k] + [0] * (width - k))
        used += k
    starts = torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(c, c + n) for c, n in seqs])
    return torch.tensor(tables, dtype=torch.int32), starts, pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 2, 64, 16, 0), (6, 2, 64, 16, 7), (4, 4, 32, 32, 0),
                                   (4, 2, 48, 16, 0), (8, 1, 128, 64, 0)])
# (heads, KV heads, head size, block, window)
@pytest.mark.parametrize("roped", [True, False])
def test_paged_attention_equals_the_torch_path(isa, dtype, shape, roped):
    # one step mixing prompt chunks (from position 0 and after cached positions) and decode rows
    # over blocks dealt out of order: the kernel's keys and values land where torch's do, and
    # its attention over the blocks in place equals torch's over gathered copies
    from powerinfer.model.transformer import KVCache, KVTables, paged_attention

    H, Hkv, D, bs, window = shape
    seqs = [(0, 37), (20, 1), (5, 1), (33, 40), (0, 1), (16, 1), (15, 1)]
    n_blocks = 64
    tables, starts, pos = paged_step(seqs, bs, n_blocks)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(len(pos), (H + 2 * Hkv) * D, generator=g).to(dtype)
    cos, sin = torch.randn(len(pos), D, generator=g), torch.randn(len(pos), D, generator=g)
    caches = [KVCache(n_blocks, Hkv, bs, D, dtype, "cpu") for _ in range(2)]
    for c in caches:  # the same earlier contents
        g = torch.Generator().manual_seed(2)
        c.k.copy_(torch.randn(c.k.shape, generator=g))
        c.v.copy_(torch.randn(c.v.shape, generator=g))
    if not roped:  # (a model without RoPE: q and the keys as the projection gave them)
        cos = sin = torch.empty(0)
    got = torch.ops.powerinfer.paged_attention(qkv, cos, sin, caches[0].k, caches[0].v, tables,
                                               starts, pos, H, window, D ** -0.5)
    want = paged_attention(qkv, (cos, sin) if roped else None, pos, KVTables(starts, tables),
                           caches[1], H, window, D ** -0.5)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert (got.float() - want.float()).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 50])
def test_a_tokens_attention_is_the_same_however_its_prompt_is_cut(isa, dtype, window):
    # the online softmax's steps are fixed by position, so a token's floats do not depend on the
    # chunks its prompt came in (chunked prefill, a prefix from the cache) or the tile it sits in
    from powerinfer.model.transformer import KVCache

    H, Hkv, D, bs, T = 6, 2, 64, 16, 200
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    tables = torch.randperm(16, generator=g).to(torch.int32)[None]  # (blocks out of order)

    def run(cuts):
        cache, outs = KVCache(16, Hkv, bs, D, dtype, "cpu"), []
        for a, b in zip(cuts, cuts[1:]):
            outs.append(torch.ops.powerinfer.paged_attention(
                qkv[a:b], cos[a:b], sin[a:b], cache.k, cache.v, tables, torch.tensor([0, b - a]),
                torch.arange(a, b), H, window, D ** -0.5))
        return torch.cat(outs)

    whole = run([0, T])
    for cuts in ([0, 37, 101, 199, T], [0, 64, 128, 192, T], [0, 1, 63, 65, T]):
        assert torch.equal(run(cuts), whole), cuts


def test_a_residual_add_rounds_as_torch(isa):
    # the native loop's add into the residual: h + y.to(h.dtype), in the kernel's vectors, the
    # same bits as torch's bf16 (ties to even, a NaN, infinities, overflow, denormals) and float32
    g = torch.Generator().manual_seed(3)
    n = 1000 + 7  # (vectors and a tail)
    h, y = (torch.randn(n, generator=g) * 4).bfloat16(), torch.randn(n, generator=g) * 4
    y[:9] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38, 1e-39, float("inf"),
                          float("nan"), -0.0, 2**-130])
    y[-3:] = torch.tensor([1 + 2**-8, float("nan"), 1e-39])
    h[9:13] = torch.tensor([float("nan"), float("-inf"), 1e-39, 3.3e38]).bfloat16()
    got = h.clone()
    torch.ops.powerinfer.residual_add_(got, y)
    want = (h.float() + y.bfloat16().float()).bfloat16()
    nan = want.isnan()  # (a NaN's bits: c10's one quiet NaN here, torch's vectors another)
    assert nan.sum() == 3 and torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    f = h.float()
    got = f.clone()
    torch.ops.powerinfer.residual_add_(got, y)
    torch.testing.assert_close(got, f + y, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("window", [0, 7])
def test_paged_attention_shares_a_steps_index_work_across_layers(decode, window):
    # a step's layers share what they derive from its tables and positions (KVTables.memo): the
    # second layer reuses the first's slots and mask, and every layer's output and cache equal
    # what it computes alone, exactly
    from powerinfer.model.transformer import KVCache, KVTables, paged_attention

    H, Hkv, D, bs = 4, 2, 16, 16
    seqs = [(20, 1), (5, 1), (0, 1)] if decode else [(0, 37), (20, 1), (33, 40)]
    tables, starts, pos = paged_step(seqs, bs, 32)
    g = torch.Generator().manual_seed(3)
    step = KVTables(starts, tables, {})
    for layer in range(2):
        qkv = torch.randn(len(pos), (H + 2 * Hkv) * D, generator=g)
        rope = torch.randn(len(pos), D, generator=g), torch.randn(len(pos), D, generator=g)
        caches = [KVCache(32, Hkv, bs, D, torch.float32, "cpu") for _ in range(2)]
        for c in caches:
            c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(layer)))
            c.v.copy_(torch.randn(c.v.shape, generator=torch.Generator().manual_seed(layer + 9)))
        alone = paged_attention(qkv, rope, pos, KVTables(starts, tables), caches[0], H, window, 0.25)
        shared = paged_attention(qkv, rope, pos, step, caches[1], H, window, 0.25)
        assert torch.equal(alone, shared)
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    kinds = sorted(k[0] for k in step.memo)
    assert kinds == (["blocks", "mask", "slots"] if decode else ["slots"]), kinds


@pytest.mark.parametrize("dim", [64, 576, 4096, 96])  # 96: not whole pairs of blocks
def test_bf16_gemv_of_one_row_equals_the_many_row_path_and_a_matmul(isa, dim):
    # a decode row over bf16 rows runs its own path (four rows at a time where the CPU has
    # AVX512_BF16) with every row count, split across threads at any row: its sums are the
    # row-at-a-time path's in the same order (equal to a 2-row call's first row) and a matmul's
    torch.manual_seed(3)
    x2 = torch.randn(2, dim)
    for n in (1, 3, 4, 5, 8, 37, 130):
        w = torch.randn(n, dim).bfloat16()
        rows = w.view(torch.uint8).reshape(n, dim * 2)
        want = x2[:1].bfloat16().float() @ w.float().t()
        for threads in (1, 2):
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                one = torch.ops.powerinfer.linear(x2[:1], rows, 1)
                two = torch.ops.powerinfer.linear(x2, rows, 1)
            finally:
                torch.set_num_threads(before)
            assert torch.equal(one[0], two[0]), (n, threads)
            assert (one - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6, (n, threads)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n", [48, 200])  # whole groups of 16 rows; a padded last group
def test_q4x16_gemv_equals_a_matmul_over_the_files_weights(isa, kind, n):
    # the file's 4-bit blocks regrouped 16 rows at a time: x W^T over exactly the weights the
    # blocks hold (the GGUF dequantizer's), with x rounded to 8 bits per block as the kernel does
    from gguf import GGMLQuantizationType, quantize

    from powerinfer.formats.q4 import q4_split
    torch.manual_seed(7)
    k = 192
    data = quantize(torch.randn(n, k).numpy(), getattr(GGMLQuantizationType, kind))
    held = K.dequantize_rows(torch.from_numpy(data), kind.lower(), k)
    w = K.pack_q4x16(*(torch.from_numpy(a) for a in q4_split(kind, n, k, data)))
    assert w.shape == (-(-n // 16), k // 32 * K.Q4X16_BLOCK)
    assert w.numel() == -(-n // 16) * 16 * k // 32 * 20  # 20 bytes a row's block, as Q4_1
    for rows in (1, 2, 5, 9, 70):  # every tail of the 4-row steps; past MAX_ROWS a call
        x = torch.randn(rows, k)
        want = K.quantize_input(x) @ held.t()
        got = K.linear_q4x16(x, w, n)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), rows
        xb = x.bfloat16()  # read as bf16, answered in bf16 (rounded once)
        want = K.quantize_input(xb) @ held.t()
        got = K.linear_q4x16(xb, w, n)
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max() <= 2**-8 * want.abs().max(), rows


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
# whole passes of 64 rows; padded rows past n; with two threads an odd share of passes (the
# AVX-512 classes take them two at a time, the last one alone)
@pytest.mark.parametrize("n", [64, 200, 300])
def test_input_sparse_product_reads_the_kept_channels_of_the_files_weights(isa, kind, n):
    # the file's 4-bit blocks (and a Q4_K_M file's 6-bit ones) held by input channel (q4c):
    # x' W^T over exactly the weights the blocks hold, where x' is x with the channels at or
    # below the threshold zeroed and rounded to 8 bits per block as the dense q4x16 (q4kx16,
    # q6kx16) product rounds its input: the same floats as it gives for the zeroed input; 288
    # channels: 9 blocks (K-quants: 512, two super-blocks of 8)
    from gguf import GGMLQuantizationType, dequantize, quantize

    from powerinfer.formats import kquants
    from powerinfer.formats.q4 import q4_split
    torch.manual_seed(11)
    if kind in ("Q4_K", "Q6_K"):  # 6-bit scales and minimums a block (Q6_K: 8-bit scales a 16)
        k = 512
        w0 = torch.randn(n, k) * torch.rand(n, 1) * 3 + torch.randn(n, k // 32).repeat_interleave(32, 1)
        data = kquants.quantize(w0.numpy(), kind)
        held = torch.from_numpy(dequantize(data, getattr(GGMLQuantizationType, kind))).reshape(n, k)
        dense = K.pack_kquant(torch.from_numpy(data), kind)
        if kind == "Q4_K":
            w, offsets = K.q4kc_of_q4kx16(dense, n, k), K.Q4C_KINDS.index("q4_k")
            # the q4kx16 bytes: a byte of scale and of minimum a row and block, 2 f16 a super-block
            assert w.numel() == K.q4c_rows(n) * (k // 32 * 18 + k // 256 * 4)
        else:
            w, offsets = K.q6kc_of_q6kx16(dense, n, k), K.Q4C_KINDS.index("q6_k")
            # the q6kx16 bytes: 6 bits a weight, a byte of scale a row per 16, a f16 a super-block
            assert w.numel() == K.q4c_rows(n) * (k // 32 * 26 + k // 256 * 2)
        layout = {"Q4_K": "q4kx16", "Q6_K": "q6kx16"}[kind]
        dense_product = lambda x: K.linear_x16(x, dense, n, layout)  # noqa: E731
    else:
        k = 288
        data = quantize(torch.randn(n, k).numpy(), getattr(GGMLQuantizationType, kind))
        held = K.dequantize_rows(torch.from_numpy(data), kind.lower(), k)
        parts = [torch.from_numpy(a) for a in q4_split(kind, n, k, data)]
        w, offsets = K.pack_q4c(*parts)
        assert offsets == (kind == "Q4_1")  # a Q4_0 matrix keeps no offsets: 18 bytes a block of a row
        assert w.numel() == k // 32 * K.q4c_rows(n) * (20 if offsets else 18)
        dense = K.pack_q4x16(*parts)
        dense_product = lambda x: K.linear_q4x16(x, dense, n)  # noqa: E731
    for rows, threshold in [(1, 0.0), (1, 0.7), (3, 1.2), (70, 0.4), (1, 1e9)]:
        x = torch.randn(rows, k)
        x[0, 32:64] = 0.1  # a block whose every channel is under the thresholds but the first
        kept = torch.where(x.abs() > threshold, x, 0.0)
        want = K.quantize_input(kept) @ held.t()
        stats = torch.zeros(2, dtype=torch.long)
        got = K.linear_q4c(x, w, n, offsets, threshold, stats)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6, (rows, threshold)
        assert torch.equal(got, dense_product(kept))  # the same floats, summed alike
        # the channels kept: those over the threshold that 8 bits do not round to 0
        assert stats.tolist() == [int((K.quantize_input(kept) != 0).sum()), rows * k]
        if threshold >= 1e9:
            assert not got.any() and stats[0] == 0
        xb = x.bfloat16()  # read as bf16 (compared with the threshold in float), answered in bf16
        kept = torch.where(xb.float().abs() > threshold, xb, torch.zeros_like(xb))
        want = K.quantize_input(kept) @ held.t()
        got = K.linear_q4c(xb, w, n, offsets, threshold)
        assert got.dtype == torch.bfloat16 and torch.equal(got, dense_product(kept))
        assert (got.float() - want).abs().max() <= 2**-8 * want.abs().max() + 1e-6, (rows, threshold)
    with pytest.raises(RuntimeError, match="q4c matrix"):
        K.linear_q4c(torch.randn(1, k), w, n + 128, offsets, 0.0)
    with pytest.raises(RuntimeError, match="not kind"):  # its kind checked against its size
        K.linear_q4c(torch.randn(1, k), w, n, (offsets + 1) % 3, 0.0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        K.linear_q4c(torch.randn(1, 100), w, n, offsets, 0.0)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
# 40 passes (5,000 rows), 64 (8,192) and 128 (16,384) over 512 channels, blocks of up to 8
# quads: the VNNI bodies' walk quad by quad (`q4c_walk("runs")`) takes a thread's 16 to 64
# passes of a Q4 matrix (40 and 20 a thread; 64 and 32; 64), the walk pass by pass the others
# (128 on one thread) and a Q6_K matrix's
@pytest.mark.parametrize("n", [5000, 8192, 16384])
def test_the_q4c_walks_give_the_dense_floats_over_many_passes(isa, kind, n):
    # quad by quad and pass by pass, on one thread and two: the dense product's floats
    torch.manual_seed(5)
    k = 512
    if kind == "Q4_K":  # random codes, 6-bit scales and minimums, small f16 d and dmin
        sb = torch.randint(0, 256, (n, k // 256, 144), dtype=torch.uint8)
        sb[..., 0:4] = (torch.rand(n, k // 256, 2) * 0.01 + 0.001).half().view(torch.uint8).view(n, k // 256, 4)
        dense = K.pack_kquant(sb.view(n, -1), "Q4_K")
        w, kind_id = K.q4kc_of_q4kx16(dense, n, k), K.Q4C_KINDS.index("q4_k")
        dense_product = lambda x: K.linear_x16(x, dense, n, "q4kx16")  # noqa: E731
    elif kind == "Q6_K":  # random codes and 8-bit scales, small f16 d
        sb = torch.randint(0, 256, (n, k // 256, 210), dtype=torch.uint8)
        sb[..., 208:210] = (torch.rand(n, k // 256, 1) * 0.001 + 0.0001).half().view(torch.uint8)
        dense = K.pack_kquant(sb.view(n, -1), "Q6_K")
        w, kind_id = K.q6kc_of_q6kx16(dense, n, k), K.Q4C_KINDS.index("q6_k")
        dense_product = lambda x: K.linear_x16(x, dense, n, "q6kx16")  # noqa: E731
    else:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale = torch.rand(n, k // 32) * 0.01 + 0.001
        zero = torch.rand(n, k // 32) * 0.01 if kind == "Q4_1" else torch.zeros(n, k // 32)
        w, kind_id = K.pack_q4c(q, scale, zero)
        dense = K.pack_q4x16(q, scale, zero)
        dense_product = lambda x: K.linear_q4x16(x, dense, n)  # noqa: E731
    threads = torch.get_num_threads()
    try:
        # (0.3 keeps about 76% of the channels: 6 quads a block, quad by quad; 0.7 and 1.6 48%
        # and 11%, too few quads a block for it: pass by pass)
        for threshold in (0.0, 0.3, 0.7, 1.6):
            x = torch.randn(1, k)
            x[0, 64:96] = 0.1  # a block with no kept channel
            x[0, 128:144] = 0.1  # and one with none in its first half (Q6_K's halves apart)
            x[0, 176:192] = 0.1  # and one with none in its second
            want = dense_product(torch.where(x.abs() > threshold, x, 0.0))
            for walk in ("runs", "passes"):
                K.q4c_walk(walk)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    assert torch.equal(K.linear_q4c(x, w, n, kind_id, threshold), want), (walk, t, threshold)
    finally:
        K.q4c_walk("runs")
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="runs or passes"):
        K.q4c_walk("rows")


def test_predictor_logits_on_8bit_groups(isa):
    # a predictor's two GEMVs on q8x16 groups (`pred_logits`, what every native loop picks
    # neurons from, a bf16 predictor's decode rows on the CPU): the first over the input rounded
    # to 8 bits a block, the second over its relu rounded again, each against the Q8_0 blocks'
    # weights; on bf16 rows, `linear`'s two products
    g = torch.Generator().manual_seed(4)
    fc1 = (torch.randn(64, 128, generator=g) / 8).bfloat16()
    fc2 = torch.randn(160, 64, generator=g).bfloat16()
    q1, q2 = K.quantize_rows(fc1, "q8_0"), K.quantize_rows(fc2, "q8_0")
    w1, w2 = K.pack_q8x16(q1), K.pack_q8x16(q2)
    d1, d2 = K.dequantize_rows(q1, "q8_0", 128), K.dequantize_rows(q2, "q8_0", 64)
    for rows in (1, 3):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        h = K.linear_x16(x.float(), w1, 64, "q8x16")  # the first GEMV's floats
        assert (h - K.quantize_input(x) @ d1.T).abs().max() <= 1e-5 * h.abs().max()
        got = K.pred_logits(x, w1, w2, "q8x16")
        want = K.quantize_input(torch.relu(h)) @ d2.T
        assert got.dtype == torch.float32 and got.shape == (rows, 160)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), rows
        assert torch.equal(K.pred_logits(x, fc1, fc2, "bf16"),
                           K.linear(K.linear(x, fc1, "bf16").relu_(), fc2, "bf16"))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("n", [32, 200])  # whole groups of 16 rows; a padded last group
def test_kquant_gemv_equals_a_matmul_over_the_files_weights(isa, kind, n):
    # a Q4_K_M file's Q4_K and Q6_K matrices (and a Q5_K_M file's Q5_K) kept in their bytes, 16
    # rows at a time: x W^T over exactly the weights the gguf package's dequantizer reads from
    # the same blocks, with every scale and sign in play (wide rows: 6-bit scales near 63, Q5_K
    # and Q6_K codes at both ends); and Q8_0 rows (an 8-bit output head, q8x16), codes at both
    # ends of -127..127
    from gguf import GGMLQuantizationType, dequantize
    from gguf import quantize as gguf_quantize

    from powerinfer.formats.kquants import quantize
    torch.manual_seed(11)
    k = 512  # two super-blocks
    w0 = torch.randn(n, k) * torch.rand(n, 1) * 3 + torch.randn(n, k // 32).repeat_interleave(32, 1)
    if kind == "Q8_0":
        data = gguf_quantize(w0.numpy(), GGMLQuantizationType.Q8_0)
        codes = data.reshape(n, k // 32, 34)[..., 2:].view(np.int8)
        assert codes.min() == -127 and codes.max() == 127
    elif kind in ("Q5_0", "Q5_1"):  # (a Q4_K_M file's fallback where a row is not 256s: Q5_0)
        data = gguf_quantize(w0.numpy(), getattr(GGMLQuantizationType, kind))
    else:
        data = quantize(w0.numpy(), kind)
    held = torch.from_numpy(dequantize(data, getattr(GGMLQuantizationType, kind))).reshape(n, k)
    w = K.pack_kquant(torch.from_numpy(data), kind)
    layout = KQUANT_LAYOUTS[kind]
    assert w.shape == (-(-n // 16), K.group_bytes(layout, k))
    # the file's bytes regrouped (Q4_K's 6-bit scales and minimums a byte each: 4 more a block)
    extra = {"Q4_K": 4 * k // 256, "Q5_K": 4 * k // 256, "Q5_0": 2 * k // 32}.get(kind, 0)
    assert w.numel() == -(-n // 16) * 16 * (data.shape[1] + extra)  # (Q5_0: an f16 offset)
    if kind == "Q5_K":
        codes = K.q5_k_codes(torch.from_numpy(data).view(n, -1, 176))[2]
        assert codes.min() == 0 and codes.max() == 31
    for rows in (1, 2, 5, 70):  # every tail of the 4-row steps; past MAX_ROWS a call
        x = torch.randn(rows, k)
        want = K.quantize_input(x).double() @ held.double().t()
        got = K.linear_x16(x, w, n, layout)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), rows
        xb = x.bfloat16()
        got = K.linear_x16(xb, w, n, layout)
        want = K.quantize_input(xb).double() @ held.double().t()
        assert got.dtype == torch.bfloat16
        assert (got.double() - want).abs().max() <= 2**-8 * want.abs().max(), rows


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0"])
def test_a_rows_dense_product_does_not_depend_on_its_batch(isa, kind):
    # the 16-row group products take a batch's rows eight, four, three, two or one at a time: a
    # row's floats are the same alone as anywhere in a call of 1 to 64 rows
    from gguf import GGMLQuantizationType
    from gguf import quantize as gguf_quantize

    from powerinfer.formats.kquants import quantize
    torch.manual_seed(17)
    n, k = 48, 512
    w0 = torch.randn(n, k)
    if kind == "Q4_0":
        w, layout = K.pack_q4x16(torch.randint(0, 16, (n, k), dtype=torch.uint8),
                                 torch.rand(n, k // 32) * 0.01, torch.zeros(n, k // 32)), "q4x16"
    else:
        data = (gguf_quantize(w0.numpy(), getattr(GGMLQuantizationType, kind))
                if kind in ("Q8_0", "Q5_0") else quantize(w0.numpy(), kind))
        w, layout = K.pack_kquant(torch.from_numpy(data), kind), KQUANT_LAYOUTS[kind]
    x = torch.randn(64, k)
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        alone = torch.cat([K.linear_x16(xs[r:r + 1], w, n, layout) for r in range(64)])
        assert alone.float().abs().max() > 1
        for rows in (64, 37, 13, 8, 7):
            got = K.linear_x16(xs[64 - rows:], w, n, layout)
            assert torch.equal(got, alone[64 - rows:]), (dtype, rows)


def test_the_prefetch_levels_give_the_same_floats(isa):
    # where the weight walks ask for their next lines (into L1, or into L2 and again further
    # ahead) changes no float: the dense GEMVs over each layout and the records kernel, on one
    # thread and two, rows long enough that the second request lands past a group's end
    from gguf import GGMLQuantizationType
    from gguf import quantize as gguf_quantize

    from powerinfer.formats.kquants import quantize
    from powerinfer.model.sparse import NeuronSet
    torch.manual_seed(3)
    n, k = 40, 2048
    w0 = torch.randn(n, k)
    products = []
    for kind in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0"):
        data = (gguf_quantize(w0.numpy(), getattr(GGMLQuantizationType, kind))
                if kind in ("Q8_0", "Q5_0") else quantize(w0.numpy(), kind))
        w, layout = K.pack_kquant(torch.from_numpy(data), kind), KQUANT_LAYOUTS[kind]
        products.append(lambda x, w=w, layout=layout: K.linear_x16(x, w, n, layout))
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    dense = K.pack_q4x16(q, torch.rand(n, k // 32) * 0.01, torch.zeros(n, k // 32))
    products.append(lambda x: K.linear_q4x16(x, dense, n))
    ffn = 600
    s = NeuronSet("reglu", torch.randn(2 * ffn, k) / 30, None, torch.randn(k, ffn) / 30,
                  torch.arange(ffn), "q4_0")
    sel = torch.randperm(ffn)[:150].sort().values
    products.append(lambda x: K.neuron_ffn(x, s.records, sel, None, None, 0.0, "reglu", "q4_0"))
    _same_floats_at_each_setting(K.prefetch_level, ("l1", "l2"), products, k)
    with pytest.raises(RuntimeError, match="l1 or l2"):
        K.prefetch_level("l3")


def _same_floats_at_each_setting(switch, settings, products, k):
    """Each product of x (one row and three, (rows, k), on one thread and two) gives the same
    floats, not all zero, at every one of `settings` of `switch` (a kernels setter: "" reads
    it); the setting before and the thread count restored after."""
    threads, before = torch.get_num_threads(), switch()
    try:
        for rows in (1, 3):
            x = torch.randn(rows, k)
            for t in (1, 2):
                torch.set_num_threads(t)
                got = {}
                for setting in settings:
                    assert switch(setting) in settings
                    assert switch() == setting
                    got[setting] = [f(x) for f in products]
                for setting in settings[1:]:
                    for i, (a, b) in enumerate(zip(got[settings[0]], got[setting])):
                        assert a.abs().sum() > 0 and torch.equal(a, b), (i, setting, rows, t)
    finally:
        switch(before)
        torch.set_num_threads(threads)


def test_the_far_prefetches_give_the_same_floats(isa):
    # whether the records kernel's walks also ask for rows two passes ahead changes no float:
    # each setting, 4-bit and 8-bit records, gated and plain, one thread and two, one row and
    # a batch, selections long enough for many groups of down rows past the far ones
    from powerinfer.model.sparse import NeuronSet
    torch.manual_seed(4)
    k, ffn = 1024, 500
    cases = []
    for act, fmt in (("reglu", "q4_0"), ("reglu", "q4_1"), ("relu", "q4_0"), ("swiglu", "i8")):
        gated = act != "relu"
        s = NeuronSet(act, torch.randn((2 if gated else 1) * ffn, k) / 20, None,
                      torch.randn(k, ffn) / 20, torch.arange(ffn), fmt)
        cases.append((s, act, fmt))
    sel = torch.randperm(ffn)[:300].sort().values
    products = [lambda x, s=s, act=act, fmt=fmt:
                K.neuron_ffn(x, s.records, sel, None, None, 0.0, act, fmt) for s, act, fmt in cases]
    _same_floats_at_each_setting(K.far_prefetch, K.FAR_PREFETCH, products, k)
    with pytest.raises(RuntimeError, match="none, acts, downs or both"):
        K.far_prefetch("all")


def test_the_prefetch_level_follows_the_cpus_vendor_unless_set():
    # Intel's cores ask for lines into L2, others into every level; POWERINFER_PREFETCH decides
    # over the vendor (read once, when the kernel loads: a fresh process each)
    import os
    import subprocess
    import sys
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    vendor = next((line.split(":")[1].strip() for line in lines if line.startswith("vendor_id")), "")
    env = {k: v for k, v in os.environ.items()
           if k not in ("POWERINFER_PREFETCH", "POWERINFER_FAR_PREFETCH")}

    def fresh(getter, var, setting):  # the setting a fresh process reads with var=setting
        code = f"from powerinfer import kernels as K; assert K.available(); print(K.{getter}())"
        e = dict(env, **({var: setting} if setting else {}))
        return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True,
                              text=True, cwd=Path(__file__).parent.parent, check=True)
    default = "l2" if vendor == "GenuineIntel" else "l1"
    other = "l1" if default == "l2" else "l2"
    for setting, want in ((None, default), (other, other)):
        out = fresh("prefetch_level", "POWERINFER_PREFETCH", setting).stdout.split()
        assert out[-1] == want, (setting, vendor, out)
    # the records kernel's requests two passes ahead: Intel's cores make both, others none;
    # POWERINFER_FAR_PREFETCH decides over the vendor, and a value that is none of the settings
    # is named in a warning and left to the vendor
    default = "both" if vendor == "GenuineIntel" else "none"
    for setting, want in ((None, default), ("downs", "downs"), ("all", default)):
        r = fresh("far_prefetch", "POWERINFER_FAR_PREFETCH", setting)
        assert r.stdout.split()[-1] == want, (setting, vendor, r.stdout)
        assert ("POWERINFER_FAR_PREFETCH='all' is not one of" in r.stderr) == (setting == "all")


def test_q5_k_sums_at_their_largest_do_not_saturate(isa):
    # every code 31 under x's 8-bit values all 127: without VNNI a block's 16-bit pair sums
    # would pass 32767 if its eight products a lane were added before widening (block_sums5)
    k, n = 512, 16
    raw = np.zeros((n, k // 256, 176), np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(2 ** -10).tobytes(), np.uint8)  # d; dmin 0
    raw[..., 4:8] = 63  # sub-blocks 0-3: scale 63 (bytes 8:12, their minimums: 0)
    raw[..., 12:16] = 15  # sub-blocks 4-7: scale 15, minimum 0
    raw[..., 16:] = 255  # every fifth bit and nibble: code 31
    raw = torch.from_numpy(raw.reshape(n, -1))
    from powerinfer.formats.kquants import dequantize
    held = dequantize(raw.numpy(), "Q5_K", k)
    assert held.max() == 31 * 63 * 2 ** -10
    x = torch.ones(1, k)
    assert K.quantize_input(x).eq(1).all()
    got = K.linear_x16(x, K.pack_kquant(raw, "Q5_K"), n, "q5kx16")
    want = held.double().sum(1)
    assert torch.allclose(got.double(), want.view(1, n), rtol=1e-6), (got[0, 0], want[0])


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_q5_sums_at_their_largest_do_not_saturate(isa, kind):
    # q5x16 as q5kx16 above: every code 31 under x's 8-bit values all 127 (block_sums5)
    k, n = 256, 16
    size = 22 if kind == "Q5_0" else 24
    raw = np.zeros((n, k // 32, size), np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(2 ** -10).tobytes(), np.uint8)  # d (Q5_1: m 0)
    raw[..., size - 20:] = 255  # every fifth bit and nibble: code 31
    raw = torch.from_numpy(raw.reshape(n, -1))
    from powerinfer.formats.kquants import dequantize
    held = dequantize(raw.numpy(), kind, k)
    assert held.max() == (31 - (16 if kind == "Q5_0" else 0)) * 2 ** -10
    x = torch.ones(1, k)
    got = K.linear_x16(x, K.pack_kquant(raw, kind), n, "q5x16")
    assert torch.allclose(got.double(), held.double().sum(1).view(1, n), rtol=1e-6)


def test_q6_k_codes_are_the_gguf_dequantizers():
    from gguf import GGMLQuantizationType, dequantize

    from powerinfer.formats.kquants import quantize
    data = quantize(torch.randn(4, 512).numpy(), "Q6_K")
    b = torch.from_numpy(data).view(4, 2, 210)
    q = K.q6_k_codes(b).float() - 32
    d = b[..., 208:210].contiguous().view(torch.float16).float()  # (4, 2, 1)
    sc = b[..., 192:208].contiguous().view(torch.int8).float().repeat_interleave(16, -1)
    want = dequantize(data, GGMLQuantizationType.Q6_K).reshape(4, 2, 256)
    assert torch.equal(d * sc * q, torch.from_numpy(want))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_torch_quantizers_write_the_gguf_packages_bytes(kind):
    # kquants.quantize's torch ops against gguf's numpy (ggml's reference arithmetic), byte for
    # byte, with the blocks where rounding and ties decide: all zero, all one value, the largest
    # magnitude twice with both signs, values on a half step of the grid, one huge value
    from gguf import GGMLQuantizationType
    from gguf import quantize as gguf_quantize

    from powerinfer.formats.kquants import quantize
    torch.manual_seed(5)
    x = torch.randn(64, 256) * torch.rand(64, 1) * 4
    x[0, :32] = 0
    x[1, :32] = 0.75
    x[2, :32] = torch.linspace(-1, 1, 32)
    x[2, 5], x[2, 9] = -3.0, 3.0
    x[3, :32] = torch.arange(32).float() / 16 - 1 + 1 / 32  # on half steps
    x[4, 40] = 1e4
    x[5, :32] = torch.arange(32).float() - 15.5  # Q8_0: codes on half steps (1/d exactly 1)
    x[5, 0] = 127.0
    want = gguf_quantize(x.numpy(), getattr(GGMLQuantizationType, kind))
    got = quantize(x.numpy(), kind)
    assert got.dtype == np.uint8 and np.array_equal(got, want)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_the_torch_dequantizer_reads_what_the_gguf_package_reads(kind):
    # kquants.dequantize (the loader's and the converter's) on blocks of random bytes, every code
    # and scale bit in play, the fp16 scales made finite: the same float32 values as gguf's
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    from powerinfer.formats.kquants import BLOCK_BYTES, dequantize
    g = torch.Generator().manual_seed(6)
    bb = BLOCK_BYTES[kind]
    per = 32 if bb < 100 else 256
    rows, n = 24, 2 * per
    raw = torch.randint(0, 256, (rows * n // per, bb), dtype=torch.uint8, generator=g)
    scales = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[kind]
    for at in scales:  # finite fp16 scales of either sign (NaN would not compare)
        scale = (torch.randn(raw.shape[0], 1, generator=g) * 0.1).half()
        raw[:, at:at + 2] = scale.view(torch.uint8)
    raw = raw.numpy().reshape(rows, -1)
    want = gguf_dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(rows, n)
    got = dequantize(raw, kind, n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want, np.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_equals_the_per_head_norms(dtype):
    # Qwen3's and Gemma 3's q/k norms in one call: each q head through q_norm, each k head
    # through k_norm, v as it is; as torch's rms_norm computes them (float, rounded once)
    if not K.available():
        pytest.skip("the kernel library does not run here")
    torch.manual_seed(4)
    N, H, Hkv, D = 5, 4, 2, 48
    qkv = (torch.randn(N, (H + 2 * Hkv) * D) * 50).to(dtype)
    qw, kw = ((1 + 0.2 * torch.randn(D)).to(dtype) for _ in range(2))
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    want = torch.cat([F.rms_norm(q.reshape(N, H, D), (D,), qw, 1e-6).reshape(N, -1),
                      F.rms_norm(k.reshape(N, Hkv, D), (D,), kw, 1e-6).reshape(N, -1), v], -1)
    got = torch.ops.powerinfer.qk_norm(qkv, qw, kw, H, Hkv, 1e-6)
    assert got.dtype == dtype and torch.equal(got[:, -Hkv * D:], v)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    with pytest.raises(RuntimeError, match="qkv: \\(N"):
        torch.ops.powerinfer.qk_norm(qkv[:, :-D], qw, kw, H, Hkv, 1e-6)


def test_fused_ops_reject_bad_input():
    pools = torch.zeros(4, 2, 16, 16), torch.zeros(4, 2, 16, 16)  # 4 blocks of 16, 2 KV heads
    qkv, none = torch.randn(1, (4 + 2 * 2) * 16), torch.empty(0)

    def attend(qkv=qkv, tables=torch.tensor([[0]], dtype=torch.int32), pos=torch.tensor([0]),
               pools=pools):
        return torch.ops.powerinfer.paged_attention(qkv, none, none, *pools, tables,
                                                    torch.tensor([0, 1]), pos, 4, 0, 0.25)

    attend()
    with pytest.raises(RuntimeError, match="outside the pool"):
        attend(tables=torch.tensor([[4]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="outside its block table"):
        attend(pos=torch.tensor([16]))
    with pytest.raises(RuntimeError, match="qkv"):
        attend(qkv=qkv[:, :-16])
    with pytest.raises(RuntimeError, match="one type"):
        attend(qkv=qkv.bfloat16())
    with pytest.raises(RuntimeError, match="int32"):
        attend(tables=torch.tensor([[0]]))
    with pytest.raises(RuntimeError, match="w:"):
        torch.ops.powerinfer.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    w = torch.zeros(2, 2 * K.Q4X16_BLOCK, dtype=torch.uint8)  # 32 rows of 64
    q4x16 = K.LAYOUTS.index("q4x16")
    with pytest.raises(RuntimeError, match="groups of 16 rows"):
        torch.ops.powerinfer.linear_x16(torch.randn(1, 64), w, 40, q4x16)
    with pytest.raises(RuntimeError, match="bytes per group"):
        torch.ops.powerinfer.linear_x16(torch.randn(1, 96), w, 32, q4x16)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        torch.ops.powerinfer.linear_x16(torch.randn(65, 64), w, 32, q4x16)


def test_a_kernel_built_beside_the_package_is_used_by_a_user_who_cannot_write_there(monkeypatch,
                                                                                     tmp_path):
    """The container builds the kernel into the package as root and runs as another user, for
    whom the package is read-only and the build directory is elsewhere: the built one is used,
    not built again (the image has no compiler)."""
    from powerinfer import kernels

    built = kernels.build()
    if built.parent != Path(kernels.__file__).parent / "_ext":
        pytest.skip("this checkout's package directory is not writable")
    monkeypatch.setattr(kernels, "_ext_dir", lambda: tmp_path / "elsewhere")
    assert kernels._library_path() == built


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_a_block_embedding_widens_the_tokens_rows_as_the_gguf_package_does(kind):
    # the embedding a GPU keeps in the file's blocks (torch ops on its own device, graph-safe):
    # a lookup equals gguf's dequantizer over the same rows, in the model's type, any shape of
    # tokens; its bytes are kquants.row_bytes a row
    from gguf import GGMLQuantizationType, dequantize

    from powerinfer.formats.kquants import quantize, row_bytes
    from powerinfer.model.quant import BlockEmbedding
    torch.manual_seed(3)
    vocab, dim = 50, 512
    data = quantize((torch.randn(vocab, dim) * torch.rand(vocab, 1)).numpy(), kind)
    assert data.shape == (vocab, row_bytes(kind, dim))
    table = torch.from_numpy(np.asarray(dequantize(data, getattr(GGMLQuantizationType, kind)),
                                        dtype=np.float32)).view(vocab, dim)
    for dtype in (torch.float32, torch.bfloat16):
        emb = BlockEmbedding(torch.from_numpy(data), kind, dim, dtype)
        for tokens in (torch.tensor([[3]]), torch.tensor([[0, 49, 7, 7]]),
                       torch.tensor([[1, 2], [48, 5]])):
            got = emb(tokens)
            assert got.dtype == dtype and got.shape == (*tokens.shape, dim)
            assert torch.equal(got, table[tokens].to(dtype)), (kind, dtype, tokens.tolist())
    with pytest.raises(ValueError, match="no block embedding for Q3_K"):
        BlockEmbedding(torch.from_numpy(data), "Q3_K", dim, torch.float32)
