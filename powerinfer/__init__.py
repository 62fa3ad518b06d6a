"""Neuron-aware LLM inference in the spirit of PowerInfer.

The names below are loaded on first use (PEP 562): a process that needs only a part of the
library (the Serve ingress and the `powerinfer serve` driver: the errors, the configuration,
a request's settings) does not import torch and the engine through this package's `__init__`."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (
    ConfigError,
    EngineFailedError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    OverloadedError,
    PowerInferError,
    RetryableError,
)

if TYPE_CHECKING:
    from .api import PowerInfer
    from .config import Config
    from .engine.params import SamplingParams

_LAZY = {"PowerInfer": ".api", "Config": ".config", "SamplingParams": ".engine.params"}

__all__ = ["PowerInfer", "Config", "SamplingParams", "PowerInferError", "ModelLoadError",
           "ModelNotFoundError", "ConfigError", "InvalidRequestError", "RetryableError",
           "OverloadedError", "EngineFailedError"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
