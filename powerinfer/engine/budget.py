"""What `Config(vram_budget_gb=...)` decides at load: which FFN neurons are hot (the GPU's).

- With a sparsity bundle (`Config(bundle=...)`, or the folder `<model file>.bundle` next to the
  model when a budget is given), the placement is solved for the budget, the context and the
  batch, and cached in the bundle under that key (`placements/`), so the next load is instant.
- Without one, attention, embeddings, lm_head and the KV cache are placed first, then whole FFN
  layers in order as they fit (layer offload, llama.cpp's -ngl for the FFNs).
- On a machine without a GPU the plan is still made (the actor runtime's hot executor takes the
  hot neurons, the in-process engine runs a bundle's placement as it would on a GPU, and keeps a
  dense model dense), and the log line says that nothing is placed on a GPU.

The decision is said in one log line (logger "powerinfer").
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from ..config import Config
from ..formats.args import ModelArgs
from ..formats.bundle import BUNDLE_SUFFIX, Bundle
from ..model.predictor import device_format
from ..model.quant import block_format
from ..sparsity.solver import gpu_bytes, neuron_bytes, solve_for_bundle
from .partial import device_fixed_bytes
from .plan import SparsePlan

log = logging.getLogger("powerinfer")


def find_bundle(config: Config, model_path: Path) -> str:
    """The bundle a load uses: Config.bundle, or with a budget the one beside the model file."""
    if config.bundle:
        return config.bundle
    beside = Path(str(model_path) + BUNDLE_SUFFIX)
    if config.vram_budget_gb > 0 and (beside / "manifest.json").is_file():
        return str(beside)
    return ""


def plan_for(config: Config, args: ModelArgs, model_path: Path, kv_tokens: int,
             on_gpu: bool, checkpoint=None) -> SparsePlan | None:
    """The sparse plan a load runs (None: the dense model, nothing to place); kv_tokens: the
    positions its paged KV cache holds (the placement counts their bytes); checkpoint: the
    file's (`Checkpoint`: its `info` and `source`), whose blocks the hot neurons and attention's
    matrices keep on a GPU under `Config(weights="int4")`, the placement counting them at
    those bytes."""
    bundle = find_bundle(config, model_path)
    budget = int(config.vram_budget_gb * 2**30)
    plan = (SparsePlan.from_bundle(bundle, args, model_path, config.predictor,
                                   config.max_ppl_increase) if bundle else None)
    if budget <= 0:
        return plan
    dtype_bytes = config.torch_dtype.itemsize
    where = "" if on_gpu else "; this machine has no GPU: nothing is placed on one"
    if plan is None:
        k = ffn_layers_that_fit(args, budget, dtype_bytes, 1, kv_tokens)
        fixed = gpu_bytes(args, dtype_bytes=dtype_bytes, batch=1, context=kv_tokens)
        layers = k * args.ffn_dim * neuron_bytes(args, dtype_bytes)
        log.info("VRAM budget %.2f GB, no sparsity bundle: layer offload, attention, embeddings, "
                 "lm_head and %d of %d FFN layers on the GPU; GPU %s%s", config.vram_budget_gb, k,
                 args.n_layers, bytes_line({"fixed_bytes": fixed, "hot_neuron_bytes": layers,
                                            "used_bytes": sum(fixed.values()) + layers,
                                            "budget_bytes": budget}, "FFN layers"), where)
        return SparsePlan.layer_offload(args, k)
    b = Bundle.open(bundle)
    if not b.has("stats"):  # an imported bundle: its own placement, if any, stands
        log.info("VRAM budget %.2f GB: the bundle %s has no profile to solve a placement from; "
                 "%s%s", config.vram_budget_gb, bundle, "its own placement is used"
                 if plan.hot is not None else "every neuron is cold", where)
        return plan
    t0 = time.perf_counter()
    fmt = None
    if on_gpu and checkpoint is not None:
        fmt = gpu_neuron_format(config, checkpoint.info)
    blocks = None
    if fmt is not None:  # attention's matrices (an untied head's) in the file's blocks too
        blocks = device_fixed_bytes(checkpoint.source, args, dtype_bytes)
    # (the predictors on the hot executor's GPU, as Q8_0 rows where the Triton kernels run)
    pred_fmt = device_format("cuda") if on_gpu and config.predictor_device != "cpu" else None
    hot, cached, report = cached_placement(b, config.vram_budget_gb,
                                           1, kv_tokens, dtype_bytes,
                                           plan.predictor_input or "ffn", fmt, blocks, pred_fmt)
    plan.hot = hot
    n_hot, total = sum(int(h.sum()) for h in hot), args.n_layers * args.ffn_dim
    log.info("VRAM budget %.2f GB: %.1f%% of FFN neurons hot (%s of %s, %s), %s; GPU %s; "
             "placement %s in %.1f s (%s)%s", config.vram_budget_gb, 100 * n_hot / total,
             f"{n_hot:,}", f"{total:,}", f"in {fmt.upper()} records" if fmt else config.dtype,
             mass_line(report), bytes_line(report), "read from the cache" if cached else "solved",
             time.perf_counter() - t0, bundle, where)
    return plan


def mass_line(report: dict) -> str:
    """The predicted share of the FFN's activation mass the hot neurons carry (the solver's
    objective over the profile), as the load's line says it."""
    share = report.get("share")
    return "activation mass on the GPU unknown" if share is None else \
        f"{100 * share:.1f}% of the predicted activation mass on the GPU"


