"""What the server hosts: the models (each a name clients use, a file, and how to run it) and the
front end's own settings. Read from a YAML file (`powerinfer serve --config`) or from the `args`
of a Ray Serve config file's application."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields

from powerinfer.config import Config
from powerinfer.errors import ConfigError

API_KEY_ENV = "POWERINFER_API_KEY"
CONTROL_CALLS = 32  # a model replica's room for calls that are not generations
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One served model. `name` is what requests put in `model`; `model` is a GGUF file, a
    Hugging Face folder or an installed model's short name (never taken from a request)."""

    name: str
    model: str
    bundle: str = ""
    cold_executors: int = 1
    device: str = "cpu"
    dtype: str = "auto"
    cpu_isa: str = "auto"  # the CPU kernel's instruction-set class (`Config.cpu_isa`)
    max_batch: int = 64
    max_queue: int = 256
    max_seq_len: int = 0
    kv_cache_gb: float = 0.0  # the paged KV cache (0: auto, from the host's memory)
    prefix_cache: bool = True
    prefill_chunk: int = 512  # prompt tokens a step at most (0: a prompt in one step)
    prefill_pace: float = 3.0  # beside decoding streams, a step takes about this x a decode step
    cpu_threads: int = 0
    predictor: str = "auto"
    predictor_device: str = "auto"  # beside a hot executor on a GPU: "auto" (that GPU) or "cpu"
    vram_budget_gb: float = 0.0
    cores: str = ""  # the cores its actor group is planned on (cpulist; "": every core)
    replicas: int = 1  # Serve replicas, each with its own actor group on its own share of cores
    resources: dict = field(default_factory=dict)  # Ray resources its group's node must have

    def __post_init__(self):
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise ConfigError(f"model name {self.name!r}: use 1-64 letters, digits and . _ : -")
        if not isinstance(self.resources, dict):
            raise ConfigError(f"model {self.name!r}: resources must be a mapping of Ray resource "
                              "names to amounts")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"model {self.name!r}: replicas must be a positive integer")
        self.config()  # validates the runtime settings

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's bound on a model replica's requests in flight: what its scheduler admits
        (max_batch running, max_queue waiting), and room for the status, metrics and tokenize
        calls beside them, so that /health answers under full load. Beyond it Serve queues,
        and the scheduler's own bound answers 429 first."""
        return self.max_batch + self.max_queue + CONTROL_CALLS

    def config(self, replica: int = 0) -> Config:
        """The runtime configuration of replica `replica` (Serve's local rank on its node):
        with several replicas each takes its own slice of the model's cores."""
        return Config(runtime="actors", bundle=self.bundle, cold_executors=self.cold_executors,
                      device=self.device, dtype=self.dtype, cpu_isa=self.cpu_isa,
                      max_batch=self.max_batch,
                      max_queue=self.max_queue, max_seq_len=self.max_seq_len,
                      kv_cache_gb=self.kv_cache_gb, prefix_cache=self.prefix_cache,
                      prefill_chunk=self.prefill_chunk, prefill_pace=self.prefill_pace,
                      cpu_threads=self.cpu_threads, predictor=self.predictor,
                      predictor_device=self.predictor_device, vram_budget_gb=self.vram_budget_gb,
                      cores=self.replica_cores(replica),
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


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """models: served models, routed by name. api_key: required on every request but /health and
    /metrics when set (default: the POWERINFER_API_KEY environment variable). max_body_bytes:
    larger request bodies are refused with 413. ingress_replicas: replicas of the HTTP/gRPC
    ingress (each keeps its own request metrics), or ingress_autoscaling: Ray Serve's
    `autoscaling_config` for it (min_replicas, max_replicas, target_ongoing_requests...).
    replica_resources: Ray resources the nodes
    running the ingress and the model deployments must have (on a cluster, e.g. {"head": 0.01}
    keeps them on the head while model groups run where their `resources` say)."""

    models: tuple[ModelSpec, ...]
    api_key: str = ""
    max_body_bytes: int = 1 << 20
    ingress_replicas: int = 1
    ingress_autoscaling: dict = field(default_factory=dict)  # Serve's autoscaling_config
    replica_resources: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.models:
            raise ConfigError("the server needs at least one model")
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"model names must be unique; repeated: {', '.join(sorted(dup))}")
        if self.max_body_bytes < 1024 or self.ingress_replicas < 1:
            raise ConfigError("max_body_bytes must be >= 1024 and ingress_replicas >= 1")
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
        spec_fields = {f.name for f in fields(ModelSpec)}
        specs = []
        for m in models:
            if not isinstance(m, dict) or "name" not in m or "model" not in m:
                raise ConfigError(f"each model needs a 'name' and a 'model' (file or installed "
                                  f"name), got {m!r}")
            bad = set(m) - spec_fields
            if bad:
                raise ConfigError(f"model {m['name']!r}: unknown setting(s) "
                                  f"{', '.join(sorted(bad))}")
            specs.append(ModelSpec(**m))
        kw = {k: d[k] for k in known if k in d}
        kw["api_key"] = str(kw.get("api_key") or os.environ.get(API_KEY_ENV, ""))
        return cls(models=tuple(specs), **kw)
