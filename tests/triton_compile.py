"""Compile the Triton kernels of `powerinfer.triton_ffn` (and `triton_attention`,
`triton_linear`) for NVIDIA targets, with no GPU here:
Triton's compiler lowers each kernel to PTX and runs ptxas (shipped in the triton wheel) to a
cubin, which catches what the interpreter never checks (types of every constexpr branch, what
the code generator accepts, register and shared-memory limits). Each variant is chosen so that
every branch of every kernel is compiled at least once.

    python tests/triton_compile.py 90 89      # compute capabilities; prints one JSON line each

Must run without TRITON_INTERPRET (the kernels are then compiled, not interpreted)."""
import json
import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "unset TRITON_INTERPRET to compile"

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile  # noqa: E402

from powerinfer.kernels import triton_attention as TA, triton_ffn as T, triton_linear as TL

I32 = "i32"


def ffn(x, w, act, fmt, dfmt, row_bytes, gated, sel, keep, bias, block_b):
    sel_t = {0: "*u8", 1: "*i32", 2: "*u8"}[sel]
    return ("_ffn_kernel",
            dict(x_ptr=x, w_ptr=w, sel_ptr=sel_t, count_ptr="*i32", keep_ptr="*u8",
                 bias_ptr="*fp32", out_ptr="*fp32", B=I32, dim=I32, k=I32, rec_stride=I32,
                 keep_stride=I32, threshold="fp32"),
            dict(ACT=T.ACTS.index(act), FMT=fmt, DFMT=dfmt, ROW_BYTES=row_bytes, GATED=gated,
                 SEL=sel, KEEP=keep, HAS_BIAS=bias, BLOCK_B=block_b, BLOCK_N=T.BLOCK_N,
                 BLOCK_K=T.BLOCK_K))


