"""Reading a share of a model from its file (`TensorSource`, `partial.read_neuron_set`): the
rows, columns and blocks read equal those of the whole tensor read at once, and a neuron set
read on its own equals the one cut from the dense model, byte for byte, in every format. Real
files: the default model (Q4_1, Q8_0 embedding) and a synthetic bf16 one."""
import pickle

import pytest
import torch

from powerinfer import kernels
from powerinfer.formats.loader import load_checkpoint
from powerinfer.formats.gguf import open_gguf
from powerinfer.engine.partial import read_neuron_set
from powerinfer.engine.plan import SparsePlan
from powerinfer.model.sparse import BlockSlice, NeuronSet
from powerinfer.sparsity.synthetic import write_synthetic


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("partial") / "tiny.gguf"
    write_synthetic(path, "tiny", progress=False)
    return path


@pytest.fixture(params=["default", "synthetic"])
def model(request, default_model_path, synthetic):
    return default_model_path if request.param == "default" else synthetic


def test_rows_columns_and_blocks_equal_the_whole_tensor(model):
    src = pickle.loads(pickle.dumps(load_checkpoint(model, with_weights=False).source))
    idx = torch.tensor([0, 3, 4, 17, 100, 255])
    for name in ("0.up", "1.down", "embed"):
        whole = src.get(name, torch.float32)
        assert torch.equal(src.rows(name, idx, torch.float32), whole[idx])
        assert torch.equal(src.columns(name, idx, torch.float32), whole[:, idx].t())
        out = torch.zeros(len(idx), 2, whole.shape[1])
        src.rows_into(name, idx, out[:, 1])  # a strided destination
        assert torch.equal(out[:, 1], whole[idx]) and not out[:, 0].any()
        raw = src.raw_rows(name, idx)
        if raw is not None:
            fmt = src.kind(name).lower()
            assert torch.equal(kernels.dequantize_rows(raw, fmt, whole.shape[1]), whole[idx])
    none = torch.tensor([], dtype=torch.long)
    assert src.rows("0.up", none, torch.float32).shape == (0, src.shape("0.up")[1])
    assert src.columns("0.down", none, torch.float32).shape == (0, src.shape("0.down")[0])
    # q and k come back in the model's row order, as the eager load gives them
    ck = load_checkpoint(model, torch.float32)
    assert torch.equal(src.get("0.q", torch.float32), ck.weights["0.q"])


