"""What the server hosts: the models (each a name clients use, a file, and how to run it) and the
front end's own settings. Read from a YAML file (`powerinfer serve --config`) or from the `args`
of a Ray Serve config file's application."""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field, fields, replace

from powerinfer.config import Config, device_for
from powerinfer.errors import ConfigError

API_KEY_ENV = "POWERINFER_API_KEY"
CONTROL_CALLS = 32  # a model replica's room for calls that are not generations
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


# what a served model's entry sets beside its name and file: any field of `Config` but those the
# server decides (the runtime: always the actor runtime) or the entry holds in its own form
# (cores: split between replicas; resources: a mapping), with the server's defaults where they
# differ from an in-process engine's
SERVER_DEFAULTS = {"max_queue": 256}
SPEC_FIELDS = ("name", "model", "cores", "replicas", "resources")
CONFIG_FIELDS = tuple(f.name for f in fields(Config) if f.name not in ("runtime", "cores", "resources"))


@dataclass(frozen=True)
class ModelSpec:
    """One served model. `name` is what requests put in `model`; `model` is a GGUF file, a
    Hugging Face folder or an installed model's short name (never taken from a request);
    `cores`: the cores its actor groups are planned on (cpulist; "": every core), split between
    `replicas` (Serve replicas, each with its own group); `resources`: Ray resources its group's
    node must have; `settings`: how it runs, any `Config` field (`CONFIG_FIELDS`)."""

    name: str
    model: str
    cores: str = ""
    replicas: int = 1
    resources: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    # what the server chose for it where its entry left the choice open (`share_cores`), said
    # once at start
    chosen: str = field(default="", compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ConfigError(f"model name {self.name!r}: use 1-64 letters, digits and . _ : -")
        if not isinstance(self.resources, dict):
            raise ConfigError(f"model {self.name!r}: resources must be a mapping of Ray resource "
                              "names to amounts")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"model {self.name!r}: replicas must be a positive integer")
        bad = set(self.settings) - set(CONFIG_FIELDS)
        if bad:
            raise ConfigError(f"model {self.name!r}: unknown setting(s) {', '.join(sorted(bad))}")
        self.config()  # validates the runtime settings

    @classmethod
    def from_entry(cls, m: dict) -> "ModelSpec":
        """From a YAML entry: {name, model, cores, replicas, resources, and Config's fields}."""
        if not isinstance(m, dict) or "name" not in m or "model" not in m:
            raise ConfigError(f"each model needs a 'name' and a 'model' (file or installed "
                              f"name), got {m!r}")
        return cls(**{k: m[k] for k in SPEC_FIELDS if k in m},
                   settings={k: v for k, v in m.items() if k not in SPEC_FIELDS})

    @functools.cached_property
    def base(self) -> Config:
        """Its runtime configuration, cores and resources aside (made once: the entry is
        frozen)."""
        device = device_for(self.settings.get("vram_budget_gb") or 0, self.settings.get("device"))
        return Config(runtime="actors", **{**SERVER_DEFAULTS, **self.settings, "device": device})

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's bound on a model replica's requests in flight: what its scheduler admits
        (max_batch running, max_queue waiting), and room for the status, metrics and tokenize
        calls beside them, so that /health answers under full load. Beyond it Serve queues,
        and the scheduler's own bound answers 429 first."""
        return self.base.max_batch + self.base.max_queue + CONTROL_CALLS

    def config(self, replica: int = 0) -> Config:
        """The runtime configuration of replica `replica` (Serve's local rank on its node):
        with several replicas each takes its own slice of the model's cores."""
        return replace(self.base, cores=self.replica_cores(replica),
                       resources=tuple(sorted((str(k), float(v)) for k, v in self.resources.items())))

    def replica_cores(self, replica: int) -> str:
        """This replica's slice of `cores` (of every core this process may use when none are
        named), as a cpulist; the model's cores when it has one replica."""
        if self.replicas == 1:
            return str(self.cores)
        from cluster.topology import parse_cpulist
        cores = parse_cpulist(str(self.cores)) if self.cores else sorted(os.sched_getaffinity(0))
        if len(cores) < self.replicas:
            raise ConfigError(f"model {self.name!r}: {self.replicas} replicas need a core each; "
                              f"it has {len(cores)}")
        q, r = divmod(len(cores), self.replicas)
        lo = replica * q + min(replica, r)
        return ",".join(map(str, cores[lo:lo + q + (replica < r)]))

    def core_sets(self) -> list[frozenset[int]]:
        """Each replica's cores (every core this process may use where none are named)."""
        from cluster.topology import parse_cpulist
        return [frozenset(parse_cpulist(c) if c else os.sched_getaffinity(0))
                for c in map(self.replica_cores, range(self.replicas))]


