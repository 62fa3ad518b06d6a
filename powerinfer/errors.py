"""Typed user-facing errors. Internal invariants use asserts; these carry a cause to the edge."""
from __future__ import annotations


class PowerInferError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelLoadError(PowerInferError):
    """A model could not be loaded: names the file and the problem."""

    def __init__(self, path, problem: str):
        self.path, self.problem = str(path), problem
        super().__init__(f"cannot load model {self.path}: {problem}")

    def __reduce__(self):  # pickled as its arguments: raised again as itself across processes
        return type(self), (self.path, self.problem)


class ModelNotFoundError(ModelLoadError):
    """Neither a path nor the short name of an installed model."""


class ConfigError(PowerInferError, ValueError):
    """An invalid `Config` value or combination."""


class InvalidRequestError(PowerInferError, ValueError):
    """A generation request with invalid parameters (bad sampling values, prompt too long...).
    `param`: the request's field at fault where one is (an HTTP error body's `param`)."""

    def __init__(self, *args, param: str | None = None):
        super().__init__(*args)
        self.param = param

    def __reduce__(self):  # (its field kept across processes)
        return _invalid_request, (type(self), self.args, self.param)


def _invalid_request(cls: type, args: tuple, param: str | None) -> InvalidRequestError:
    return cls(*args, param=param)


class RetryableError(PowerInferError):
    """The request failed for a reason outside it; sending it again may succeed."""

    retryable = True


class OverloadedError(RetryableError):
    """The server's request queue is full."""


class EngineFailedError(RetryableError):
    """An actor of the model's group died or failed mid-request; the group is being rebuilt."""