def _mapping_of(t: torch.Tensor) -> str:
    """The name /proc/self/maps gives the mapping that holds t's first byte ("" anonymous)."""
    p = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= p < hi:
                return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{p:#x} is in no mapping")


def test_the_embedding_reads_the_files_own_pages(default_model_path):
    """A quantized embedding is looked up in the file's pages, not in a copy of the whole table
    (a copy cost each process that embeds the table's size: Gemma 3's is 170 MiB), and its rows
    equal the file's rows widened; the tied Q8_0 head still answers as the file's rows do."""
    from powerinfer import Config, PowerInfer
    from powerinfer.model.quant import KernelEmbedding

    pi = PowerInfer.from_pretrained(default_model_path, Config(max_seq_len=64, max_batch=1))
    try:
        emb = pi.engine.model.tok_embeddings
        assert isinstance(emb, KernelEmbedding), type(emb)
        assert _mapping_of(emb.records) == str(default_model_path.resolve())
        src = load_checkpoint(default_model_path, with_weights=False).source
        tokens = torch.tensor([0, 1, 17, 4242, src.shape("embed")[0] - 1])
        rows = kernels.dequantize_rows(src.raw_rows("embed", tokens), emb.fmt, emb.dim)
        assert torch.equal(emb(tokens).float(), rows.to(emb.dtype).float())
        # the head over the same rows: its logits against the file's rows times a hidden state
        h = torch.randn(1, emb.dim, generator=torch.Generator().manual_seed(0))
        logits = pi.engine.model.output(h.to(emb.dtype)).float()
        ref = h @ src.get("embed", torch.float32).t()
        assert torch.corrcoef(torch.stack([logits[0], ref[0]]))[0, 1] > 0.999
    finally:
        pi.close()


def test_the_4bit_load_never_widens_what_it_holds_as_blocks(default_model_path, monkeypatch):
    """The in-process 4-bit configuration reads each projection, the embedding and the tied head
    as the file's blocks: none of them is widened to 16 bits at load (a whole model widened and
    then dropped cost a 7B-shape file its resident size seven times over at the peak). Only
    what no block format takes (the norms) is read widened, and the model answers as one
    loaded the eager way (the file's tensors widened first, then replaced)."""
    from powerinfer import Config, PowerInfer
    from powerinfer import api
    from powerinfer.formats.gguf import GGUFSource

    if not kernels.available():
        pytest.skip("the CPU kernel does not run here: the 4-bit configuration needs it")
    widened = []
    read_into = GGUFSource.read_into
    monkeypatch.setattr(GGUFSource, "read_into",
                        lambda self, name, out: widened.append(name) or read_into(self, name, out))
    cfg = Config(dtype="bfloat16", weights="int4", max_seq_len=64, max_batch=1)
    pi = PowerInfer.from_pretrained(default_model_path, cfg)
    names = {n.split(".")[-1] for n in widened}
    assert names and names <= {"attn_norm", "ffn_norm", "norm"}, sorted(names)
    monkeypatch.setattr(api, "_read_in_place", lambda ck, config: False)  # the eager load
    eager = PowerInfer.from_pretrained(default_model_path, cfg)
    assert {"q", "gate", "down", "embed"} <= {n.split(".")[-1] for n in widened}
    ids = pi.tokenize("The capital of France is Paris, and the capital of Italy is")
    assert torch.equal(pi.engine.logits(ids), eager.engine.logits(ids))


def _held_once(path, imports: str, model: str):
    """Loads `model` (a Python expression over `path`, after `imports`) in a fresh process,
    whose peak (VmHWM: this process's own; getrusage's counts the forked parent's pages before
    exec) is its own, and asserts that the peak is the model's once, not twice."""
    import json
    import subprocess
    import sys

    code = ("import json, sys\n"
            "from cluster.topology import process_memory\n"
            "from powerinfer.model.transformer import held_bytes\n"
            f"{imports}\n"
            "path = sys.argv[1]\n"
            f"model = {model}\n"
            "m = process_memory()\n"
            "print(json.dumps({'peak': m['hwm'], 'after': m['rss'], 'held': held_bytes(model)}))\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.splitlines()[-1])
    assert m["held"] > 400 << 20, m  # (float32: the model's weights widened, over 400 MiB)
    assert m["peak"] - m["after"] < 0.25 * m["held"], m


def test_a_dense_load_holds_the_model_once(default_model_path):
    """A float32 dense load reads each of the file's tensors straight into its parameter: its
    peak memory is the model's, not the model's twice (every tensor read into a dict first,
    then copied into the model, took SmolLM2's peak 519 MiB over its resident size)."""
    _held_once(default_model_path, "from powerinfer import Config, PowerInfer",
               "PowerInfer.from_pretrained(path, Config(dtype='float32', weights='dense', "
               "max_seq_len=64, max_batch=1)).model")


def test_the_pipelines_model_holds_the_model_once_and_equals_the_eager_read(default_model_path):
    """The offline pipeline's model (`load_model`: profile, calibrate-input, eval) reads each
    tensor straight into its parameter too: read into a dict first, a 7B file widened to bf16
    was held twice (27 GB at its peak, past a 24 GB host's memory, so that `profile` was
    killed). Its peak in a fresh process is the model's once, and its weights are those of the
    file's tensors read the eager way."""
    from powerinfer.model.load import load_model

    _held_once(default_model_path, "from powerinfer.model.load import load_model",
               "load_model(path)[0]")
    model = load_model(default_model_path, torch.bfloat16)[0]
    ck = load_checkpoint(default_model_path, torch.bfloat16)
    a = ck.args
    b = model.layers[a.n_layers - 1]
    assert torch.equal(model.tok_embeddings.weight, ck.weights["embed"])
    assert torch.equal(b.attn.wqkv.weight, torch.cat([ck.weights[f"{a.n_layers - 1}.{p}"]
                                                      for p in ("q", "k", "v")]))
    assert torch.equal(b.ffn.w2.weight, ck.weights[f"{a.n_layers - 1}.down"])


@pytest.mark.parametrize("fmt", [None, "f32", "bf16", "q4_1"])
def test_a_neuron_set_read_alone_equals_the_one_cut_from_the_dense_model(default_model_path, fmt):
    if fmt is not None and not kernels.available():
        pytest.skip("the CPU FFN kernel cannot run here (it needs AVX2 and FMA)")
    dtype = torch.bfloat16 if fmt in ("bf16", "q4_1") else torch.float32
    ck = load_checkpoint(default_model_path, dtype)
    a, w = ck.args, ck.weights
    idx = torch.arange(5, a.ffn_dim, 7)
    w1 = torch.cat([w["2.gate"], w["2.up"]])
    want = NeuronSet(a.ffn_act, w1, None, w["2.down"], idx, fmt)
    got = read_neuron_set(ck.source, a, 2, idx, fmt, dtype)
    if fmt is None:
        for x, y in zip(want.rows(), got.rows()):
            assert torch.equal(x, y)
    elif fmt == "q4_1":  # gate and up are the file's own blocks; down is Q8_0 from the same values
        rb = kernels.row_bytes(fmt, a.dim)
        assert torch.equal(got.records[:, rb:2 * rb], kernels.split_rows(ck.source.raw_rows("2.up", idx), fmt))
        for x, y in zip(want.rows(), got.rows()):
            torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=1e-2)
    else:
        assert torch.equal(want.records, got.records)
    x = torch.randn(3, 1, a.dim, dtype=dtype)
    torch.testing.assert_close(got(x).float(), want(x).float(), rtol=2e-2, atol=2e-2)
    empty = read_neuron_set(ck.source, a, 2, torch.tensor([], dtype=torch.long), fmt, dtype)
    assert len(empty.idx) == 0 and not empty(x).any()


@pytest.mark.skipif(not kernels.available(), reason="the kernel library cannot run here")
def test_a_dense_split_runs_whole_blocks_of_the_files_ffn(default_model_path):
    # a plan without a predictor cuts each layer's neurons at whole 4-bit blocks (hot share, then
    # cold shards in order), and each range is a BlockSlice over the file's own blocks: its
    # output for any number of rows is the FFN of the file's weights (the input rounded to 8
    # bits per block), and the ranges add up to the whole FFN
    ck = load_checkpoint(default_model_path, with_weights=False)
    a, src = ck.args, ck.source
    plan = SparsePlan.dense(a)
    hot = plan.hot_mask(0, 1 / 3)
    cold = plan.shards(0, ~hot, 2)
    ranges = [hot.nonzero().squeeze(-1), *cold]
    assert torch.equal(torch.cat(ranges), torch.arange(a.ffn_dim))
    assert all(len(r) % 32 == 0 and len(r) > 0 for r in ranges)
    layer = 3
    gate, up = (src.get(f"{layer}.{n}", torch.float32) for n in ("gate", "up"))
    down = src.get(f"{layer}.down", torch.float32)
    for rows in (1, 5, 70):  # decode, a batch, a prefill past one kernel call
        x = torch.randn(rows, 1, a.dim)
        xq = kernels.quantize_input(x)
        total = 0
        for idx in ranges:
            s = read_neuron_set(src, a, layer, idx, "q4_1", torch.float32, every_step=True)
            assert isinstance(s, BlockSlice)
            h = torch.nn.functional.silu(xq @ gate[idx].t()) * (xq @ up[idx].t())
            want = kernels.quantize_input(h) @ down[:, idx].t()
            got = s(x)
            assert got.shape == want.shape
            # an 8-bit rounding of h may flip against the reference's h (summed in another order)
            assert (got - want).abs().max() <= 2e-3 * want.abs().max(), (rows, idx[0])
            total = total + got
        dense = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t()) @ down.t()
        assert (total - dense).abs().max() <= 0.05 * dense.abs().max()
    # not whole blocks, or a predictor will pick neurons: the per-neuron kernel's set
    odd = read_neuron_set(src, a, layer, torch.arange(16, 80), "q4_1", torch.float32, every_step=True)
    assert isinstance(odd, NeuronSet)
    assert isinstance(read_neuron_set(src, a, layer, torch.arange(32, 96), "q4_1", torch.float32),
                      NeuronSet)


