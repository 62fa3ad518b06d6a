"""Neuron-aware LLM inference in the spirit of PowerInfer."""
from .api import PowerInfer
from .config import Config, SamplingParams
from .errors import InvalidRequestError, ModelLoadError, ModelNotFoundError, PowerInferError

__all__ = ["PowerInfer", "Config", "SamplingParams", "PowerInferError", "ModelLoadError",
           "ModelNotFoundError", "InvalidRequestError"]
