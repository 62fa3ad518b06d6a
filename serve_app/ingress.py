"""The ingress deployment: the OpenAI-compatible HTTP API (FastAPI) and the gRPC service
`powerinfer.v1.Inference` (served by Ray Serve's gRPC proxy, which calls the methods of the same
name here), both routed by the request's model name to the model deployments.

Every request becomes one stream per choice; both protocols share that path, its metrics and its
errors. The model deployment (`model.py`) prepares a choice (prompt tokens, sampling, a seed) and
names its group's scheduler, and the ingress streams the tokens from the scheduler itself
(`actors.follow`): a token crosses one Ray hop to the ingress, not two, and the model deployment is
asked again only to resume a stream after the group fails. A request for top_logprobs streams
through the model deployment, which names their tokens. An error before the first token is a status
code (HTTP 4xx/5xx with an OpenAI error body; a gRPC status); after it, an SSE event with the error
object followed by [DONE], or the gRPC status at the end of the stream. A client that goes away
cancels its streams, which frees their batch slots in the scheduler. When the server stops
(`stopping`), new requests are refused with 503 and the responses in flight are given until the
announced time, then end with an error that says so.
"""
# no `from __future__ import annotations` here: FastAPI reads the routes' annotations, which
# Serve's ingress wrapper re-binds where string annotations no longer resolve
import asyncio
import email.message
import hmac
import ipaddress
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import openai_schema as oa
from actors.follow import follow
from actors.tokens import ends
from powerinfer.compat import trim_heap_every
from powerinfer.errors import InvalidRequestError, PowerInferError
from powerinfer.engine.grammar import Grammar

from .errors import RETRY_AFTER_S, ApiError, error_value
from .metrics import Metrics
from .request import GenerationRequest
from .settings import HEAP_TRIM_S, STREAM_INTERVAL_MS
from .stopping import StopWatch
from .streams import OpenAIFormat, Piece, ToolCalls, collect, primed

logger = logging.getLogger("ray.serve")
STATUS_TIMEOUT_S = 5.0
WATCH_POLL_S = 1.0  # grpc.health.v1 Watch: how often a watched status is looked at
SERVICE = "powerinfer.v1.Inference"
FINISH = {"stop": 1, "length": 2}  # powerinfer.v1.FinishReason
STOPPING = ("the server is stopping: send the request to another server, or again once this one "
            "has restarted")


class _Cut(Exception):
    """A response still running when the server's stop ended those in flight."""


async def gathered(source: AsyncIterator[list], interval: float) -> AsyncIterator[list]:
    """The lists of events `source` yields, sent on at most once per `interval` seconds: what
    arrives meanwhile is joined to the next list sent. The first goes at once (the time to the
    first token is not changed), and so does a list with the stream's last event."""
    if interval <= 0:
        try:
            async for item in source:
                yield item
        finally:  # (a reader that stops early closes the source now, not when it is collected)
            await source.aclose()
        return
    loop, queue, done = asyncio.get_running_loop(), asyncio.Queue(), object()

    async def pump():
        try:
            async for item in source:
                queue.put_nowait(item)
            queue.put_nowait(done)
        except Exception as e:  # noqa: BLE001 - raised to the reader (not a cancellation)
            queue.put_nowait(e)

    task = asyncio.create_task(pump())
    sent, held = -interval, None
    try:
        while True:
            item = held if held is not None else await queue.get()
            held = None
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            batch = list(item)
            while not ends(batch[-1]):
                left = sent + interval - loop.time()
                if queue.empty() and left <= 0:
                    break
                try:
                    more = queue.get_nowait() if not queue.empty() else \
                        await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    break
                if more is done or isinstance(more, BaseException):
                    held = more
                    break
                batch.extend(more)
            yield batch
            sent = loop.time()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _pb():
    """The generated gRPC messages, imported where used (they are built by `make`, and Serve
    pickles this module's classes)."""
    from powerinfer.v1 import inference_pb2
    return inference_pb2


