"""Request and response bodies of the OpenAI-compatible HTTP API, as pydantic models.

Requests accept the OpenAI fields the engine can honour and, like vLLM, the engine's other
sampling fields as extras (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids); other
unknown fields are ignored. OpenAI fields the engine cannot honour (penalties other than 0,
logit_bias, echo, suffix, best_of > n) are refused with a message that says so. Structured output
(`response_format`, vLLM's `guided_*`) becomes the request's `Grammar`; tools and tool
messages become a tool spec for the model deployment (`powerinfer.engine.tools`).
"""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from powerinfer.errors import InvalidRequestError
from powerinfer.engine import tools
from powerinfer.engine.grammar import Grammar

MAX_CHOICES = 16  # prompts x n in one request
MAX_TOP_LOGPROBS = 5


class _Body(BaseModel):
    # strict, as OpenAI's API is: pydantic's lax mode read `"max_tokens": true` as 1, "5" as 5
    # and 5.5 as an error but 5.0 as 5, `"stream": "no"` as false and `"prompt": [true]` as
    # token 1 (an integer for a float field stays allowed)
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _has_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise InvalidRequestError("response_format of type json_schema needs a json_schema "
                                      "object", param="response_format")
        return self


class _Sampling(_Body):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # (their count and lengths: SamplingParams says)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict | None = None  # (refused where it holds any entry)
    user: str | None = Field(None, max_length=256)
    _grammar: Grammar | None = PrivateAttr(None)
    # the engine's own sampling fields, accepted as vLLM accepts them
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    # structured output: OpenAI's response_format, and vLLM's guided_* fields (one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None  # llguidance's Lark dialect

    @model_validator(mode="after")
    def _supported(self):
        if self.logit_bias:  # (it was ignored, the tokens it named sampled as ever)
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true",
                                      param="stream_options")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise InvalidRequestError("stop_token_ids must be >= 0", param="stop_token_ids")
        self._grammar = self._constraint()
        return self

    def _constraint(self) -> Grammar | None:
        """The output's constraint, from at most one of the fields that ask for one, named as
        its origin (the model's replica, which compiles it for the model's vocabulary, names
        that field where the engine cannot take it)."""
        rf = self.response_format
        asked = {k: v for k, v in (("response_format", rf if rf and rf.type != "text" else None),
                                   ("guided_json", self.guided_json),
                                   ("guided_regex", self.guided_regex),
                                   ("guided_choice", self.guided_choice),
                                   ("guided_grammar", self.guided_grammar)) if v is not None}
        if not asked:
            return None
        field, value = next(iter(asked.items()))
        if len(asked) > 1:
            raise InvalidRequestError(f"give at most one of {', '.join(asked)}", param=field)
        try:
            if field == "response_format":
                g = Grammar.json_object() if value.type == "json_object" else \
                    Grammar.json_schema(value.json_schema.schema_, bool(value.json_schema.strict))
            elif field == "guided_json":
                g = Grammar.json_schema(value, strict=True)
            elif field == "guided_regex":
                g = Grammar.regex(value)
            elif field == "guided_choice":
                g = Grammar.choice(value)
            else:
                g = Grammar.lark(value)
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param=field) from None
        return g.named(field)

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> dict:
        """Keyword arguments of the engine's SamplingParams (absent fields keep its defaults;
        max_tokens None: up to the end of the context)."""
        kw = dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                  top_k=None if self.top_k is None else max(self.top_k, 0), min_p=self.min_p,
                  repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
                  stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                  logprobs=logprobs, grammar=self._grammar,
                  presence_penalty=self.presence_penalty or None,
                  frequency_penalty=self.frequency_penalty or None)
        return {k: v for k, v in kw.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=1 << 16)  # JSON text, as the model wrote it


