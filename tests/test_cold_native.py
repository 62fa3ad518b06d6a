"""The torch-free cold executor (`actors/cold_native.py`: its shard loaded by a child process, its
messages answered by the kernel library's torch-free build through the C entry points) against
the torch one, each driven over its own channels as the hot executor drives them, with no Ray:
every kind of message the native loop answers gives the same floats, bit for bit."""
from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from actors.cold_native import ColdNativeImpl, cold_executor
from actors.plane import ATTN, DECODE, HEAD, PREFILL, STOP, FFNInput, Partial, PlaneSpec, receive, send
from actors.sealed import Sealed
from on_thread import OnThread
from powerinfer import kernels
from powerinfer.config import Config
from powerinfer.model.transformer import rope_tables

MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="the CPU kernel does not run here: no torch-free executor")


class Side(OnThread):
    """One executor on its thread (`OnThread`) and the hot executor's end of its channels."""

    def __init__(self, spec: PlaneSpec, build):
        super().__init__(build)
        self.spec = spec
        self.x, self.part = spec.open("x", writer=True), spec.open("part.0")

    def ask(self, words: FFNInput, parts: list[tuple[int, torch.Tensor]], cols: int) -> np.ndarray:
        for offset, t in parts:
            self.x.put(t, offset)
        send(self.x, words)
        got = receive(self.part, Partial, timeout=60)
        return self.part.array(np.float32, (got.rows, cols)).copy()


@contextmanager
def torch_and_native(config: Config, num_blocks: int, head: bool, attention: bool):
    """The torch executor and the torch-free one over the same shard of `config`'s model, each
    on its own channels (RoPE tables filled as the hot executor fills them): (the model's args,
    the torch side, the native side); their channels unlinked after."""
    from actors.cold_executor import ColdExecutorImpl
    from actors.prepare import prepare
    done, table, _ = prepare(MODEL, config, False)
    a = table.args
    cores, threads = tuple(sorted(os.sched_getaffinity(0))), torch.get_num_threads()
    specs = [PlaneSpec.new(1, 72, 128, 256, num_blocks, 16, a, torch.bfloat16) for _ in range(2)]
    for spec in specs:
        spec.create_all()
        if spec.ropes and attention:  # (the hot executor's to fill)
            for mine, want in zip(spec.rope_tables(writer=True), rope_tables(a, spec.max_seq)):
                for t, w in zip(mine, want):
                    t.copy_(w)
    args = dict(rank=0, cores=cores, plan=done.plan, hot_share=0.5, threads=0, weights="int4",
                head=head, attention=attention)
    try:
        torch_side = Side(specs[0], lambda: ColdExecutorImpl(specs[0], model=table, **args))
        native_side = Side(specs[1], lambda: cold_executor(specs[1], model=Sealed.of(table), **args))
        assert isinstance(native_side.impl, ColdNativeImpl), getattr(native_side.impl, "torch_why", "")
        yield a, torch_side, native_side
    finally:
        torch.set_num_threads(threads)
        for spec in specs:
            spec.unlink_all()


def answer_alike(sides: list[Side], steps: list, cols: dict | None = None):
    """Each message of `steps` to both sides: the same floats, finite and not all zero; then
    both stopped."""
    for words, parts in steps:
        width = (cols or {}).get(words.op, sides[0].spec.dim)
        want, got = (s.ask(words, parts, width) for s in sides)
        assert np.isfinite(want).all() and np.abs(want).max() > 0, words
        assert np.array_equal(want, got), (words, np.abs(want - got).max())
    for s in sides:
        send(s.x, FFNInput(STOP, 0, 0, 0, 0))
        s.thread.join(30)
    assert [s.result for s in sides] == ["stopped", "stopped"]


