"""The `powerinfer` command line: generate, chat and info; the offline sparsity pipeline
(profile, train-predictors, calibrate-input, solve, eval, report, export-pwri, import-pwri,
synthetic); and the server's commands (serve, plan, ray-start). `powerinfer COMMAND --help`
gives each one's options and their defaults."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from .config import DTYPE_HELP, DTYPES, ISA_HELP, Config, device_for, gib
from .errors import InvalidRequestError, PowerInferError
from .formats.loader import DEFAULT_MODEL
from .cpu import ISAS
from .runtimes import add_commands


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help, where the help does not give it already (and the
    default says something: not None, False or an empty string or list)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        empty = d is None or d is False or d == argparse.SUPPRESS or \
            (isinstance(d, (str, list)) and not d)
        if "default" in text or empty or not action.option_strings or \
                isinstance(action, argparse._StoreConstAction):
            return text
        return f"{text} (default {d})" if text else f"default {d}"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", _Help)
        super().__init__(*args, **kw)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="powerinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="complete a prompt and print the completion")
    _model_args(gen)
    gen.add_argument("--prompt", "-p", required=True, help="the text to complete")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _sampling_args(gen)

    chat = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _model_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    _sampling_args(chat)

    info = sub.add_parser("info", help="print architecture, sizes and tensor types")
    info.add_argument("--model", "-m", default=DEFAULT_MODEL,
                      help="GGUF file, Hugging Face folder or installed model name")

    _pipeline_commands(sub)
    add_commands(sub)  # commands of installed packages built on this one (`serve`)
    args = parser.parse_args(argv)
    log = logging.getLogger("powerinfer")  # what a load decided, one line each, on stderr
    if not log.handlers:
        log.addHandler(logging.StreamHandler(sys.stderr))
        log.setLevel(logging.INFO)
    try:
        return args.run(args) if hasattr(args, "run") else \
            {"generate": _generate, "chat": _chat, "info": _info}[args.command](args)
    except PowerInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a file the command reads or writes: missing, a folder, not allowed
        print(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def count(minimum: int):
    """The command line's type for a whole number of at least `minimum` (int alone took
    `--tokens -5` and `--window 0`, which ended deep in the pipeline as a traceback or a
    silently shorter run)."""
    def whole_number(text: str) -> int:
        v = int(text)  # (a ValueError: argparse says "invalid whole_number value")
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is less than {minimum}")
        return v
    return whole_number


def ranks(text: str) -> list[int]:
    """The command line's type for a comma-separated list of predictor ranks, each at least 1."""
    try:
        out = [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole "
                                         "numbers") from None
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each rank must be at least 1")
    return out


def share(text: str) -> float:
    """The command line's type for a share in (0, 1]."""
    v = float(text)
    if not 0 < v <= 1:  # (NaN too)
        raise argparse.ArgumentTypeError(f"{text!r} is not in (0, 1]")
    return v


def positive(text: str) -> float:
    """The command line's type for a finite number above 0 (a time limit)."""
    import math

    v = float(text)
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number above 0")
    return v


def seconds(text: str) -> float:
    """The command line's type for a finite number of seconds, 0 or more (a time limit where 0
    says none, or at once)."""
    import math

    v = float(text)
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds, 0 or more")
    return v


def _model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="GGUF file, Hugging Face folder or installed model name")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--cpu-isa", default="auto", choices=["auto", *ISAS], help=ISA_HELP)
    p.add_argument("--threads", "-t", type=count(0), default=0, help="CPU threads (0: all)")
    p.add_argument("--ctx-size", "-c", "--ctx", dest="ctx", type=count(0), default=0,
                   help="positions a sequence may reach (0: the model's context)")
    p.add_argument("--vram-budget", type=gib, default=0.0, metavar="GB",
                   help="GPU memory the hot neurons' placement may use")
    p.add_argument("--device", default=None, choices=["cpu", "cuda", "auto"],
                   help="default: auto (the GPU where there is one) with --vram-budget, else cpu")
    p.add_argument("--kv-cache-gb", type=gib, default=0.0,
                   help="memory of the paged KV cache (0: auto, from the host's free memory)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--weights", default="auto", choices=["auto", "dense", "int4"],
                   help="int4: keep the file's Q4_0/Q4_1 weights 4-bit (on a GPU a sparse "
                        "FFN's hot neurons, read by the Triton kernels); auto: int4 on the CPU "
                        "where the kernel runs")
    p.add_argument("--runtime", default="local", choices=["local", "actors"],
                   help="actors: the Ray actor runtime (scheduler, predictor, hot and cold executors)")
    p.add_argument("--bundle", "--predictor-path", dest="bundle", default="",
                   help="sparsity bundle: compute the predicted-active neurons only")
    p.add_argument("--input-sparsity", default="auto", metavar="auto|off|BUNDLE",
                   help="input sparsity in the projections (TEAL, `powerinfer calibrate-input`): "
                        "auto: the --bundle's thresholds where it has them; off; or a bundle's")
    p.add_argument("--no-input-sparsity", dest="input_sparsity", action="store_const", const="off",
                   help="the same as --input-sparsity off")
    p.add_argument("--cold-executors", type=count(0), default=1,
                   help="cold-neuron executors (--runtime actors; 0: one executor with the whole "
                        "model, a dense model on the CPU)")
    p.add_argument("--verbose", "-v", action="store_true", help="print timings to stderr")


