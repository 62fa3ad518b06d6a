"""Errors at the edge: one kind per failure, with its HTTP status, gRPC status and OpenAI type.

The model deployment reports failures as values ({"error": kind, "message", "retryable"}); the
ingress raises them as `ApiError`, which the HTTP app turns into an OpenAI error body and the
gRPC methods into a status code. Messages name the cause and never carry a traceback.
"""
from __future__ import annotations

from powerinfer.errors import InvalidRequestError, OverloadedError, PowerInferError, RetryableError

# kind: (HTTP status, gRPC status code name, OpenAI error type)
KINDS = {
    "invalid_request": (400, "INVALID_ARGUMENT", "invalid_request_error"),
    "unauthorized": (401, "UNAUTHENTICATED", "authentication_error"),
    "forbidden": (403, "PERMISSION_DENIED", "permission_error"),
    "not_found": (404, "NOT_FOUND", "not_found_error"),
    "too_large": (413, "INVALID_ARGUMENT", "invalid_request_error"),
    "unsupported_media": (415, "INVALID_ARGUMENT", "invalid_request_error"),
    "overloaded": (429, "RESOURCE_EXHAUSTED", "rate_limit_error"),
    "unavailable": (503, "UNAVAILABLE", "service_unavailable_error"),
    "internal": (500, "INTERNAL", "internal_error"),
}
RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, kind: str, message: str, param: str | None = None):
        assert kind in KINDS, kind
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param

    def __reduce__(self):  # Serve pickles a gRPC method's exception to the proxy
        return ApiError, (self.kind, self.message, self.param)

    @property
    def status(self) -> int:
        return KINDS[self.kind][0]

    @property
    def grpc_code(self) -> str:
        return KINDS[self.kind][1]

    @property
    def retryable(self) -> bool:
        return self.kind in ("overloaded", "unavailable")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": KINDS[self.kind][2],
                          "param": self.param, "code": self.status}}

    @classmethod
    def from_value(cls, err: dict) -> "ApiError":
        return cls(err["kind"], err["message"], err.get("param"))


class ModelUnavailableError(RetryableError):
    """The model cannot take requests now: loading, failed to load, rebuilt or shutting down."""


def error_value(e: BaseException) -> dict:
    """An engine failure as the value the model deployment sends to the ingress."""
    if isinstance(e, InvalidRequestError):
        kind = "invalid_request"
    elif isinstance(e, OverloadedError):
        kind = "overloaded"
    elif isinstance(e, RetryableError):  # the group died, or the model is loading or rebuilt
        kind = "unavailable"
    elif isinstance(e, ValueError):  # e.g. a chat template's raise_exception
        kind = "invalid_request"
    else:
        kind = "internal"
    message = str(e) if isinstance(e, (PowerInferError, ValueError)) else \
        f"internal error ({type(e).__name__}); see the server log"
    param = e.param if isinstance(e, InvalidRequestError) else None
    return {"error": {"kind": kind, "message": message, "param": param}}