@pytest.mark.skipif(not kernels.available(), reason="the kernel library does not run here")
def test_a_dense_split_of_a_layer_with_an_8_bit_down(tmp_path):
    # a Q4_K_M file's more-bits layers keep down in more bits (Q6_K, Q8_0 once a bundle converts
    # it): the range is still a BlockSlice, gate and up on the int4 GEMV, down's columns one
    # Q8_0 matrix of the file's own blocks; prompts of 1 to 70 tokens (the GEMV and widened rows)
    import gguf
    from checkpoints import build_hf_model, llama_family_config, write_llama_gguf
    from powerinfer.model.quant import KQuantLinear
    T = gguf.GGMLQuantizationType
    cfg = llama_family_config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                              num_key_value_heads=2)
    path = tmp_path / "mixed.gguf"
    w = write_llama_gguf(path, build_hf_model(cfg, seed=2), qtype=T.Q4_0, down_qtype=T.Q8_0)
    ck = load_checkpoint(path, with_weights=False)
    a, src = ck.args, ck.source
    assert src.kind("1.down") == "Q8_0" and src.kind("1.gate") == "Q4_0"
    p = "model.layers.1.mlp."
    gate, up, down = (w[p + n].float() for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    total = {}
    for lo, hi in ((0, 96), (96, 256)):
        idx = torch.arange(lo, hi)
        s = read_neuron_set(src, a, 1, idx, "q4_0", torch.float32, every_step=True)
        # (its Q8_0 rows 16 at a time: 8.5 bits a weight, as stored)
        assert isinstance(s, BlockSlice) and isinstance(s.down, KQuantLinear)
        assert s.down.segments == [("packed0", 128, "q8x16")]
        assert s.down.nbytes == 128 * (hi - lo) // 32 * 34
        for rows in (1, 5, 70):
            x = torch.randn(rows, 1, a.dim, generator=torch.Generator().manual_seed(rows))
            xq = kernels.quantize_input(x)
            h = torch.nn.functional.silu(xq @ gate[idx].t()) * (xq @ up[idx].t())
            want = h @ down[:, idx].t()
            got = s(x)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert (got - want).abs().max() <= 0.02 * want.abs().max(), (rows, lo)
            total[rows] = total.get(rows, 0) + got
    for rows, y in total.items():
        x = torch.randn(rows, 1, a.dim, generator=torch.Generator().manual_seed(rows))
        dense = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t()) @ down.t()
        assert (y - dense).abs().max() <= 0.05 * dense.abs().max(), rows