def _sampling_args(p: argparse.ArgumentParser):
    p.add_argument("--max-tokens", "-n", type=count(1), default=128, help="tokens to generate")
    # llama.cpp's spelling; -t is the thread count there and here
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.8,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=count(0), default=40, help="the k likeliest tokens (0: off)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="the likeliest tokens up to this mass (1: off)")
    p.add_argument("--min-p", type=float, default=0.05,
                   help="tokens at least this share of the likeliest one's probability (0: off)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="the last 64 tokens' logits divided by it (1: off)")
    p.add_argument("--seed", type=int, default=None, help="the sampler's seed (default random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _load(args):
    from .api import PowerInfer

    t0 = time.perf_counter()
    config = Config(dtype=args.dtype, cpu_isa=args.cpu_isa, cpu_threads=args.threads,
                    max_seq_len=args.ctx,
                    max_batch=1, compile=args.compile, weights=args.weights, runtime=args.runtime,
                    bundle=args.bundle, cold_executors=args.cold_executors,
                    input_sparsity=args.input_sparsity,
                    vram_budget_gb=args.vram_budget, kv_cache_gb=args.kv_cache_gb,
                    device=device_for(args.vram_budget, args.device))
    model = PowerInfer.from_pretrained(args.model, config=config)
    if args.verbose:
        print(f"[loaded {args.model} in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    return model


def _sampling(args) -> dict:
    return dict(max_new_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repeat_penalty,
                seed=args.seed, stop=args.stop)


def _print_stream(pieces, verbose: bool) -> str:
    t0, n, out = time.perf_counter(), 0, []
    for piece in pieces:
        out.append(piece)
        n += 1
        print(piece, end="", flush=True)
    print()
    if verbose:
        dt = time.perf_counter() - t0
        print(f"[{n} pieces in {dt:.2f} s]", file=sys.stderr)
    return "".join(out)


def _generate(args) -> int:
    model = _load(args)
    # (bytes that are not UTF-8 reach Python as lone surrogates, which the tokenizer refused
    # with a traceback: they become U+FFFD, as on standard input)
    text = args.prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    prompt = [{"role": "user", "content": text}] if args.chat else text
    try:
        _print_stream(model.stream(prompt, **_sampling(args)), args.verbose)
    finally:
        model.close()
    return 0


def _chat(args) -> int:
    model = _load(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # (bytes that are not UTF-8: U+FFFD, not a traceback)
        sys.stdin.reconfigure(errors="replace")
    if interactive:
        print("Chat with the model. /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if args.system else []
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        try:
            reply = _print_stream(model.stream(history, **_sampling(args)), args.verbose)
        except InvalidRequestError as e:  # (a turn past the context ended the whole session)
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})


def _info(args) -> int:
    from .formats.loader import load_checkpoint

    ck = load_checkpoint(args.model, with_weights=False)
    a, info = ck.args, ck.info
    rows = [
        ("model", str(ck.path)), ("name", info.get("name", "")), ("format", info["format"]),
        ("architecture", info.get("gguf_arch") or info.get("hf_model_type")),
        ("parameters", f"{info['n_params'] / 1e6:.1f} M"),
        ("file size", f"{info['file_bytes'] / 2**20:.1f} MiB"),
        ("layers", a.n_layers), ("hidden size", a.dim), ("FFN size", a.ffn_dim),
        ("FFN activation", a.ffn_act), ("heads / KV heads", f"{a.n_heads} / {a.n_kv_heads}"),
        ("head dim", a.head_dim), ("vocabulary", a.vocab_size), ("context", a.max_seq_len),
        ("positions", "learned" if a.learned_pos else f"RoPE (base {a.rope_base:g})"),
        ("norm", "LayerNorm" if a.layer_norm else f"RMSNorm (eps {a.norm_eps:g})"),
        ("tied embeddings", a.tie_embeddings),
        ("attention", _attention_kind(a)),
        ("tensor types", ", ".join(f"{k}: {v}" for k, v in sorted(info["tensor_types"].items()))),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _attention_kind(a) -> str:
    parts = [f"sliding window {a.sliding_window}" + (
        f" on {a.swa_pattern - 1} of every {a.swa_pattern} layers" if a.swa_pattern else "")
        if a.sliding_window else "full"]
    if a.rope_base_local:
        parts.append(f"sliding layers' RoPE base {a.rope_base_local:g}")
    parts += [name for name, on in (("q/k norms", a.qk_norm), ("norms after each branch", a.post_norms),
                                    ("parallel with the FFN", a.parallel)) if on]
    return ", ".join(parts)


# `sparsity.synthetic.PRESETS`' names, here without importing it (and torch) for --help
PRESET_NAMES = ("7b", "13b", "70b", "tiny")


def _pipeline_commands(sub):
    p = sub.add_parser("profile", help="record neuron firing statistics and predictor samples")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="GGUF file, Hugging Face folder or installed model name")
    p.add_argument("--corpus", default="lee", help="built-in corpus name (lee) or a text file")
    p.add_argument("--tokens", type=count(0), default=0,
                   help="calibration tokens (0: the whole corpus)")
    p.add_argument("--out", required=True, help="bundle directory to write")
    p.add_argument("--samples", type=count(1), default=16384, help="predictor samples per layer")
    p.add_argument("--sparsity", type=share, default=None,
                   help="SwiGLU models: target share of neurons under the threshold "
                        "(default 0.15, the default model's operating point; a ReLU-family "
                        "model's zeros are its own)")
    p.add_argument("--calib-tokens", type=count(1), default=None,
                   help="SwiGLU models: tokens run first to set the thresholds (default 8192)")
    p.add_argument("--window", type=count(2), default=512, help="tokens per window")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="the model's type while it is profiled")
    p.add_argument("--device", default="auto",
                   help="where the model runs: auto (a GPU torch sees, where it holds the "
                        "model), cpu, cuda, cuda:N")
    p.set_defaults(run=_profile)

    p = sub.add_parser("train-predictors", help="train the per-layer activation predictors")
    p.add_argument("--bundle", required=True, help="the bundle folder (`profile --out`)")
    p.add_argument("--input", choices=["ffn", "layer", "both"], default="both",
                   help="predictor input: the FFN's own input, or the layer input (lookahead)")
    p.add_argument("--recall", type=share, default=0.99,
                   help="target recall by activation mass, in (0, 1]")
    p.add_argument("--epochs", type=count(1), default=None, help="at most this many epochs per rank")
    p.add_argument("--ranks", type=ranks, default=None,
                   help="comma-separated ranks to try (default: five powers of two up to min(d, n_ff))")
    p.add_argument("--device", default="auto",
                   help="where the training steps run: auto (a GPU where torch sees one), cpu, "
                        "cuda, cuda:N")
    p.set_defaults(run=_train)

    p = sub.add_parser("solve", help="place neurons on the GPU under a VRAM budget (MILP)")
    p.add_argument("--bundle", required=True, help="the bundle folder (`profile --out`)")
    p.add_argument("--vram-budget", type=gib, required=True, help="GiB")
    p.add_argument("--batch", type=count(1), default=1,
                   help="sequences decoding together (the KV cache counted for them)")
    p.add_argument("--context", type=count(1), default=2048,
                   help="positions each sequence's KV cache holds")
    p.add_argument("--group", type=count(1), default=64, help="neurons per placement unit")
    p.add_argument("--min-share", type=float, default=0.1,
                   help="a layer holds no GPU neurons or at least this share")
    p.add_argument("--time-limit", type=positive, default=60, help="seconds")
    p.add_argument("--input", choices=["auto", "ffn", "layer"], default="auto",
                   help="the predictors the GPU holds (auto: lookahead when trained, as the "
                        "runtimes choose)")
    p.set_defaults(run=_solve)

    p = sub.add_parser("calibrate-input", help="input sparsity's thresholds (TEAL) into a bundle")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="GGUF file, Hugging Face folder or installed model name")
    p.add_argument("--bundle", required=True, help="bundle directory (made where there is none)")
    p.add_argument("--sparsity", type=float, default=0.25,
                   help="share of each projection input's entries under its threshold (default "
                        "0.25: SmolLM2 holds it within +2%% held-out perplexity)")
    p.add_argument("--corpus", default="lee", help="built-in corpus name (lee) or a text file")
    p.add_argument("--tokens", type=count(1), default=8192, help="calibration tokens")
    p.add_argument("--held-out", type=count(1), default=4096, help="held-out tokens the quality is measured on")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="the model's type while it runs (bfloat16 holds a 7B in half the memory)")
    p.set_defaults(run=_calibrate_input)

    p = sub.add_parser("eval", help="held-out perplexity, agreement and recall: dense vs sparse")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="GGUF file, Hugging Face folder or installed model name")
    p.add_argument("--bundle", required=True, help="the bundle folder (`profile --out`)")
    p.add_argument("--tokens", type=count(0), default=0, help="held-out tokens (0: all)")
    p.add_argument("--window", type=count(2), default=256, help="tokens per window")
    p.add_argument("--per-layer", action="store_true", help="print the per-layer recall")
    p.add_argument("--corpus", default=None,
                   help="held-out text: a built-in corpus name or a file (default: the bundle's)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="the model's type while it runs (bfloat16 holds a 7B in half the memory)")
    p.set_defaults(run=_eval)

    p = sub.add_parser("report", help="write the bundle's plots and print its summary")
    p.add_argument("--bundle", required=True, help="the bundle folder (`profile --out`)")
    p.add_argument("--out", default=None, help="folder for the plots (default BUNDLE/report)")
    p.set_defaults(run=_report)

    p = sub.add_parser("export-pwri", help="write a PowerInfer (PWRI) GGUF and its GPU index")
    p.add_argument("--model", "-m", required=True, help="the GGUF file the bundle was made from")
    p.add_argument("--bundle", required=True, help="the bundle folder (`profile --out`)")
    p.add_argument("--out", required=True, help="PWRI model file to write")
    p.add_argument("--input", choices=["ffn", "layer"], default="ffn")
    p.set_defaults(run=_export)

    p = sub.add_parser("import-pwri", help="make a bundle from a PowerInfer (PWRI) GGUF")
    p.add_argument("--model", "-m", required=True)
    p.add_argument("--out", required=True, help="bundle directory to write")
    p.add_argument("--gpu-index", default=None, help="split file (default: found next to the model)")
    p.set_defaults(run=_import)

    p = sub.add_parser("synthetic", help="write a synthetic ReLU model of real shapes as GGUF")
    p.add_argument("--preset", default="7b", choices=PRESET_NAMES,
                   help="the shapes of a LLaMA model of this size")
    p.add_argument("--layers", type=count(1), default=None,
                   help="blocks to write (default the preset's)")
    p.add_argument("--sparsity", type=share, default=0.9,
                   help="the share of neurons that do not fire, on average")
    p.add_argument("--seed", type=count(0), default=0, help="the weights' seed")
    p.add_argument("--subspace", type=count(0), default=0,
                   help="rank of each layer's gate rows (0: isotropic; r > 0: firing a predictor "
                        "of about rank r can learn, as in trained models)")
    p.add_argument("--residual-rank", type=count(0), default=0,
                   help="rank of the residual stream (0: full; R >= subspace: the embeddings and "
                        "every layer's output in R directions, which predictors learn from fewer "
                        "samples)")
    p.add_argument("--quant", default=None, choices=["q4_0", "q4_k_m", "q5_k_m", "q8_0"],
                   help="the matrices in these GGUF block types, as llama.cpp quantizes a file "
                        "of that type (default: bf16)")
    p.add_argument("--out", required=True, help="the GGUF file to write")
    p.set_defaults(run=_synthetic)


def _profile(args) -> int:
    from .sparsity.profile import ProfileOptions, profile
    from .sparsity.report import sparsity

    given = {"sparsity": args.sparsity, "calib_tokens": args.calib_tokens}
    opts = ProfileOptions(tokens=args.tokens, window=args.window, samples=args.samples,
                          **{k: v for k, v in given.items() if v is not None})
    b = profile(args.model, args.corpus, args.out, opts, dtype=args.dtype, device=args.device)
    counts, _, tokens = b.stats()
    mean = sum(sparsity(c, tokens) for c in counts) / len(counts)
    print(f"profiled {tokens} tokens of {b.manifest.corpus['name']} into {b.path}; "
          f"mean sparsity {mean:.1%}")
    return 0


def _train(args) -> int:
    from .formats.bundle import Bundle
    from .sparsity.train import format_table, train_predictors

    b = Bundle.open(args.bundle)
    for inp in (["ffn", "layer"] if args.input == "both" else [args.input]):
        extra = {} if args.epochs is None else {"epochs": args.epochs}
        if args.ranks:
            extra["ranks"] = args.ranks
        rows = train_predictors(b, inp, recall_target=args.recall, device=args.device, **extra)
        print(f"predictors reading the {inp} input:")
        print(format_table(rows))
    return 0


def _solve(args) -> int:
    from .formats.bundle import Bundle
    from .sparsity.solver import solve_bundle

    b = Bundle.open(args.bundle)
    print(f"placing {b.n_layers} layers' neurons under {args.vram_budget:g} GiB (an integer "
          f"program: at most {args.time_limit:g} s)...", file=sys.stderr, flush=True)
    p = solve_bundle(b, args.vram_budget, batch=args.batch,
                     context=args.context, group=args.group, min_share=args.min_share,
                     time_limit=args.time_limit, predictor_input=args.input)
    print(p.table())
    return 0


def _calibrate_input(args) -> int:
    from .sparsity.input_sparsity import BUNDLE_FILE, calibrate_bundle

    b = calibrate_bundle(args.model, args.bundle, args.sparsity, corpus=args.corpus,
                         tokens=args.tokens, held_out=args.held_out, dtype=args.dtype)
    q = b.load_json(BUNDLE_FILE)["quality"]
    print(f"input sparsity at {args.sparsity:.0%} of each input (q/k/v, output, gate/up) into "
          f"{b.path / BUNDLE_FILE}: held-out perplexity {q['dense_ppl']:.3f} -> {q['ppl']:.3f} "
          f"({q['ppl_increase']:+.1%}), top-1 agreement {q['top1']:.1%}, realised {q['realised']:.1%} "
          f"of those projections' weights not read")
    return 0


def _eval(args) -> int:
    from .formats.bundle import Bundle
    from .sparsity.evaluate import evaluate, format_rows, per_layer_table

    rows = evaluate(args.model, Bundle.open(args.bundle), tokens=args.tokens, window=args.window,
                    corpus=args.corpus, dtype=args.dtype)
    print(format_rows(rows))
    if args.per_layer:
        for r in rows:
            if r["kind"] == "predicted":
                print(per_layer_table(r))
    return 0


def _report(args) -> int:
    from pathlib import Path

    from .formats.bundle import Bundle
    from .sparsity.report import summary_text, write_report

    b = Bundle.open(args.bundle)
    print(summary_text(b))
    for f in write_report(b, Path(args.out) if args.out else None):
        print(f"wrote {f}")
    return 0


def _export(args) -> int:
    from pathlib import Path

    from .formats.bundle import Bundle
    from .formats.pwri import export_gpu_index, export_pwri

    from .formats.loader import resolve_model

    b = Bundle.open(args.bundle)
    out = Path(args.out)
    # (an installed model's short name too, as every other command takes it)
    export_pwri(resolve_model(args.model), b, out, predictor_input=args.input)
    print(f"wrote {out}")
    if b.has("placement"):
        budget = b.load_json("placement.json", {"budget_bytes": int})["budget_bytes"]
        index = out.with_name(out.name + ".generated.gpuidx")
        export_gpu_index(b, index, vram_capacity=budget)
        print(f"wrote {index}")
    return 0


def _import(args) -> int:
    from pathlib import Path

    from .formats.pwri import import_pwri

    b = import_pwri(Path(args.model), Path(args.out),
                    Path(args.gpu_index) if args.gpu_index else None)
    print(f"wrote bundle {b.path} with {', '.join(b.manifest.parts)}")
    return 0


def _synthetic(args) -> int:
    from .sparsity.synthetic import write_synthetic

    info = write_synthetic(args.out, preset=args.preset, n_layers=args.layers,
                           sparsity=args.sparsity, seed=args.seed, subspace=args.subspace,
                           residual_rank=args.residual_rank, quant=args.quant)
    for k, v in info.summary().items():
        print(f"{k:>16}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
