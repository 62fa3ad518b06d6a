"""A checkpoint as the loaders give it: canonical tensor names, `Checkpoint`, `ModelFile`,
and `TensorSource`, its tensors read on demand (whole, rows or columns)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .args import ModelArgs

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


def tensor_types(info: dict) -> str:
    """A checkpoint's tensor types with their counts, most first ("Q4_1 210, F32 61, Q8_0 1"),
    and for a converted copy the file it was made from and its blocks the kernel reads as they
    are ("Q8_0 58, F32 17; from m.gguf, whose Q5_K 49, Q6_K 9 a 4-bit load reads in their own
    bits")."""
    def listed(counts: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))

    out = listed(info.get("tensor_types", {})) or "unknown"
    if info.get("original") and info.get("kquant_types"):
        out += (f"; from {info['original']}, whose {listed(info['kquant_types'])} a 4-bit load "
                "reads in their own bits")
    return out


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

    def mapped_rows(self, name: str) -> torch.Tensor | None:
        """Every row of a block-quantized tensor as a read-only view of the file's own pages,
        (n, row bytes) uint8, in the file's row order: nothing copied, and only the rows read
        later become resident (shared with every process that maps the file). None where the
        source has no such view or the tensor is not stored in blocks."""
        return None

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


class LazyWeights(Mapping):
    """A TensorSource as the name -> tensor mapping `Transformer.load_weights` reads: each
    tensor is read (and dequantized to `dtype`) when asked for, and not kept. A down projection
    the file stores only transposed (`down_t`: PowerInfer's own files) reads as `down`, turned
    back, as the eager read's dict holds it."""

    def __init__(self, source: TensorSource, dtype: torch.dtype):
        self.source, self.dtype = source, dtype

    def _stored_as(self, name: str) -> str | None:
        """The source's name of `name` (its `down_t` for a down it stores only transposed), or
        None where it has none."""
        if name in self.source.names and not name.endswith(".down_t"):
            return name
        t = name + "_t"
        if name.endswith(".down") and t in self.source.names:
            return t
        return None

    def __getitem__(self, name: str) -> torch.Tensor:
        stored = self._stored_as(name)
        if stored is None:
            raise KeyError(name)
        w = self.source.get(stored, self.dtype)
        return w if stored == name else w.t().contiguous()

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and self._stored_as(name) is not None

    def __iter__(self):
        for n in self.source.names:
            if not n.endswith(".down_t"):
                yield n
            elif n[:-2] not in self.source.names:
                yield n[:-2]

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def shape(self, name: str) -> tuple[int, ...]:
        stored = self._stored_as(name)
        if stored is None:
            raise KeyError(name)
        shape = tuple(self.source.shape(stored))
        return shape if stored == name else shape[::-1]

    def read_into(self, name: str, out: torch.Tensor):
        stored = self._stored_as(name)
        if stored is None:
            raise KeyError(name)
        if stored == name:
            self.source.read_into(name, out)
        else:
            out.copy_(self.source.get(stored, out.dtype).t())
