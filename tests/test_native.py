"""The native decode loop (`native.NativeDecode`, the kernel library's `hot_layers`) against the
model's own modules: the in-process engine's decode steps take it on the default model's default
configuration and give the modules' logits, for one sequence and for a batch of sequences at
different positions in the paged cache, and so does a prompt step (chunks and decode rows);
models it cannot run keep their modules."""
import time

import pytest
import torch

from powerinfer import Config, PowerInfer, kernels
from powerinfer.model.transformer import KVTables
from powerinfer.engine.native import NativeDecode

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel library does not "
                                                                "run here (needs g++ and AVX2)")


# a prompt each model answers right, greedily (by vocabulary size: SmolLM2's, Gemma 3's)
KNOWN = {49152: ("The capital of France is", "Paris"),
         262144: ("Water boils at a temperature of", "100")}


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def smol(request):
    # the default configuration (bf16+int4 written out: the same layouts on every CPU), on the
    # default model and on Gemma 3, whose layers have their own variants (q/k norms, post-norms,
    # sliding windows with their own RoPE table every five layers in six)
    if request.param == "gemma3-270m":
        request.getfixturevalue("gemma_model_path")  # (skips where it is not installed)
    return PowerInfer.from_pretrained(request.param,
                                      config=Config(dtype="bfloat16", weights="int4", max_batch=4,
                                                    max_seq_len=256))


def test_the_engine_decodes_natively_with_the_defaults(smol):
    assert isinstance(smol.engine.native, NativeDecode)
    prompt, answer = KNOWN[smol.checkpoint.args.vocab_size]
    assert answer in smol.generate(prompt, max_new_tokens=8, temperature=0)


def test_the_loop_profile_counts_the_native_steps_phases_only_while_on(smol):
    # kernels.loop_profile (benchmarks/phases.py): the decode loop's phases add up while it is
    # on, within the step's own time, and nothing is counted before "start" or after "stop"
    def steps(n):
        t0 = time.perf_counter()
        smol.generate("The capital of France is", max_new_tokens=n, temperature=0, ignore_eos=True)
        return time.perf_counter() - t0

    kernels.loop_profile("stop")
    steps(4)
    kernels.loop_profile("start")
    assert kernels.loop_profile("read")["calls"] == 0
    took = steps(6)
    on = kernels.loop_profile("stop")
    assert on["calls"] >= 5  # six tokens: five decode steps (and the prompt's, where it runs there)
    assert set(on) == {"calls", *kernels.LOOP_PHASES}
    for phase in ("norms", "q/k/v projection", "RoPE, new keys and values placed",
                  "attention over the cache", "output projection", "FFN"):
        assert on[phase] > 0, phase
    assert on["waits for the executors' FFN"] == 0  # (in process: no executors)
    assert sum(v for k, v in on.items() if k != "calls") < took
    steps(3)
    assert kernels.loop_profile("read") == on


def test_native_decode_equals_the_modules(smol):
    m, native = smol.model, smol.engine.native
    prompts = [smol.tokenize(p) for p in ("Once upon a time", "The capital of France is",
                                          "def fibonacci(n):")]
    bs = smol.config.block_size
    tables = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)  # each its own 4 blocks
    with torch.inference_mode():
        for s, ids in enumerate(prompts):  # the prompts through the modules, each in its blocks
            T = len(ids)
            m(torch.tensor([ids]), torch.arange(T)[None], KVTables(torch.tensor([0, T]), tables[s:s + 1]),
              torch.tensor([T - 1]))
        pos = torch.tensor([[len(p)] for p in prompts])
        tokens = torch.tensor([[p[-1]] for p in prompts])
        kv = KVTables(torch.arange(4), tables)
        last = torch.arange(3)
        caches = [(b.attn.kv_cache.k.clone(), b.attn.kv_cache.v.clone()) for b in m.layers]
        want = m(tokens, pos, kv, last)  # one decode step, all three sequences
        written = [(b.attn.kv_cache.k.clone(), b.attn.kv_cache.v.clone()) for b in m.layers]
        for b, (k, v) in zip(m.layers, caches):  # the same step again, natively
            b.attn.kv_cache.k.copy_(k)
            b.attn.kv_cache.v.copy_(v)
        got = native(tokens, pos, kv, last)
    assert got.shape == want.shape == (3, 1, m.args.vocab_size) and got.dtype == torch.float32
    # the same operations in the same order: the logits agree to bf16 rounding at most, and each
    # sequence's greedy token is the same
    assert (got - want).abs().max() <= 2**-7 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for b, (k, v) in zip(m.layers, written):  # and the cache holds the same keys and values
        assert torch.equal(b.attn.kv_cache.k, k) and torch.equal(b.attn.kv_cache.v, v)
    assert pos.max() < bs * 4


