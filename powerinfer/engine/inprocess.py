"""The in-process engine: the batching core's steps (`batching.py`) run on a model in this
process, over a paged KV cache whose blocks persist between calls (a prompt's cached prefix is
reused by the next). Only its steps touch the model: the modules (`Engine._forward`), or the
native layer loop (`native.NativeDecode`) where it runs the model's steps."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..compat import compile_per_instance, trim_heap
from ..config import Config
from ..errors import InvalidRequestError
from ..formats.tokenizer import Tokenizer
from ..model.transformer import KVTables, Transformer
from .batching import Batcher, Sequence, context_length, new_sequence
from .kv import BlockManager, Blocks, describe, pool_blocks
from .native import NativeDecode
from .params import SamplingParams

log = logging.getLogger("powerinfer")


@dataclass(slots=True)
class Event:
    index: int  # which request of the batch
    text: str
    token: int  # -1 when the sequence ended without a new token (its context is full)
    finish_reason: str | None


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: Config,
                 pool: tuple[int, str] | None = None, sparse: bool = False):
        # pool: the KV cache's blocks and why (`kv.pool_blocks`), where the caller decided it;
        # sparse: the model's FFNs compute a decode row's predicted neurons only (`Step.parts`)
        self.model, self.tokenizer, self.config, self.sparse = model, tokenizer, config, sparse
        self.device = model.norm.weight.device
        context, elt = context_length(model.args, config), model.norm.weight.element_size()
        n, why = pool or pool_blocks(model.args, config, context, elt)
        self.blocks = BlockManager(n, config.block_size, config.prefix_cache)
        self.max_seq = min(context, self.blocks.capacity)
        # what bounds it, for a prompt that does not fit
        self.max_seq_by = "Config.max_seq_len" if context <= self.blocks.capacity else \
            f"the KV cache's size: {why}"
        log.info("KV cache: %s (%s); a sequence reaches %d positions",
                 describe(n, model.args, config, elt), why, self.max_seq)
        model.setup_pool(n, config.block_size, self.max_seq)
        self._decode = self._forward
        if config.compile:
            self._decode = compile_per_instance(self._forward, cpp_wrapper=self.device.type == "cpu")
        # otherwise decode steps run their layer loop in C++ where the model allows it
        self.native = None if config.compile else NativeDecode.of(model)
        self._prompt = self._forward
        if self.native is not None:
            self._decode = self.native
            # prompt steps in the loop too, where it takes them: its floats are then an actor
            # group's (whose executors run every step there). The modules' attention, norms and
            # activations part from the loop's in their last bits (float32: always; bf16: where
            # a rounding falls the other way, as GeGLU's exponential form makes it), and the
            # 4-bit kernel's 8-bit activations turn those into other 8-bit steps: SmolLM2's
            # float32 log-probabilities 0.1-0.3 apart after 30 layers, 13 of 24 prompts' greedy
            # tokens parted within 24 (benchmarks/logit_spread.py). The loop's prompt step is as
            # fast as the modules' or faster (benchmarks/prompt_loop.py).
            if self.native.prompts:
                self._prompt = self.native
        # the load's transients (dequantized rows, repacked blocks), freed, stay resident in
        # glibc's heap otherwise: about 400 MiB after Gemma 3 270M's load, as the executors found
        trim_heap()

    def new_sequence(self, prompt: list[int], params: SamplingParams) -> Sequence:
        return new_sequence(prompt, params, self.tokenizer, self.model.args.vocab_size, self.max_seq,
                            self.max_seq_by)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> Iterator[Event]:
        """Generate for the sequences together (max_batch at a time, as the cache's blocks
        allow); yields events as tokens arrive."""
        c = self.config
        batcher = Batcher(self.blocks, c.max_batch, self.max_seq, c.prefill_chunk, self.sparse,
                          c.prefill_pace)
        for i, s in enumerate(seqs):
            s.key = i
            batcher.add(s)
        try:
            while (step := batcher.schedule()) is not None:
                t0 = time.perf_counter()
                logits = torch.cat([self._step(part) for part in step.parts(self.sparse)])
                batcher.observe(step, time.perf_counter() - t0)
                for out in batcher.postprocess(step, logits):
                    if out.error:
                        raise InvalidRequestError(out.error)
                    yield Event(out.seq.key, out.text, out.token, out.finish_reason)
        finally:  # a caller that stops early (or an error) leaves no blocks held
            for s in [*batcher.running, *batcher.waiting]:
                batcher.remove(s)

    @torch.inference_mode()
    def logits(self, ids: list[int], every: bool = False) -> torch.Tensor:
        """The model's fp32 logits after a fresh prefill of `ids` (no cached prefix is reused nor
        kept): at its last position (vocab,), or at every position (T, vocab)."""
        held, T, dev = Blocks(), len(ids), self.device
        if T > self.max_seq or not self.blocks.grow(held, T):
            raise InvalidRequestError(f"{T} tokens do not fit the KV cache now")
        try:
            kv = KVTables(torch.tensor([0, T], device=dev),
                          torch.tensor([held.table], dtype=torch.int32, device=dev))
            out = self._forward(torch.tensor([ids], device=dev), torch.arange(T, device=dev)[None],
                                kv, None if every else torch.tensor([T - 1], device=dev))
        finally:
            self.blocks.release(held)
        return out[0] if every else out[0, -1]

    def _step(self, step) -> torch.Tensor:
        """A step's logits (K, vocab) on the CPU, one row per sampled sequence."""
        dev = self.device
        run = self._decode if step.decode else self._prompt
        t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731 - the step's numpy arrays
        self.model.rope_ensure(step.positions)  # (a compiled or native step reads them as they are)
        logits = run(t(step.tokens), t(step.positions), KVTables(t(step.starts), t(step.tables)),
                     t(step.last))
        return logits[:, -1].cpu()

    def _forward(self, tokens, pos, kv, last):
        return self.model(tokens, pos, kv, last)
