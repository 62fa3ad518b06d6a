"""The GPU path on a real GPU: device buffers shared by two processes through CUDA IPC, and the
hybrid actor runtime on the GPU (hot neurons, attention and the predictor there, cold neurons
on CPU executors) against the in-process engine, on a synthetic model written here (no model
package needed). Skipped without a CUDA device."""
import multiprocessing as mp

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: the GPU path")

PROMPTS = ["The capital of France is", "Once upon a time"]
N = 16


def _peer(handles, go, done):
    """A second process: waits for the first's writes on the device, answers 2x+1."""
    from actors.device_buffers import DeviceBuffer
    torch.cuda.init()
    a, b = (DeviceBuffer.open(h) for h in handles)
    shape = go.get()
    a.consume()  # the writer's copy, ordered on the device
    b.view(torch.float32, shape).copy_(a.view(torch.float32, shape) * 2 + 1)
    b.publish()
    done.put(int(b.ptr != 0))
    go.get()  # stay alive (the mapping) until the reader is done
    a.close(), b.close()


def test_device_buffers_cross_two_processes():
    """What one process writes into a device buffer, another reads after waiting on its
    interprocess event, and answers in a second buffer: no host copy between them."""
    from actors import device_buffers
    if not device_buffers.available():
        pytest.skip("CuPy is not installed: the device buffers need it")
    ctx = mp.get_context("spawn")
    a, b = device_buffers.DeviceBuffer(1 << 20), device_buffers.DeviceBuffer(1 << 20)
    go, done = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=_peer, args=((a.handle(), b.handle()), go, done))
    peer.start()
    try:
        shape = (64, 1024)
        b.view(torch.float32, shape).fill_(float("nan"))  # poisoned: every element is written
        x = torch.randn(shape, device="cuda")
        a.view(torch.float32, shape).copy_(x)
        a.publish()
        go.put(shape)
        assert done.get(timeout=120) == 1
        b.consume()
        got = b.view(torch.float32, shape).clone()
        go.put(None)
        torch.testing.assert_close(got, x * 2 + 1)
    finally:
        peer.join(timeout=60)
        if peer.is_alive():
            peer.kill()
    assert peer.exitcode == 0
    a.close(), b.close()


def test_predictors_train_on_the_gpu_as_on_the_cpu():
    # the training steps on the device (`train_predictors(device="auto")` there): the same
    # draws and schedule, weights back on the host, the held-out recall the CPU's reaches
    from powerinfer.sparsity.train import train_layer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 64, generator=g)
    w = torch.randn(256, 16, generator=g) @ torch.randn(16, 64, generator=g) / 32  # (rank 16)
    pre = x @ w.T - 0.5
    fired, mag = pre > 0, pre.clamp_min(0)[-500:]
    got = {dev: train_layer(x, fired, mag, 32, epochs=6, device=dev) for dev in ("cpu", "cuda")}
    for fc1, fc2, m in got.values():
        assert fc1.shape == (32, 64) and fc2.shape == (256, 32) and m["recall_mass"] > 0.97, m
    assert abs(got["cuda"][2]["recall_mass"] - got["cpu"][2]["recall_mass"]) < 0.01
    # (the CPU's own seeds differ by 0.03 in the share of neurons marked)
    assert abs(got["cuda"][2]["active_share"] - got["cpu"][2]["active_share"]) < 0.1


