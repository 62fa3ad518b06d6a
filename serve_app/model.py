"""The model deployment: one per served model, holding the engine handle (`actors.handle`) of the
model's actor group. It tokenizes, renders chat templates, turns a request into the engine's
sampling parameters and streams the engine's events; it never touches tensors.

The group loads in a background thread, so a model that is slow or fails to load leaves the
others serving: `status()` says "loading", "ready", "rebuilding" (an actor died and the handle
is replacing the group) or "failed" (with the load error). While it rebuilds, the requests in
flight pause and resume on the new group, and new ones wait for it (`actors.handle`). Serve's
periodic `check_health` runs the engine's data-path probe (one token through every actor); a
probe that fails while the handle is not already rebuilding makes Serve replace this replica.

`open` prepares a request for the ingress to stream from the scheduler itself and `reopen` names
the group to resume it on after a failure (`actors.follow`); `generate` streams through this
deployment (the ingress uses it for requests with top_logprobs). It yields dicts: the first
{"prompt_tokens": n, "events": [...]}, then {"events": [...]};
an event is the scheduler's ({"text", "token", "finish_reason"}, "queue_s" on the first, and
"logprob"/"top_logprobs" with the token texts when asked). A failure ends the stream with
{"error": {"kind", "message"}} (see `errors.py`), before or after the first events.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

from ray import serve
from ray.exceptions import TaskCancelledError

from cluster.topology import process_memory
from powerinfer.compat import trim_heap_every
from powerinfer.engine import tools
from powerinfer.engine.params import sampling_params
from powerinfer.engine.tools import render as render_tools
from powerinfer.errors import InvalidRequestError, PowerInferError

from .errors import ModelUnavailableError, error_value
from .request import GenerationRequest
from .settings import HEAP_TRIM_S, ModelSpec

logger = logging.getLogger("ray.serve")
PROBE_TIMEOUT_S = 20.0
# Serve asks a replica for its health every 2 s: the call failing is how its controller learns
# that the replica's process died (at Serve's default of 10 s, about 5 s passed on average before
# it started another); the probe of the group behind it runs at most every GROUP_PROBE_S
GROUP_PROBE_S = 10.0


# a replica being stopped looks for requests still running every quarter second (Serve's default,
# 2 s, was most of the time a stop took), and waits for them up to a minute
@serve.deployment(max_ongoing_requests=10_000, health_check_period_s=2,
                  health_check_timeout_s=60, graceful_shutdown_timeout_s=60,
                  graceful_shutdown_wait_loop_s=0.25, ray_actor_options={"num_cpus": 0})
class ModelServer:
    def __init__(self, spec: ModelSpec):
        library = logging.getLogger("powerinfer")  # what the load decides, in this replica's log
        library.setLevel(logging.INFO)
        library.handlers = list(logger.handlers)
        self.spec = spec
        if spec.chosen:  # (where no `powerinfer serve` printed it first: `serve run`)
            logger.info("%s: %s", spec.name, spec.chosen)
        context = serve.get_replica_context()
        rank = getattr(context, "rank", None)
        self.replica = getattr(rank, "local_rank", 0) or 0  # its slice of the model's cores
        self.replica_id = str(getattr(getattr(context, "replica_id", None), "unique_id", ""))
        self.engine = None
        self._format: str | None = None  # how the model writes tool calls
        self.error: str | None = None
        self.created = int(time.time())
        self._probed = 0.0  # when check_health last probed the group (monotonic)
        self._loader = threading.Thread(target=self._load, name=f"load-{spec.name}", daemon=True)
        self._loader.start()
        trim_heap_every(HEAP_TRIM_S)  # a burst's freed heap given back

    def _load(self):
        from actors.handle import ActorEngine

        t0 = time.perf_counter()
        try:
            self.engine = ActorEngine(self.spec.model, self.spec.config(self.replica))
        except Exception as e:  # noqa: BLE001 - reported by status(); the others keep serving
            self.error = str(e) if isinstance(e, PowerInferError) else f"{type(e).__name__}: {e}"
            logger.error("model %s failed to load: %s", self.spec.name, self.error)
            return
        logger.info("model %s ready in %.1f s", self.spec.name, time.perf_counter() - t0)

    # ---- status and health ----
    def _state(self) -> str:
        if self.engine is None:
            return "failed" if self.error else "loading"
        return self.engine.state

    async def status(self) -> dict:
        state = self._state()
        out = {"id": self.spec.name, "status": state, "created": self.created,
               "max_model_len": self.engine.max_seq if self.engine else None, "error": None,
               "replica_id": self.replica_id}
        if state == "failed":
            out["error"] = self.error
        elif state == "rebuilding":
            out["error"] = self.engine.last_failure
        return out

    async def check_health(self):
        if self._state() != "ready":
            return  # loading, or the handle is already replacing its group: nothing to add
        if time.monotonic() - self._probed < GROUP_PROBE_S:
            return
        self._probed = time.monotonic()
        h = await asyncio.get_running_loop().run_in_executor(None, self.engine.health,
                                                             PROBE_TIMEOUT_S)
        if not h["ok"] and self._state() == "ready":
            raise RuntimeError(f"model {self.spec.name}: health probe failed: {h.get('error')}")

    async def stats(self) -> dict:
        """Scheduler counters for the metrics, and the group's process ids ({} unless ready:
        during a rebuild there is no scheduler to ask)."""
        if self._state() != "ready":
            return {}
        engine = self.engine
        st = await asyncio.get_running_loop().run_in_executor(None, engine.stats)
        sched = st["actors"].get("scheduler", {})
        return {"restarts": engine.restarts, "running": sched.get("running", 0),
                "waiting": sched.get("waiting", 0), "max_batch": self.spec.base.max_batch,
                **{k: sched.get(k, 0) for k in ("kv_usage", "kv_blocks", "prefix_queries",
                                                "prefix_hits", "preemptions")},
                "cancelled": sched.get("cancelled", 0), "finished": sched.get("finished", 0),
                **{k: sched.get(k, 0) for k in ("prefill_steps", "prefill_s", "decode_steps",
                                                "decode_rows", "decode_s")},
                "pids": st["pids"], "nodes": st["nodes"], "replica": self.replica,
                "requests": sched.get("requests", 0)}

    async def memory(self) -> dict:
        """The host memory this replica's model costs (`ActorEngine.memory`, each process of its
        group, and this replica's own process as "replica"); {} unless ready."""
        if self._state() != "ready":
            return {}
        out = await asyncio.get_running_loop().run_in_executor(None, self.engine.memory)
        mine = process_memory()
        return {**out, "replica": {"pss": mine["pss"], "weight": 0, "kv": 0,
                                   "weight_resident": 0, "kv_resident": 0}}

    # ---- the interface the ingress uses ----
    def _ready_engine(self):
        state = self._state()
        if state == "loading":
            raise ModelUnavailableError(f"model {self.spec.name} is still loading; retry shortly")
        if state == "failed":
            raise ModelUnavailableError(f"model {self.spec.name} failed to load: {self.error}")
        if state == "closed":
            raise ModelUnavailableError(f"model {self.spec.name} is shutting down")
        return self.engine

    async def tokenize(self, prompt: str | list[dict], add_special_tokens: bool = True,
                       tools: dict | None = None, continue_final: bool = False) -> dict:
        try:
            engine = self._ready_engine()
            ids = self._ids(engine, prompt, add_special_tokens, tools, continue_final)
        except (PowerInferError, ValueError) as e:
            return error_value(e)
        return {"tokens": ids, "max_model_len": engine.max_seq}

    async def detokenize(self, ids: list[int]) -> dict:
        try:
            engine = self._ready_engine()
            bad = [t for t in ids if not 0 <= t < engine.args.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} outside the vocabulary "
                                          f"(0..{engine.args.vocab_size - 1})")
        except PowerInferError as e:
            return error_value(e)
        return {"text": engine.tokenizer.decode(ids)}

    def _prepare(self, req: GenerationRequest):
        """The engine, the prompt's token ids and the sampling parameters of a request."""
        engine = self._ready_engine()
        ids = self._ids(engine, req.prompt, tools=req.tools, continue_final=req.continue_final)
        room = engine.max_seq - len(ids)
        if room < 1:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the context of model "
                                      f"{self.spec.name} holds {engine.max_seq}")
        kw = dict(req.sampling)
        asked = kw.get("max_tokens")  # (None: up to the end of the context; 0 is refused)
        kw["max_tokens"] = room if asked is None else min(asked, room)
        spec = req.tools
        if spec and spec["choice"] not in ("none", "auto"):  # a call, and nothing else
            only = None if spec["choice"] == "required" else spec["choice"]
            kw["grammar"] = tools.grammar(spec["functions"], self._tool_format(engine), only,
                                          spec["parallel"]).named("tools")
        return engine, ids, sampling_params(**kw)

    def _tool_format(self, engine) -> str:
        if self._format is None:
            self._format = tools.format_for(engine.tokenizer)
        return self._format

    async def tool_format(self) -> dict:
        """How this model writes tool calls (`powerinfer.engine.tools`), for the ingress to parse them."""
        try:
            return {"format": self._tool_format(self._ready_engine())}
        except PowerInferError as e:
            return error_value(e)

    async def open(self, req: GenerationRequest) -> dict:
        """A request for the ingress to stream from the group's scheduler itself (one hop less
        for every token): {"prompt_tokens", "flight", "target"} (`actors.follow`), or
        {"error"}. During a rebuild it waits for the new group, as `generate` does."""
        try:
            engine, ids, params = self._prepare(req)
            flight, at = await asyncio.get_running_loop().run_in_executor(
                None, engine.open, ids, params, req.request_id)
        except (PowerInferError, ValueError) as e:
            return error_value(e)
        return {"prompt_tokens": len(ids), "flight": flight, "target": at}

    async def reopen(self, failed: str, why: str) -> dict:
        """The target to resume on after the group whose scheduler is `failed` failed, once it
        is rebuilt: {"target"} or {"error"} (retryable). A replica still loading (the one Serve
        started after the group's replica died, and the group with it) is waited for as long as
        a rebuilt group is, so that the streams in flight resume on it."""
        from actors.handle import RESUME_WAIT_S
        deadline = time.monotonic() + RESUME_WAIT_S
        while self._state() == "loading" and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
        try:
            engine = self._ready_engine()
            at = await asyncio.get_running_loop().run_in_executor(None, engine.replacement,
                                                                  failed, why)
        except PowerInferError as e:
            return error_value(e)
        return {"target": at}

    async def generate(self, req: GenerationRequest):
        try:
            engine, ids, params = self._prepare(req)
        except (PowerInferError, ValueError) as e:
            yield error_value(e)
            return
        first = {"prompt_tokens": len(ids)}
        try:
            async for events in engine.agenerate(ids, params, req.request_id):
                for ev in events:
                    if "top_logprobs" in ev:
                        self._name_tokens(engine, ev)
                yield {**first, "events": events}
                first = {}
        except (PowerInferError, ValueError) as e:
            yield error_value(e)
        except TaskCancelledError:  # the caller went away: nobody to tell
            raise
        except Exception as e:  # noqa: BLE001 - a bug: logged here, a clean 500 at the edge
            logger.exception("model %s: generation failed", self.spec.name)
            yield error_value(e)

    def _ids(self, engine, prompt, add_special_tokens: bool = True,
             tools: dict | None = None, continue_final: bool = False) -> list[int]:
        tok = engine.tokenizer
        if isinstance(prompt, str):
            return tok.encode(prompt, None if add_special_tokens else False)
        if prompt and isinstance(prompt[0], dict):
            extra = {}
            if tools is not None:  # the tools and the tool messages in the model's own words
                listed = tools["functions"] if tools["choice"] != "none" else None
                prompt, extra = render_tools(prompt, listed, self._tool_format(engine))
            return tok.encode(tok.apply_chat_template(prompt, continue_final_message=continue_final,
                                                      **extra),
                              None if add_special_tokens else False)
        return list(prompt)

    @staticmethod
    def _name_tokens(engine, ev: dict):
        tok = engine.tokenizer
        text = tok.decode
        if ev["token"] >= 0:
            ev["token_text"] = text([ev["token"]])
            ev["token_bytes"] = list(tok.token_bytes(ev["token"]))  # (a part of a character too)
        ev["top_bytes"] = [list(tok.token_bytes(t)) for t, _ in ev["top_logprobs"]]
        ev["top_logprobs"] = [(t, text([t]), lp) for t, lp in ev["top_logprobs"]]

    def __del__(self):
        self._loader.join(timeout=50)
        if self.engine is not None:
            self.engine.shutdown()

