"""Prometheus metrics of the ingress, with vLLM's names under `powerinfer:` and a `model_name`
label. Request metrics are recorded as streams pass through the ingress (one request per
choice); the engine gauges and the restart counter are read from the model deployments at
scrape time. Each ingress replica keeps its own registry."""
from __future__ import annotations

import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "powerinfer:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                   300.0)
SHARE_BUCKETS = tuple(i / 20 for i in range(1, 21))  # 0.05 .. 1


class Metrics:
    def __init__(self):
        disable_created_metrics()  # no `_created` series beside every counter and histogram
        r = self.registry = CollectorRegistry()
        m = ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token",
                              m, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between tokens",
                             m, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency",
                             m, buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds", "Wait to be admitted",
                               m, buckets=REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens", m, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", m,
                                         registry=r)
        self.success = Counter(P + "request_success", "Finished requests",
                               m + ["finished_reason"], registry=r)
        self.failure = Counter(P + "request_failure", "Failed requests", m + ["kind"],
                               registry=r)
        self.input_sparsity = Histogram(
            P + "input_sparsity_realised", "Share of the projections' input channels a request's "
            "decode steps skipped (input sparsity; the hot executor's count, one-row steps)",
            m, buckets=SHARE_BUCKETS, registry=r)
        self.streams = Gauge(P + "ingress_streams", "Streams this ingress replica is sending "
                             "(each choice of a request one)", registry=r)
        self.engines: dict[str, dict] = {}  # model name -> ModelServer.stats(), set at scrape
        r.register(_EngineCollector(self))

    def request(self, model: str, arrived: float) -> "RequestMetrics":
        return RequestMetrics(self, model, arrived)

    def render(self, engines: dict[str, dict]) -> bytes:
        self.engines = engines
        return generate_latest(self.registry)


class RequestMetrics:
    """One request's stream: call `tokens` as events arrive, then `finished` or `failed`."""

    def __init__(self, metrics: Metrics, model: str, arrived: float):
        self.m, self.model, self.arrived = metrics, model, arrived
        self.last: float | None = None
        self.done = False

    def prompt(self, n: int):
        self.m.prompt_tokens.labels(self.model).inc(n)

    def tokens(self, n: int, queue_s: float | None = None):
        now = time.perf_counter()
        if queue_s is not None:
            self.m.queue.labels(self.model).observe(queue_s)
        if n:
            if self.last is None:
                self.m.ttft.labels(self.model).observe(now - self.arrived)
            else:
                self.m.itl.labels(self.model).observe(now - self.last)
            self.last = now
            self.m.generation_tokens.labels(self.model).inc(n)

    def finished(self, reason: str):
        if not self.done:
            self.done = True
            self.m.e2e.labels(self.model).observe(time.perf_counter() - self.arrived)
            self.m.success.labels(self.model, reason).inc()

    def input_sparsity(self, kept: int, seen: int):
        """The request's realised input sparsity: the channels its decode steps skipped."""
        if seen > 0:
            self.m.input_sparsity.labels(self.model).observe(1 - kept / seen)

    def failed(self, kind: str):
        if not self.done:
            self.done = True
            self.m.failure.labels(self.model, kind).inc()


class _EngineCollector:
    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        running = GaugeMetricFamily(P + "num_requests_running", "Requests running",
                                    labels=["model_name"])
        waiting = GaugeMetricFamily(P + "num_requests_waiting", "Requests waiting to be admitted",
                                    labels=["model_name"])
        usage = GaugeMetricFamily(P + "kv_cache_usage_perc", "Share of the KV cache's blocks "
                                  "held by requests (1 = full)", labels=["model_name"])
        queries = CounterMetricFamily(P + "prefix_cache_queries", "Prompt tokens looked up in "
                                      "the prefix cache", labels=["model_name"])
        hits = CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens found in the prefix "
                                   "cache", labels=["model_name"])
        preempted = CounterMetricFamily(P + "num_preemptions", "Requests preempted (their KV "
                                        "blocks freed, prefilled again later)",
                                        labels=["model_name"])
        restarts = CounterMetricFamily(P + "engine_restarts", "Actor group rebuilds",
                                       labels=["model_name"])
        for name, st in self.m.engines.items():
            if not st:
                continue
            running.add_metric([name], st["running"])
            waiting.add_metric([name], st["waiting"])
            usage.add_metric([name], st["kv_usage"])
            queries.add_metric([name], st["prefix_queries"])
            hits.add_metric([name], st["prefix_hits"])
            preempted.add_metric([name], st["preemptions"])
            restarts.add_metric([name], st["restarts"])
        yield from (running, waiting, usage, queries, hits, preempted, restarts)
