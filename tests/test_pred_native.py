"""The torch-free predictor (`actors/pred_native.py`: its matrices loaded by a child process, each
decode step's masks answered by the kernel library's torch-free build through the C entry
points) against the torch one, each driven over its own channels as the hot executor drives
them, with no Ray: the same masks, bit for bit, as `Predictors.active` gives them, at any width."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from actors.plane import DECODE, STOP, Masks, PlaneSpec, PredictorInput, receive, send
from on_thread import OnThread
from powerinfer import kernels
from powerinfer.config import Config

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="the CPU kernel does not run here: no torch-free predictor")

WIDTHS = (1, 3, 64, 70, 130)  # (past a GEMV's 64 rows: in 64-row calls)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    """A synthetic model of the tiny preset and a bundle with its layer-input predictors."""
    from powerinfer.sparsity.profile import ProfileOptions, profile
    from powerinfer.sparsity.synthetic import write_synthetic
    from powerinfer.sparsity.train import train_predictors
    d = tmp_path_factory.mktemp("tiny-pred")
    model = str(write_synthetic(d / "tiny.gguf", "tiny", subspace=16, seed=0, progress=False).path)
    b = profile(model, "lee", d / "bundle", ProfileOptions(tokens=1024, window=256, samples=1000),
                progress=False)
    train_predictors(b, "layer", ranks=[32], epochs=2, progress=False)
    return model, str(b.path)


class Side(OnThread):
    """One predictor on its thread (`OnThread`) and the hot executor's end of its channels."""

    def __init__(self, spec: PlaneSpec, build):
        super().__init__(build)
        self.spec = spec
        self.x, self.mask = spec.open("pred_in", writer=True), spec.open("mask")

    def ask(self, layer: int, rows: torch.Tensor, ffn_dim: int) -> np.ndarray:
        self.x.put(rows)
        send(self.x, PredictorInput(DECODE, layer, rows.shape[0]))
        got = receive(self.mask, Masks, timeout=60)
        assert (got.layer, got.B) == (layer, rows.shape[0])
        return self.mask.array(np.bool_, (got.B, ffn_dim)).copy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # f32 rows; q8x16 copies of bf16
def test_the_torch_free_predictor_answers_as_the_torch_one_bit_for_bit(tiny, dtype):
    from actors.pred_native import PredNativeImpl, predictor
    from actors.predictor import PredictorImpl
    from actors.prepare import prepare
    model, bundle = tiny
    done, table, _ = prepare(model, Config(runtime="actors", dtype=dtype, bundle=bundle), False)
    a, plan = table.args, done.plan
    cores, threads = tuple(sorted(os.sched_getaffinity(0))), torch.get_num_threads()
    specs = [PlaneSpec.new(1, max(WIDTHS), 256, 256, 16, 16, a, getattr(torch, dtype))
             for _ in range(2)]
    for spec in specs:
        spec.create_all()
    sides = []
    try:
        sides.append(Side(specs[0], lambda: PredictorImpl(specs[0], cores, plan)))
        sides.append(Side(specs[1], lambda: predictor(specs[1], cores, plan)))
        torch_side, native_side = sides
        assert isinstance(native_side.impl, PredNativeImpl)
        info = native_side.impl.ready()
        assert info["native"] and info["input"] == "layer" and info["torch_why"] == ""
        assert info["ranks"] == torch_side.impl.preds.ranks
        preds = torch_side.impl.preds
        gen = torch.Generator().manual_seed(0)
        asked = 0
        for layer in (0, a.n_layers - 1):
            for B in WIDTHS:
                rows = torch.randn(B, a.dim, generator=gen) * 2
                want, got = (s.ask(layer, rows, a.ffn_dim) for s in sides)
                asked += 1
                assert 0 < want.sum() < want.size, (layer, B)  # (some neurons each way)
                assert np.array_equal(want, got), (layer, B, int((want != got).sum()))
                # the masks the in-process engine's predictors give the same rows
                assert np.array_equal(want, preds.active(layer, rows).numpy()), (layer, B)
        for s in sides:
            send(s.x, PredictorInput(STOP, 0, 0))
            s.thread.join(30)
        assert [s.result for s in sides] == ["stopped", "stopped"]
        stats = [s.impl.stats() for s in sides]
        assert stats[0]["calls"] == stats[1]["calls"] == asked
        assert stats[1]["busy_s"] > 0 and 0 < stats[1]["weight_resident"] <= stats[1]["weight_bytes"]
    finally:
        torch.set_num_threads(threads)
        for spec in specs:
            spec.unlink_all()


def test_the_predictor_keeps_torch_where_asked(tiny, monkeypatch):
    # POWERINFER_PREDICTOR=torch: the torch predictor, which says why
    from actors.pred_native import predictor
    from actors.predictor import PredictorImpl
    from actors.prepare import prepare
    model, bundle = tiny
    done, table, _ = prepare(model, Config(runtime="actors", dtype="float32", bundle=bundle), False)
    spec = PlaneSpec.new(1, 4, 64, 256, 16, 16, table.args, torch.float32)
    spec.create_all()
    threads = torch.get_num_threads()
    monkeypatch.setenv("POWERINFER_PREDICTOR", "torch")
    try:
        impl = predictor(spec, tuple(sorted(os.sched_getaffinity(0))), done.plan)
        assert isinstance(impl, PredictorImpl)
        assert impl.ready()["torch_why"] == "POWERINFER_PREDICTOR=torch"
    finally:
        torch.set_num_threads(threads)
        spec.unlink_all()
