"""The Ray Serve application: one model deployment per served model behind one ingress.

`build_app` is the import path of the Serve config file (`serve run serve_app/config.yaml`);
`powerinfer serve` builds the same application from its flags or a models YAML file.
"""
from __future__ import annotations

from ray.serve import Application

from .ingress import Ingress
from .model import ModelServer
from .settings import ServeSettings

GRPC_SERVICER = "serve_app.grpc_host.add_inference_servicer"


def build(settings: ServeSettings, local_only: bool = False) -> Application:
    """The application; `local_only`: the HTTP front end listens on a loopback address, and
    takes requests naming it only by a loopback name or an address (`Ingress._check_host`)."""
    where = {"ray_actor_options": {"num_cpus": 0, "resources": dict(settings.replica_resources)}}
    models = {m.name: ModelServer.options(name=f"Model:{m.name}", num_replicas=m.replicas,
                                          max_ongoing_requests=m.max_ongoing_requests,
                                          **where).bind(m)
              for m in settings.models}
    scale = ({"autoscaling_config": dict(settings.ingress_autoscaling)}
             if settings.ingress_autoscaling else {"num_replicas": settings.ingress_replicas})
    return Ingress.options(**scale, **where).bind(models, settings.api_key,
                                                  settings.max_body_bytes,
                                                  settings.stream_interval_ms, local_only)


def build_app(args: dict) -> Application:
    """Ray Serve's application builder: `args` as in a models YAML file
    ({"models": [{"name", "model", ...}], "api_key", "max_body_bytes", "ingress_replicas"})."""
    return build(ServeSettings.from_dict(args))
