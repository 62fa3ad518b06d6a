"""The `powerinfer` command line: generate, chat, info."""
from __future__ import annotations

import argparse
import sys
import time

from .config import Config
from .errors import PowerInferError
from .loader import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="powerinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt and print the completion")
    _model_args(gen)
    gen.add_argument("--prompt", "-p", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _sampling_args(gen)

    chat = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _model_args(chat)
    chat.add_argument("--system", default=None, help="system message")
    _sampling_args(chat)

    info = sub.add_parser("info", help="print architecture, sizes and tensor types")
    info.add_argument("--model", "-m", default=DEFAULT_MODEL)

    args = parser.parse_args(argv)
    try:
        return {"generate": _generate, "chat": _chat, "info": _info}[args.command](args)
    except PowerInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"GGUF file, Hugging Face folder or installed model name (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: all)")
    p.add_argument("--ctx", type=int, default=0, help="context length of the KV cache")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    p.add_argument("--weights", default="dense", choices=["dense", "int4"],
                   help="int4: keep the file's Q4_0/Q4_1 weights 4-bit (with --dtype bfloat16)")
    p.add_argument("--verbose", "-v", action="store_true", help="print timings to stderr")


def _sampling_args(p: argparse.ArgumentParser):
    p.add_argument("--max-tokens", "-n", type=int, default=128)
    p.add_argument("--temperature", "-t", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _load(args):
    from .api import PowerInfer

    t0 = time.perf_counter()
    config = Config(dtype=args.dtype, cpu_threads=args.threads, max_seq_len=args.ctx,
                    max_batch=1, compile=args.compile, weights=args.weights)
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
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    _print_stream(model.stream(prompt, **_sampling(args)), args.verbose)
    return 0


def _chat(args) -> int:
    model = _load(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
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
        reply = _print_stream(model.stream(history, **_sampling(args)), args.verbose)
        history.append({"role": "assistant", "content": reply})


def _info(args) -> int:
    from .loader import load_checkpoint

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
        ("tensor types", ", ".join(f"{k}: {v}" for k, v in sorted(info["tensor_types"].items()))),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
