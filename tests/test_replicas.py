"""A model with two Serve replicas on one host: two actor groups on disjoint cores, with requests
spread over both (a real `powerinfer serve` process, real HTTP, each group's own counters)."""
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
import yaml
from test_serve import APP, KEY, POWERINFER, allowed_cores, free_port, join_servers_ray

from powerinfer.sparsity.synthetic import write_synthetic

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                 reason="two replicas on disjoint cores need two cores")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    write_synthetic(d / "tiny.gguf", "tiny", seed=1, progress=False)
    cores = sorted(os.sched_getaffinity(0))[:2]
    (d / "models.yaml").write_text(yaml.safe_dump({"models": [
        {"name": "tiny", "model": str(d / "tiny.gguf"), "max_seq_len": 256, "max_batch": 2,
         "replicas": 2, "cores": ",".join(map(str, cores))}]}))
    port, log = free_port(), d / "server.log"
    proc = subprocess.Popen([str(POWERINFER), "serve", "--config", str(d / "models.yaml"),
                             "--port", str(port), "--grpc-port", str(free_port()),
                             "--api-key", KEY], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 300
    while "HTTP (OpenAI API)" not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    join_servers_ray(log, proc)
    yield f"http://127.0.0.1:{port}", set(cores)
    import ray
    ray.shutdown()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def test_two_replicas_hold_two_groups_on_disjoint_cores_and_share_the_load(server):
    from ray import serve
    url, cores = server
    with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        def one(i):
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": f"hello {i}",
                                                "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200, r.text
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(24)))
    handle = serve.get_deployment_handle("Model:tiny", app_name=APP)
    seen = {}
    for _ in range(60):  # each call reaches one replica; collect both
        st = handle.stats.remote().result(timeout_s=60)
        seen[st["replica"]] = st
        if len(seen) == 2:
            break
    assert sorted(seen) == [0, 1], seen
    pinned = []
    for st in seen.values():
        assert st["requests"] > 0, seen  # each group served some of the requests
        pinned.append(set().union(*(allowed_cores(p) for k, p in st["pids"].items()
                                    if k == "hot" or k.startswith("cold"))))
    assert not pinned[0] & pinned[1] and pinned[0] | pinned[1] <= cores, pinned
    assert seen[0]["pids"]["scheduler"] != seen[1]["pids"]["scheduler"]
