"""A checkpoint made a model: the dense `Transformer` and its tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..formats.loader import load_checkpoint
from ..formats.source import Checkpoint, LazyWeights
from ..formats.tokenizer import Tokenizer
from .transformer import Transformer


def build_model(ck: Checkpoint, dtype: torch.dtype, device="cpu", tokenizer: bool = True):
    """The dense model and the tokenizer of a loaded checkpoint (its weights are moved into the
    model; no tokenizer, None, where not asked for); a file whose tensors do not fit the
    architecture is a ModelLoadError."""

    try:
        model = Transformer.from_weights(ck.args, ck.weights, dtype, device)
        tokenizer = Tokenizer.from_source(ck.tokenizer_source) if tokenizer else None
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ModelLoadError(ck.path, str(e)) from e
    ck.weights = {}  # the model holds them now
    return model, tokenizer


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer, path) on the CPU, for the offline pipeline: no engine, no runtime.
    Each tensor is read from the file straight into its parameter: read into a dict first, a
    7B file widened to bf16 was held twice (27 GB at the peak, past a 24 GB host's memory)."""
    ck = load_checkpoint(name_or_path, dtype, with_weights=False)
    ck.weights = LazyWeights(ck.source, dtype)
    return (*build_model(ck, dtype), ck.path)