def bytes_line(report: dict, neurons: str = "hot neurons") -> str:
    """What the placement puts on the GPU, MiB by part (the FFN's part named `neurons`), and
    the total against the budget."""
    parts = {k: v for k, v in report.get("fixed_bytes", {}).items() if v}
    parts[neurons] = report.get("hot_neuron_bytes", 0)
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    return (f"MiB: {', '.join(f'{k} {mib(v)}' for k, v in parts.items())}; "
            f"{mib(report.get('used_bytes', sum(parts.values())))} of "
            f"{mib(report.get('budget_bytes', 0))}")


def gpu_neuron_format(config: Config, info: dict) -> str | None:
    """The block format ("q4_0", "q4_1", "q8_0") a GPU keeps the hot neurons' records in: the
    file's, with `Config(weights="int4")` (`quant.block_format`); None: the model's type."""

    fmt = block_format(config.weights, info)
    return fmt.lower() if fmt else None


def ffn_layers_that_fit(args: ModelArgs, budget: int, dtype_bytes: int, batch: int,
                        context: int) -> int:
    """Whole FFN layers that fit the budget after everything else the GPU holds."""
    fixed = sum(gpu_bytes(args, dtype_bytes=dtype_bytes, batch=batch, context=context).values())
    per_layer = args.ffn_dim * neuron_bytes(args, dtype_bytes)
    return max(0, min(args.n_layers, (budget - fixed) // per_layer))


def cached_placement(bundle: Bundle, budget_gb: float, batch: int, context: int,
                     dtype_bytes: int, predictor_input: str, neuron_fmt: str | None = None,
                     fixed_bytes: dict[str, int] | None = None, predictor_fmt: str | None = None
                     ) -> tuple[list[np.ndarray], bool, dict]:
    """The bundle's placement for these settings, solved once and kept in `placements/`
    (neuron_fmt, fixed_bytes: the hot neurons' block format on the GPU and the parts it keeps
    in the file's blocks, `partial.device_fixed_bytes`; None: the model's type; predictor_fmt:
    the predictors' rows on the GPU, `predictor.device_format`): the hot masks, whether they
    were cached, and the solver's report (`Placement.report`)."""
    key = f"{budget_gb:g}GB-ctx{context}-batch{batch}-{dtype_bytes}B-{predictor_input}"
    key += f"-{neuron_fmt}" if neuron_fmt else ""
    key += f"-predictors_{predictor_fmt}" if predictor_fmt else ""
    key += "".join(f"-{k}{v}" for k, v in sorted((fixed_bytes or {}).items()))
    name = f"placements/{key}.safetensors"
    if (bundle.path / name).is_file():
        t = bundle.load_tensors(name)
        report = bundle.load_json(f"placements/{key}.json") \
            if (bundle.path / f"placements/{key}.json").is_file() else {}
        return [t[f"hot.{i}"].astype(bool) for i in range(bundle.n_layers)], True, report
    p, _ = solve_for_bundle(bundle, budget_gb, batch=batch, context=context,
                            dtype_bytes=dtype_bytes, predictor_input=predictor_input,
                            neuron_fmt=neuron_fmt, fixed_bytes=fixed_bytes,
                            predictor_fmt=predictor_fmt)
    bundle.save_tensors(name, {f"hot.{i}": h.astype(np.uint8) for i, h in enumerate(p.hot)})
    bundle.save_json(f"placements/{key}.json", p.report())
    return p.hot, False, p.report()
