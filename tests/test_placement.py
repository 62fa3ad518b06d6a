"""The placement planner on the shipped EPYC box description and on this machine: disjoint core
sets, cold executors near their GPU, memory within each node, refusals that name what is short,
and `powerinfer plan` printing the table."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.placement import Host, ModelSpec, PlanError, models_from_yaml, plan
from cluster.topology import parse_cpulist

ROOT = Path(__file__).resolve().parent.parent
EPYC = ROOT / "cluster" / "hosts" / "epyc-9554-2s.yaml"
MODELS = ROOT / "cluster" / "hosts" / "models-example.yaml"
POWERINFER = Path(sys.executable).with_name("powerinfer")


def test_the_epyc_box_hosts_four_models_on_disjoint_cores():
    host = Host.from_yaml(EPYC)
    assert len(host.nodes) == 8 and host.cores == 128 and len(host.gpus) == 4
    models = models_from_yaml(MODELS)
    p = plan(host, models)
    assert [g.model for g in p.groups] == [m.name for m in models]
    seen = []
    for g in p.groups:
        seen += g.cores()
        node_of = {c: n.id for n in host.nodes for c in n.cores}
        # the hot executor, scheduler and predictor on the home node; each cold executor on one node
        assert {node_of[c] for c in (*g.hot, *g.scheduler, *g.predictor)} == {g.home}
        for node, cores in g.cold:
            assert {node_of[c] for c in cores} == {node}
        if g.gpu is not None:  # its GPU's nearest node is home, and cold executors start there
            gpu = host.gpus[g.gpu]
            assert g.home == gpu.numa_node and g.cold[0][0] == gpu.numa_node
    assert len(seen) == len(set(seen)), "a core planned twice"
    for n in host.nodes:
        assert sum(g.memory_gb.get(n.id, 0) for g in p.groups) <= n.memory_gb
    vram = {}
    for g in p.groups:
        if g.gpu is not None:
            vram[g.gpu] = vram.get(g.gpu, 0) + g.vram_gb
    assert all(v <= host.gpus[i].memory_gb for i, v in vram.items())
    table = p.table()
    for m in models:
        assert f"| {m.name} |" in table


def test_a_plan_that_does_not_fit_names_what_is_short(tmp_path):
    host = Host.from_yaml(EPYC)
    big = ModelSpec("huge", 10, 900, 1, 1e-4, cold_executors=2, cores_per_cold=8)
    with pytest.raises(PlanError, match=r"model huge: cold executor 0 needs 8 cores and .* GB short"):
        plan(host, [big])
    gpu = dataclasses.replace(big, name="gpu-hungry", ffn_gb=10, vram_budget_gb=30)
    with pytest.raises(PlanError, match=r"gpu-hungry: wants 30.0 GB of VRAM; .* 7.0 GB short"):
        plan(host, [gpu])
    many = [dataclasses.replace(big, name=f"m{i}", ffn_gb=10, cores_per_cold=16, cold_executors=1)
            for i in range(8)]
    with pytest.raises(PlanError, match=r"cores? short .*give it fewer cold_executors; 0: one "
                                        r"executor with the whole model"):
        plan(host, many)
    # (a 2-core host, one model with a cold executor: "1 cores short")
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({"numa_nodes": [{"id": 0, "cores": "0-1", "memory_gb": 16}]}))
    small = ModelSpec("small", 0.1, 0.1, 0.1, 1e-6, cold_executors=1, cores_per_cold=1,
                      hot_cores=1, predictor=False)
    with pytest.raises(PlanError, match=r"has 0 cores and .*: 1 core short \(give it fewer"):
        plan(Host.from_yaml(two), [small])
    assert plan(Host.from_yaml(two), [dataclasses.replace(small, cold_executors=0)])
    bad = tmp_path / "host.yaml"
    bad.write_text(yaml.safe_dump({"numa_nodes": [{"id": 0, "cores": "0-3", "memory_gb": 8}],
                                   "gpus": [{"id": 0, "memory_gb": 24, "numa_node": 3}]}))
    with pytest.raises(PlanError, match="gpu 0 names a NUMA node"):
        Host.from_yaml(bad)
    node = {"id": 0, "cores": "0-3", "memory_gb": 8}
    for nodes, needle in [([node, node], "its own id"), ([{**node, "memory_gb": -10}], "over 0"),
                          ([node, {**node, "id": 1}], "two NUMA nodes")]:
        bad.write_text(yaml.safe_dump({"numa_nodes": nodes}))
        with pytest.raises(PlanError, match=needle):
            Host.from_yaml(bad)
    # a models file's mistakes are named (two models of one name were planned on the same
    # cores; a misspelt key planned with its default; broken YAML was a traceback)
    shape = {"dim": 4096, "n_ff": 11008, "layers": 32, "heads": 32, "kv_heads": 32,
             "vocab": 32000}
    models = tmp_path / "models.yaml"
    for body, needle in [({"models": [{"name": "s", "params": shape}] * 2}, "listed twice"),
                         ({"models": [{"name": "s", "params": shape, "cold_executor": 2}]},
                          "unknown keys"),
                         ("models: [name: s", "not a YAML file"), ("- a list", "a mapping"),
                         ({"models": [{"name": "z", "params": {**shape, "heads": 0}}]},
                          "must be >= 1")]:
        models.write_text(body if isinstance(body, str) else yaml.safe_dump(body))
        with pytest.raises(PlanError, match=needle):
            models_from_yaml(models)


def test_this_machine_from_sysfs_and_the_command_line(tmp_path, default_model_path):
    host = Host.read()
    assert host.cores >= 1 and all(n.memory_gb > 0 for n in host.nodes)
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": [
        {"name": "smol", "model": str(default_model_path), "cold_executors": 1,
         "cores_per_cold": 1, "hot_cores": 1, "predictor": False}]}))
    spec = models_from_yaml(models)[0]
    # sizes from the file's header: the 4-bit FFN with its down rows in Q8_0, about the file
    total = spec.weights_gb * 1e9
    assert 0.9 * default_model_path.stat().st_size < total < 1.3 * default_model_path.stat().st_size
    out = subprocess.run([str(POWERINFER), "plan", "--host", str(EPYC), "--models", str(models)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| smol |" in out.stdout and "of 128 cores planned" in out.stdout
    # the plan as a models file for `powerinfer serve`, loaded by the application's own loader
    from serve_app.settings import ServeSettings
    written = tmp_path / "serve.yaml"
    out = subprocess.run([str(POWERINFER), "plan", "--host", str(EPYC), "--models", str(models),
                          "--serve-config", str(written)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    (smol,) = ServeSettings.from_dict(yaml.safe_load(written.read_text())).models
    group = plan(Host.from_yaml(EPYC), [spec]).groups[0]
    assert smol.model == str(default_model_path) and smol.base.cold_executors == 1
    assert set(parse_cpulist(smol.cores)) == set(group.cores())
    out = subprocess.run([str(POWERINFER), "plan", "--host", str(tmp_path / "nope.yaml"),
                          "--models", str(models)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "error:" in out.stderr


def test_ray_start_advertises_the_numa_nodes():
    import json

    from cluster.start import ray_start_command
    from cluster.topology import Topology

    topo = Topology(((0, 1, 2, 3), (4, 5, 6, 7)))
    cmd = ray_start_command(["--head", "--port", "6380", "--resources", '{"gpu_kind": 1}'], topo)
    assert cmd[1:5] == ["start", "--head", "--port", "6380"]
    assert json.loads(cmd[cmd.index("--resources") + 1]) == {
        "numa_node_0": 4.0, "numa_node_1": 4.0, "gpu_kind": 1}
    assert cmd.count("--resources") == 1
    cmd = ray_start_command(["--address=h:6379", '--resources={"x": 2}'], topo)
    assert json.loads(cmd[-1]) == {"numa_node_0": 4.0, "numa_node_1": 4.0, "x": 2}
