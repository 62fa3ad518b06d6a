"""Neuron-aware LLM inference in the spirit of PowerInfer."""
from .api import PowerInfer
from .config import Config
from .engine.sampling import SamplingParams
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

__all__ = ["PowerInfer", "Config", "SamplingParams", "PowerInferError", "ModelLoadError",
           "ModelNotFoundError", "ConfigError", "InvalidRequestError", "RetryableError",
           "OverloadedError", "EngineFailedError"]