def test_the_torch_free_executor_answers_as_the_torch_one_bit_for_bit(tmp_path):
    config = Config(runtime="actors", dtype="bfloat16", weights="int4")
    with torch_and_native(config, 64, head=True, attention=True) as (a, torch_side, native_side):
        info = native_side.impl.info  # (what its `ready` says of the shard, the child's word)
        assert info["kv_heads"] == torch_side.impl._described()["kv_heads"] != [0, 0]
        assert info["block_slices"] == a.n_layers and info["native_attention"] == a.n_layers

        dim, spec, head_rows = a.dim, torch_side.spec, info["head_rows"]
        gen = torch.Generator().manual_seed(0)
        rows = lambda n: torch.randn(n, dim, generator=gen).to(torch.bfloat16)  # noqa: E731

        def attn(layer, B, T, x, pos, starts, tables):  # (an ATTN message: spec.attn_layout)
            at = spec.attn_layout(B * T, len(starts) - 1)
            parts = [(at.rows, x), (at.positions, torch.tensor(pos)), (at.starts, torch.tensor(starts)),
                     (at.tables, torch.tensor(tables, dtype=torch.int32))]
            return FFNInput(ATTN, layer, B, T, len(starts) - 1, len(tables[0])), parts

        M = spec.max_blocks  # (two sequences' blocks, apart)
        assert 2 * M <= spec.num_blocks
        table0, table1 = [list(range(M))], [list(range(M)), list(range(M, 2 * M))]
        prompt = rows(6)
        steps = []
        for layer in (0, a.n_layers - 1):
            steps += [attn(layer, 1, 6, prompt, list(range(6)), [0, 6], table0),  # a prompt's heads
                      (FFNInput(PREFILL, layer, 1, 6, 0), [(0, prompt)]),  # its neurons
                      attn(layer, 2, 1, rows(2), [6, 0], [0, 1, 2], table1),  # decode: two sequences
                      (FFNInput(DECODE, layer, 3, 1, 0), [(0, rows(3))]),
                      (FFNInput(DECODE, layer, 70, 1, 0), [(0, rows(70))])]  # past a GEMV's batch
        wide = rows(70)
        heads = [(FFNInput(HEAD, -1, 1, 1, 0), [(0, wide[:1])]), (FFNInput(HEAD, -1, 70, 1, 0), [(0, wide)])]
        sides = [torch_side, native_side]
        answer_alike(sides, steps + heads, {HEAD: head_rows})
        # (counted as the loop hands back: its answers, and what it holds as the torch one does)
        stats = [s.impl.stats() for s in sides]
        assert stats[0]["messages"] == stats[1]["messages"] == len(steps) + len(heads)
        assert stats[0]["held_bytes"] == stats[1]["held_bytes"] > 0
        assert stats[1]["kv_resident"] > 0 and stats[1]["weight_resident"] > 0


def test_a_bundles_records_answer_without_torch_as_with_it(bundle):
    # a sparse model's cold executor (neuron records and a predictor's masks) runs without torch
    # too: a prompt's rows over its records (the kernel library's product, the one the torch
    # executor's set runs), a one-token prompt, decode rows with the predictor's masks and
    # without, up to a call's 64 rows and past them, bit for bit as the torch executor answers them
    config = Config(runtime="actors", dtype="bfloat16", weights="int4", bundle=bundle)
    with torch_and_native(config, 16, head=False, attention=False) as (a, torch_side, native_side):
        spec, dim = torch_side.spec, a.dim
        gen = torch.Generator().manual_seed(1)
        rows = lambda n: torch.randn(n, dim, generator=gen).to(torch.bfloat16)  # noqa: E731
        masks = torch.rand(70, a.ffn_dim, generator=gen) < 0.4
        held = [i for i, st in enumerate(torch_side.impl.sets) if st is not None and len(st.idx)]
        assert held, "the shard holds no layer's neurons"
        steps = []
        for layer in (held[0], held[-1]):
            steps += [(FFNInput(PREFILL, layer, 1, 37, 0), [(0, rows(37))]),  # a prompt's rows
                      (FFNInput(PREFILL, layer, 1, 1, 0), [(0, rows(1))]),  # a one-token prompt
                      (FFNInput(DECODE, layer, 5, 1, 1), [(0, rows(5)), (spec.mask_offset(5), masks[:5])]),
                      (FFNInput(DECODE, layer, 3, 1, 0), [(0, rows(3))]),
                      # past a call's 64 rows (a group's batch is its max_batch + 1)
                      (FFNInput(DECODE, layer, 70, 1, 1), [(0, rows(70)), (spec.mask_offset(70), masks)]),
                      (FFNInput(DECODE, layer, 70, 1, 0), [(0, rows(70))])]
        answer_alike([torch_side, native_side], steps)
        assert torch_side.impl.stats()["held_bytes"] == native_side.impl.stats()["held_bytes"] > 0


