"""The in-process engine: the batching core's steps (`batching.py`) run on a model in this
process. Only `Engine._forward` touches the model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .batching import Batcher, Sequence, context_length, new_sequence
from .compat import compile_per_instance
from .config import Config, SamplingParams
from .errors import InvalidRequestError
from .model import Transformer
from .tokenizer import Tokenizer


@dataclass(slots=True)
class Event:
    index: int  # which request of the batch
    text: str
    token: int  # -1 when the sequence ended without a new token (its context is full)
    finish_reason: str | None


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: Config):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_seq = context_length(model.args, config)
        self.device = model.tok_embeddings.weight.device
        model.setup_cache(config.max_batch, self.max_seq)
        self._decode = self._forward
        if config.compile:
            self._decode = compile_per_instance(self._forward, cpp_wrapper=self.device.type == "cpu")

    def new_sequence(self, prompt: list[int], params: SamplingParams) -> Sequence:
        return new_sequence(prompt, params, self.tokenizer, self.model.args.vocab_size, self.max_seq)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> Iterator[Event]:
        """Generate for up to max_batch sequences together; yields events as tokens arrive."""
        assert 0 < len(seqs) <= self.config.max_batch, len(seqs)
        batcher = Batcher(self.config.max_batch, self.max_seq)
        for i, s in enumerate(seqs):
            s.key = i
            batcher.add(s)
        dev = self.device
        while (step := batcher.schedule()) is not None:
            # prefill: right-padded; padding writes cache entries that decode overwrites
            B = len(step.seqs)
            slots = None if step.slots.tolist() == list(range(B)) else step.slots.to(dev)
            run = self._forward if step.prefill else self._decode
            logits = run(step.tokens.to(dev), step.positions.to(dev), step.kv_len, slots,
                         step.last.to(dev) if step.prefill else None)
            for out in batcher.postprocess(step, logits[:, -1].cpu()):
                if out.error:
                    raise InvalidRequestError(out.error)
                yield Event(out.seq.key, out.text, out.token, out.finish_reason)

    def _forward(self, tokens, pos, kv_len, slots, last):
        return self.model(tokens, pos, kv_len, slots, last)
