"""The kernel library's native decode loops, and what Python hands them: each layer's weights as
the loops take them (`ffn_entry`, `attention_entry`: the actor runtime's cold executors answer
with them in `cold_serve`, its hot executor runs its share of a decode step in `hot_layers`), and
`NativeDecode`, a decode step whose layer loop is one C++ call, `hot_layers`: the in-process
engine's (no executors to exchange with) and the hot executor's, which runs its prompt steps
through it too where every layer is in 16-row group layouts (`NativeDecode.prompts`).

A decode step of a small model run by its modules is mostly per-op dispatch (SmolLM2: about 20
ops a layer, 30 layers); the loop runs the same operations in the same order (the norms, the
fused q/k/v product, RoPE and attention over the paged cache, the output product, the FFN's
products and activation, the residual adds, each rounded as the modules round), so a step's
values are the modules' own. It runs where every layer allows it (`native_model`, every
projection a kernel-library matrix without a bias); elsewhere the modules run.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..formats.args import ModelArgs
from ..model import sparse
from ..model.quant import KernelLinear, KQuantLinear, Q4Linear
from ..model.sparse import BlockSlice, HybridFFN, NeuronSet, ffn_w1
from ..model.transformer import FFN, KVTables, Transformer


def runs(m) -> list[tuple[torch.Tensor, int, int]] | None:
    """A projection as the native loops take it, per run of rows of one format: (its weights,
    -1 - the layout's code for a matrix of 16-row groups (-1 q4x16, -2 q4kx16, -3 q6kx16,
    -4 q8x16) or the kernel format's code, its rows); None for one they cannot run (a bias, or no
    kernel-library matrix). A KQuantLinear has a run per type (q and k in Q4_K, v in Q6_K), the
    others one."""
    if getattr(m, "bias", None) is not None:
        return None
    if isinstance(m, KQuantLinear):
        return [(getattr(m, name), -1 - kernels.LAYOUTS.index(layout), n) for name, n, layout in m.segments]
    if isinstance(m, Q4Linear):
        return [(m.packed, -1, m.out_features)]
    if isinstance(m, KernelLinear):
        return [(m.records, m.code, m.out_features)]
    return None


def matrix(m) -> tuple[torch.Tensor, int] | None:
    """A projection of one run (`runs`) as (its weights, format code), else None."""
    r = runs(m)
    return None if r is None or len(r) != 1 else r[0][:2]


_EMPTY = torch.empty(0, dtype=torch.uint8)


_NO_IDX = torch.empty(0, dtype=torch.int64)


# the entries of a layer a native loop leaves to Python (see ffn_entry, attention_entry)
NO_FFN = (_EMPTY, _EMPTY, 0, 0, 0, 0, _NO_IDX, 0.0)


NO_ATTENTION = (_EMPTY, 0, 0, _EMPTY, 0, 0, _EMPTY, 0, _EMPTY, _EMPTY)


def ffn_entry(s: nn.Module, threshold: float = 0.0) -> tuple | None:
    """A layer's neurons as the native loops take them: (w1, w2, kind, n, down's format, w1's,
    the neurons' indices in the layer, their threshold), kind 1 gate+up rows of 16-row groups and
    a down matrix (a block slice, or a whole dense FFN; n: its gate+up rows), 2 neuron records
    (n: their format; the indices select them from a predictor's masks); None for what they
    cannot run (a bias, no kernel layout)."""
    if isinstance(s, BlockSlice):
        w1, w2, plain = s.w1, s.down, s.up_b is None
    elif isinstance(s, FFN):
        w1, w2, plain = s.w1, s.w2, True  # (a bias: `runs` refuses it)
    elif isinstance(s, NeuronSet) and s.records is not None and s.bias32 is None:
        idx = s.idx.to(torch.int64).contiguous()
        if len(idx) > 1 and not bool((idx[1:] > idx[:-1]).all()):
            return None  # (the loops find a mask's neurons by a search: in order only)
        return (s.records, _EMPTY, 2, kernels.FORMATS.index(s.fmt), 0, 0, idx, float(threshold))
    else:
        return None
    if plain and (a := matrix(w1)) and a[1] < 0 and (b := matrix(w2)):
        return a[0], b[0], 1, w1.out_features, b[1], a[1], _NO_IDX, 0.0
    return None


def predicted_entry(f: HybridFFN) -> tuple | None:
    """A sparse layer's neurons with their predictor as `hot_layers` takes them in process (the
    decode step `HybridFFN` runs in one `kernels.predicted_ffn` call): (its `ffn_entry` of kind
    3, the records with the predictor's first matrix and the neurons' threshold; the predictor's
    second; the predictor's rule threshold; whether it reads the layer's input); None where the
    layer's step is not that call (see `HybridFFN.predicted_records`) or has a bias."""
    found = f.predicted_records()
    if found is None or f.down_b is not None:
        return None
    s, preds, (fc1, fc2, fmt) = found
    if s.bias32 is not None or not kernels.usable(s.records):
        return None
    entry = (s.records, fc1, 3, kernels.FORMATS.index(s.fmt), kernels.pred_code(fmt), 0, _NO_IDX,
             float(f.threshold))
    return entry, fc2, float(preds.threshold), f.predictor_input == "layer"


