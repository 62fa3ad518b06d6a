"""What a model's actor group is built from, decided once per engine: the configuration with
"auto" resolved for this host and file, the model's table (`ModelFile`) and tokenizer, the KV
pool's size and the sparse plan (a bundle's placement, input sparsity's thresholds).

Deciding reads the file's header, a K-quant file's converted copy (made once), the bundle and the
placement solver, all code that imports torch. A process that already has torch (the Python API's
`Config(runtime="actors")`) decides in place; one that does not (a served model's replica, which
only tokenizes and supervises) runs `prepare` as a one-off Ray task on its own node, in a worker
that exits after it, and keeps the replica free of torch's memory (about 0.15 GiB a model). The
table and the tokenizer come back as objects in Ray's store, owned by the caller, which passes them
to the group's actors as they are. The task's log lines come back with it and are logged by the
caller, so a replica's log still says what the load decided; its typed errors (a missing file, a
bad bundle) are raised as themselves."""
from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from powerinfer.config import Config
from powerinfer.engine.batching import context_length
from powerinfer.engine.kv import BlockManager, describe, planned_blocks, pool_blocks
from powerinfer.engine.plan import SparsePlan
from powerinfer.formats.args import ModelArgs

from .sealed import Sealed

log = logging.getLogger("powerinfer")


@dataclass
class Prepared:
    config: Config  # resolved
    args: ModelArgs
    path: Path
    kv_blocks: int
    max_seq: int
    plan: SparsePlan
    input_sparsity: dict | None  # the bundle's record of its thresholds, where they are on
    logged: list[tuple[int, str]]  # the decisions' log records (level, message), in order


def prepare(model: str, config: Config, gpu: bool):
    """(Prepared, the model's table, its tokenizer); gpu: the hot executor takes a GPU
    (`group.wants_gpu`, decided against the cluster by the caller). Each file's header is parsed
    once here (`parsed_once`): the load reads it four times over (the listing, the converted
    copy's and the original's, the table); Gemma 3's prepare 3.86 -> 3.01 s on an EPYC Milan
    (`benchmarks/load.py`)."""
    from powerinfer.formats.gguf import parsed_once

    with parsed_once():
        return _prepare(model, config, gpu)


def _prepare(model: str, config: Config, gpu: bool):
    from powerinfer.engine.budget import plan_for
    from powerinfer.engine.partial import dense_block
    from powerinfer.engine.plan import input_thresholds
    from powerinfer.errors import ModelLoadError
    from powerinfer.formats.loader import load_checkpoint
    from powerinfer.formats.q4 import has_q4
    from powerinfer.formats.source import tensor_types
    from powerinfer.formats.tokenizer import Tokenizer
    from powerinfer.model.convert import kernel_ready
    from powerinfer.sparsity.input_sparsity import MEASURE, MIN_ROWS

    # block types the CPU kernel cannot read (K-quants): a converted copy, made once
    ckpt = kernel_ready(load_checkpoint(model, with_weights=False), config)
    four_bit, kquant = has_q4(ckpt.info), bool(ckpt.info.get("kquant_types"))
    config = config.resolve(four_bit, kquant)  # every actor gets the decided configuration
    if config.cold_weights == "int4" and not (four_bit or kquant):
        raise ModelLoadError(ckpt.path, "cold_weights='int4' needs a GGUF file with Q4_0/Q4_1 "
                                        "or K-quant projections")
    log.info("%s: %s; the file's tensors: %s", ckpt.path.name, config.summary(),
             tensor_types(ckpt.info))
    tokenizer = Tokenizer.from_source(ckpt.tokenizer_source)
    context, elt = context_length(ckpt.args, config), config.torch_dtype.itemsize
    kv_blocks, why = pool_blocks(ckpt.args, config, context, elt, gpu)  # (a GPU's: the hot side's)
    max_seq = min(context, BlockManager(kv_blocks, config.block_size).capacity)
    log.info("KV cache: %s (%s), a sequence reaches %d positions",
             describe(kv_blocks, ckpt.args, config, elt), why, max_seq)
    planned = planned_blocks(kv_blocks, ckpt.args, config, context, elt, gpu)
    plan = (plan_for(config, ckpt.args, ckpt.path, planned * config.block_size, gpu, ckpt)
            or SparsePlan.dense(ckpt.args, dense_block(ckpt)))
    # input sparsity: the bundle's thresholds, applied by each executor to the 4-bit
    # projections it holds on the host (on a GPU host the hot side's widen: none there)
    got = input_thresholds(config, ckpt.path, config.weights == "int4" and not gpu)
    if got is not None:
        plan = replace(plan, inputs=(got[0], MIN_ROWS, got[1].get("target"), MEASURE))
    done = Prepared(config, ckpt.args, ckpt.path, kv_blocks, max_seq, plan,
                    None if got is None else got[1], [])
    return done, ckpt.model_file(), tokenizer


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[tuple[int, str]] = []

    def emit(self, record):
        self.records.append((record.levelno, record.getMessage()))


def _prepare_logged(model: str, config: Config, gpu: bool):
    """`prepare` in a worker of its own: its log records returned with what it decided (the
    caller logs them), the table and the tokenizer as separate objects."""
    lib = logging.getLogger("powerinfer")
    lib.setLevel(logging.INFO)
    lib.propagate = False  # (returned instead: not also printed by the worker)
    records = _Records()
    lib.addHandler(records)
    done, table, tokenizer = prepare(model, config, gpu)
    return replace(done, logged=records.records), Sealed.of(table), tokenizer


@functools.cache
def _remote():
    # (made once a process: Ray keeps each one made); its worker exits after the call
    return ray.remote(max_calls=1)(_prepare_logged)


def prepared(model: str, config: Config, gpu: bool):
    """(Prepared, the table (`Sealed`) and the tokenizer as objects in Ray's store (refs the caller owns),
    the tokenizer): `prepare`d here where this process has torch, else in a one-off task on
    this node."""
    if "torch" in sys.modules:
        done, table, tokenizer = prepare(model, config, gpu)
        return done, ray.put(Sealed.of(table)), ray.put(tokenizer), tokenizer
    task = _remote().options(
        num_cpus=0, num_returns=3, max_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                           soft=False))
    refs = task.remote(model, config, gpu)
    try:
        done = ray.get(refs[0])
    except RayTaskError as e:  # the load's own error (a typed PowerInferError), as itself
        # the other two returns hold the same error: read too, or Ray prints each with its
        # traceback as an unhandled error once they are dropped (after the load's own message)
        for ref in refs[1:]:
            try:
                ray.get(ref)
            except RayTaskError:
                pass
        raise e.cause if isinstance(e.cause, Exception) else e from None
    for level, message in done.logged:
        log.log(level, "%s", message)
    return done, refs[1], refs[2], ray.get(refs[2])
