"""GGUF files (every type the gguf package dequantizes, and the original PowerInfer's PWRI
layout): the architecture from the metadata, the tensors by their canonical names
(`formats.source.TENSOR_NAMES`), read on demand (`GGUFSource`) or whole. A converted copy's
original K-quant blocks are found beside it (`formats.bundle.original_of`). Every failure becomes
a `ModelLoadError` that names the file and the problem. A converted copy holds only the tensors
it converted; its model's other tensors are read from the original (`Stored.file`).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import mmap
import warnings
import weakref
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..compat import ArrayParts, gguf_reader
from ..errors import ModelLoadError
from . import kquants
from .args import ModelArgs
from .bundle import CONVERTED_ONLY_KEY, SOURCE_KEY, original_of
from .kquants import KQUANT_LAYOUTS
from .q4 import Q4_TYPES, q4_split
from .source import (GGUF, Checkpoint, LazyWeights, TensorSource, expand_names, split_fused,
                     unpermute_rows)

# GGUF architectures: (default FFN activation, q/k rows permuted by llama.cpp's converter for its
# interleaved RoPE, which we undo to keep one RoPE convention)
GGUF_ARCHS = {"llama": ("swiglu", True), "mistral": ("swiglu", True), "qwen2": ("swiglu", False),
              "bamboo": ("dreglu", True), "qwen3": ("swiglu", False), "phi3": ("swiglu", False),
              "gemma3": ("geglu", False), "falcon": ("gelu", False)}


# per architecture, canonical names read from other tensors than TENSOR_NAMES says (None: none)
GGUF_RENAMES = {
    "phi3": {"{i}.gate_up": "blk.{i}.ffn_up.weight", "{i}.up": None},
    "falcon": {"norm_b": "output_norm.bias"},  # (its layers' norms: see load_gguf)
}


def gguf_metadata(reader) -> dict:
    """The file's key-value pairs, decoded (once a reader: a load asks for them several times;
    an array read by the project's reader decoded whole, `compat.ArrayParts`). The caller gets
    its own dict; the values are shared."""
    meta = getattr(reader, "_powerinfer_meta", None)
    if meta is None:
        meta = {}
        for key, f in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                meta[key] = f.parts.contents() if isinstance(f.parts, ArrayParts) \
                    else f.contents()
            except Exception:  # a value type the reader cannot decode: skip it
                continue
        reader._powerinfer_meta = meta
    return dict(meta)


_READERS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("gguf_readers", default=None)


@contextlib.contextmanager
def parsed_once():
    """Within it, `open_gguf` parses each file once: one load reads a file's header several
    times over (its listing, its converted copy's, the original's blocks beside the copy). The
    parsed headers are dropped on leaving (a large vocabulary's are tens of MB)."""
    if _READERS.get() is not None:
        yield
        return
    token = _READERS.set({})
    try:
        yield
    finally:
        _READERS.reset(token)


def open_gguf(path: Path):
    if not path.is_file():
        raise ModelLoadError(path, "not a file")
    cache = _READERS.get()
    if cache is not None:
        st = path.stat()
        key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in cache:
            cache[key] = _open_gguf(path)
        return cache[key]
    return _open_gguf(path)


GGUF_VERSIONS = (2, 3)  # the versions the gguf package reads (READER_SUPPORTED_VERSIONS)


def _open_gguf(path: Path):
    with open(path, "rb") as fh:
        magic, version = fh.read(4), fh.read(4)
    if magic not in (b"GGUF", b"PWRI"):  # PWRI: the original PowerInfer's layout (pwri.py)
        raise ModelLoadError(path, f"not a GGUF file (magic {magic!r}, "
                             "expected b'GGUF' or b'PWRI')")
    v = int.from_bytes(version, "little")
    if v & 0xFFFF == 0:  # a big-endian file, as the reader tells them apart
        v = int.from_bytes(version, "big")
    if len(version) == 4 and v not in GGUF_VERSIONS:  # (it was "corrupt or truncated")
        raise ModelLoadError(path, f"GGUF version {v}, which this build does not read (it reads "
                             f"versions {', '.join(map(str, GGUF_VERSIONS))})")
    try:
        return gguf_reader(path)
    except Exception as e:  # (the reader's own words say where it stopped, not why)
        raise ModelLoadError(path, f"corrupt or truncated GGUF: its header, tensor table or "
                             f"tensors do not fit in its {path.stat().st_size:,} bytes, or hold "
                             f"values no GGUF holds; a download or copy may have stopped early "
                             f"(the reader stopped with {type(e).__name__}: {e})") from e


def dequantize(t) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (row-major) order: shape reversed from ggml's."""
    import gguf

    shape = tuple(int(s) for s in reversed(t.shape))
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(arr, dtype=np.float32).reshape(shape)


_PLAIN = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}  # stored as plain numbers


