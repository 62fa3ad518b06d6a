"""The native decode loop (`native.NativeDecode`, the kernel library's `hot_layers`) against the
model's own modules: the in-process engine's decode steps take it on the default model's default
configuration and give the modules' logits, for one sequence and for a batch of sequences at
different positions in the paged cache, and so does a prompt step (chunks and decode rows);
models it cannot run keep their modules."""
import pytest
import torch

from powerinfer import Config, PowerInfer, kernels
from powerinfer.model import KVTables
from powerinfer.native import NativeDecode

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernel library does not "
                                                                "run here (needs g++ and AVX2)")


@pytest.fixture(scope="module")
def smol():
    # the default configuration on a CPU with native bf16; bf16+int4 written out where it has
    # none, so that the same layouts are tested on every CPU
    return PowerInfer.from_pretrained("smollm2-135m-instruct",
                                      config=Config(dtype="bfloat16", weights="int4", max_batch=4,
                                                    max_seq_len=256))


def test_the_engine_decodes_natively_with_the_defaults(smol):
    assert isinstance(smol.engine.native, NativeDecode)
    assert "Paris" in smol.generate("The capital of France is", max_new_tokens=8, temperature=0)


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
