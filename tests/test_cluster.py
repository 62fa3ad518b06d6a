"""The Serve application on a real two-node Ray cluster (two raylets on this machine, token
authentication on): one model's actor group is pinned to node 2 by a custom resource and serves
from there, the other model's to the head; removing node 2 leaves the other model serving and
makes the pinned one report unavailable, until a node with the resource returns. And a local
start beside a cluster recorded on the machine (this one) does not join it."""
import os

import httpx2 as httpx
import pytest
import ray

from powerinfer.sparsity.synthetic import write_synthetic

from test_serve import free_port, wait_for

pytestmark = pytest.mark.slow
KEY = "cluster-key-81c2"
MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray._raylet import Config
    from ray.cluster_utils import Cluster

    from ray._private.authentication.authentication_token_setup import (
        ensure_token_if_auth_enabled)

    os.environ["RAY_AUTH_MODE"] = "token"  # the nodes this starts inherit it
    Config.initialize("")
    # Cluster starts its GCS without ray.init's step that writes ~/.ray/auth_token on a machine
    # that has none yet: the GCS then exits at start (a fresh machine, this module run first)
    ensure_token_if_auth_enabled()
    ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"head": 1}, "object_store_memory": 200 * MiB})
    node2 = c.add_node(num_cpus=1, resources={"node2": 1}, object_store_memory=200 * MiB)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="warning")
    d = tmp_path_factory.mktemp("cluster")
    for seed, name in enumerate(("a", "b")):
        write_synthetic(d / f"{name}.gguf", "tiny", seed=seed, progress=False)
    yield c, node2, d
    from ray import serve
    serve.shutdown()
    ray.shutdown()
    c.shutdown()


def test_a_model_pinned_to_node_2_serves_from_there_and_survives_losing_it(cluster):
    from ray import serve

    from serve_app.app import build
    from serve_app.settings import ServeSettings

    c, node2, d = cluster
    settings = ServeSettings.from_dict({"api_key": KEY, "replica_resources": {"head": 0.01},
                                        "models": [
        {"name": "a", "model": str(d / "a.gguf"), "max_seq_len": 128, "max_batch": 2,
         "resources": {"head": 1}},
        {"name": "b", "model": str(d / "b.gguf"), "max_seq_len": 128, "max_batch": 2,
         "resources": {"node2": 1}}]})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(settings), name="powerinfer", route_prefix="/")
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                        headers={"Authorization": f"Bearer {KEY}"})

    answers = []  # (model, status, body) of the last requests: what a failure shows

    def complete(model: str) -> int:
        try:
            r = http.post("/v1/completions", json={"model": model, "prompt": "hello",
                                                   "max_tokens": 4})
        except httpx.HTTPError as e:
            answers[:] = answers[-4:] + [(model, 0, repr(e)[:300])]
            return 0
        answers[:] = answers[-4:] + [(model, r.status_code, r.text[:300])]
        return r.status_code

    assert wait_for(lambda: complete("a") == 200 and complete("b") == 200, timeout=240,
                    every=0.5)
    head_id = ray.get_runtime_context().get_node_id()  # this driver runs on the head
    nodes = {m: serve.get_deployment_handle(f"Model:{m}", app_name="powerinfer")
             .stats.remote().result(timeout_s=60)["nodes"] for m in ("a", "b")}
    assert set(nodes["b"].values()) == {node2.node_id}, nodes  # every actor of b's group
    assert set(nodes["a"].values()) == {head_id}, nodes

    c.remove_node(node2)
    # b's group is gone and cannot be placed again; a keeps serving all along
    codes_b = []
    assert wait_for(lambda: codes_b.append(complete("b")) or codes_b[-1] in (503, 404),
                    timeout=120, every=1), codes_b
    for _ in range(5):
        assert complete("a") == 200
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["a"]["status"] == "ready" and models["b"]["status"] != "ready", models

    # a node with the resource returns: b is rebuilt there and answers again
    node3 = c.add_node(num_cpus=1, resources={"node2": 1}, object_store_memory=200 * MiB)
    assert wait_for(lambda: complete("b") == 200, timeout=300, every=1), answers
    b = serve.get_deployment_handle("Model:b", app_name="powerinfer").stats.remote().result(
        timeout_s=60)
    assert set(b["nodes"].values()) == {node3.node_id}, b
    assert complete("a") == 200
    http.close()


def test_a_local_start_does_not_join_a_cluster_recorded_on_the_machine(cluster):
    # `ray.init()` with no address joins the cluster a `ray start` recorded on the machine
    # (/tmp/ray/ray_current_cluster; this module's cluster is recorded there): perhaps one
    # started without authentication, or another user's. Without RAY_ADDRESS the project's
    # processes start their own instance beside it (with this user's token, joining would work)
    import subprocess
    import sys

    from ray._private.utils import read_ray_address
    c = cluster[0]
    assert read_ray_address() == c.address  # recorded where ray.init() looks
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    code = ("import ray\n"
            "from powerinfer.compat import ray_init\n"
            "ray_init()\n"
            "print('GCS', ray.get_runtime_context().gcs_address, flush=True)\n"
            "ray.shutdown()\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=180)
    gcs = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("GCS ")]
    assert gcs and gcs[0] != c.address, r.stdout + r.stderr[-2000:]
