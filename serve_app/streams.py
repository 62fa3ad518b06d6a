"""Streams of choices and their OpenAI bodies: merging the choices of one request, waiting for
their first pieces, and formatting whole responses and server-sent events."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator

from powerinfer.engine import tools

from . import openai_schema as oa
from .errors import ApiError

logger = logging.getLogger("ray.serve")


@dataclass
class Piece:
    """What one choice produced since its previous piece."""
    index: int
    text: str
    events: list[dict]
    finish_reason: str | None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, reused from the prefix cache


@dataclass
class Choice:
    """A finished choice, for non-streaming responses."""
    index: int
    text: str = ""
    events: list[dict] = field(default_factory=list)
    finish_reason: str | None = None


async def merge(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[Piece]:
    """The pieces of several choices as they come; the first error ends them all."""
    if len(streams) == 1:
        try:
            async for p in streams[0]:
                yield p
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(s):
        try:
            async for p in s:
                await queue.put(p)
            await queue.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the reader
            await queue.put(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class PromptCounts:
    """Each choice's prompt length, and how much of it the prefix cache held."""
    tokens: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)

    def add(self, p: Piece):
        if p.prompt_tokens is not None:
            self.tokens[p.index] = p.prompt_tokens
        if p.cached_tokens is not None:
            self.cached[p.index] = p.cached_tokens


async def collect(streams) -> tuple[list[Choice], PromptCounts]:
    """Every choice to its end, and the counts of their prompts."""
    choices = [Choice(i) for i in range(len(streams))]
    counts = PromptCounts()
    async for p in merge(streams):
        c = choices[p.index]
        c.text += p.text
        c.events += p.events
        c.finish_reason = p.finish_reason or c.finish_reason
        counts.add(p)
    return choices, counts


async def primed(streams) -> AsyncIterator[Piece]:
    """Wait for every choice's first piece (so an early error is a status code), then stream."""
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failed = [e for e in firsts if isinstance(e, BaseException)]
    if failed:
        for s in streams:
            await s.aclose()
        e = failed[0]
        raise e if isinstance(e, ApiError) else ApiError("internal", "a stream ended early")

    async def chained(first, rest):
        yield first
        async for p in rest:
            yield p

    return merge([chained(f, s) for f, s in zip(firsts, streams)])