def test_a_prompt_step_natively_equals_the_modules(smol):
    # a prompt step as the batcher builds one: a chunk of one prompt, the whole of another, and a
    # decode row of a third sequence, in one (1, N) step; the native loop takes it (its layers
    # are in 16-row group layouts) and writes the cache and gives the logits the modules do
    m, native = smol.model, smol.engine.native
    assert native.prompts
    a, b, c = (smol.tokenize(p) for p in ("Once upon a time there was", "The capital of France is",
                                          "def fibonacci(n):"))
    tables = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    with torch.inference_mode():
        T = len(c)  # the third sequence's prompt first, through the modules
        m(torch.tensor([c]), torch.arange(T)[None], KVTables(torch.tensor([0, T]), tables[2:3]),
          torch.tensor([T - 1]))
        rows = [(0, a[:4], 0), (1, b, 0), (2, [c[-1]], len(c))]  # (sequence, tokens, first position)
        rows = sorted(rows, key=lambda r: len(r[1]) > 1)  # decode rows first, as make_step puts them
        tokens = torch.tensor([[t for _, ids, _ in rows for t in ids]])
        pos = torch.tensor([[p0 + i for _, ids, p0 in rows for i in range(len(ids))]])
        starts = torch.tensor([0] + [len(ids) for _, ids, _ in rows]).cumsum(0)
        kv = KVTables(starts, tables[[s for s, _, _ in rows]])
        last = starts[1:] - 1
        caches = [(blk.attn.kv_cache.k.clone(), blk.attn.kv_cache.v.clone()) for blk in m.layers]
        want = m(tokens, pos, kv, last)
        written = [(blk.attn.kv_cache.k.clone(), blk.attn.kv_cache.v.clone()) for blk in m.layers]
        for blk, (k, v) in zip(m.layers, caches):
            blk.attn.kv_cache.k.copy_(k)
            blk.attn.kv_cache.v.copy_(v)
        got = native(tokens, pos, kv, last)
    assert got.shape == want.shape == (3, 1, m.args.vocab_size)
    assert (got - want).abs().max() <= 2**-7 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for blk, (k, v) in zip(m.layers, written):  # every row's keys and values, the chunk's included
        assert torch.equal(blk.attn.kv_cache.k, k) and torch.equal(blk.attn.kv_cache.v, v)


def test_models_it_cannot_run_keep_their_modules():
    # float32 dense projections are torch's (no kernel-library matrix): the modules decode
    pi = PowerInfer.from_pretrained("smollm2-135m-instruct",
                                    config=Config(dtype="float32", weights="dense", max_seq_len=64))
    assert pi.engine.native is None
    assert "Paris" in pi.generate("The capital of France is", max_new_tokens=8, temperature=0)


def sparse_model(dtype: torch.dtype, source: str, threshold: float):
    """A small LLaMA-shaped model made sparse: each FFN a HybridFFN over one set of kernel records
    with a `Predictors` on the kernel's GEMV (what the in-process sparse engine holds on a CPU),
    its attention's projections kernel-library matrices; and the predictors."""
    from test_sparse import random_model

    from powerinfer.model.predictor import Predictors, run_dtype
    from powerinfer.model.quant import KernelLinear
    from powerinfer.model.sparse import apply_hybrid_ffn
    g = torch.Generator().manual_seed(5)
    pdt = run_dtype(dtype)
    preds = Predictors([(torch.randn(32, 64, generator=g) / 8).to(pdt) for _ in range(3)],
                       [torch.randn(256, 32, generator=g).to(pdt) for _ in range(3)], source,
                       threshold=0.5)
    m = random_model("reglu").to(dtype)
    m.rows = None
    m.setup_cache(2, 64)  # again: the cache in the model's type, the RoPE tables in float32
    apply_hybrid_ffn(m, preds.active, predictor_input=source, thresholds=[threshold] * 3)
    fmt = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    for b in m.layers:
        b.attn.wqkv = KernelLinear(b.attn.wqkv.weight.detach(), None, fmt)
        b.attn.wo = KernelLinear(b.attn.wo.weight.detach(), None, fmt)
    return m, preds