class ToolCall(_Body):
    id: str = Field(max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=64)] | None = None  # assistant
    tool_call_id: str | None = Field(None, max_length=128)  # tool: the call this answers

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        """A content part other than text (an image, audio) named, where pydantic's union said
        only that the content was not a string."""
        parts = data.get("content") if isinstance(data, dict) else None
        for p in parts if isinstance(parts, list) else ():
            kind = p.get("type") if isinstance(p, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(f"a content part of type {str(kind)[:40]!r}: the models served "
                                 "here take text only")
        return data

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise InvalidRequestError("only assistant messages carry tool_calls",
                                      param="tool_calls")
        return self

    def as_template_input(self) -> dict:
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Annotated[list[dict], Field(max_length=128)] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the reply goes on from the last message, the assistant's beginning of it (a
    # prefill), where by default the template closes it and opens a new turn
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    _tools: dict | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.continue_final_message:
            _continued(self.messages)
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                raise InvalidRequestError("continue_final_message goes on inside the last "
                                          "message: add_generation_prompt must be false",
                                          param="add_generation_prompt")
        elif not self.add_generation_prompt:
            raise InvalidRequestError("add_generation_prompt false without "
                                      "continue_final_message leaves no turn for the reply",
                                      param="add_generation_prompt")
        self._tools = _tool_spec(self.tools, self.tool_choice, self.parallel_tool_calls,
                                 self.messages)
        if self._tools and self._tools["choice"] not in ("none", "auto") and \
                self._grammar is not None:
            raise InvalidRequestError("tool_choice required or a named function constrains the "
                                      "output already; drop response_format / guided_*",
                                      param="tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        return self

    def engine_sampling(self) -> dict:
        k = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(self.max_completion_tokens or self.max_tokens, k)

    @property
    def tool_spec(self) -> dict | None:
        """{"functions", "choice", "parallel"} when the conversation involves tools."""
        return self._tools


def _continued(messages: list[ChatMessage]):
    """ValueError where continue_final_message has no assistant's message last to go on from."""
    if not messages or messages[-1].role != "assistant":
        raise InvalidRequestError("continue_final_message: the last message must be the "
                                  "assistant's, the beginning of the reply to go on from",
                                  param="continue_final_message")


def _tool_spec(given: list[dict] | None, tool_choice, parallel: bool,
               messages: list[ChatMessage]) -> dict | None:
    """{"functions", "choice", "parallel"} of a conversation that involves tools (it lists some,
    or its messages carry calls or their results), else None; ValueError names what is wrong."""
    try:
        fs = tools.functions(given or [])
    except InvalidRequestError as e:
        raise InvalidRequestError(str(e), param="tools") from None
    try:
        choice = tools.chosen(tool_choice, [f["name"] for f in fs])
    except InvalidRequestError as e:
        raise InvalidRequestError(str(e), param="tool_choice") from None
    if tool_choice is not None and not fs and choice != "none":
        raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
    if not (fs or any(m.tool_calls or m.role == "tool" for m in messages)):
        return None
    # (a named function is one call of it, as OpenAI makes it: its grammar let the model call it
    # again and again)
    return {"functions": fs, "choice": choice if fs else "none",
            "parallel": parallel and choice in ("auto", "required", "none")}


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.echo or self.suffix:
            raise ValueError("echo and suffix are not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidRequestError("prompt must not be an empty list", param="prompt")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise InvalidRequestError(f"at most {MAX_CHOICES} choices (prompts x n) per request",
                                      param="n" if self.n > 1 else "prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def engine_sampling(self) -> dict:
        return self.sampling(self.max_tokens, self.logprobs)


class TokenizeRequest(_Body):
    """A prompt's tokens, or a chat's as the chat completion would render them (its tools in
    the model's own words too: give the request's tools and tool_choice)."""
    model: str = Field(min_length=1, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096)
    add_special_tokens: bool = True
    tools: Annotated[list[dict], Field(max_length=128)] | None = None
    tool_choice: str | dict | None = None
    continue_final_message: bool = False
    _tools: dict | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages",
                                      param="messages")
        if self.continue_final_message:
            _continued(self.messages or [])
        if self.messages is None and (self.tools or self.tool_choice is not None):
            raise InvalidRequestError("tools go with messages", param="tools")
        if self.messages is not None:
            self._tools = _tool_spec(self.tools, self.tool_choice, True, self.messages)
        return self

    @property
    def tool_spec(self) -> dict | None:
        return self._tools


class DetokenizeRequest(_Body):
    model: str = Field(min_length=1, max_length=256)
    tokens: list[int] = Field(max_length=1 << 17)


# ---------------------------------------------------------------------------------- responses

class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens found in the prefix cache (not computed again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str = ""


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "powerinfer"
    status: str
    max_model_len: int | None = None
    error: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
