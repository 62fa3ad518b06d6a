"""The Python API: `PowerInfer.from_pretrained(name_or_path, config=Config(...))`."""
from __future__ import annotations

import logging
import os
import queue
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from . import kernels
from .config import Config
from .engine.batching import context_length
from .engine.budget import plan_for
from .engine.inprocess import Engine, Event
from .engine.kv import pool_blocks
from .engine.partial import (LazyWeights, StoredQ4, deferred_model, keep_device_blocks,
                             keep_kquant_blocks, keep_stored_blocks)
from .engine.params import sampling_params
from .engine.plan import input_thresholds, log_input_sparsity
from .errors import ModelLoadError
from .formats.gguf import parsed_once
from .formats.loader import DEFAULT_MODEL, load_checkpoint
from .formats.q4 import has_q4
from .formats.source import Checkpoint, tensor_types
from .formats.tokenizer import Tokenizer
from .model.convert import kernel_ready
from .model.load import build_model
from .model.quant import apply_int4, apply_kernel_linears, neuron_format
from .model.sparse import offload_ffns
from .runtimes import engine_class

log = logging.getLogger("powerinfer")


Messages = list[dict]


class PowerInfer:
    """A loaded model with its tokenizer, ready to generate.

    Sampling keywords (all methods): max_new_tokens, temperature, top_k, top_p, min_p,
    repetition_penalty, seed, stop, stop_token_ids, ignore_eos, and grammar (a
    `powerinfer.engine.grammar.Grammar`: the output held to a JSON schema, a regex, choices or a Lark
    grammar, e.g. `grammar=Grammar.json_schema({...})`).
    """

    def __init__(self, checkpoint: Checkpoint, config: Config):
        config = config.resolve(bool(checkpoint.q4))  # already decided by from_pretrained
        self.config, self.checkpoint = config, checkpoint
        kernels.hold(config.cpu_isa)
        log.info("%s: %s; the file's tensors: %s", checkpoint.path.name, config.summary(),
                 tensor_types(checkpoint.info))
        if config.cpu_threads:
            torch.set_num_threads(config.cpu_threads)
        if config.runtime != "local":  # its processes load the weights; this one tokenizes
            self.model = None
            self.engine = engine_class(config.runtime)(str(checkpoint.path), config)
            self.tokenizer = self.engine.tokenizer
            self.input_sparsity = self.engine.input_sparsity
            return
        device = config.torch_device  # a ConfigError of its own, not a load error
        context = context_length(checkpoint.args, config)
        kv_blocks, why = pool_blocks(checkpoint.args, config, context, config.torch_dtype.itemsize)
        plan = plan_for(config, checkpoint.args, checkpoint.path, kv_blocks * config.block_size,
                        on_gpu=device.type == "cuda", checkpoint=checkpoint)
        in_place = not checkpoint.weights and _read_in_place(checkpoint, config)  # (`_load`)
        later = set()  # tensors the 4-bit configuration reads as blocks or after
        if not in_place:
            self.model, self.tokenizer = build_model(checkpoint, config.torch_dtype, device)
        else:
            with _load_errors(checkpoint):
                self.model, later = deferred_model(
                    checkpoint, config.torch_dtype, blocks=config.weights == "int4",
                    ffn=plan is not None and plan.bundle is not None)
                self.tokenizer = Tokenizer.from_source(checkpoint.tokenizer_source)
        if plan is not None and plan.bundle is not None:  # the in-process sparse engine
            plan.apply(self.model, fmt=neuron_format(config.weights, checkpoint.info,
                                                     self.model.tok_embeddings.weight))
        elif plan is not None and device.type == "cuda":  # layer offload
            offload_ffns(self.model, plan.hot)
        # the 4-bit matrices run on the CPU kernel; where the Triton kernels run (a GPU) int4
        # is the neuron sets' records above and the matrices' blocks below
        triton = kernels.on_triton(self.model.norm.weight)
        int4 = config.weights == "int4" and device.type == "cpu" and not triton
        # a K-quant file's Q4_K/Q6_K projections in their own bytes, then the 4-bit rest
        kept = keep_kquant_blocks(self.model, checkpoint.source) if int4 else 0
        if int4 and later:  # the file's 4-bit blocks, read as each projection is placed
            checkpoint.q4 = StoredQ4(checkpoint.source)
        if int4 and not apply_int4(self.model, checkpoint.q4) and not kept:
            raise ModelLoadError(checkpoint.path, "weights='int4' needs a GGUF file with "
                                                  "Q4_0/Q4_1 projections")
        if int4:  # the file's Q8_0 blocks (projections, embedding) kept
            keep_stored_blocks(self.model, checkpoint.source, config.torch_dtype)
        elif config.weights == "int4" and triton:
            # a GPU's matrices in the file's blocks, for the Triton kernels (its neuron sets are
            # `plan.apply`'s records above)
            keep_device_blocks(self.model, checkpoint.source, config.torch_dtype)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # (the widened matrices they replace)
        if later:  # what no block format took: widened now, as the eager load does
            with _load_errors(checkpoint):
                self.model.load_weights(LazyWeights(checkpoint.source, config.torch_dtype),
                                        skip=lambda n: n not in later)
        if in_place:
            # the pool's automatic share of the available memory, counted once the model is
            # resident (above, before it was read; its plan on the CPU places nothing by it)
            kv_blocks, why = pool_blocks(checkpoint.args, config, context,
                                         config.torch_dtype.itemsize)
        apply_kernel_linears(self.model, head="q8_0" if int4 else "bf16")  # what is left in bf16
        checkpoint.q4 = {}  # the model holds them now
        self.input_sparsity = apply_input_sparsity(self.model, config, int4, checkpoint.path)
        self.engine = Engine(self.model, self.tokenizer, config, (kv_blocks, why),
                             sparse=plan is not None and plan.bundle is not None)

    def input_sparsity_stats(self) -> tuple[int, int]:
        """Input sparsity so far (decode steps in this process): (input channels kept, channels
        seen) over every sparse projection; (0, 0) where it is off. In the actor runtime, the
        executors' counts added up."""
        if self.model is None:
            return self.engine.input_sparsity_stats()
        s = getattr(self.model, "input_sparse_stats", None)
        return (0, 0) if s is None else (int(s[0]), int(s[1]))

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike = DEFAULT_MODEL,
                        config: Config | None = None) -> "PowerInfer":
        """Load a GGUF file, a Hugging Face folder, or an installed model by short name."""
        with parsed_once():
            return cls._load(name_or_path, config or Config())

    @classmethod
    def _load(cls, name_or_path, config: Config) -> "PowerInfer":
        if config.runtime != "local" or "dense" != config.weights or config.dtype == "auto":
            # the file's header decides "auto"; block types the CPU kernel cannot read
            # (K-quants) are read from a converted copy, made once
            ck = kernel_ready(load_checkpoint(name_or_path, with_weights=False), config)
            name_or_path, config = ck.path, config.resolve(has_q4(ck.info))
            if config.runtime != "local":  # its processes load the weights
                return cls(ck, config)
        else:  # the header only, for what follows
            ck = load_checkpoint(name_or_path, with_weights=False)
        if _read_in_place(ck, config):  # read as the model is built (`deferred_model`)
            return cls(ck, config)
        return cls(load_checkpoint(name_or_path, config.torch_dtype, with_weights=True,
                                   keep_int4=config.weights == "int4"
                                   and config.torch_device.type == "cpu"), config)

    @property
    def args(self):
        return self.checkpoint.args

    def close(self):
        """Stop a runtime's processes (runtime "actors"); the in-process engine needs nothing."""
        if self.model is None:
            self.engine.shutdown()

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def generate(self, prompt: str | list[str], max_new_tokens: int = 128, **sampling) -> str | list[str]:
        """Complete a prompt (or a batch of prompts, decoded together) and return the text."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        texts = [""] * len(prompts)
        step = self.config.max_batch
        for start in range(0, len(prompts), step):
            chunk = prompts[start:start + step]
            for ev in self._run([self._ids(p) for p in chunk], max_new_tokens, sampling):
                texts[start + ev.index] += ev.text
        return texts[0] if isinstance(prompt, str) else texts

    def stream(self, prompt: str | Messages, max_new_tokens: int = 128, **sampling) -> Iterator[str]:
        """Yield text pieces as they are generated; `prompt` may be chat messages."""
        ids = self._ids(prompt)
        for ev in self._run([ids], max_new_tokens, sampling):
            if ev.text:
                yield ev.text

    def chat(self, messages: Messages, max_new_tokens: int = 128, **sampling) -> str:
        """Apply the model's chat template to `messages` and return the assistant's reply."""
        return "".join(self.stream(messages, max_new_tokens, **sampling))

    def _ids(self, prompt: str | Messages) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt))

    def _run(self, prompts: list[list[int]], max_new_tokens: int, sampling: dict) -> Iterator[Event]:
        params = sampling_params(max_tokens=max_new_tokens, **sampling)
        if self.model is None:
            return _concurrently(self.engine, prompts, params)
        seqs = [self.engine.new_sequence(p, params) for p in prompts]
        return self.engine.run(seqs)


def _read_in_place(ck: Checkpoint, config: Config) -> bool:
    """Whether the in-process model is built from the file's tensors as it needs them, each
    read straight into its parameter (`deferred_model`; the 4-bit configuration's blocks never
    widened): a GGUF file on the CPU. Elsewhere (a Hugging Face folder, a file that stores down
    transposed, a GPU, the Triton kernels on the CPU) every tensor is read first, then the model
    built from them."""
    return (config.runtime == "local" and config.torch_device.type == "cpu"
            and not kernels.TRITON_ON_CPU and ck.source is not None and ck.info.get("format") == "GGUF"
            and not any(n.endswith(".down_t") for n in ck.source.names))  # (transposed: eager)


@contextmanager
def _load_errors(ck: Checkpoint):
    """A failure while reading the file's tensors into the model, as `load_checkpoint` reports
    one: a ModelLoadError naming the file (a missing or misshapen tensor, a corrupt block)."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - a library's error deep in a read: keep its text
        raise ModelLoadError(ck.path, str(e) if isinstance(e, ValueError)
                             else f"{type(e).__name__}: {e}") from e


def _concurrently(engine, prompts: list[list[int]], params) -> Iterator[Event]:
    """The actor runtime's streams of several requests, interleaved as their events arrive."""
    q: queue.Queue = queue.Queue()

    def pump(i, ids):
        try:
            for ev in engine.generate(ids, params):
                q.put(Event(i, ev["text"], ev["token"], ev["finish_reason"]))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            q.put(e)
        q.put(None)

    threads = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for _ in threads:
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item


def apply_input_sparsity(model, config: Config, int4: bool, model_path) -> dict | None:
    """Input sparsity from `config.input_sparsity` (see Config, `plan.input_thresholds`): the
    bundle's thresholds attached to the model's 4-bit projections (`input_sparsity.attach`).
    Returns the bundle's record of them (target, quality) where it is on, else None."""
    got = input_thresholds(config, model_path, int4)
    if got is None:
        return None
    from .sparsity import input_sparsity as isp
    thresholds, rec = got
    n, small, _ = isp.attach(model, thresholds)
    log_input_sparsity(rec, n, small, config, isp.MIN_ROWS)
    return rec
