"""The deployment files: the KubeRay manifest's structure, its serveConfigV2 loaded with the
application's own loader, the Dockerfile's inputs, and the systemd unit."""
import configparser
import re
from pathlib import Path

import yaml

from serve_app.app import GRPC_SERVICER
from serve_app.settings import ServeSettings

ROOT = Path(__file__).resolve().parent.parent


def test_the_rayservice_manifest_serves_the_application_with_token_auth():
    d = yaml.safe_load((ROOT / "cluster" / "k8s" / "rayservice.yaml").read_text())
    assert d["apiVersion"] == "ray.io/v1" and d["kind"] == "RayService"
    serve = yaml.safe_load(d["spec"]["serveConfigV2"])
    assert serve["http_options"]["port"] == 8000 and serve["grpc_options"]["port"] == 9000
    assert serve["grpc_options"]["grpc_servicer_functions"] == [GRPC_SERVICER]
    (app,) = serve["applications"]
    assert app["import_path"] == "serve_app.app:build_app"
    settings = ServeSettings.from_dict(app["args"])  # the application's own loader
    assert [m.name for m in settings.models] == ["smollm2-135m-instruct"]
    settings.models[0].config()  # a valid Config

    cluster = d["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in head["ports"]} >= {8000, 9000}
    for probe in ("readinessProbe", "livenessProbe"):
        assert head[probe]["httpGet"] == {"path": "/health", "port": 8000}
    groups = [head] + [g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]
    for c in groups:
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]
    worker = cluster["workerGroupSpecs"][0]
    assert "numa_node_0" in worker["rayStartParams"]["resources"]
    vols = worker["template"]["spec"]["volumes"]
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in vols)  # /dev/shm


def test_both_serve_configs_follow_serves_conventions():
    """Serve's own schema accepts them; the ingress autoscales, each model deployment's
    max_ongoing_requests follows its scheduler's bounds, and requests have a timeout."""
    import pytest
    from ray.serve.schema import ServeDeploySchema

    from powerinfer.errors import ConfigError
    from serve_app.app import build
    from serve_app.settings import CONTROL_CALLS

    manifest = yaml.safe_load((ROOT / "cluster" / "k8s" / "rayservice.yaml").read_text())
    for cfg in (yaml.safe_load((ROOT / "serve_app" / "config.yaml").read_text()),
                yaml.safe_load(manifest["spec"]["serveConfigV2"])):
        ServeDeploySchema.model_validate(cfg)  # every key is one Serve knows
        assert cfg["http_options"]["request_timeout_s"] > 0
        assert cfg["grpc_options"]["request_timeout_s"] > 0
        settings = ServeSettings.from_dict(cfg["applications"][0]["args"])
        ingress = build(settings)._bound_deployment
        scaling = ingress._deployment_config.autoscaling_config
        assert scaling is not None and scaling.max_replicas > scaling.min_replicas >= 1
        for spec in settings.models:
            model = ingress.init_args[0][spec.name]._bound_deployment
            assert model.max_ongoing_requests == spec.max_batch + spec.max_queue + CONTROL_CALLS
    args = {"models": [{"name": "m", "model": "smollm2-135m-instruct"}]}
    assert build(ServeSettings.from_dict(args))._bound_deployment.num_replicas == 1
    with pytest.raises(ConfigError, match="ingress_autoscaling"):
        ServeSettings.from_dict({**args, "ingress_autoscaling": {"max_replicas": 0}})
    with pytest.raises(ConfigError, match="not both"):
        ServeSettings.from_dict({**args, "ingress_autoscaling": {"max_replicas": 2},
                                 "ingress_replicas": 2})


def test_the_dockerfile_and_the_systemd_unit():
    docker = (ROOT / "Dockerfile").read_text()
    assert "torch==2.13.0" in docker and 'ENTRYPOINT ["powerinfer", "serve"' in docker
    for src in re.findall(r"^COPY (\S+)", docker, re.M):  # every input exists
        assert (ROOT / src).exists(), src
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "cluster" / "systemd" / "powerinfer.service")
    assert "powerinfer serve" in unit["Service"]["ExecStart"]
    assert unit["Service"]["KillSignal"] == "SIGTERM"
