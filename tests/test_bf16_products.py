"""bf16 products of many rows on a CPU that emulates bf16 (no AVX-512 BF16 or AMX): in float32, a
slice of the weights widened at a time, the sums rounded to bf16 once (torch's emulated bf16 GEMM
took about 5x as long: `benchmarks/bf16_gemm.py`). Each case runs as such a CPU runs it and as one
with bf16 arithmetic runs it (torch's own bf16 product), whatever this CPU is: the answers agree
to bf16's rounding, and a decode step's few rows keep torch's way."""
import pytest
import torch

from powerinfer import kernels
from powerinfer.model import transformer
from powerinfer.model.transformer import WIDE_ROWS, Linear


@pytest.fixture
def bf16_native(monkeypatch):
    """A switch: bf16_native(False) decides as a CPU without bf16 arithmetic, True as one with."""
    def switch(native: bool):
        monkeypatch.setattr(transformer, "_native_bf16", lambda: native)
    return switch


def one_rounding(x, w, b=None):
    """The float32 sums of x w^T (+ b), rounded to bf16 once."""
    y = x.float() @ w.float().t()
    return (y if b is None else y + b.float()).bfloat16()


def test_a_linears_many_bf16_rows_run_in_float32_rounded_once(bf16_native, monkeypatch):
    g = torch.Generator().manual_seed(0)
    lin = Linear(96, 5000, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(5000, 96, generator=g) / 10)
        lin.bias.copy_(torch.randn(5000, generator=g))
    lin = lin.bfloat16()
    # slices of 700 rows: several, the last one short
    monkeypatch.setattr(transformer, "WIDE_SLICE_BYTES", 96 * 4 * 700)
    calls = []
    real = transformer.linear_f32
    monkeypatch.setattr(transformer, "linear_f32", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(2, WIDE_ROWS // 2 + 3, 96, generator=g).bfloat16()
    want = one_rounding(x, lin.weight, lin.bias)
    bf16_native(False)
    with torch.no_grad():
        y = lin(x)
        assert calls == [x.shape] and y.dtype == torch.bfloat16 and y.shape == want.shape
        # the same float32 sums as one rounding of them but for their order: a bf16 step apart
        # at most, and seldom
        assert (y != want).float().mean() < 0.01
        assert ((y.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()
        lin(x[:, :1])  # a decode step's rows: torch's own product
        assert len(calls) == 1
        bf16_native(True)  # torch's bf16 product: about the same sums
        y2 = lin(x)
        assert len(calls) == 1
    torch.testing.assert_close(y2.float(), want.float(), rtol=2 ** -6, atol=1e-2)


@pytest.mark.skipif(not kernels.available(), reason="needs the CPU kernel library (its records)")
def test_a_neuron_sets_and_a_kernel_linears_many_bf16_rows_widen_to_float32(bf16_native,
                                                                            monkeypatch):
    from powerinfer.model.quant import KernelLinear
    from powerinfer.model.sparse import NeuronSet
    torch.manual_seed(3)
    n, dim = 96, 64
    w1, w2 = torch.randn(2 * n, dim) * 0.3, torch.randn(dim, n) * 0.3
    s = NeuronSet("swiglu", w1.bfloat16(), None, w2.bfloat16(), torch.arange(n), "q4_0")
    head = KernelLinear((torch.randn(300, dim) / 8).bfloat16(), None, "q8_0")
    x = torch.randn(2, 9, dim).bfloat16()  # 18 rows
    keep = torch.rand(2, 9, n) > 0.5  # per-token masks (an evaluation's): the widened torch path
    asked = []
    real = kernels.widened
    monkeypatch.setattr(kernels, "widened", lambda w, *a: asked.append(a[3]) or real(w, *a))
    bf16_native(False)
    got, got_head = s(x, None, 0.0, keep), head(x)
    assert asked == [torch.float32, torch.float32]
    bf16_native(True)  # widened to bf16, torch's bf16 products
    asked.clear()
    want, want_head = s(x, None, 0.0, keep), head(x)
    assert asked == [torch.bfloat16, torch.bfloat16]
    for a, b in ((got, want), (got_head, want_head)):
        assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02,
                                   atol=0.02 * float(b.float().abs().max()))