def variants():
    q4 = 4096 // 32 * 18
    yield ffn("*bf16", "*bf16", "swiglu", T.PLAIN, T.PLAIN, 0, True, 1, 2, False, 1)
    yield ffn("*bf16", "*bf16", "geglu", T.PLAIN, T.PLAIN, 0, True, 0, 0, False, 16)
    yield ffn("*fp32", "*fp32", "relu", T.PLAIN, T.PLAIN, 0, False, 2, 2, True, 16)
    yield ffn("*fp16", "*fp16", "swiglu", T.PLAIN, T.PLAIN, 0, True, 1, 1, False, 64)
    yield ffn("*bf16", "*u8", "reglu", T.Q4_0, T.Q8_0, q4, True, 1, 1, False, 1)
    yield ffn("*bf16", "*u8", "dreglu", T.Q4_1, T.Q8_0, 4096 // 32 * 20, True, 1, 0, False, 16)
    yield ffn("*fp32", "*u8", "gelu", T.Q8_0, T.Q8_0, 4096 // 32 * 34, False, 0, 0, True, 1)
    # records' split 4-bit rows (`Config(weights="int4")` on a GPU): a decode row in one launch,
    # and several rows through tl.dot
    yield ffn("*bf16", "*u8", "swiglu", T.Q4_0S, T.Q8_0, q4, True, 1, 0, False, 1)
    yield ffn("*bf16", "*u8", "reglu", T.Q4_0S, T.Q8_0, q4, True, 2, 2, False, 16)
    yield ffn("*bf16", "*u8", "relu", T.Q4_1S, T.Q8_0, 4096 // 32 * 20, False, 1, 1, True, 64)
    # (ungated, every row: `triton_linear`'s matrices, a row a record)
    for fmt, gated, sel in ((T.PLAIN, True, 1), (T.Q4_0S, True, 1), (T.Q4_1S, False, 0),
                            (T.Q8_0, True, 2), (T.Q4_0S, False, 0), (T.Q8_0, False, 0)):
        (bn, bk, nw), _ = T.SPLIT_TILES[fmt == T.PLAIN]
        yield ("_gate_up_kernel",
               dict(x_ptr="*bf16", w_ptr="*bf16" if fmt == T.PLAIN else "*u8",
                    sel_ptr="*i32" if sel == 1 else "*u8", count_ptr="*i32", gu_ptr="*fp32",
                    dim=I32, k=I32, cap=I32, rec_stride=I32),
               dict(FMT=fmt, ROW_BYTES=0 if fmt == T.PLAIN else T._row_bytes(fmt, 4096),
                    GATED=gated, SEL=sel, BLOCK_N=bn, BLOCK_K=bk, COLS=T.SPLIT_COLS))
    for act, dfmt, sel, keep, bias in (("swiglu", T.PLAIN, 1, 1, False), ("reglu", T.Q8_0, 1, 2, False),
                                       ("gelu", T.Q8_0, 0, 0, True), ("dreglu", T.PLAIN, 2, 2, False)):
        _, (bn, bk, nw) = T.SPLIT_TILES[dfmt == T.PLAIN]
        yield ("_down_kernel",
               dict(gu_ptr="*fp32", w_ptr="*bf16" if dfmt == T.PLAIN else "*u8",
                    sel_ptr="*i32" if sel == 1 else "*u8", count_ptr="*i32", keep_ptr="*u8",
                    bias_ptr="*fp32", out_ptr="*fp32", dim=I32, k=I32, cap=I32, rec_stride=I32,
                    threshold="fp32", GROUPS=I32),
               dict(ACT=T.ACTS.index(act), DFMT=dfmt, ROW_BYTES=4096 // 32 * 18,
                    GATED=act != "gelu", SEL=sel, KEEP=keep, HAS_BIAS=bias, BLOCK_N=bn,
                    BLOCK_K=bk))
    yield "_compact_kernel", dict(mask_ptr="*u8", n=I32, idx_ptr="*i32", count_ptr="*i32"), \
        dict(BLOCK=1024)
    for rows, fmt, dfmt in ((3, T.Q4_0, T.Q8_0), (2, T.Q4_1, T.Q8_0), (1, T.Q8_0, T.Q8_0),
                            (1, T.Q4_0S, T.Q4_0S), (1, T.Q4_1S, T.Q4_1S)):  # (split: a matrix)
        yield "_widen_kernel", dict(w_ptr="*u8", out_ptr="*fp32", n=I32, dim=I32, rec_stride=I32), \
            dict(NROWS=rows, ROW_BYTES=q4, FMT=fmt, DFMT=dfmt, BLOCK_N=T.BLOCK_N, BLOCK_K=T.BLOCK_K)
    # (the predictors' matrices in float32 beside a float32 model, else in its 16-bit type, or
    # as Q8_0 rows: a GPU's, `predictor.device_format`)
    for x, fc, block_b in (("*fp32", "*fp32", 1), ("*bf16", "*bf16", 1), ("*bf16", "*bf16", 16),
                           ("*bf16", "*u8", 1), ("*bf16", "*u8", 16)):
        yield "_linear_kernel", dict(x_ptr=x, w_ptr=fc, out_ptr="*fp32", B=I32, dim=I32, n=I32,
                                     row_stride=I32), \
            dict(FMT=T.Q8_0 if fc == "*u8" else T.PLAIN, RELU=True, BLOCK_B=block_b, BLOCK_N=32,
                 BLOCK_K=T.BLOCK_K)
    for fc, block_b, select, store in (("*bf16", 1, True, False), ("*fp32", 16, True, True),
                                       ("*bf16", 16, False, True), ("*u8", 1, True, False),
                                       ("*u8", 16, True, True), ("*u8", 16, False, True)):
        yield "_logits_kernel", dict(h_ptr="*fp32", fc2_ptr=fc, thr_ptr="*fp32",
                                     logits_ptr="*fp32", keep_ptr="*i8", idx_ptr="*i32",
                                     count_ptr="*i32", B=I32, r=I32, n=I32, row_stride=I32), \
            dict(FMT=T.Q8_0 if fc == "*u8" else T.PLAIN, BLOCK_B=block_b, BLOCK_N=64, BLOCK_K=64,
                 SELECT=select, STORE=store)
    yield "_kth_kernel", dict(logits_ptr="*fp32", thr_ptr="*fp32", n=I32, k=I32), dict(BLOCK=1024)
    for fmt, block_b in ((T.Q4_0S, 16), (T.Q4_1S, 64), (T.Q8_0, 32)):  # (a batch's decode rows)
        yield "_linear_kernel", dict(x_ptr="*bf16", w_ptr="*u8", out_ptr="*fp32", B=I32, dim=I32,
                                     n=I32, row_stride=I32), \
            dict(FMT=fmt, RELU=False, BLOCK_B=block_b, BLOCK_N=TL.BLOCK_N, BLOCK_K=TL.BLOCK_K)
    yield "_select_kernel", dict(logits_ptr="*fp32", thr_ptr="*fp32", keep_ptr="*i8",
                                 idx_ptr="*i32", count_ptr="*i32", B=I32, n=I32), \
        dict(BLOCK_B=8, BLOCK_N=64)
    for x, offsets in (("*bf16", False), ("*fp32", True)):  # input sparsity's one-row product
        yield "_q4c_kernel", dict(x=x, w="*u8", y="*fp32", k=I32, rows=I32, block_bytes=I32,
                                  head=I32, threshold="fp32"), \
            dict(OFFSETS=offsets, CHUNK=TL.Q4C_CHUNK)


def attention_variants():
    for qkv, cache, H, hkv, D, rope, splits in (("*bf16", "*bf16", 64, 8, 128, True, 1),
                                                 ("*bf16", "*bf16", 64, 8, 128, True, 32),
                                                 ("*fp32", "*fp32", 9, 3, 64, False, 3),
                                                 ("*fp16", "*fp16", 32, 32, 128, True, 1)):
        g = H // hkv
        yield ("_decode_attention_kernel",
               dict(qkv_ptr=qkv, cos_ptr="*fp32", sin_ptr="*fp32", k_ptr=cache, v_ptr=cache,
                    tables_ptr="*i32", pos_ptr="*i64", out_ptr=qkv, part_ptr="*fp32",
                    count_ptr="*i32", qkv_stride=I32, out_stride=I32, M=I32, window=I32,
                    scale="fp32", k_sb=I32, k_sh=I32, v_sb=I32, v_sh=I32, splits=I32),
               dict(H=H, HKV=hkv, D=D, BS=16, G=g, GP=max(16, T._pow2(g)), ROPE=rope,
                    SPLIT=splits > 1))


def compile_one(name, args, constexprs, capability):
    fn = next(getattr(m, name) for m in (T, TA, TL) if hasattr(m, name))
    names = fn.arg_names
    assert set(names) == set(args) | set(constexprs), (name, set(names) ^ (set(args) | set(constexprs)))
    sig = {n: args.get(n, "constexpr") for n in names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    out = triton_compile(src, target=GPUTarget("cuda", capability, 32))
    return out.metadata


def compile_entry(job):
    (name, args, cx), cap = job
    md = compile_one(name, args, cx, cap)
    return {"kernel": name, "shared": getattr(md, "shared", None), "regs": getattr(md, "n_regs", None)}


def main(capabilities):
    from concurrent.futures import ProcessPoolExecutor

    # one variant a process at a time on every core (each compile is single-threaded)
    with ProcessPoolExecutor(len(os.sched_getaffinity(0))) as pool:
        for cap in capabilities:
            t0 = time.perf_counter()
            done = list(pool.map(compile_entry, [(v, cap) for v in (*variants(), *attention_variants())]))
            print(json.dumps({"capability": cap, "kernels": len(done), "seconds":
                              round(time.perf_counter() - t0, 1), "variants": done}), flush=True)


if __name__ == "__main__":
    main([int(c) for c in sys.argv[1:]] or [90])