def attention_entry(m: nn.Module) -> tuple | None:
    """A layer's heads (an `Attention`, or a share of its heads) as the native loops take them:
    (qkv, its format, rows, a second run of q/k/v rows or none, wo, its format, k cache, v
    cache); None where its projections are not runs `runs` takes (a bias, more than two runs)."""
    q, o = runs(m.wqkv), matrix(m.wo)
    if q is None or len(q) > 2 or o is None or m.kv_cache is None:
        return None
    return (*q[0], *(q[1] if len(q) > 1 else (_EMPTY, 0, 0)), *o, m.kv_cache.k, m.kv_cache.v)


def native_model(a: ModelArgs, dtype: torch.dtype) -> bool:
    """Whether `hot_layers` runs this model's layers, in process or in a hot executor: the LLaMA
    family, RMSNorm, sequential branches, heads of a multiple of 16, in float32 or bfloat16, on a
    CPU where the kernel library runs, with each layer's own variants (`layer_variants`: Gemma
    3's post-norms, sliding windows and local RoPE table, q/k norms)."""
    return (kernels.available() and a.outside_native_loop() is None
            and dtype in (torch.float32, torch.bfloat16))


VARIANTS = ("qk_norms", "post_norms", "layer_cos", "layer_sin", "layer_window")  # their order


def layer_variants(model: Transformer, dtype: torch.dtype) -> dict | None:
    """`hot_layers`' keyword arguments for the layers' own variants (none for a uniform model):
    q/k norms and post-norms two a layer (an empty tensor where a layer has none), each layer's
    RoPE table and window; None where a norm is not one the loop computes (`rms_weight`)."""
    a, out = model.args, {}
    own = lambda b: getattr(b.attn, "own", b.attn)  # noqa: E731 - (a share of the heads: its own)
    for key, on, pairs in (("qk_norms", a.qk_norm, lambda b: (own(b).q_norm, own(b).k_norm)),
                           ("post_norms", a.post_norms, lambda b: (b.post_attn_norm, b.post_ffn_norm))):
        if on:
            ws = [rms_weight(n, dtype) for b in model.layers for n in pairs(b)]
            if any(w is None for w in ws):
                return None
            out[key] = ws
    if not a.uniform:
        local = [a.local(i) for i in range(a.n_layers)]
        out["layer_cos"] = [model.rope_cos_local if x else model.rope_cos for x in local]
        out["layer_sin"] = [model.rope_sin_local if x else model.rope_sin for x in local]
        out["layer_window"] = [a.window(i) for i in range(a.n_layers)]
    return out


