"""The Python API: `PowerInfer.from_pretrained(name_or_path, config=Config(...))`."""
from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Iterator

import torch

from . import kernels
from .config import Config
from .engine.inprocess import Engine, Event
from .engine.load import read_whole, whole_model
from .engine.load import read_in_place as _read_in_place  # (a test holds it to the eager load)
from .engine.params import sampling_params
from .errors import InvalidRequestError
from .formats.gguf import parsed_once
from .formats.loader import DEFAULT_MODEL, load_checkpoint
from .formats.q4 import has_q4
from .formats.source import Checkpoint, tensor_types
from .model.convert import kernel_ready
from .runtimes import engine_class

log = logging.getLogger("powerinfer")


Messages = list[dict]


class PowerInfer:
    """A loaded model with its tokenizer, ready to generate.

    Sampling keywords (all methods): max_new_tokens, temperature, top_k, top_p, min_p,
    repetition_penalty, presence_penalty, frequency_penalty, seed, stop, stop_token_ids,
    ignore_eos, and grammar (a `powerinfer.engine.grammar.Grammar`: the output held to a JSON
    schema, a regex, choices or a Lark grammar, e.g. `grammar=Grammar.json_schema({...})`).
    """

    def __init__(self, checkpoint: Checkpoint, config: Config):
        # (already decided by from_pretrained)
        if not isinstance(checkpoint, Checkpoint):  # (a name or path: from_pretrained loads it)
            raise TypeError(f"PowerInfer() takes a loaded checkpoint, not {checkpoint!r}: load a "
                            "model by name or path with PowerInfer.from_pretrained(name_or_path, "
                            "config)")
        config = config.resolve(bool(checkpoint.q4), bool(checkpoint.info.get("kquant_types")))
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
        loaded = whole_model(checkpoint, config)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.input_sparsity = loaded.input_sparsity
        self.engine = Engine(self.model, self.tokenizer, config, loaded.pool, sparse=loaded.sparse)

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
            name_or_path = ck.path
            config = config.resolve(has_q4(ck.info), bool(ck.info.get("kquant_types")))
            if config.runtime != "local":  # its processes load the weights
                return cls(ck, config)
        else:  # the header only, for what follows
            ck = load_checkpoint(name_or_path, with_weights=False)
        if _read_in_place(ck, config):  # read as the model is built (`deferred_model`)
            return cls(ck, config)
        return cls(read_whole(name_or_path, config), config)

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

    def generate(self, prompt: str | list[str], max_new_tokens: int | None = None,
                 **sampling) -> str | list[str]:
        """Complete a prompt (or a batch of prompts, decoded together) and return the text.
        max_new_tokens: the tokens to generate at most (128 unless given; `max_tokens`, the
        HTTP API's and `SamplingParams`' name for it, is taken too); `sampling`: the other
        `SamplingParams` fields."""
        if not isinstance(prompt, (str, list, tuple)):
            raise InvalidRequestError(f"prompt must be a string or a list of strings, got "
                                      f"{type(prompt).__name__}")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        texts = [""] * len(prompts)
        step = self.config.max_batch
        for start in range(0, len(prompts), step):
            chunk = prompts[start:start + step]
            for ev in self._run([self._ids(p) for p in chunk], max_new_tokens, sampling):
                texts[start + ev.index] += ev.text
        return texts[0] if isinstance(prompt, str) else texts

    def stream(self, prompt: str | Messages, max_new_tokens: int | None = None,
               **sampling) -> Iterator[str]:
        """Yield text pieces as they are generated; `prompt` may be chat messages."""
        ids = self._ids(prompt)
        for ev in self._run([ids], max_new_tokens, sampling):
            if ev.text:
                yield ev.text

    def chat(self, messages: Messages | str, max_new_tokens: int | None = None,
             **sampling) -> str:
        """Apply the model's chat template to `messages` (a string: one user message) and return
        the assistant's reply."""
        if isinstance(messages, str):  # (it was completed as plain text, with no template)
            messages = [{"role": "user", "content": messages}]
        return "".join(self.stream(messages, max_new_tokens, **sampling))

    def _ids(self, prompt: str | Messages) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InvalidRequestError(f"a prompt is a string or a list of chat messages, got "
                                      f"{prompt!r:.60}")
        for i, m in enumerate(prompt):  # (the template's own errors named neither)
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and
                    isinstance(m.get("content"), str)):
                raise InvalidRequestError(f"message {i}: a chat message is {{'role': str, "
                                          f"'content': str}}, got {m!r:.80}")
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(list(prompt)))

    def _run(self, prompts: list[list[int]], max_new_tokens: int | None,
             sampling: dict) -> Iterator[Event]:
        n, sampling = _max_tokens(max_new_tokens, sampling)
        params = sampling_params(max_tokens=n, **sampling)
        if self.model is None:
            return _concurrently(self.engine, prompts, params)
        seqs = [self.engine.new_sequence(p, params) for p in prompts]
        return self.engine.run(seqs)


def _max_tokens(max_new_tokens: int | None, sampling: dict) -> tuple[int, dict]:
    """(the tokens a call generates at most, the other sampling settings): max_new_tokens, or
    `max_tokens` among the sampling settings (the same setting by its HTTP name), else 128."""
    if "max_tokens" not in sampling:
        return (128 if max_new_tokens is None else max_new_tokens), sampling
    rest = dict(sampling)
    n = rest.pop("max_tokens")
    if max_new_tokens is not None and max_new_tokens != n:
        raise InvalidRequestError(f"max_new_tokens={max_new_tokens} and max_tokens={n} are the "
                                  "same setting (the tokens to generate): give one")
    return n, rest


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