@pytest.mark.skipif(not kernels.available(), reason="the kernel library does not run here")
@pytest.mark.parametrize("quant", ["q4_k_m", "q5_k_m"])
def test_a_dense_split_of_a_k_quant_file_reads_its_own_blocks(tmp_path, quant):
    # a Q4_K_M (Q5_K_M) file's converted copy: a range of whole super-blocks (as a plan for such
    # a file cuts: `dense_block`) is a BlockSlice over the original's Q4_K (Q5_K) gate and up
    # rows and its down's columns (Q4_K (Q5_K), or Q6_K in the more-bits layers); a range of
    # 32-blocks keeps the copy's down; each computes the file's FFN over its neurons, the two
    # halves sum to it
    from powerinfer.model.convert import kernel_ready
    from powerinfer import Config
    from powerinfer.engine.partial import dense_block
    from powerinfer.model.quant import KQuantLinear
    from powerinfer.model.sparse import activate
    m = write_synthetic(tmp_path / "m.gguf", preset="tiny", quant=quant, progress=False)
    base, kind = ("q4kx16", "Q4_K") if quant == "q4_k_m" else ("q5kx16", "Q5_K")
    ck = kernel_ready(load_checkpoint(m.path, with_weights=False), Config(dtype="bfloat16", weights="int4"))
    a, src = ck.args, ck.source
    assert dense_block(ck) == 256 and src.kind("0.gate") == ("Q4_1" if kind == "Q4_K" else "Q8_0")
    dense = load_checkpoint(m.path, torch.float32).weights
    for layer, down_kind in ((1, base), (3, "q6kx16")):  # layer 3 gets more bits
        gate, up, down = (dense[f"{layer}.{n}"] for n in ("gate", "up", "down"))
        x = torch.randn(5, 1, a.dim)
        xq = kernels.quantize_input(x)
        total = 0
        for lo, hi in ((0, 256), (256, a.ffn_dim)):
            idx = torch.arange(lo, hi)
            s = read_neuron_set(src, a, layer, idx, "q4_1", torch.float32, every_step=True)
            assert isinstance(s, BlockSlice) and isinstance(s.w1, KQuantLinear)
            assert isinstance(s.down, KQuantLinear) and s.down.segments[0][2] == down_kind
            h = activate(a.ffn_act, xq @ gate[idx].t(), xq @ up[idx].t())[1]
            want = kernels.quantize_input(h) @ down[:, idx].t()
            got = s(x)
            assert got.dtype == torch.float32 and got.shape == want.shape
            # a near tie: the kernel's h (its own sums' order) may round a value to the next
            # 8-bit step of its block of 32, which moves the product by that step times down
            step = h.abs().reshape(*h.shape[:-1], -1, 32).amax(-1).max() / 127
            slack = step * down[:, idx].abs().max()
            assert (got - want).abs().max() <= 1e-3 * want.abs().max() + slack, (layer, lo)
            total = total + got
        full = activate(a.ffn_act, xq @ gate.t(), xq @ up.t())[1] @ down.t()
        assert (total - full).abs().max() <= 0.02 * full.abs().max(), layer
        s = read_neuron_set(src, a, layer, torch.arange(32, 96), "q4_1", torch.float32, every_step=True)
        # (down's columns not whole super-blocks: the converted copy's, Q4_1 as int4 groups,
        # Q8_0 regrouped 16 rows at a time)
        assert isinstance(s.w1, KQuantLinear)
        held = s.down.segments[0][2] if isinstance(s.down, KQuantLinear) else type(s.down).__name__
        assert held == ("Q4Linear" if down_kind == "q4kx16" else "q8x16"), (layer, held)