def rms_weight(norm: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """An RMSNorm's weight where the loop computes it as the module does (`Norm` in the model's
    type), else None."""
    if getattr(norm, "layer_norm", True) or norm.weight.dtype != dtype:
        return None
    return norm.weight


class NativeDecode:
    """`Transformer.forward` of a decode step (one token a sequence), or where `prompts` of a
    prompt step (chunks and decode rows, tokens (1, N)), with its layer loop in C++:
    `exchange` are `hot_layers`' channel arguments (the actor runtime's hot executor) or none (in
    process), `layers` its per-layer ones (norms, eps, the FFN and attention entries' columns,
    heads, RoPE tables, window, scale)."""

    def __init__(self, model: Transformer, exchange: tuple, layers: tuple, variants: dict | None = None):
        # (the layers' variants: none where the caller gives none)
        variants = {k: [] for k in VARIANTS} | (variants or {})
        self.model, self.args = model, (*exchange, *layers, *(variants[k] for k in VARIANTS))
        self.input_sparse = ([], [], None)  # no input sparsity unless `of` finds it
        # a predictor actor's masks read in the loop (the hot executor's `predict`): decode steps
        # of any width (64 rows a records call), a prompt's step computing every neuron
        self.masked = bool(exchange[6])
        kinds, _, down, w1, _, _, qkv, qkv_fmt, _, qkv2, qkv2_fmt, _, _, wo_fmt = layers[5:19]
        # the sparse layers whose neurons and predictor the loop runs (kind 3), with what it took
        # of each: a step leaves them to the modules once one of those changes (another mask
        # source, neuron sets or threshold), or while one records `stats`, or with
        # sparse.FUSED_DECODE off (the modules' ops one at a time), or past the kernel's rows
        self.sparse = [(b.ffn, _parts(b.ffn)) for b, k in zip(model.layers, kinds) if k == 3]
        # whether a prompt's step runs here too: every layer's neurons and heads in 16-row group
        # layouts, whose GEMVs the Python modules run for any number of rows as well (the C++
        # check: prompt_rows_ffn, prompt_rows_attention)
        # (a hot executor's neuron records beside a predictor, kind 2: every record, the prompt
        # product `records_rows`, as the neuron set's module computes a prompt's rows)
        self.prompts = all(k in (0, 2) or (k == 1 and d < 0 and w < 0)
                           for k, d, w in zip(kinds, down, w1)) and all(
            not q.numel() or (f < 0 and (not q2.numel() or f2 < 0) and o < 0)
            for q, f, q2, f2, o in zip(qkv, qkv_fmt, qkv2, qkv2_fmt, wo_fmt))

    @classmethod
    def of(cls, model: Transformer) -> "NativeDecode | None":
        """The in-process engine's: a whole model on the CPU whose every layer `hot_layers` runs
        (its full attention, a dense FFN of 16-row groups), else None."""
        a, dtype = model.args, model.norm.weight.dtype
        if model.norm.weight.device.type != "cpu" or not native_model(a, dtype) or \
                getattr(model, "rope_cos", None) is None or model.rope_cos.dtype != torch.float32:
            return None
        variants = layer_variants(model, dtype)
        if variants is None:
            return None
        # a sparse layer (`HybridFFN`) holds its FFN norm, the block an identity in its place
        layers = layer_args(a, dtype, [(b.attn_norm, b.ffn.norm if isinstance(b.ffn, HybridFFN) else b.ffn_norm,
                                        b.ffn, 0.0, b.attn) for b in model.layers],
                            model.layers[0].attn.n_heads, model.rope_cos, model.rope_sin)
        exchange = (0, 0, [], [], 0.0, [0, 0, 0], [], None)  # no channels, no executors, no predictor
        if layers is None:
            return None
        step = cls(model, exchange, layers, variants)
        step.input_sparse = input_sparse_args([(b.attn, b.ffn) for b in model.layers],
                                              getattr(model, "input_sparse_stats", None))
        return step

    def __call__(self, tokens, pos, kv: KVTables, last):
        # tokens (B, 1): a decode step; (1, N): a prompt step (its chunks and decode rows, as the
        # modules take it), where `prompts` allows one; last: the sampled rows of the N
        m, (B, T) = self.model, tokens.shape
        if self.sparse and not self._sparse_ok(B * T):
            return m(tokens, pos, kv, last)
        m.rope_ensure(pos)  # (the loop reads the tables' rows at these positions)
        h = m.tok_embeddings(tokens)
        if m.args.embed_scale:
            h = h * torch.tensor(m.args.embed_scale, dtype=h.dtype)
        h = torch.ops.powerinfer.hot_layers(h.reshape(B * T, -1), pos.reshape(-1), kv.starts, kv.tables,
                                            *self.args, T > 1, *self.input_sparse)[last].unsqueeze(1)
        if h.shape[0] == 0:  # nothing sampled this step
            return h.new_zeros(0, 1, m.args.vocab_size, dtype=torch.float32)
        return m.output(m.norm(h)).float()

    def _sparse_ok(self, rows: int) -> bool:
        return sparse.FUSED_DECODE and rows <= kernels.MAX_ROWS and all(
            f.stats is None and all(a is b for a, b in zip(_parts(f), parts)) for f, parts in self.sparse)


def input_sparse_args(layers, stats: torch.Tensor | None) -> tuple:
    """`hot_layers`' (or `cold_serve`'s) input-sparsity arguments for decode steps: per layer
    (`layers`: its attention and its FFN modules, either None) the q4c copies
    (`InputSparse.sparsify_input`) of q/k/v, of the output projection, of a gate+up that
    computes every neuron (a dense FFN's, a block slice's) and of q/k/v's second run of rows (a
    Q4_K_M file's Q6_K v: `KQuantLinear.sparse_rest`) with their thresholds (an empty tensor and 0
    where that input stays dense), and `stats`, the counter of the channels kept and seen; empty
    where no projection has a copy."""
    copies, thresholds = [], []
    for attn, ffn in layers:
        wqkv = getattr(attn, "wqkv", None)
        mods = (wqkv, getattr(attn, "wo", None), None if ffn is None else ffn_w1(ffn))
        for m in mods:
            sparse = getattr(m, "sparse", None)
            copies.append(_EMPTY if sparse is None else sparse[0])
            thresholds.append(0.0 if sparse is None else sparse[2])
        rest = getattr(wqkv, "sparse_rest", None) if getattr(wqkv, "sparse", None) else None
        second = rest[0] if rest and len(rest) == 1 else None  # (the loop takes one second run)
        copies.append(_EMPTY if second is None else second[0])
        thresholds.append(0.0 if second is None else wqkv.sparse[2])
    if not any(c.numel() for c in copies):
        return [], [], None
    return copies, thresholds, stats


def _parts(f: HybridFFN) -> tuple:
    """What a sparse layer's step in the native loop took from its module (compared by identity)."""
    return f.masks, f.hot, f.cold, f.threshold, f.predictor_input, f.down_b


def layer_args(a: ModelArgs, dtype: torch.dtype, layers, n_heads: int, cos, sin) -> tuple | None:
    """`hot_layers`' arguments after its channels (the activation, norms and eps, the entries'
    columns, the heads, RoPE tables, window and scale, the predictors' (see `predicted_entry`))
    from each layer's (attention norm, FFN norm, the neurons this process computes or None for
    none, their threshold, its heads); None where a layer has a part the loop cannot run. The
    neurons may be a `HybridFFN` (in process): its neurons with their predictor."""
    norms, ffn, attn, fc2, rules = [], [], [], [], set()
    for attn_norm, ffn_norm, neurons, threshold, heads in layers:
        pair = [rms_weight(attn_norm, dtype), rms_weight(ffn_norm, dtype)]
        second = _EMPTY
        if isinstance(neurons, HybridFFN):
            p = predicted_entry(neurons)
            f = None if p is None else p[0]
            if p is not None:
                second = p[1]
                rules.add(p[2:])
        else:
            f = NO_FFN if neurons is None else ffn_entry(neurons, threshold)
        h = attention_entry(heads)
        if None in pair or f is None or h is None or len(rules) > 1:
            return None
        norms += pair
        ffn.append(f)
        attn.append(h)
        fc2.append(second)
    cols = lambda rows, j: [r[j] for r in rows]  # noqa: E731
    rule = rules.pop() if rules else (0.0, False)  # (one predictor for every layer)
    return (kernels.ACTS.index(a.ffn_act), norms, a.norm_eps, *(cols(ffn, j) for j in range(8)),
            *(cols(attn, j) for j in range(10)), n_heads, cos, sin, a.sliding_window, a.scale,
            fc2, *rule)
