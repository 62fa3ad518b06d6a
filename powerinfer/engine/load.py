"""A whole model built for one process: what the in-process engine runs (`PowerInfer` with
`runtime="local"`), and what a one-executor actor group's executor runs (`Config(cold_executors=0)`:
the same model over the group's shared-memory plane). `whole_model` reads the file's tensors
into it (as each is needed, from a GGUF file on the CPU; else from a checkpoint read whole),
keeps the 4-bit configuration's blocks as the file stores them, applies a bundle's sparse plan
and input sparsity, and counts the KV pool's blocks."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import kernels
from ..config import Config
from ..errors import ModelLoadError
from ..formats.loader import load_checkpoint
from ..formats.source import Checkpoint, LazyWeights, ModelFile
from ..formats.tokenizer import Tokenizer
from ..model.load import build_model
from ..model.quant import apply_int4, apply_kernel_linears, neuron_format
from ..model.sparse import offload_ffns
from ..model.transformer import Transformer
from .batching import context_length
from .budget import plan_for
from .kv import planned_blocks, pool_blocks
from .partial import (StoredQ4, deferred_model, keep_device_blocks, keep_kquant_blocks,
                      keep_stored_blocks)
from .plan import input_thresholds, log_input_sparsity

log = logging.getLogger("powerinfer")


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer | None  # (None where the caller asked for none)
    pool: tuple[int, str]  # the KV pool's blocks for this process alone, and why (`pool_blocks`)
    sparse: bool  # a bundle's sparse plan runs: decode rows compute their predicted neurons
    input_sparsity: dict | None  # the bundle's record of its thresholds where they are on


def read_in_place(ck: Checkpoint, config: Config) -> bool:
    """Whether the model is built from the file's tensors as it needs them, each read straight
    into its parameter (`deferred_model`; the 4-bit configuration's blocks never widened): a
    GGUF file on the CPU. Elsewhere (a Hugging Face folder, a file that stores down transposed,
    a GPU, the Triton kernels on the CPU) every tensor is read first, then the model built from
    them."""
    return (config.torch_device.type == "cpu" and not kernels.TRITON_ON_CPU
            and ck.source is not None and ck.info.get("format") == "GGUF"
            and not any(n.endswith(".down_t") for n in ck.source.names))  # (transposed: eager)


@contextmanager
def load_errors(ck: Checkpoint):
    """A failure while reading the file's tensors into the model, as `load_checkpoint` reports
    one: a ModelLoadError naming the file (a missing or misshapen tensor, a corrupt block)."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - a library's error deep in a read: keep its text
        raise ModelLoadError(ck.path, str(e) if isinstance(e, ValueError)
                             else f"{type(e).__name__}: {e}") from e


def checkpoint_of(mf: ModelFile, config: Config) -> Checkpoint:
    """The checkpoint `whole_model` reads for a file whose header was parsed elsewhere (an actor
    group's driver): the header alone where `read_in_place`, else the file read whole."""
    ck = Checkpoint(mf.path, mf.args, {}, None, dict(mf.info), source=mf.source)
    if read_in_place(ck, config):
        return ck
    mf.source.close()
    return read_whole(mf.path, config)


def read_whole(path, config: Config) -> Checkpoint:
    """The file's tensors read, for a model built from them (not `read_in_place`): widened to
    the model's type, a 4-bit file's blocks kept packed where the CPU kernel runs them."""
    return load_checkpoint(path, config.torch_dtype, with_weights=True,
                           keep_int4=config.weights == "int4" and config.torch_device.type == "cpu")


def whole_model(checkpoint: Checkpoint, config: Config, tokenizer: bool = True,
                input_sparsity: bool = True, plan: bool = True) -> LoadedModel:
    """The model of `checkpoint` (its header alone where `read_in_place`, else its tensors read)
    for a resolved `config`; without its tokenizer, without the thresholds of
    `config.input_sparsity` (a caller that attaches its own), or without a sparse plan or a
    placement (a caller that has decided there is none), where asked."""
    device = config.torch_device  # a ConfigError of its own, not a load error
    context = context_length(checkpoint.args, config)
    gpu, elt = device.type == "cuda", config.torch_dtype.itemsize
    kv_blocks, why = pool_blocks(checkpoint.args, config, context, elt, gpu)
    planned = planned_blocks(kv_blocks, checkpoint.args, config, context, elt, gpu)
    plan = plan_for(config, checkpoint.args, checkpoint.path, planned * config.block_size,
                    on_gpu=gpu, checkpoint=checkpoint) if plan else None
    in_place = not checkpoint.weights and read_in_place(checkpoint, config)
    later = set()  # tensors the 4-bit configuration reads as blocks or after
    tok = None
    if not in_place:
        model, tok = build_model(checkpoint, config.torch_dtype, device, tokenizer)
    else:
        with load_errors(checkpoint):
            model, later = deferred_model(
                checkpoint, config.torch_dtype, blocks=config.weights == "int4",
                ffn=plan is not None and plan.bundle is not None)
            if tokenizer:
                tok = Tokenizer.from_source(checkpoint.tokenizer_source)
    if plan is not None and plan.bundle is not None:  # the in-process sparse engine
        plan.apply(model, fmt=neuron_format(config.weights, checkpoint.info,
                                            model.tok_embeddings.weight))
    elif plan is not None and device.type == "cuda":  # layer offload
        offload_ffns(model, plan.hot)
    # the 4-bit matrices run on the CPU kernel; where the Triton kernels run (a GPU) int4 is the
    # neuron sets' records above and the matrices' blocks below
    triton = kernels.on_triton(model.norm.weight)
    int4 = config.weights == "int4" and device.type == "cpu" and not triton
    # a K-quant file's Q4_K/Q6_K projections in their own bytes, then the 4-bit rest
    kept = keep_kquant_blocks(model, checkpoint.source) if int4 else 0
    if int4 and later:  # the file's 4-bit blocks, read as each projection is placed
        checkpoint.q4 = StoredQ4(checkpoint.source)
    if int4 and not apply_int4(model, checkpoint.q4) and not kept:
        raise ModelLoadError(checkpoint.path, "weights='int4' needs a GGUF file with "
                                              "Q4_0/Q4_1 projections")
    if int4:  # the file's Q8_0 blocks (projections, embedding) kept
        keep_stored_blocks(model, checkpoint.source, config.torch_dtype)
    elif config.weights == "int4" and triton:
        # a GPU's matrices in the file's blocks, for the Triton kernels (its neuron sets are
        # `plan.apply`'s records above)
        keep_device_blocks(model, checkpoint.source, config.torch_dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # (the widened matrices they replace)
    if later:  # what no block format took: widened now, as the eager load does
        with load_errors(checkpoint):
            model.load_weights(LazyWeights(checkpoint.source, config.torch_dtype),
                               skip=lambda n: n not in later)
    if in_place:
        # the pool's automatic share of the available memory, counted once the model is
        # resident (above, before it was read; its plan on the CPU places nothing by it)
        kv_blocks, why = pool_blocks(checkpoint.args, config, context, elt, gpu)
    apply_kernel_linears(model, head="q8_0" if int4 else "bf16")  # what is left in bf16
    checkpoint.q4 = {}  # the model holds them now
    return LoadedModel(model, tok, (kv_blocks, why),
                       plan is not None and plan.bundle is not None,
                       apply_input_sparsity(model, config, int4, checkpoint.path)
                       if input_sparsity else None)


def apply_input_sparsity(model, config: Config, int4: bool, model_path) -> dict | None:
    """Input sparsity from `config.input_sparsity` (see Config, `plan.input_thresholds`): the
    bundle's thresholds attached to the model's 4-bit projections (`input_sparsity.attach`).
    Returns the bundle's record of them (target, quality) where it is on, else None."""
    got = input_thresholds(config, model_path, int4)
    if got is None:
        return None
    from ..sparsity import input_sparsity as isp
    thresholds, rec = got
    n, small, _ = isp.attach(model, thresholds, None, rec.get("target"))
    log_input_sparsity(rec, n, small, config, isp.MIN_ROWS)
    return rec