def test_what_the_driver_sends_its_actors_pickles(default_model_path):
    """The model file's table and the tokenizer travel to the executors and the scheduler on
    every start of a group, also after the tokenizer has rendered a chat template."""
    from powerinfer.formats.tokenizer import Tokenizer

    ck = load_checkpoint(default_model_path, with_weights=False)
    tok = Tokenizer.from_source(ck.tokenizer_source)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(chat)
    again = pickle.loads(pickle.dumps(tok))
    assert again.apply_chat_template(chat) == text and again.encode(text) == tok.encode(text)
    model = pickle.loads(pickle.dumps(ck.model_file()))
    assert torch.equal(model.source.get("0.up", torch.float32), ck.source.get("0.up", torch.float32))
    assert len(pickle.dumps(ck.model_file())) < 1 << 20  # a table, not tensors


@pytest.mark.skipif(not kernels.available(), reason="the kernel library does not run here")
@pytest.mark.parametrize("quant", ["q4_k_m", "q5_k_m"])
def test_a_k_quant_files_projections_are_read_in_their_own_blocks(tmp_path, quant):
    """A Q4_K_M file stores q and k in Q4_K and v in Q6_K in llama.cpp's more-bits layers (down
    too), a Q5_K_M file the same over Q5_K: with 4-bit weights every projection is a
    KQuantLinear over the file's own Q4_K (Q5_K) and Q6_K bytes (one GEMV per run of one type),
    in the in-process engine and in the actor runtime's attention slices; each computes x W^T
    over exactly the weights the file holds (the dense load's), and it reads fewer bytes than
    the converted copy's Q4_1/Q8_0 blocks would."""
    from powerinfer import Config, PowerInfer
    from powerinfer.formats.q4 import has_q4
    from powerinfer.model.convert import converted, kernel_ready
    from powerinfer.engine.partial import attention_slice, read_head
    from powerinfer.model.quant import KernelLinear, KQuantLinear, Q4Linear

    m = write_synthetic(tmp_path / "m.gguf", preset="tiny", quant=quant, progress=False)
    base, kind = ("q4kx16", "Q4_K") if quant == "q4_k_m" else ("q5kx16", "Q5_K")
    # "auto" treats the file's K-quants as it treats Q4_0/Q4_1 projections, whatever it picks
    # on this machine (a Q5_K_M copy holds no 4-bit block: it took dense bf16 before)
    info = load_checkpoint(converted(m.path, progress=False), with_weights=False).info
    assert set(info["kquant_types"]) >= {kind, "Q6_K"}
    assert Config().resolve(has_q4(info), bool(info["kquant_types"])) == Config().resolve(True)
    dense = PowerInfer.from_pretrained(m.path, Config(dtype="float32", weights="dense"))
    int4 = PowerInfer.from_pretrained(m.path, Config(dtype="bfloat16", weights="int4"))
    config = Config(dtype="bfloat16", weights="int4")
    src = kernel_ready(load_checkpoint(m.path, with_weights=False), config).source
    a = int4.args
    def holds(mod, ref):  # x W^T over the file's weights, answered in bf16
        x = torch.randn(3, ref.shape[1])
        want = kernels.quantize_input(x.bfloat16()) @ ref.t()
        got = mod(x.bfloat16()).float()
        assert (got - want).abs().max() <= 2**-7 * want.abs().max()

    for i in range(a.n_layers):  # layers 2 and 3 of 4 get more bits
        layer, ref = int4.model.layers[i], dense.model.layers[i]
        more = [base] if i < 2 else [base, "q6kx16"]  # q and k, then v
        wqkv = layer.attn.wqkv
        assert isinstance(wqkv, KQuantLinear) and [s[2] for s in wqkv.segments] == more
        holds(wqkv, ref.attn.wqkv.weight)
        for name in ("w1", "w2"):  # the dense FFN too: gate and up, then down
            mod, w = getattr(layer.ffn, name), getattr(ref.ffn, name).weight
            assert isinstance(mod, KQuantLinear), (i, name)
            holds(mod, w)
        half = attention_slice(src, a, i, (0, a.n_kv_heads // 2), torch.bfloat16, int4=True)
        assert isinstance(half.wqkv, KQuantLinear)
        # columns of o: not whole K-quant super-blocks (the copy's Q4_1, or Q8_0 rows)
        assert isinstance(half.wo, Q4Linear if kind == "Q4_K" else KernelLinear)
        hd, g, W = a.head_dim, a.n_heads // a.n_kv_heads, ref.attn.wqkv.weight
        q, kv = a.n_kv_heads // 2 * g * hd, a.n_kv_heads // 2 * hd
        holds(half.wqkv, torch.cat([W[:q], W[a.n_heads * hd:][:kv], W[a.n_heads * hd + a.n_kv_heads * hd:][:kv]]))
    assert not a.tie_embeddings and isinstance(int4.model.output, KQuantLinear)
    holds(int4.model.output, dense.model.output.weight)
    head = read_head(src, a, 16, 80, torch.bfloat16, int4=True)  # a cold executor's rows
    assert isinstance(head, KQuantLinear)
    holds(head, dense.model.output.weight[16:80])
    kq = sum(mod.nbytes for mod in int4.model.modules() if isinstance(mod, KQuantLinear))
    file_bytes = sum(t.n_bytes for t in open_gguf(m.path).tensors if t.tensor_type.name in (kind, "Q6_K")
                     and not t.name.startswith("token_embd"))
    copy_bytes = sum(t.n_bytes for t in open_gguf(src.path).tensors if t.tensor_type.name in ("Q4_1", "Q8_0")
                     and not t.name.startswith("token_embd"))
    assert file_bytes <= kq < 1.03 * file_bytes < copy_bytes
    ids = int4.tokenize("a b c d")
    assert torch.allclose(int4.engine.logits(ids), dense.engine.logits(ids), atol=0.5, rtol=0.1)


@pytest.mark.skipif(not kernels.available(), reason="the kernel library does not run here")
def test_a_q8_0_files_projections_keep_their_blocks(tmp_path):
    """A Q8_0 file (no 4-bit block, no conversion): "auto" treats it as a 4-bit file, whatever it
    picks on this machine (it took bf16 dense before, twice the bytes a token), and with int4
    every projection and the head is a KQuantLinear over the file's own Q8_0 bytes (q8x16),
    x W^T over exactly the weights the file holds, the model's logits the dense reference's up
    to bf16 and the inputs' 8-bit rounding."""
    from powerinfer import Config, PowerInfer
    from powerinfer.formats.q4 import has_q4
    from powerinfer.model.quant import KQuantLinear

    m = write_synthetic(tmp_path / "m.gguf", preset="tiny", quant="q8_0", progress=False)
    info = load_checkpoint(m.path, with_weights=False).info
    assert not has_q4(info) and set(info["kquant_types"]) == {"Q8_0"}
    assert Config().resolve(False, True) == Config().resolve(True)
    dense = PowerInfer.from_pretrained(m.path, Config(dtype="float32", weights="dense"))
    pi = PowerInfer.from_pretrained(m.path, Config(dtype="bfloat16", weights="int4"))
    assert pi.checkpoint.path == m.path  # nothing converted
    mods = [(pi.model.output, dense.model.output.weight)]
    for mine, ref in zip(pi.model.layers, dense.model.layers):
        mods += [(mine.attn.wqkv, ref.attn.wqkv.weight), (mine.attn.wo, ref.attn.wo.weight),
                 (mine.ffn.w1, ref.ffn.w1.weight), (mine.ffn.w2, ref.ffn.w2.weight)]
    for mod, w in mods:
        assert isinstance(mod, KQuantLinear) and {s[2] for s in mod.segments} == {"q8x16"}
        x = torch.randn(3, w.shape[1])
        want = kernels.quantize_input(x.bfloat16()) @ w.t()
        assert (mod(x.bfloat16()).float() - want).abs().max() <= 2**-7 * want.abs().max()
    held = sum(mod.nbytes for mod, _ in mods)
    stored = sum(t.n_bytes for t in open_gguf(m.path).tensors if t.tensor_type.name == "Q8_0"
                 and not t.name.startswith("token_embd"))
    assert stored <= held < 1.01 * stored  # 8.5 bits a weight, as the file
    ids = pi.tokenize("a b c d")
    a, b = pi.engine.logits(ids).float(), dense.engine.logits(ids).float()
    assert (a - b).norm() <= 0.05 * b.norm()


def test_a_cpu_group_deals_each_layers_neurons_by_mass():
    # on a CPU the executors share each layer's neurons by their cores' shares of the work: the
    # hot executor's share of the neurons and of their activation mass (what fires), whatever
    # the bundle's placement, which is dropped; the cold executors' shards the rest, each
    # expecting the same mass. Without a profile, a dense plan's block-aligned split stands
    import numpy as np
    rng = np.random.default_rng(0)
    mass = [rng.pareto(1.5, 1536) for _ in range(3)]  # a power law, as profiles show
    placed = [np.arange(1536) < 700 for _ in range(3)]  # uneven, and most of the mass on one side
    plan = SparsePlan(3, 1536, [0.0] * 3, placed, mass, predictor_input="ffn")
    for share in (0.5, 1 / 3):
        dealt = plan.dealt(share)
        for i in range(3):
            hot = dealt.hot_mask(i, share)
            assert abs(int(hot.sum()) - share * 1536) <= 1
            got = mass[i][hot.numpy()].sum() / mass[i].sum()
            # dealt by rank: off the share by at most the largest neuron's mass
            assert abs(got - share) <= mass[i].max() / mass[i].sum() + 1e-9, (share, i, got)
            shards = dealt.shards(i, ~hot, 2)
            assert sorted(torch.cat([hot.nonzero().squeeze(-1), *shards]).tolist()) == list(range(1536))
    assert not np.array_equal(plan.dealt(0.5).hot[0], placed[0])  # the placement dropped
    dense = SparsePlan(3, 1536, [0.0] * 3, None, None)
    assert dense.dealt(0.5).hot is None
    assert torch.equal(dense.dealt(0.5).hot_mask(0, 0.5), dense.hot_mask(0, 0.5))