def share_cores(models: tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
    """Models whose groups would have fewer cores than executors, because their cores are shared
    with other models' groups (or are one core), run each as one executor with the whole model
    (`cold_executors: 0`), where their entries leave `cold_executors` open and the model can run
    so (a dense model on the CPU: no sparsity bundle, no GPU, no VRAM budget). Each takes its
    share of the shared cores as `cpu_threads` (the cores left over to the first models in the
    file, and at least one), unless its entry sets `cpu_threads` (0 counts as not set). The
    share divides the cores among every group sharing them, those that keep two executors too.
    The default group's two
    executors each spin on the plane while the other computes; with more of them than cores they
    wait for each other's time slices. On 2 cores, four models served so ran 2.2-2.4x the
    two-executor groups' tok/s together, two models 1.66x, and each model kept within its memory
    bound (BENCHMARKS.md, "Models that share their cores run as one executor each").

    Groups count as sharing when their cores overlap and their `resources` are the same (the
    same kind of node: models sent to different nodes by their resources do not compete). A
    model that names no `cores` is counted on this process's cores, and is left as it is where
    its `resources` send it to another kind of node, whose cores are not known here. Every
    listed model counts, one that will fail to load too."""
    from cluster.topology import format_cpulist

    # (a model that names no cores but resources for another kind of node: its cores are not
    # known here, and it competes for none of those counted)
    groups = [(m, cores, tuple(sorted(m.resources.items())))
              for m in models if m.cores or not m.resources for cores in m.core_sets()]
    out = []
    for m in models:
        b = m.base
        if ("cold_executors" in m.settings or b.needs_cold_executors or b.device != "cpu"
                or (m.resources and not m.cores)):
            out.append(m)
            continue
        where = tuple(sorted(m.resources.items()))
        worst = None  # (executors over the cores, cores, the groups sharing them)
        for cores in m.core_sets():
            sharing = [o for o, c, r in groups if r == where and c & cores]
            executors = sum(o.base.cold_executors + 1 for o in sharing)
            if executors > len(cores) and (worst is None or executors / len(cores) > worst[0]):
                worst = (executors / len(cores), cores, sharing)
        if worst is None:
            out.append(m)
            continue
        _, cores, sharing = worst
        q, r = divmod(len(cores), len(sharing))
        rank = next(i for i, o in enumerate(sharing) if o is m)
        threads = m.settings.get("cpu_threads") or max(1, q + (rank < r))
        k = len(sharing)
        why = (f"{k} groups share" if k > 1 else "its group has") + \
            f" {len(cores)} core{'s' if len(cores) > 1 else ''} ({format_cpulist(cores)})"
        out.append(replace(m, settings={**m.settings, "cold_executors": 0, "cpu_threads": threads},
                           chosen=f"one executor with the whole model, {threads} thread"
                                  f"{'s' if threads > 1 else ''} ({why}; a models file's "
                                  "cold_executors, or --cold-executors with --model, chooses)"))
    return tuple(out)


# A stream's tokens go to its client at most once per this many milliseconds (the ingress's
# `stream_interval_ms`; 0: each as it comes). Each chunk costs the ingress and Serve's proxy
# about 2-3 ms of CPU each, whatever it carries (one stream of SmolLM2 on 2 cores); at 50 ms a
# stream faster than 20 tokens a second sends several a chunk, and the two took about 40% less
# CPU a token (Ray Serve's LLM app batches its streams every 50 ms by default). Measured with
# `benchmarks/serve.py --scenarios load` on 2 cores, three runs against 0: one stream 1.11-1.27x
# the tok/s (0.79-0.99x llama-server against 0.71-0.78x), TTFT p50 level over 8 requests (141
# against 143 ms), 8 streams 0.95-0.96x in two runs (1.31x llama-server against 1.37x).
STREAM_INTERVAL_MS = 50.0
# how often the ingress and each model replica look whether a burst of requests left their heap
# grown, and give its freed blocks back (`powerinfer.compat.trim_heap_every`)
HEAP_TRIM_S = 10.0


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """models: served models, routed by name. api_key: required on every request but /health and
    /metrics when set (default: the POWERINFER_API_KEY environment variable). max_body_bytes:
    larger request bodies are refused with 413. ingress_replicas: replicas of the HTTP/gRPC
    ingress (each keeps its own request metrics), or ingress_autoscaling: Ray Serve's
    `autoscaling_config` for it (min_replicas, max_replicas, target_ongoing_requests...).
    replica_resources: Ray resources the nodes
    running the ingress and the model deployments must have (on a cluster, e.g. {"head": 0.01}
    keeps them on the head while model groups run where their `resources` say).
    stream_interval_ms: a stream's tokens go to its client at most once per this many
    milliseconds, those generated meanwhile in one chunk (default 50; 0: each as it comes);
    the first token and the last are never held."""

    models: tuple[ModelSpec, ...]
    api_key: str = ""
    max_body_bytes: int = 1 << 20
    ingress_replicas: int = 1
    ingress_autoscaling: dict = field(default_factory=dict)  # Serve's autoscaling_config
    replica_resources: dict = field(default_factory=dict)
    stream_interval_ms: float = STREAM_INTERVAL_MS

    def __post_init__(self):
        if not self.models:
            raise ConfigError("the server needs at least one model")
        object.__setattr__(self, "models", share_cores(tuple(self.models)))
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"model names must be unique; repeated: {', '.join(sorted(dup))}")
        if self.max_body_bytes < 1024 or self.ingress_replicas < 1:
            raise ConfigError("max_body_bytes must be >= 1024 and ingress_replicas >= 1")
        if not 0 <= self.stream_interval_ms <= 1000:
            raise ConfigError(f"stream_interval_ms must be between 0 and 1000 (milliseconds); "
                              f"got {self.stream_interval_ms}")
        if self.ingress_autoscaling:
            if self.ingress_replicas != 1:
                raise ConfigError("give ingress_replicas or ingress_autoscaling, not both")
            from ray.serve.config import AutoscalingConfig
            try:
                AutoscalingConfig(**self.ingress_autoscaling)
            except Exception as e:  # noqa: BLE001 - pydantic's error names the field
                raise ConfigError(f"ingress_autoscaling: {e}") from None

    @classmethod
    def from_dict(cls, d: dict) -> "ServeSettings":
        """From the YAML/args layout: {"models": [{name, model, ...}], "api_key", ...}."""
        if not isinstance(d, dict):
            raise ConfigError("the serving config must be a mapping with a 'models' list")
        known = {f.name for f in fields(cls)} - {"models"}
        unknown = set(d) - known - {"models"}
        if unknown:
            raise ConfigError(f"unknown serving setting(s): {', '.join(sorted(unknown))}")
        models = d.get("models")
        if not isinstance(models, list):
            raise ConfigError("'models' must be a list of {name, model, ...}")
        specs = [ModelSpec.from_entry(m) for m in models]
        kw = {k: d[k] for k in known if k in d}
        kw["api_key"] = str(kw.get("api_key") or os.environ.get(API_KEY_ENV, ""))
        return cls(models=tuple(specs), **kw)