@pytest.mark.parametrize("dtype,source,threshold", [(torch.float32, "ffn", 0.0),
                                                    (torch.bfloat16, "layer", 0.05)])
def test_sparse_decode_natively_equals_the_modules(monkeypatch, dtype, source, threshold):
    # the in-process sparse engine's decode step: each layer's predictor, rule and neurons run in
    # the native loop (no Python between layers) and give the modules' logits and cache, for one
    # sequence and for two (each keeping its own predicted neurons); the loop leaves a step to
    # the modules while a layer records stats, with sparse.FUSED_DECODE off, and once a layer's
    # mask source changes
    from powerinfer.model import sparse
    from powerinfer.model.sparse import LayerStats
    m, preds = sparse_model(dtype, source, threshold)
    native = NativeDecode.of(m)
    assert native is not None and len(native.sparse) == 3 and not native.prompts
    calls = []  # the modules' one-call path, counted
    real = kernels.predicted_ffn
    monkeypatch.setattr(kernels, "predicted_ffn", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    tol = 1e-5 if dtype == torch.float32 else 2**-7

    def step(B: int, s: int, run):
        tokens = torch.tensor([[(7 * s + 3 * b + 1) % 300] for b in range(B)])
        return run(tokens, torch.full((B, 1), 4 + s), m.row_tables(B, 1), torch.arange(B))

    with torch.inference_mode():
        for B in (1, 2):
            m(torch.tensor([[1, 5, 9, 13]] * B), torch.arange(4).expand(B, 4))  # the prompts
            for s in range(4):
                caches = [(b.attn.kv_cache.k.clone(), b.attn.kv_cache.v.clone()) for b in m.layers]
                calls.clear()
                want = step(B, s, m)
                assert calls == [B] * 3  # the modules: one kernel call a layer
                written = [(b.attn.kv_cache.k.clone(), b.attn.kv_cache.v.clone()) for b in m.layers]
                for b, (k, v) in zip(m.layers, caches):
                    b.attn.kv_cache.k.copy_(k)
                    b.attn.kv_cache.v.copy_(v)
                calls.clear()
                got = step(B, s, native)
                assert calls == []  # the loop in C++ took every layer
                assert got.shape == want.shape == (B, 1, 300)
                assert (got - want).abs().max() <= tol * want.abs().max()
                assert torch.equal(got.argmax(-1), want.argmax(-1))
                for b, (k, v) in zip(m.layers, written):
                    assert torch.equal(b.attn.kv_cache.k, k) and torch.equal(b.attn.kv_cache.v, v)
        # the predictor's picks are neither none nor all of a layer's neurons
        share = float(preds.active(0, torch.randn(8, 64).to(dtype)).float().mean())
        assert 0.05 < share < 0.95
        # left to the modules: while a layer records what it computes ...
        m.layers[1].ffn.stats = LayerStats()
        calls.clear()
        step(1, 0, native)
        assert calls == [1, 1] and m.layers[1].ffn.stats.computed > 0  # (that layer op by op)
        m.layers[1].ffn.stats = None
        # ... with the one-call path off, and once a layer's masks are another source's
        monkeypatch.setattr(sparse, "FUSED_DECODE", False)
        calls.clear()
        step(1, 0, native)
        assert calls == []
        monkeypatch.setattr(sparse, "FUSED_DECODE", True)
        m.layers[2].ffn.masks = lambda i, x: torch.ones(*x.shape[:-1], 256, dtype=torch.bool)
        step(1, 0, native)
        assert calls == [1, 1]