@dataclass
class ToolCalls:
    """How to find a chat request's tool calls in its choices' text (`powerinfer.engine.tools`)."""
    format: str
    names: list[str]
    parallel: bool = True

    def split(self, text: str, finish: str | None = None) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished text; content None when the reply is calls only.
        A text cut at max_tokens inside a call gives that call as far as it was written (its
        markup went to the client as content)."""
        content, calls = tools.parse(text, self.format, self.names)
        if not calls and finish == "length":
            content, calls = tools.cut_call(text, self.format, self.names) or (text, [])
        if not calls:
            return content if finish == "length" else text, []
        return content or None, calls if self.parallel else calls[:1]

    def held(self, text: str) -> int:
        """Where the part of a streamed text that may be a call begins (len(text): none)."""
        opener = tools.opener(self.format)
        if self.format == "gemma":  # a reply of calls and nothing else
            s = text.lstrip()
            return len(text) - len(s) if s[:len(opener)] == opener[:len(s)] else len(text)
        at = text.find(opener)
        if at >= 0:
            return at
        for k in range(min(len(opener) - 1, len(text)), 0, -1):
            if text.endswith(opener[:k]):
                return len(text) - k
        return len(text)


@dataclass
class _Held:
    """A streamed chat choice with tools: its text so far, and how much of it was sent."""
    text: str = ""
    sent: int = 0
    events: list[dict] = field(default_factory=list)  # not yet sent (their logprobs)


class OpenAIFormat:
    """OpenAI bodies for chat ("chat") or legacy completions ("completion")."""

    def __init__(self, kind: str, rid: str, model: str, logprobs: bool, n: int,
                 tool_calls: ToolCalls | None = None):
        self.kind, self.id, self.model, self.logprobs = kind, rid, model, logprobs
        self.n = n  # choices a prompt: choice i answers prompt i // n
        self.tool_calls = tool_calls
        self.created = int(time.time())

    def _message(self, c: Choice) -> tuple[oa.AssistantMessage, str | None]:
        content, calls = (c.text, []) if self.tool_calls is None else \
            self.tool_calls.split(c.text, c.finish_reason)
        if not calls:
            return oa.AssistantMessage(content=content), c.finish_reason
        return (oa.AssistantMessage(content=content, tool_calls=calls),
                "tool_calls" if c.finish_reason == "stop" else c.finish_reason)

    def usage(self, prompts: PromptCounts, completion: int) -> oa.Usage:
        """Each prompt counted once, however many choices answer it (as OpenAI counts); its
        cached tokens as its first choice found them."""
        prompt = sum(t for i, t in prompts.tokens.items() if i % self.n == 0)
        cached = sum(t for i, t in prompts.cached.items() if i % self.n == 0)
        return oa.Usage(prompt_tokens=prompt, completion_tokens=completion,
                        total_tokens=prompt + completion,
                        prompt_tokens_details=oa.PromptTokensDetails(cached_tokens=cached))

    def whole(self, choices: list[Choice], prompts: PromptCounts):
        completion = sum(ev["token"] >= 0 for c in choices for ev in c.events)
        usage = self.usage(prompts, completion)
        if self.kind == "chat":
            out = []
            for c in choices:
                message, finish = self._message(c)
                out.append(oa.ChatChoice(index=c.index, message=message, finish_reason=finish,
                                         logprobs=self._chat_logprobs(c.events)))
            return oa.ChatCompletion(id=self.id, created=self.created, model=self.model,
                                     usage=usage, choices=out)
        return oa.Completion(id=self.id, created=self.created, model=self.model, usage=usage,
                             choices=[oa.CompletionChoice(
                                 index=c.index, text=c.text, finish_reason=c.finish_reason,
                                 logprobs=self._completion_logprobs(c.events, 0))
                                 for c in choices])

    async def sse(self, pieces: AsyncIterator[Piece], include_usage: bool):
        """Server-sent events: one chunk per token (as OpenAI sends them), the usage chunk when
        asked, an error event if the stream fails after it started, then [DONE]."""
        prompts, completion = PromptCounts(), 0
        offsets: dict[int, int] = {}  # choice -> characters of text sent so far
        held: dict[int, _Held] = {}  # choice -> its text, with tools (a call is sent whole)
        try:
            async for p in pieces:
                prompts.add(p)
                for k, ev in enumerate(p.events):
                    completion += ev["token"] >= 0
                    first = k == 0 and p.prompt_tokens is not None
                    if self.tool_calls is not None:
                        for chunk in self._tool_chunks(p.index, ev, first, held):
                            yield _event(chunk.model_dump_json())
                        continue
                    yield _event(self._chunk(p.index, ev, first, offsets).model_dump_json())
            if include_usage:
                usage = self.usage(prompts, completion)
                cls = oa.ChatCompletionChunk if self.kind == "chat" else oa.Completion
                yield _event(cls(id=self.id, created=self.created, model=self.model, choices=[],
                                 usage=usage).model_dump_json())
        except ApiError as e:
            yield _event(json.dumps(e.body()))
        except Exception:  # noqa: BLE001 - a bug: logged, and the client still gets an end
            logger.exception("stream %s failed", self.id)
            yield _event(json.dumps(ApiError("internal", "internal server error").body()))
        finally:
            await pieces.aclose()  # a client that went away cancels every choice's stream
        yield _event("[DONE]")

    def _tool_chunks(self, index: int, ev: dict, first: bool, held: dict[int, "_Held"]):
        """Chat chunks of a choice that may call tools: text streams until it may be a call;
        from there it is held to the end, and sent as tool_calls deltas (one per call, whole,
        as the OpenAI client assembles them) or, if it was no call after all, as content."""
        h = held.setdefault(index, _Held())
        h.text += ev["text"]
        h.events.append(ev)
        chunk = partial(self._chat_chunk, index)
        if first:
            yield chunk(oa.Delta(role="assistant", content=""), None, [])
        if not ev["finish_reason"]:
            upto = self.tool_calls.held(h.text)
            if upto > h.sent:
                yield chunk(oa.Delta(content=h.text[h.sent:upto]), None, h.events)
                h.sent, h.events = upto, []
            return
        rest = h.text[h.sent:]
        finish = ev["finish_reason"]
        content, calls = self.tool_calls.split(rest, finish)
        if calls:
            if content:
                yield chunk(oa.Delta(content=content), None, [])
            deltas = [oa.DeltaToolCall(index=i, id=c["id"], type="function", function=oa.DeltaFunction(
                name=c["function"]["name"], arguments=c["function"]["arguments"]))
                for i, c in enumerate(calls)]
            yield chunk(oa.Delta(tool_calls=deltas), "tool_calls" if finish == "stop" else finish,
                        h.events)
        else:  # (the text as it came, or without a call cut before its name)
            yield chunk(oa.Delta(content=content), finish, h.events)
        h.sent, h.events = len(h.text), []

    def _chat_chunk(self, index: int, delta: oa.Delta, finish: str | None, events: list[dict]):
        return oa.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[oa.ChunkChoice(
                index=index, finish_reason=finish, delta=delta,
                logprobs=self._chat_logprobs(events))])

    def _chunk(self, index: int, ev: dict, first: bool, offsets: dict[int, int]):
        if self.kind == "chat":
            return oa.ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=[oa.ChunkChoice(
                    index=index, finish_reason=ev["finish_reason"],
                    delta=oa.Delta(role="assistant" if first else None, content=ev["text"]),
                    logprobs=self._chat_logprobs([ev]))])
        at = offsets.get(index, 0)
        offsets[index] = at + len(ev["text"])
        return oa.Completion(
            id=self.id, created=self.created, model=self.model, choices=[oa.CompletionChoice(
                index=index, text=ev["text"], finish_reason=ev["finish_reason"],
                logprobs=self._completion_logprobs([ev], at))])

    def _chat_logprobs(self, events: list[dict]) -> oa.ChatLogprobs | None:
        if not self.logprobs:
            return None
        return oa.ChatLogprobs(content=[
            oa.TokenLogprob(token=ev["token_text"], logprob=ev["logprob"],
                            bytes=ev["token_bytes"],
                            top_logprobs=[oa.TopLogprob(token=t, logprob=lp, bytes=b)
                                          for (_, t, lp), b in zip(ev["top_logprobs"],
                                                                   ev["top_bytes"])])
            for ev in events if ev["token"] >= 0])

    def _completion_logprobs(self, events: list[dict], at: int) -> oa.CompletionLogprobs | None:
        if not self.logprobs:
            return None
        out = oa.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for ev in events:
            if ev["token"] < 0:
                continue
            out.tokens.append(ev["token_text"])
            out.token_logprobs.append(ev["logprob"])
            out.top_logprobs.append({t: lp for _, t, lp in ev["top_logprobs"]})
            out.text_offset.append(at)
            at += len(ev["text"])
        return out


def _event(data: str) -> str:
    return f"data: {data}\n\n"