def test_a_shard_the_child_cannot_load_raises_its_error_here(tmp_path):
    # the loading child's error comes back as itself, naming the cause; no segment is left
    import shutil

    from actors.prepare import prepare
    from powerinfer.formats.loader import resolve_model
    path = tmp_path / "copy.gguf"
    shutil.copy(resolve_model(MODEL), path)
    done, table, _ = prepare(str(path), Config(runtime="actors", dtype="bfloat16", weights="int4"), False)
    path.unlink()  # (gone between the table's parse and the executor's load)
    spec = PlaneSpec.new(1, 4, 64, 256, 16, 16, table.args, torch.bfloat16)
    spec.create_all()
    threads = torch.get_num_threads()
    try:
        with pytest.raises(OSError, match="copy.gguf"):
            cold_executor(spec, 0, tuple(sorted(os.sched_getaffinity(0))), Sealed.of(table), done.plan,
                          0.5, 0, "int4", True, True)
    finally:
        torch.set_num_threads(threads)
        spec.unlink_all()


def shard_kwargs(config: Config):
    """(the model's args, a cold executor's arguments but its plane) for `config`'s model."""
    from actors.prepare import prepare
    done, table, _ = prepare(MODEL, config, False)
    return table.args, dict(rank=0, cores=tuple(sorted(os.sched_getaffinity(0))), model=Sealed.of(table),
                            plan=done.plan, hot_share=0.5, threads=0, weights="int4", head=True,
                            attention=True)


def test_a_shards_second_load_reads_the_cache_and_answers_as_the_first(tmp_path, monkeypatch, caplog):
    # a torch-free executor loaded again with the same shard (a group built again after a death)
    # starts no child: the cache gives it what the first load's child packed, and it answers the
    # same floats; an entry that does not read back whole is dropped and the shard packed again
    import resource
    monkeypatch.setenv("POWERINFER_SHARD_CACHE", str(tmp_path / "shards"))
    a, kw = shard_kwargs(Config(runtime="actors", dtype="bfloat16", weights="int4"))
    threads = torch.get_num_threads()
    # (the second plane's KV pool of another size, as a pool sized from the memory free at start)
    specs = [PlaneSpec.new(1, 8, 64, 256, blocks, 16, a, torch.bfloat16) for blocks in (16, 24, 16)]
    children = lambda: resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime  # noqa: E731
    try:
        sides = []
        for spec in specs[:2]:
            spec.create_all()
            before = children()
            sides.append(Side(spec, lambda spec=spec: cold_executor(spec, **kw)))
            sides[-1].ran_child = children() > before
        assert [s.impl.ready()["shard_cached"] for s in sides] == [False, True]
        assert [s.ran_child for s in sides] == [True, False]
        assert [s.impl.kv[0].shape[0] for s in sides] == [16, 24]  # (each its own plane's pool)
        gen = torch.Generator().manual_seed(2)
        rows = lambda n: torch.randn(n, a.dim, generator=gen).to(torch.bfloat16)  # noqa: E731
        steps = [(FFNInput(PREFILL, 3, 1, 9, 0), [(0, rows(9))]),
                 (FFNInput(DECODE, 3, 4, 1, 0), [(0, rows(4))]),
                 (FFNInput(HEAD, -1, 2, 1, 0), [(0, rows(2))])]
        answer_alike(sides, steps, {HEAD: sides[0].impl.info["head_rows"]})

        entry, = (tmp_path / "shards").glob("*.shard")
        with open(entry, "r+b") as f:  # (a disk that lost the entry's end)
            f.truncate(entry.stat().st_size - 4096)
        specs[2].create_all()
        with caplog.at_level("WARNING", logger="powerinfer"):
            again = cold_executor(specs[2], **kw)
        assert not again.ready()["shard_cached"], "a short entry was read"
        assert "dropped" in caplog.text and entry.name in caplog.text
        assert entry.stat().st_size > 4096 and len(list((tmp_path / "shards").iterdir())) == 1
    finally:
        torch.set_num_threads(threads)
        for spec in specs:
            spec.unlink_all()


