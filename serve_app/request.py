"""What the ingress asks of a model deployment: one choice of a request. Kept apart from the
deployment so that the ingress, which builds it, imports nothing of the engine."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """prompt: text, token ids, or chat messages ({"role", "content"}) for the model's chat
    template. sampling: SamplingParams keywords; max_tokens absent or None means up to the end
    of the context, and any max_tokens is capped by the room the context leaves."""

    prompt: str | list[int] | list[dict]
    sampling: dict
    request_id: str
    tools: dict | None = None  # chat with tools: {"functions", "choice", "parallel"}
    continue_final: bool = False  # chat: go on from the last (assistant) message's text