_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class Stored(NamedTuple):
    """Where one tensor lies in a GGUF file: its type, its shape (row-major, numpy order),
    its bytes' offset and length, and which of its source's files holds it (0: the one the
    source is named by; 1: a converted copy's original, for the tensors it did not convert)."""
    kind: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    file: int = 0


# The file maps GGUFSources hold open in this process, by their first byte's address: (size, the
# file, the map): a tensor read in place can be told from a copy (`mapped_at`), so that the
# torch-free actors' loading child hands such a tensor over as the file's own bytes, which the
# actor maps again, rather than as a copy of them.
_MAPS: dict[int, tuple[int, str, weakref.ref]] = {}


def mapped_at(address: int, nbytes: int) -> tuple[str, int] | None:
    """(the file, the offset in it) of the nbytes at `address` where they lie whole in a GGUF
    file this process maps (a source's view of its own pages), else None."""
    for base, (size, path, ref) in list(_MAPS.items()):
        m = ref()
        if m is None or m.closed:  # (its range may since hold anything)
            del _MAPS[base]
        elif base <= address and address + nbytes <= base + size:
            return path, address - base
    return None


class GGUFSource(TensorSource):
    """Tensors of a GGUF file read from its memory map, described by a table of `Stored`
    entries (no parse: it pickles small, so a process that receives it reads tensors without
    parsing the file again). Rows of a quantized tensor are whole rows of blocks, so reading
    some rows touches only their pages; columns are read a chunk of rows at a time
    (`COLUMN_CHUNK_BYTES` of float32 at most in flight)."""

    COLUMN_CHUNK_BYTES = 64 << 20

    def __init__(self, path: Path, table: dict[str, Stored], permute_args: ModelArgs | None,
                 others: tuple[Path, ...] = ()):
        self.path, self.table, self._permute = Path(path), table, permute_args
        self.files = (self.path, *map(Path, others))  # Stored.file indexes these
        self.names = frozenset(table)
        self._maps: dict[int, tuple[np.ndarray, mmap.mmap]] = {}

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}

    def _mapped(self, file: int) -> tuple[np.ndarray, mmap.mmap]:
        if file not in self._maps:
            with open(self.files[file], "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            arr = np.frombuffer(mm, dtype=np.uint8)
            _MAPS[arr.ctypes.data] = (arr.size, str(self.files[file].resolve()), weakref.ref(mm))
            self._maps[file] = arr, mm
        return self._maps[file]

    def _stored(self, name: str) -> Stored:
        try:
            return self.table[name]
        except KeyError:
            raise ModelLoadError(self.path, f"missing tensor {name}") from None

    def _data(self, name: str) -> np.ndarray:
        """The tensor's bytes (a view of the map): (rows, bytes per row) uint8."""
        st = self._stored(name)
        rows = int(np.prod(st.shape[:-1])) if len(st.shape) > 1 else 1
        return self._mapped(st.file)[0][st.offset:st.offset + st.nbytes].reshape(rows, -1)

    def _release(self, name: str):
        """Drop the tensor's pages from this process (MADV_DONTNEED; the page cache keeps
        them): what was read is copied out, and file pages left mapped would count in the
        process's resident memory until the map closes."""
        st = self._stored(name)
        lo = st.offset // mmap.PAGESIZE * mmap.PAGESIZE
        if hasattr(mmap, "MADV_DONTNEED") and st.file in self._maps:
            self._maps[st.file][1].madvise(mmap.MADV_DONTNEED, lo, st.offset + st.nbytes - lo)

    def kind(self, name: str) -> str:
        return self._stored(name).kind

    def shape(self, name: str) -> tuple[int, ...]:
        return self._stored(name).shape

    def _heads(self, name: str) -> int | None:
        """The head count whose rows llama.cpp's converter permuted (q and k), else None."""
        role, a = name.split(".")[-1], self._permute
        if a is None or role not in ("q", "k", "q_b", "k_b"):
            return None
        return a.n_heads if role[0] == "q" else a.n_kv_heads

    def _view(self, name: str) -> torch.Tensor:
        """A tensor stored as plain numbers, as a read-only torch view of the map (rows, k):
        whatever reads it copies out only what it keeps, once."""
        data = self._data(name)
        with warnings.catch_warnings():  # the map is read-only: nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            w = torch.from_numpy(data.view(_PLAIN[self.kind(name)]))
        return w.view(torch.bfloat16) if self.kind(name) == "BF16" else w

    def _dequantize(self, name: str, raw: np.ndarray) -> torch.Tensor:
        """Rows of a block-quantized tensor's bytes -> (rows, k) float32."""

        return kquants.dequantize(raw, self.kind(name), self.shape(name)[-1])

    def read_into(self, name: str, out: torch.Tensor):
        """Copy the whole tensor into `out` (its shape, any dtype): one copy for plain numbers."""
        heads = self._heads(name)
        w = (self._view(name) if self.kind(name) in _PLAIN
             else self._dequantize(name, self._data(name)))
        w = w.reshape(self.shape(name))
        out.copy_(w if heads is None else unpermute_rows(w, heads))
        del w
        self._release(name)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self.shape(name), dtype=dtype)
        self.read_into(name, out)
        return out

    def rows(self, name: str, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        assert self._heads(name) is None, f"rows of a permuted tensor ({name})"
        if len(idx) == 0:
            return torch.empty(0, self.shape(name)[-1], dtype=dtype)
        if self.kind(name) not in _PLAIN:
            return self._dequantize(name, self._data_rows(name, idx)).to(dtype)
        out = self._view(name).index_select(0, idx).to(dtype)
        self._release(name)
        return out

    def _data_rows(self, name: str, idx: torch.Tensor) -> np.ndarray:
        assert self._heads(name) is None, f"rows of a permuted tensor ({name})"
        out = self._data(name)[idx.numpy()]  # a copy of just these rows
        self._release(name)
        return out

    def raw_rows(self, name: str, idx: torch.Tensor) -> torch.Tensor | None:
        if self.kind(name) in _PLAIN:
            return None
        return torch.from_numpy(self._data_rows(name, idx))

    def mapped_rows(self, name: str) -> torch.Tensor | None:
        if self.kind(name) in _PLAIN or self._heads(name) is not None:
            return None
        with warnings.catch_warnings():  # the map is read-only: nothing reads it to write
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self._data(name))

    def block_rows(self, name: str) -> torch.Tensor | None:
        if self.kind(name) in _PLAIN:
            return None
        heads = self._heads(name)
        data = self._data(name)
        out = torch.from_numpy(np.array(data if heads is None else unpermute_rows(data, heads)))
        self._release(name)
        return out

    def rows_into(self, name: str, idx: torch.Tensor, out: torch.Tensor):
        if self.kind(name) in _PLAIN and out.dtype == _TORCH[self.kind(name)] and len(idx):
            torch.index_select(self._view(name), 0, idx, out=out)  # straight into place
            self._release(name)
        else:
            super().rows_into(name, idx, out)

    def columns(self, name: str, idx: torch.Tensor, dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape(name)
        out = torch.empty(len(idx), n, dtype=dtype) if out is None else out
        if len(idx) == 0:
            return out
        plain = self.kind(name) in _PLAIN
        step = max(1, self.COLUMN_CHUNK_BYTES // (4 * k))
        if plain:  # a chunk of rows in place, its columns gathered along each row
            step, view = max(1, step // 16), self._view(name)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            chunk = view[lo:hi] if plain else self._dequantize(name, self._data(name)[lo:hi])
            out[:, lo:hi] = chunk.index_select(1, idx).t()
        self._release(name)
        return out

    def kquant_rows(self, name: str, rows: tuple[int, int] | None = None,
                    cols: tuple[int, int] | None = None) -> tuple[torch.Tensor, str] | None:

        if self.kquant is not None:  # a converted copy: the original's
            return super().kquant_rows(name, rows, cols)
        st = self._stored(name)
        if st.kind not in KQUANT_LAYOUTS:
            return None
        unit = 256 if st.kind.endswith("_K") else 32  # a row is whole blocks (K-quant: of 256)
        c0, c1 = cols or (0, st.shape[-1])
        if c0 % unit or c1 % unit:
            return None
        lo, hi = rows or (0, st.shape[0])
        heads = self._heads(name)
        order = torch.arange(st.shape[0])
        order = order if heads is None else unpermute_rows(order, heads)  # q, k: the model's order
        per = st.nbytes // st.shape[0] // (st.shape[-1] // unit)  # bytes of one block
        data = self._data(name)[order[lo:hi].numpy(), c0 // unit * per:c1 // unit * per]
        self._release(name)
        return torch.from_numpy(np.ascontiguousarray(data)), st.kind

    def q4(self, name: str):
        st = self._stored(name)
        if st.kind not in Q4_TYPES:
            return super().q4(name)
        n, k = st.shape
        blocks = q4_split(st.kind, n, k, self._data(name))
        self._release(name)
        heads = self._heads(name)
        return blocks if heads is None else tuple(unpermute_rows(b, heads) for b in blocks)

    def q4_part(self, name: str, rows: tuple[int, int], cols: tuple[int, int]):
        st = self._stored(name)
        (r0, r1), (c0, c1) = rows, cols
        if st.kind not in Q4_TYPES or self._heads(name) is not None or c0 % 32 or c1 % 32:
            return super().q4_part(name, rows, cols)
        per = st.nbytes // (st.shape[0] * st.shape[1] // 32)  # bytes of one block
        data = self._data(name)[r0:r1, c0 // 32 * per:c1 // 32 * per]  # only these bytes
        blocks = q4_split(st.kind, r1 - r0, c1 - c0, np.ascontiguousarray(data))
        self._release(name)
        return blocks

    def close(self):
        self._maps = {}


def load_gguf(path: Path, dtype, with_weights: bool, keep_int4: bool) -> Checkpoint:
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(path, f"unknown architecture {arch!r} "
                             f"(supported: {', '.join(GGUF_ARCHS)})")
    pwri = reader.magic == b"PWRI"
    original = original_of(path) if SOURCE_KEY in meta else None
    own = {t.name: t for t in reader.tensors}
    taken = _taken_from_original(path, meta, original, own)
    tensors = {**taken, **own}
    args = _gguf_args(path, arch, meta, tensors, pwri)
    permuted = GGUF_ARCHS[arch][1]
    names, found, extra = _gguf_tensor_table(arch, args, tensors)
    table = {c: Stored(t.tensor_type.name, tuple(int(x) for x in reversed(t.shape)),
                       int(t.data_offset), int(t.n_bytes), int(t.name in taken))
             for c, t in found.items()}
    table = split_fused(table, args, lambda st, sub, lo, hi: _stored_rows(st, lo, hi))
    source = GGUFSource(path, table, args if permuted else None, (original,) if taken else ())
    source.kquant = _kquant_source(original, found, args if permuted else None)
    weights, q4 = _gguf_weights(source, dtype, keep_int4) if with_weights else ({}, {})
    info = {"format": "PWRI" if pwri else "GGUF", "gguf_arch": arch,
            "file_bytes": path.stat().st_size + sum(int(t.n_bytes) for t in taken.values()),
            "n_params": sum(int(np.prod(t.shape)) for n, t in tensors.items() if n in names),
            "tensor_types": dict(Counter(t.tensor_type.name for t in tensors.values())),
            # the projections read in their own blocks with int4 (`kquant_rows`): a converted
            # copy's original's K-quant ones, a plain file's Q8_0 ones
            "original": original.name if original is not None else None,  # (of a copy)
            "kquant_types": dict(Counter(
                st.kind for c, st in (source.kquant or source).table.items()
                if st.kind in KQUANT_LAYOUTS and c != "embed")),
            "ffn_type": source.kind("0.up") if "0.up" in source.names else None,
            "name": meta.get("general.name", path.stem)}
    return Checkpoint(path, args, weights, ("gguf", meta), info, extra, q4, source)


def _gguf_args(path: Path, arch: str, meta: dict, tensors: dict, pwri: bool) -> ModelArgs:
    """The model's shape and switches from a GGUF file's metadata (`{arch}.*` keys) and which
    tensors it holds; ModelLoadError for what is not supported."""
    default_act = GGUF_ARCHS[arch][0]
    if pwri and arch == "llama":
        default_act = "reglu"  # the original runs a PWRI file's LLaMA FFN as relu(gate) * up

    def key(name, default=None):
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise ModelLoadError(path, f"missing metadata key {arch}.{name}")
        return v

    n_heads = int(key("attention.head_count"))
    dim = int(key("embedding_length"))
    n_vocab = len(meta.get("tokenizer.ggml.tokens", ())) or int(tensors["token_embd.weight"].shape[1])
    head_dim = int(meta.get(f"{arch}.attention.key_length", dim // n_heads))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(path, f"partial rotary embedding ({rope_dims} of {head_dim} dims) "
                             "is not supported")
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(path, "RoPE frequency factors (rope_freqs.weight) are not supported")
    if float(meta.get(f"{arch}.final_logit_softcapping", 0) or 0) > 0 or \
            float(meta.get(f"{arch}.attn_logit_softcapping", 0) or 0) > 0:
        raise ModelLoadError(path, "logit soft-capping is not supported")
    act = str(meta.get("powerinfer.ffn_activation", default_act))
    n_layers = int(key("block_count"))
    falcon, gemma = arch == "falcon", arch == "gemma3"
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    extra_args = {}
    if gemma:
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # per layer: whether it slides
            pattern = _pattern_of([bool(x) for x in pattern], path)
        extra_args = dict(
            swa_pattern=int(pattern) if window else 0, qk_norm=True, post_norms=True,
            embed_scale=dim ** 0.5,
            rope_base_local=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)) if window else 0.0,
            # gemma_pytorch's rule, as llama.cpp's: 27B scales by dim / heads, the others by head_dim
            attn_scale=(dim / n_heads) ** -0.5 if n_layers == 62 else head_dim ** -0.5)
    elif arch == "qwen3":
        extra_args = dict(qk_norm=True)
    elif falcon:
        extra_args = dict(parallel=True, layer_norm=True)
    eps = (float(key("attention.layer_norm_epsilon")) if falcon
           else float(key("attention.layer_norm_rms_epsilon")))
    return ModelArgs(
        arch="llama", vocab_size=int(meta.get(f"{arch}.vocab_size", n_vocab)), dim=dim,
        n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        ffn_dim=int(key("feed_forward_length")), head_dim=head_dim, ffn_act=act,
        norm_eps=eps, rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(path, arch, meta, tensors),
        max_seq_len=int(meta.get(f"{arch}.context_length", 2048)),
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        sliding_window=window, tie_embeddings="output.weight" not in tensors, **extra_args,
    )


def _gguf_tensor_table(arch: str, args: ModelArgs, tensors: dict) -> tuple[dict, dict, dict]:
    """The file's tensors by the model's canonical names: (the GGUF name -> canonical names
    map, canonical name -> tensor, and the tensors no canonical name takes, read on demand by
    whoever needs them, e.g. the sparse bundle)."""
    renames = dict(GGUF_RENAMES.get(arch, {}))
    if arch == "falcon":  # Falcon-40B: attention reads attn_norm_2, the FFN attn_norm; Falcon-7B: one norm
        two = "blk.0.attn_norm_2.weight" in tensors
        for end, suffix in (("weight", ""), ("bias", "_b")):
            renames[f"{{i}}.attn_norm{suffix}"] = f"blk.{{i}}.attn_norm{'_2' if two else ''}.{end}"
            renames[f"{{i}}.ffn_norm{suffix}"] = f"blk.{{i}}.attn_norm.{end}"
    names = expand_names(GGUF, args.n_layers, renames)
    found, extra = {}, {}
    for name, t in tensors.items():
        canons = names.get(name)
        if canons is None:
            extra[name] = t
        for canon in canons or ():
            found[canon] = t
    for i in range(args.n_layers):  # PWRI files hold the down projection transposed
        down_t = extra.get(f"blk.{i}.ffn_down_t.weight")
        if down_t is not None:
            found[f"{i}.down_t"] = down_t
    return names, found, extra


def _gguf_weights(source: "GGUFSource", dtype, keep_int4: bool) -> tuple[dict, dict]:
    """Every tensor in `dtype` (a transposed down projection turned back: `LazyWeights`, which
    the lazy reads go through), and with keep_int4 the 4-bit ones' blocks as they are
    (`q4_split`)."""
    lazy = LazyWeights(source, dtype)
    weights = {canon: lazy[canon] for canon in lazy}
    q4 = {canon: source.q4(canon) for canon in weights  # (a down turned back: not as stored)
          if canon in source.names and source.kind(canon) in Q4_TYPES} if keep_int4 else {}
    return weights, q4


def _taken_from_original(path: Path, meta: dict, original: Path | None, own: dict) -> dict:
    """For a converted copy that holds only the tensors it converted (`convert.converted`):
    the original's other tensors, by name, which the copy's model reads from there; else {}."""
    if not meta.get(CONVERTED_ONLY_KEY):
        return {}
    if original is None:
        made_from = meta.get(SOURCE_KEY, "").rsplit(":", 2)[0]
        raise ModelLoadError(path, "a converted copy that holds only the tensors it converted; "
                             f"the file it was made from ({made_from}) is no longer beside it "
                             "unchanged: load that file, and the copy is made again")
    return {t.name: t for t in open_gguf(original).tensors if t.name not in own}


def _kquant_source(original: Path | None, found: dict, permute_args) -> "GGUFSource | None":
    """For a converted copy (`convert.converted`) whose original is still beside it: the
    original's tensors stored in Q4_K or Q6_K (the kernel's q4kx16/q6kx16 GEMVs read them as
    they are), under the copy's canonical names; else None."""

    if original is None:
        return None
    by_name = {t.name: t for t in open_gguf(original).tensors}
    table = {}
    for canon, t in found.items():
        o = by_name.get(t.name)
        if o is not None and o.tensor_type.name in KQUANT_LAYOUTS and tuple(o.shape) == tuple(t.shape):
            table[canon] = Stored(o.tensor_type.name, tuple(int(x) for x in reversed(o.shape)),
                                  int(o.data_offset), int(o.n_bytes))
    return GGUFSource(original, table, permute_args) if table else None


def _stored_rows(st: Stored, lo: int, hi: int) -> Stored:
    """Rows lo:hi of a stored tensor (whole rows of blocks: a row range is a byte range)."""
    row = st.nbytes // (st.shape[0] if len(st.shape) > 1 else 1)
    if len(st.shape) == 1:  # a fused bias: elements lo:hi of plain numbers
        item = st.nbytes // st.shape[0]
        return Stored(st.kind, (hi - lo,), st.offset + lo * item, (hi - lo) * item, st.file)
    return Stored(st.kind, (hi - lo, *st.shape[1:]), st.offset + lo * row, (hi - lo) * row,
                  st.file)


def _pattern_of(slides: list[bool], path) -> int:
    """The period p of a per-layer sliding pattern where layer i is full iff i % p == p - 1."""
    for p in range(1, len(slides) + 2):
        if all(s == (i % p < p - 1) for i, s in enumerate(slides)):
            return p
    raise ModelLoadError(path, f"sliding-window layers {slides} follow no supported pattern")


def _gguf_rope_scaling(path, arch: str, meta: dict, tensors: dict) -> tuple | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if "rope_factors_long.weight" in tensors:  # Phi-3's long-context RoPE
        long, short = (np.asarray(dequantize(tensors[n]), dtype=np.float64).reshape(-1).tolist()
                       for n in ("rope_factors_long.weight", "rope_factors_short.weight"))
        original = int(meta.get(f"{arch}.rope.scaling.original_context_length", 4096))
        factor = int(meta.get(f"{arch}.context_length", original)) / original
        mscale = meta.get(f"{arch}.rope.scaling.attn_factor")
        if mscale is None:
            mscale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        return ("longrope", tuple(short), tuple(long), original, float(mscale))
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return ("linear", float(meta[f"{arch}.rope.scaling.factor"]))
    raise ModelLoadError(path, f"unsupported rope scaling {kind!r}")