def test_a_shard_cache_entry_follows_its_files_and_arguments_not_its_plane_or_cores(tmp_path, monkeypatch):
    # the key: another plane (segment names) or other cores keep it; another shard, a model file
    # written since, another POWERINFER_ setting or torch's class do not; a forged entry is
    # refused, not run
    import dataclasses
    import pickle

    from actors import shard_cache
    monkeypatch.setenv("POWERINFER_SHARD_CACHE", str(tmp_path / "shards"))
    a, kw = shard_kwargs(Config(runtime="actors", dtype="bfloat16", weights="int4"))
    spec = PlaneSpec.new(1, 8, 64, 256, 16, 16, a, torch.bfloat16)
    role = "actors.cold_executor:ColdExecutorImpl"
    key = lambda **change: shard_cache.key(role, {"spec": spec, **kw, **change})  # noqa: E731
    assert key() == key(cores=(0,), spec=PlaneSpec.new(1, 8, 64, 256, 16, 16, a, torch.bfloat16))
    assert key() != key(rank=1) != key(hot_share=0.25)
    assert key() == key(spec=dataclasses.replace(spec, num_blocks=99))  # (its KV cache a Slot)
    assert key() != key(spec=dataclasses.replace(spec, batch=9))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    sealed = dataclasses.replace(kw["model"], files=(model,))
    first = key(model=sealed)
    os.utime(model, ns=(1, 1))
    assert key(model=sealed) != first
    base = key()
    monkeypatch.setenv("POWERINFER_KV_SOMETHING", "1")
    assert key() != base
    # (torch's operators held to a class, as the suite held to one runs: the packing ran on them)
    base = key()  # (another class than the one this run holds them to, if any)
    held = os.environ.get("ATEN_CPU_CAPABILITY")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2" if held != "avx2" else "default")
    assert key() != base

    class Run:  # (what an entry must never be able to do when read)
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))
    head = pickle.dumps({"size": 0, "why": Run()}, protocol=4)
    forged = tmp_path / "shards" / "forged.shard"
    forged.parent.mkdir(exist_ok=True, mode=0o700)
    forged.write_bytes(shard_cache.HEAD.pack(shard_cache.MAGIC, len(head), 0) + head.ljust(4096 - 24, b"\0"))
    assert shard_cache.fetch("forged") is None
    assert not (tmp_path / "ran").exists() and not forged.exists()
    # an entry whose kernel library is gone (rebuilt elsewhere) is packed again
    shard_cache.store("gone", {"size": 0, "why": "w", "library": str(tmp_path / "no.so")}, None, 0)
    assert (tmp_path / "shards" / "gone.shard").exists() and shard_cache.fetch("gone") is None
    assert not (tmp_path / "shards" / "gone.shard").exists()
    os.chmod(tmp_path / "shards", 0o777)  # (others could write entries: no cache)
    assert shard_cache.directory() is None


def test_a_tensor_read_in_place_from_the_model_file_is_handed_over_as_the_files_own_bytes(
        default_model_path):
    # the loading child hands over a tensor the model reads in place from its GGUF file (the
    # embedding's rows: `GGUFSource.mapped_rows`) as where it lies in the file, which the actor
    # maps again (the page cache's pages, shared: Gemma 3's 170 MiB embedding copied into each
    # torch-free hot executor before); a copy of the same bytes, or a strided view, is written
    # into the memory file; each reads back equal, through a shard cache entry's header too
    import io
    import mmap
    import pickle

    from actors import clib, shard_cache
    from actors.pack import pack_args
    from actors.packed import Mapped, Packed
    from powerinfer.formats.gguf import load_gguf

    ck = load_gguf(default_model_path, torch.float32, False, True)
    rows = ck.source.mapped_rows("embed")
    assert rows is not None
    copy, strided = rows.clone(), rows[:, :16]
    fd = os.memfd_create("packed")
    try:
        packed, size = pack_args((rows, [copy, strided]), fd, {})
        memory = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    mapped, (copied, view) = shard_cache._Header(io.BytesIO(pickle.dumps(packed))).load()
    assert isinstance(mapped, Mapped) and mapped.path == str(default_model_path.resolve())
    assert mapped.shape == tuple(rows.shape)
    assert isinstance(copied, Packed) and isinstance(view, Packed)
    assert size < 2 * rows.numel()  # (the rows written once: the copy's)
    held: list[np.ndarray] = []  # (the caller's list of what it reads in the model file)
    got = [clib.unpack(v, memory, {}, [], held).array for v in (mapped, copied, view)]
    for a, want in zip(got, (rows, copy, strided)):
        assert np.array_equal(a, want.numpy())
    file_map = clib.mapped_file(mapped.path)
    assert got[0].ctypes.data == clib.address(file_map) + mapped.offset  # (the file's pages)
    assert [a.ctypes.data for a in held] == [got[0].ctypes.data]
    with pytest.raises(ValueError, match="shorter than when it was loaded"):
        clib.unpack(mapped._replace(offset=len(file_map)), memory, {}, [], [])