def _request_body(model: type[BaseModel]) -> dict:
    """OpenAPI description of a body that the route reads and validates itself."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}


# (the API's description and its pages are the Ingress's own routes, behind its API key: FastAPI
# served them to anyone)
app = FastAPI(title="PowerInfer", description="OpenAI-compatible API of a neuron-aware server",
              openapi_url=None, docs_url=None, redoc_url=None)


def _error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.retryable else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


@app.exception_handler(ApiError)
async def _api_error(request: Request, e: ApiError):
    return _error_response(e)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException):
    kind = {401: "unauthorized", 404: "not_found", 413: "too_large"}.get(e.status_code)
    if kind is None:
        kind = "invalid_request" if e.status_code < 500 else "internal"
    err = ApiError(kind, f"{request.method} {request.url.path}: {e.detail}")
    body = err.body()
    body["error"]["code"] = e.status_code
    return JSONResponse(body, status_code=e.status_code)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    return _error_response(_invalid(e.errors()))


@app.exception_handler(Exception)
async def _unexpected(request: Request, e: Exception):
    if isinstance(e, TaskCancelledError):  # the client hung up and Serve cancelled the call
        logger.info("%s %s: the client went away", request.method, request.url.path)
        return _error_response(ApiError("internal", "the request was cancelled"))
    logger.exception("unexpected error in %s %s", request.method, request.url.path)
    return _error_response(ApiError("internal", "internal server error; see the server log"))


# the steps pydantic adds to a field's path where a value failed each type of a union (`str`,
# `list[TextPart]`, `function-after[...]`): not the request's own names
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _invalid(errors: list[dict]) -> ApiError:
    """The first validation error, as the field it names (`messages.0.content`, not pydantic's
    `messages.0.content.str`) and its message (without pydantic's "Value error, ")."""
    first = errors[0]
    loc = ".".join(str(x) for x in first.get("loc", ())
                   if x != "body" and not (isinstance(x, str) and (
                       x in _UNION_TAGS or "[" in x)))
    msg = first["msg"].removeprefix("Value error, ")
    # (a check of the whole request names its field on the error it raises)
    param = loc or getattr((first.get("ctx") or {}).get("error"), "param", None)
    return ApiError("invalid_request", f"{loc}: {msg}" if loc else msg, param=param)


def _not_answering(model: str, e: Exception) -> ApiError:
    logger.warning("model %s is not answering: %s: %s", model, type(e).__name__, e)
    return ApiError("unavailable", f"model {model} is not answering ({type(e).__name__}); "
                                   "retry shortly")


def _overall(statuses: list[dict]) -> str:
    states = {s["status"] for s in statuses}
    if states == {"ready"}:
        return "ok"
    if states <= {"ready", "failed"} and "ready" in states:
        return "degraded"  # a model that failed to load is reported, and the others serve
    return "loading" if "loading" in states else "unavailable"


def _serving(statuses: list[dict]) -> bool:
    """The server answers: /health's 200, gRPC Health's ok, grpc.health.v1's SERVING."""
    return _overall(statuses) in ("ok", "degraded")


def _abort(grpc_context, e: ApiError):
    """End a gRPC call with e's status code (Serve sends the code set on the context when the
    method raises)."""
    import grpc

    grpc_context.set_code(getattr(grpc.StatusCode, e.grpc_code))
    grpc_context.set_details(e.message)
    raise e


def _grpc_sampling(sp) -> dict:
    """SamplingParams keywords from the message: fields left unset keep the engine's defaults."""
    kw = {f: getattr(sp, f) for f in ("max_tokens", "temperature", "top_k", "top_p", "min_p",
                                      "repetition_penalty", "seed", "presence_penalty",
                                      "frequency_penalty") if sp.HasField(f)}
    if sp.HasField("top_logprobs"):
        if sp.top_logprobs > oa.MAX_TOP_LOGPROBS:
            raise ApiError("invalid_request", f"top_logprobs must be in [0, "
                                              f"{oa.MAX_TOP_LOGPROBS}]", "top_logprobs")
        kw["logprobs"] = sp.top_logprobs
    kw.update(stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
              ignore_eos=sp.ignore_eos)
    for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty"):
        if f in kw:  # float32 on the wire: 0.1 arrives as 0.10000000149
            kw[f] = float(f"{kw[f]:.7g}")
    which = sp.WhichOneof("constraint")
    try:
        if which == "json_schema":
            kw["grammar"] = Grammar.json_schema(sp.json_schema, strict=not sp.lenient)
        elif which == "json_object" and sp.json_object:
            kw["grammar"] = Grammar.json_object()
        elif which == "regex":
            kw["grammar"] = Grammar.regex(sp.regex)
        elif which == "choice":
            kw["grammar"] = Grammar.choice(list(sp.choice.choices))
        elif which == "grammar":
            kw["grammar"] = Grammar.lark(sp.grammar)
    except InvalidRequestError as e:
        raise ApiError("invalid_request", str(e), which) from None
    return kw


def _chat_message(m) -> dict:
    """A gRPC chat message through the HTTP API's schema: the same roles, the same rendering."""
    try:
        return oa.ChatMessage(role=m.role, content=m.content).as_template_input()
    except ValidationError as e:
        raise _invalid(e.errors(include_url=False, include_input=False)) from None


def _generated_token(pb, ev: dict):
    t = pb.GeneratedToken(token_id=ev["token"])
    if "logprob" in ev:
        t.logprob = ev["logprob"]
        t.top_logprobs.extend(pb.TokenLogprob(token_id=i, token=s, logprob=lp)
                              for i, s, lp in ev["top_logprobs"])
    return t


def _model_info(s: dict):
    return _pb().ModelInfo(id=s["id"], status=s["status"], max_model_len=s["max_model_len"] or 0,
                           error=s["error"] or "")


class _NoClientErrorTracebacks(logging.Filter):
    """Serve logs every exception a gRPC method raises, with its traceback; an ApiError is how a
    method sets its status code (a client's mistake or a retryable state), not a server fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        while e is not None:
            if isinstance(e, ApiError):
                return False
            e = e.__cause__
        return True


def _trim_serve_proxies():
    """Serve's HTTP proxies (Ray's processes, one a node) give their freed heap back, asked
    after a burst that grew the ingress's: the proxy holds every stream's connection, and after
    a burst of 400 it stayed 53 MiB up until a trim gave back 34 of them. The call runs a small
    function in the proxy (`__ray_call__`: an actor task, not one of the proxy's methods),
    fire-and-forget; nothing of this project need be importable there."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE, SERVE_PROXY_NAME

    def trim(_proxy):
        import ctypes
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(SERVE_PROXY_NAME):
            ray.get_actor(a["name"], namespace=SERVE_NAMESPACE).__ray_call__.remote(trim)


@serve.deployment(max_ongoing_requests=4096, graceful_shutdown_wait_loop_s=0.25,
                  health_check_period_s=2,  # (as the models': a dead one replaced promptly)
                  ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Ingress:
    def __init__(self, models: dict, api_key: str = "", max_body_bytes: int = 1 << 20,
                 stream_interval_ms: float = STREAM_INTERVAL_MS, local_only: bool = False):
        self.models = models  # name -> DeploymentHandle of its ModelServer
        self.api_key = api_key.encode()
        self.local_only = local_only  # (served on a loopback address: `_check_host`)
        self.max_body_bytes = max_body_bytes
        self.stream_interval = stream_interval_ms / 1000
        self.metrics = Metrics()
        self.tool_formats: dict[str, str] = {}  # model -> how it writes tool calls
        logger.addFilter(_NoClientErrorTracebacks())
        # a burst's freed heap given back, here and in Serve's proxies, which carried it too
        trim_heap_every(HEAP_TRIM_S, then=_trim_serve_proxies)
        # the server's stop: new requests refused, the choices streaming (`running`) given until
        # the announced time; each wait for a stream's next item (`waits`) then ends (`_next`)
        self.running = 0
        self.metrics.streams.set_function(lambda: self.running)  # (read at each scrape)
        self.loop: asyncio.AbstractEventLoop | None = None  # (the one the requests run on)
        self.cut_at: float | None = None  # the loop's time those in flight end
        self.waits: set[asyncio.Timeout] = set()
        ctx = serve.get_replica_context()
        self.stop = StopWatch(ctx.app_name, ctx.replica_tag, self._stopping,
                              lambda: self.running)

    # ------------------------------------------------------------------------- HTTP routes

    @app.post("/v1/chat/completions", openapi_extra=_request_body(oa.ChatCompletionRequest))
    async def chat_completions(self, request: Request):
        self._guard(request)
        body = await self._read(request, oa.ChatCompletionRequest)
        prompt = [m.as_template_input() for m in body.messages]
        spec, calls = body.tool_spec, None
        if spec and spec["choice"] != "none":  # the model's calls are parsed out of its text
            calls = ToolCalls(await self._tool_format(body.model),
                              [f["name"] for f in spec["functions"]], spec["parallel"])
        return await self._respond("chat", body, [prompt], body.engine_sampling(), spec, calls,
                                   body.continue_final_message)

    @app.post("/v1/completions", openapi_extra=_request_body(oa.CompletionRequest))
    async def completions(self, request: Request):
        self._guard(request)
        body = await self._read(request, oa.CompletionRequest)
        return await self._respond("completion", body, body.prompts(), body.engine_sampling())

    @app.get("/v1/models")
    async def list_models(self, request: Request):
        self._guard(request)
        cards = [oa.ModelCard(**s) for s in await self._statuses()]
        return Response(oa.ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str, request: Request):
        """One served model's card (OpenAI's "retrieve model"), 404 naming the served ones."""
        self._guard(request)
        self._handle(model_id)
        card = next(s for s in await self._statuses() if s["id"] == model_id)
        return Response(oa.ModelCard(**card).model_dump_json(), media_type="application/json")

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        self._guard(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        from fastapi.openapi.docs import get_swagger_ui_html

        self._guard(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title + " - docs")

    @app.get("/health")
    async def health(self, request: Request):
        """200 when every model answers ("ok"), or every model but those that failed to load
        ("degraded", each with its error); 503 while one loads or is being rebuilt."""
        self._check_host(request)
        statuses = await self._statuses()
        if self.stop.until is not None:
            return JSONResponse({"status": "stopping", "models": statuses}, status_code=503)
        return JSONResponse({"status": _overall(statuses), "models": statuses},
                            status_code=200 if _serving(statuses) else 503)

    @app.get("/metrics")
    async def prometheus(self, request: Request):
        self._check_host(request)
        names = list(self.models)
        stats = await asyncio.gather(*(self._call(n, "stats") for n in names),
                                     return_exceptions=True)
        engines = {n: s for n, s in zip(names, stats) if isinstance(s, dict)}
        return Response(self.metrics.render(engines), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=_request_body(oa.TokenizeRequest))
    async def tokenize(self, request: Request):
        self._guard(request)
        body = await self._read(request, oa.TokenizeRequest)
        prompt = body.prompt if body.messages is None else \
            [m.as_template_input() for m in body.messages]
        out = await self._unary(body.model, "tokenize", prompt, body.add_special_tokens,
                                body.tool_spec, body.continue_final_message)
        res = oa.TokenizeResponse(tokens=out["tokens"], count=len(out["tokens"]),
                                  max_model_len=out["max_model_len"])
        return Response(res.model_dump_json(), media_type="application/json")

    @app.post("/detokenize", openapi_extra=_request_body(oa.DetokenizeRequest))
    async def detokenize(self, request: Request):
        self._guard(request)
        body = await self._read(request, oa.DetokenizeRequest)
        out = await self._unary(body.model, "detokenize", body.tokens)
        return Response(oa.DetokenizeResponse(prompt=out["text"]).model_dump_json(),
                        media_type="application/json")

    async def _read(self, request: Request, model: type[BaseModel]):
        """The body, at most max_body_bytes, validated as `model`: JSON, by its Content-Type
        (application/json or application/*+json) or with none. A browser's cross-site POST
        without a preflight can only be text/plain or a form, which were read as JSON too."""
        declared_type = request.headers.get("content-type")
        if declared_type:
            m = email.message.Message()
            m["content-type"] = declared_type
            sub = m.get_content_subtype()
            if m.get_content_maintype() != "application" or not (sub == "json" or
                                                                  sub.endswith("+json")):
                raise ApiError("unsupported_media", f"Content-Type {declared_type[:100]!r}: "
                                                    "send the body as application/json")
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError("too_large", f"request body of {declared} bytes; the limit is {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError("too_large", f"request body over the limit of {limit} bytes")
        try:
            return model.model_validate_json(bytes(body))
        except ValidationError as e:
            raise _invalid(e.errors(include_url=False, include_input=False)) from None

    async def _respond(self, kind: str, body, prompts: list, sampling: dict,
                       tools: dict | None = None, calls: ToolCalls | None = None,
                       continue_final: bool = False):
        streams = self._streams(body.model, prompts, sampling, body.n, tools=tools,
                                continue_final=continue_final)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        fmt = OpenAIFormat(kind, rid, body.model, sampling.get("logprobs") is not None, body.n,
                           calls)
        if not body.stream:
            choices, prompts = await collect(streams)
            return Response(fmt.whole(choices, prompts).model_dump_json(),
                            media_type="application/json")
        pieces = await primed(streams)  # errors before the first token are status codes
        return StreamingResponse(fmt.sse(pieces, body.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ---------------------------------------------------------------------------- gRPC

    async def Generate(self, request, grpc_context):
        async for r in self._grpc_generate(request, grpc_context, chat=False):
            yield r

    async def Chat(self, request, grpc_context):
        async for r in self._grpc_generate(request, grpc_context, chat=True):
            yield r

    async def Tokenize(self, request, grpc_context):
        pb = _pb()
        try:
            self._grpc_admit(request, grpc_context)
            out = await self._unary(request.model, "tokenize", request.text,
                                    request.add_special_tokens)
        except ApiError as e:
            _abort(grpc_context, e)
        return pb.TokenizeResponse(token_ids=out["tokens"], max_model_len=out["max_model_len"])

    async def Detokenize(self, request, grpc_context):
        try:
            self._grpc_admit(request, grpc_context)
            out = await self._unary(request.model, "detokenize", list(request.token_ids))
        except ApiError as e:
            _abort(grpc_context, e)
        return _pb().DetokenizeResponse(text=out["text"])

    async def ListModels(self, request, grpc_context):
        try:
            self._grpc_admit(request, grpc_context)
        except ApiError as e:
            _abort(grpc_context, e)
        return _pb().ListModelsResponse(models=[_model_info(s) for s in await self._statuses()])

    async def Health(self, request, grpc_context):
        statuses = await self._statuses()
        return _pb().HealthResponse(ok=_serving(statuses), models=[_model_info(s) for s in statuses])

    # ---- grpc.health.v1.Health, for probes and load balancers (no API key, as /health) ----

    async def Check(self, request, grpc_context):
        """SERVING or NOT_SERVING for the server ("" or "powerinfer.v1.Inference": every model
        answers, but those that failed to load) or for one model (its name: it is ready);
        NOT_FOUND for another name."""
        from grpc_health.v1 import health_pb2

        status = await self._service_status(request.service)
        if status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            _abort(grpc_context, ApiError("not_found", f"no service or model named "
                                                       f"{request.service[:100]!r}", "service"))
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, grpc_context):
        """The status now, then each change of it (SERVICE_UNKNOWN for a name that is neither
        the server nor a model, as the protocol asks)."""
        from grpc_health.v1 import health_pb2

        last = None
        while True:
            status = await self._service_status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            if self.stop.until is not None:  # (NOT_SERVING sent: the stop waits for no watch)
                return
            await asyncio.sleep(WATCH_POLL_S)

    async def _service_status(self, service: str) -> int:
        """The health of the server or of one model; NOT_SERVING for every one while the server
        stops."""
        from grpc_health.v1 import health_pb2

        R = health_pb2.HealthCheckResponse
        statuses = await self._statuses()
        if service in ("", SERVICE):
            ok = _serving(statuses) and self.stop.until is None
        elif service in self.models:
            ok = next(s["status"] for s in statuses if s["id"] == service) == "ready"
        else:
            return R.SERVICE_UNKNOWN
        return R.SERVING if ok else R.NOT_SERVING

    async def _grpc_generate(self, request, grpc_context, chat: bool):
        pb = _pb()
        arrived = time.perf_counter()
        try:
            self._grpc_admit(request, grpc_context)
            if chat:
                prompt = [_chat_message(m) for m in request.messages]
                if not prompt:
                    raise ApiError("invalid_request", "messages must not be empty", "messages")
            elif request.WhichOneof("prompt") == "text":
                prompt = request.text
            elif request.WhichOneof("prompt") == "token_ids":
                prompt = list(request.token_ids.ids)
            else:
                raise ApiError("invalid_request", "give a prompt: text or token_ids", "prompt")
            sampling = _grpc_sampling(request.sampling)
            stream, = self._streams(request.model, [prompt], sampling, 1, arrived)
            prompt_tokens = completion = cached = 0
            queue_s, ttft = 0.0, None
            async for p in stream:
                prompt_tokens = p.prompt_tokens or prompt_tokens
                cached = p.cached_tokens or cached
                queue_s = p.events[0].get("queue_s", queue_s)
                tokens = [_generated_token(pb, ev) for ev in p.events if ev["token"] >= 0]
                completion += len(tokens)
                if ttft is None and tokens:
                    ttft = time.perf_counter() - arrived
                r = pb.GenerateResponse(text=p.text, tokens=tokens)
                if p.finish_reason:
                    r.finish_reason = FINISH.get(p.finish_reason, 0)
                    r.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_tokens,
                                              completion_tokens=completion,
                                              total_tokens=prompt_tokens + completion,
                                              cached_tokens=cached))
                    r.timings.CopyFrom(pb.Timings(queue_s=queue_s, time_to_first_token_s=ttft or 0,
                                                  total_s=time.perf_counter() - arrived))
                yield r
        except ApiError as e:
            _abort(grpc_context, e)

    def _grpc_admit(self, request, grpc_context):
        metadata = dict(grpc_context.invocation_metadata() or ())
        self._authorize(metadata.get("authorization"))
        self._admit()
        if request.ByteSize() > self.max_body_bytes:
            raise ApiError("too_large", f"request of {request.ByteSize()} bytes; the limit is "
                                        f"{self.max_body_bytes}")

    # ---------------------------------------------------------------------------- shared

    def _guard(self, request: Request):
        """An HTTP request's Host (`_check_host`), then its API key, then the server's stop."""
        self._check_host(request)
        self._authorize(request.headers.get("authorization"))
        self._admit()

    def _admit(self):
        if self.stop.until is not None:
            raise ApiError("unavailable", STOPPING)

    def _stopping(self, until: float):
        """(The stop watch's thread) the server stops: its responses end at `until`."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._cut, until)

    def _cut(self, until: float):
        """(On the requests' loop) every wait of a response in flight ends at `until`."""
        self.cut_at = self.loop.time() + max(0.0, until - time.time())
        for t in list(self.waits):
            t.reschedule(self.cut_at)

    async def _next(self, gen):
        """The next item of a choice's stream; `_Cut` when the server's stop ends it first."""
        t = asyncio.timeout_at(self.cut_at)
        self.waits.add(t)
        try:
            async with t:
                return await anext(gen)
        except TimeoutError:
            if t.expired():
                raise _Cut from None
            raise
        finally:
            self.waits.discard(t)

    def _check_host(self, request: Request):
        """Served on a loopback address with no API key, a request must name the host as a
        loopback name or an address: a web page whose own name an attacker points at 127.0.0.1
        (DNS rebinding) would otherwise reach this server from the user's browser as its own
        origin. With a key such a page gets 401 anyway, and a reverse proxy in front may pass
        on its own name."""
        if not self.local_only or self.api_key:
            return
        host = request.headers.get("host", "")
        if host.startswith("["):  # an IPv6 address, [addr] or [addr]:port
            name = host[1:host.find("]")]
        else:  # name or name:port
            name = host.rpartition(":")[0] if host.count(":") == 1 else host
        name = name.lower().rstrip(".")
        if not host or name == "localhost" or name.endswith(".localhost"):
            return
        try:
            ipaddress.ip_address(name)  # (an address names no one who could rebind it)
        except ValueError:
            raise ApiError("forbidden", f"Host {host[:100]!r} is not this server's: it serves "
                                        "on a loopback address without an API key, for "
                                        "localhost or an IP address (a proxy in front that "
                                        "passes on another name: give the server an API "
                                        "key)") from None

    def _authorize(self, header: str | None):
        """Constant-time check of `Bearer KEY` when the server has an API key."""
        if not self.api_key:
            return
        scheme, _, key = (header or "").partition(" ")
        if not header:
            raise ApiError("unauthorized", "missing API key: send the header "
                                           "'Authorization: Bearer KEY'")
        if not (hmac.compare_digest(key.strip().encode(), self.api_key)
                and scheme.lower() == "bearer"):
            raise ApiError("unauthorized", "invalid API key")

    def _handle(self, model: str):
        try:
            return self.models[model]
        except KeyError:
            served = ", ".join(sorted(self.models))
            raise ApiError("not_found", f"model {model[:100]!r} is not served here; served: "
                                        f"{served}", "model") from None

    async def _call(self, model: str, method: str, *args):
        handle = self._handle(model)
        return await asyncio.wait_for(getattr(handle, method).remote(*args), STATUS_TIMEOUT_S)

    async def _unary(self, model: str, method: str, *args) -> dict:
        try:
            out = await self._call(model, method, *args)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - the replica is down or restarting
            raise _not_answering(model, e) from None
        if "error" in out:
            raise ApiError.from_value(out["error"])
        return out

    async def _statuses(self) -> list[dict]:
        names = list(self.models)
        got = await asyncio.gather(*(self._call(n, "status") for n in names),
                                   return_exceptions=True)
        return [{k: v for k, v in s.items() if k != "replica_id"} if isinstance(s, dict) else
                {"id": n, "status": "unavailable", "created": 0, "max_model_len": None,
                 "error": f"the model's deployment is not answering ({type(s).__name__})"}
                for n, s in zip(names, got)]

    async def _tool_format(self, model: str) -> str:
        """How the model writes tool calls (asked once per model)."""
        if model not in self.tool_formats:
            self.tool_formats[model] = (await self._unary(model, "tool_format"))["format"]
        return self.tool_formats[model]

    def _streams(self, model: str, prompts: list, sampling: dict, n: int,
                 arrived: float | None = None, tools: dict | None = None,
                 continue_final: bool = False) -> list[AsyncIterator[Piece]]:
        """One stream per choice: n for each prompt, choice i of a seeded request with seed+i."""
        handle = self._handle(model)
        arrived = arrived or time.perf_counter()
        streams = []
        for p, prompt in enumerate(prompts):
            for j in range(n):
                kw = dict(sampling)
                if kw.get("seed") is not None:  # torch's seeds are 64-bit, negative ones wrap
                    kw["seed"] = (kw["seed"] + j) % 2 ** 64
                req = GenerationRequest(prompt, kw, uuid.uuid4().hex, tools, continue_final)
                streams.append(self._stream(handle, model, req, p * n + j, arrived))
        return streams

    async def _direct(self, handle, req: GenerationRequest) -> AsyncIterator[dict]:
        """A request's items ({"prompt_tokens"} on the first, "events") streamed from the model
        group's scheduler itself: the model deployment prepares the request (tokens, sampling)
        and names the scheduler, and is asked again only to resume after the group fails. Its
        events go on at most once per `stream_interval` (`gathered`)."""
        opened = await handle.open.remote(req)
        if "error" in opened:
            raise ApiError.from_value(opened["error"])

        async def replace(failed: dict, why: str) -> dict:
            got = await handle.reopen.remote(failed["id"], why)
            if "error" in got:
                raise ApiError.from_value(got["error"])
            return got["target"]

        first = {"prompt_tokens": opened["prompt_tokens"]}
        try:
            # on the scheduler's node the ring's reader gathers already, asleep between lists
            # (it wakes once a list, not once a token); `gathered` does it for Ray's stream
            async for events in gathered(follow(opened["flight"], opened["target"], replace,
                                                self.stream_interval), self.stream_interval):
                yield {**first, "events": events}
                first = {}
        except PowerInferError as e:
            raise ApiError.from_value(error_value(e)["error"]) from None

    async def _stream(self, handle, model: str, req: GenerationRequest, index: int,
                      arrived: float) -> AsyncIterator[Piece]:
        track = self.metrics.request(model, arrived)
        if req.sampling.get("logprobs") is None:
            gen = self._direct(handle, req)
        else:  # the model deployment names the tokens of top_logprobs (its tokenizer)
            gen = handle.options(stream=True).generate.remote(req)
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if self.stop.until is not None and self.cut_at is None:  # (admitted as the stop came)
            self._cut(self.stop.until)
        ended, sent = False, 0
        self.running += 1
        try:
            while True:
                try:
                    item = await self._next(gen)
                except StopAsyncIteration:
                    break
                if "error" in item:
                    raise ApiError.from_value(item["error"])
                events = item["events"]
                if "prompt_tokens" in item:
                    track.prompt(item["prompt_tokens"])
                tokens = sum(ev["token"] >= 0 for ev in events)
                sent += tokens
                track.tokens(tokens, events[0].get("queue_s"))
                finish = next((ev["finish_reason"] for ev in events if ev["finish_reason"]), None)
                ended = finish is not None
                if ended:
                    track.finished(finish)
                    if (sp := events[-1].get("input_sparsity")) is not None:
                        track.input_sparsity(sp["kept"], sp["seen"])
                cached = next((ev["cached_tokens"] for ev in events if "cached_tokens" in ev), None)
                yield Piece(index, "".join(ev["text"] for ev in events), events, finish,
                            item.get("prompt_tokens"), cached)
                if ended:
                    return
            raise ApiError("internal", f"model {model}'s stream ended without a finish reason")
        except ApiError as e:
            ended = True
            track.failed(e.kind)
            raise
        except _Cut:  # (ended stays False: the request is cancelled at its scheduler below)
            track.failed("stopped")
            raise ApiError("unavailable", f"the server is stopping: this response was ended "
                                          f"after {sent} tokens; send the request again") \
                from None
        except BackPressureError:
            ended = True
            track.failed("overloaded")
            raise ApiError("overloaded", f"model {model} has too many requests; retry "
                                         "shortly") from None
        except TaskCancelledError:  # the client went away (below: ended stays False)
            raise
        except Exception as e:  # noqa: BLE001 - the model's replica died or is restarting
            ended = True
            track.failed("unavailable")
            raise _not_answering(model, e) from None
        finally:
            self.running -= 1
            if not ended:  # the client went away, or the server's stop ended the response
                if hasattr(gen, "cancel"):
                    gen.cancel()
                else:
                    await gen.aclose()  # cancels the request at the scheduler
                track.failed("cancelled")  # (the first kind counts: "stopped" for a cut)