def test_a_profile_on_the_gpu_counts_as_the_cpus(tmp_path):
    # `profile(device="auto")` on a GPU host: the same windows through the same model on the
    # device, float32: the firing counts equal the CPU's up to a rare near-zero pre-activation,
    # the samples' rows the same positions
    from powerinfer.sparsity.profile import ProfileOptions, profile
    from powerinfer.sparsity.synthetic import write_synthetic

    m = write_synthetic(tmp_path / "tiny.gguf", "tiny", seed=2, progress=False)
    opts = ProfileOptions(tokens=512, window=128, samples=200)
    b = {dev: profile(str(m.path), "lee", tmp_path / dev, opts, progress=False, device=dev)
         for dev in ("cpu", "cuda")}
    assert b["cuda"].manifest.settings["stats"]["device"] == "cuda"
    (c_cpu, m_cpu, t_cpu), (c_gpu, m_gpu, t_gpu) = b["cpu"].stats(), b["cuda"].stats()
    assert t_cpu == t_gpu == 512
    for x, y in zip(c_cpu, c_gpu):
        assert np.abs(x - y).sum() <= 0.001 * x.sum()
    for x, y in zip(m_cpu, m_gpu):
        np.testing.assert_allclose(x, y, rtol=1e-2, atol=1e-3 * float(np.abs(x).max()))
    s_cpu, s_gpu = b["cpu"].samples(0), b["cuda"].samples(0)
    np.testing.assert_allclose(s_cpu["x_layer"].astype(np.float32),
                               s_gpu["x_layer"].astype(np.float32), rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A tiny synthetic model with a bundle: profile, lookahead predictors, and a placement
    whose budget holds attention, embeddings and the head and about a third of the FFN."""
    from powerinfer.sparsity.train import train_predictors
    from powerinfer.sparsity.profile import ProfileOptions, profile
    from powerinfer.sparsity.solver import solve_bundle
    from powerinfer.sparsity.synthetic import write_synthetic

    d = tmp_path_factory.mktemp("gpu")
    m = write_synthetic(d / "tiny.gguf", "tiny", seed=0, progress=False)
    b = profile(str(m.path), "lee", d / "bundle", ProfileOptions(tokens=1024, window=256,
                                                                 samples=1000), progress=False)
    train_predictors(b, "layer", ranks=[64], epochs=4, progress=False)
    budget_gb = 8.5 / 1024
    solve_bundle(b, budget_gb, batch=2, context=256, dtype_bytes=2, predictor_input="layer")
    yield str(m.path), str(b.path), budget_gb
    import ray
    ray.shutdown()


def test_hybrid_on_gpu_equals_the_in_process_engine(synthetic):
    """The actor runtime with its hot executor and predictor on the GPU (device buffers between
    them) decodes greedily as the in-process engine on the GPU does, up to a near-tie; with the
    predictor on the CPU (host channels) too, and with its decode step replayed as CUDA graphs
    or launched op by op; the hot executor keeps the VRAM budget."""
    from powerinfer import Config, PowerInfer

    from greedy import assert_same_or_near_tie, greedy_tokens

    path, bundle, budget_gb = synthetic
    base = dict(dtype="bfloat16", device="cuda", max_seq_len=256, max_batch=1, bundle=bundle,
                predictor="layer")
    ref = PowerInfer.from_pretrained(path, Config(**base))
    want = {p: greedy_tokens(ref, p, N) for p in PROMPTS}
    # the decode step replayed as CUDA graphs (the default), with the predictor on the GPU and
    # on the host; and launched op by op
    for where, graphs in (("auto", True), ("cpu", True), ("auto", False)):
        pi = PowerInfer.from_pretrained(path, Config(**base, runtime="actors", cold_executors=2,
                                                     predictor_device=where, cuda_graphs=graphs))
        try:
            got = {p: greedy_tokens(pi, p, N) for p in PROMPTS}
            st = pi.engine.stats()["actors"]
            info = pi.engine._group().info
        finally:
            pi.close()
        hot, pred = st["hot"], st["predictor"]
        assert hot["device"].startswith("cuda") and hot["steps"] > 0, hot
        # what the placement put there (weights, hot neurons, KV cache) within the budget; the
        # peak adds the step's activations and the libraries' workspaces (cuBLAS's among them)
        # (the predictor's matrices count where it shares the GPU: the solver counts them too)
        assert 0 < hot["held_bytes"] + pred.get("device_bytes", 0) <= budget_gb * 2**30, (hot, pred)
        assert hot["device_peak_bytes"] - hot["held_bytes"] < 64 << 20, hot
        if where == "auto":  # the predictor on the GPU, its input and masks in device buffers
            assert pred["device"].startswith("cuda") and info["hot"]["device_buffers"], (pred, info)
            assert hot["device_buffer_bytes"] > 0 and pred["device_bytes"] > 0
        else:
            assert pred["device"] == "cpu" and not info["hot"]["device_buffers"], (pred, info)
        assert pred["calls"] >= N * 4, pred  # every decode layer asked it
        g = hot["graphs"]  # one eager step at height 1, then captured and replayed
        assert g["off"] is None and g["fallback"] == 0, g
        assert (g["replayed"] >= len(PROMPTS) * (N - 2) and g["captured"]) if graphs else \
            (g["replayed"] == 0 and g["eager"] == 0), g
        for p in PROMPTS:
            assert_same_or_near_tie(ref, ref.tokenize(p), want[p], got[p], 0.1)


@pytest.fixture(scope="module")
def synthetic_q4(tmp_path_factory):
    """The tiny synthetic model in Q4_0 blocks, with its bundle and a placement that counts the
    hot neurons at their 4-bit records' bytes and attention at its blocks' bytes
    (`Config(weights="int4")` on a GPU)."""
    from powerinfer import Config
    from powerinfer.model.convert import kernel_ready
    from powerinfer.formats.loader import load_checkpoint
    from powerinfer.engine.partial import device_fixed_bytes
    from powerinfer.sparsity.train import train_predictors
    from powerinfer.sparsity.profile import ProfileOptions, profile
    from powerinfer.sparsity.solver import solve_bundle
    from powerinfer.sparsity.synthetic import write_synthetic

    d = tmp_path_factory.mktemp("gpu_q4")
    m = write_synthetic(d / "tiny-q4_0.gguf", "tiny", seed=0, quant="q4_0", progress=False)
    b = profile(str(m.path), "lee", d / "bundle", ProfileOptions(tokens=1024, window=256,
                                                                 samples=1000), progress=False)
    train_predictors(b, "layer", ranks=[64], epochs=4, progress=False)
    budget_gb = 4.5 / 1024  # (3.7 MB fixed in blocks, then about 40% of the neurons)
    ck = kernel_ready(load_checkpoint(str(m.path), with_weights=False),
                      Config(dtype="bfloat16", weights="int4"))  # (the copy the runtime reads)
    solve_bundle(b, budget_gb, batch=2, context=256, dtype_bytes=2, predictor_input="layer",
                 neuron_fmt="q4_0", fixed_bytes=device_fixed_bytes(ck.source, ck.args, 2))
    yield str(m.path), str(b.path), budget_gb
    import ray
    ray.shutdown()


def test_hybrid_on_gpu_keeps_a_4bit_files_hot_neurons_in_its_blocks(synthetic_q4):
    """Config(weights="int4") on the GPU, the actor runtime's default there: the hot executor holds its hot neurons as the file's
    Q4_0 records and attention's matrices in their blocks (the placement counted them so), the
    Triton kernels read them in graphed decode steps, and greedy decoding matches the in-process
    engine on the GPU (its neuron sets in the same records there, attention in bf16) up to a
    near-tie; the budget holds."""
    from powerinfer import Config, PowerInfer
    from powerinfer.formats.bundle import Bundle
    from powerinfer.model.sparse import hybrid_layers

    from greedy import assert_same_or_near_tie, greedy_tokens

    path, bundle, budget_gb = synthetic_q4
    base = dict(dtype="bfloat16", device="cuda", max_seq_len=256, max_batch=1, bundle=bundle,
                predictor="layer")
    ref = PowerInfer.from_pretrained(path, Config(**base, weights="int4"))
    assert all(f.cold.fmt == "q4_0" and f.cold.records.is_cuda for f in hybrid_layers(ref.model))
    want = {p: greedy_tokens(ref, p, N) for p in PROMPTS}
    # (the actor runtime's default on a GPU: weights "auto" keeps the file's blocks there)
    pi = PowerInfer.from_pretrained(path, Config(**base, runtime="actors", cold_executors=2))
    assert (pi.config.weights, pi.config.cold_weights) == ("int4", "int4"), pi.config
    try:
        got = {p: greedy_tokens(pi, p, N) for p in PROMPTS}
        st = pi.engine.stats()["actors"]
    finally:
        pi.close()
    hot, pred = st["hot"], st["predictor"]
    placed = Bundle.open(bundle).load_json("placement.json")
    assert hot["neuron_format"] == "q4_0" and hot["hot_neurons"] == sum(placed["hot_counts"])
    assert 0 < hot["hot_neurons"] < 4 * 1024  # (the cold executors hold the rest)
    assert 0 < hot["held_bytes"] + pred.get("device_bytes", 0) <= budget_gb * 2**30, (hot, pred)
    assert hot["device_peak_bytes"] - hot["held_bytes"] < 64 << 20, hot
    g = hot["graphs"]
    assert g["off"] is None and g["fallback"] == 0 and g["replayed"] >= len(PROMPTS) * (N - 2), g
    for p in PROMPTS:
        assert_same_or_near_tie(ref, ref.tokenize(p), want[p], got[p], 0.25)
