"""Compact master weights on one GPU: the release (split) and rebuild (join) of a model's fp32 masters,
the product's GPU kernels (our Triton passes) and optionally the eager ones, timed and checked bit for bit.

`megatron_config.compact_master_weights` rebuilds every fp32 master before the optimizer step and
releases it after, so both run once per training step over all parameters. The eager kernels took
about 0.44 s per step at Qwen3-4B on an H200 (2026-11-27: 15.3k against 17.0k training tokens/s);
this script times both kernel sets on masters shaped like a model's parameters (no Megatron, no
checkpoint: random fp32 masters and their bf16 rounding), and checks that each rebuild equals the
masters it started from. As in Megatron, the masters are separate tensors and the bf16 model shards
views of one contiguous buffer ("ddp" layout), so after the first (untimed) round a release and a
rebuild take one kernel call per run of back-to-back shards; on GPU the kernels are also timed with
each shard its own tensor ("separate": one run, so one call, per tensor). MoE shapes hold each expert's
two weights as tensors of their own, as our grouped experts do (thousands of tensors at 128 experts).
The optimizer step's copy back into the model weights is timed with the release both ways: torch's
`_foreach_copy_` then the split ("copy"), and the split that writes the weights itself ("write", the product's
path inside a step), the weights checked bit for bit against torch's rounding of the masters.
`--profile FILE` profiles one more release and rebuild of the "ddp" layout and writes where the device
waited (`gpu_idle.write_profile_report`; the two are marked `skyrl_megatron.masters_release` and
`skyrl_megatron.masters_rebuild`).

    python bench/gpu_master_weights_check.py --model Qwen3-4B --out $OUT/master_weights.json
    python bench/gpu_master_weights_check.py --model Qwen3-30B-A3B --layers 8 --out $OUT/mw_moe.json \
        --profile $OUT/mw_moe_profile.txt
    python bench/gpu_master_weights_check.py --smoke --out /tmp/mw.json      # CPU, tiny, eager only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from skyrl_megatron import master_weights  # noqa: E402

SHAPES_DIR = ROOT / "examples" / "megatron" / "model_configs"


# the smoke runs' model: a tiny dense Qwen3 shape
SMOKE_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 1000}


def shape_config(model: str, layers: int | None) -> dict:
    """A shape of examples/megatron/model_configs, with `layers` layers where given."""
    config = json.loads((SHAPES_DIR / f"{model}.json").read_text())
    if layers:
        config["num_hidden_layers"] = layers
    return config


def parameter_sizes(config: dict) -> list[int]:
    """Element counts of a Qwen3's (dense or MoE) parameters, one entry per tensor (as Megatron holds them)."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    query, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    attention = [hidden, hidden * (query + 2 * kv), head_dim, head_dim, query * hidden, hidden]
    if config.get("num_experts"):  # router, then per expert its fused gate/up and its down projection
        experts, ffn = config["num_experts"], config["moe_intermediate_size"]
        feed_forward = [experts * hidden] + [hidden * 2 * ffn] * experts + [ffn * hidden] * experts
    else:
        feed_forward = [hidden * 2 * config["intermediate_size"], config["intermediate_size"] * hidden]
    sizes = [config["vocab_size"] * hidden] + (attention + feed_forward) * layers + [hidden]
    if not config.get("tie_word_embeddings", False):
        sizes.append(config["vocab_size"] * hidden)
    return sizes


def make_pairs(sizes: list[int], device: torch.device, layout: str = "ddp",
               seed: int = 0) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(fp32 master, bf16 model shard) per parameter. The masters are separate tensors, as Megatron's
    optimizer allocates them. layout "ddp": the model shards are views of one contiguous bf16 buffer,
    each starting at a multiple of 64 elements, the last parameter first (as Megatron's DDP lays them
    out: compact masters then work per run of them, and the first master split is the final norm's);
    "separate": each shard its own tensor (one run per tensor)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    starts, end = [0] * len(sizes), 0
    for index in reversed(range(len(sizes))) if layout == "ddp" else range(len(sizes)):
        starts[index] = end
        end = -(-(end + sizes[index]) // 64) * 64
    buffer = torch.zeros(end, dtype=torch.bfloat16, device=device) if layout == "ddp" else None
    pairs = []
    for size, start in zip(sizes, starts):
        master = torch.randn(size, generator=generator, device=device) * 0.02
        if buffer is None:
            model = master.to(torch.bfloat16)
        else:
            model = buffer[start : start + size]
            model.copy_(master)
        pairs.append((torch.nn.Parameter(master, requires_grad=False), model))
    return pairs


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_kernels(name: str, kernels, pairs, device: torch.device, repeats: int, copy_back: str | None = None) -> dict:
    """Release and rebuild `repeats` times with `kernels`; seconds per call and whether every rebuild is exact.
    `copy_back`: the optimizer step's copy of the masters into the model weights made first, timed with the
    release: "copy" (torch's `_foreach_copy_`, then the split) or "write" (the release's split writes them,
    `round_into_models`); the weights are then checked bit for bit against torch's rounding of the masters."""
    real_kernels = master_weights._kernels
    master_weights._kernels = lambda _device: kernels
    try:
        expected = [master.detach().view(torch.int32).clone() for master, _ in pairs]
        rounded = [master.detach().to(torch.bfloat16).view(torch.int16) for master, _ in pairs]
        compact = master_weights.CompactMasterWeights(pairs)
        release, rebuild, exact, models_exact = [], [], True, True
        for _ in range(repeats + 1):  # the first round compiles the kernels: not timed
            _synchronize(device)
            start = time.perf_counter()
            if copy_back == "copy":
                torch._foreach_copy_([model for _, model in pairs], [master.detach() for master, _ in pairs])
            elif copy_back == "write":
                with compact.writing_models():
                    compact.round_into_models(0)
            freed = compact.release()
            _synchronize(device)
            middle = time.perf_counter()
            compact.rebuild()
            _synchronize(device)
            release.append(middle - start)
            rebuild.append(time.perf_counter() - middle)
            exact = exact and all(torch.equal(m.view(torch.int32), want) for (m, _), want in zip(pairs, expected))
            models_exact = models_exact and all(torch.equal(model.view(torch.int16), want)
                                                for (_, model), want in zip(pairs, rounded))
        return {"kernels": name, "copy_back": copy_back, "runs_of_masters": compact.runs,
                "release_s": sorted(release[1:])[len(release[1:]) // 2],
                "rebuild_s": sorted(rebuild[1:])[len(rebuild[1:]) // 2], "first_round_s": release[0] + rebuild[0],
                "freed_gib": freed / 2**30, "exact": exact and models_exact}
    finally:
        master_weights._kernels = real_kernels


def profile_round(pairs, device: torch.device, out_file: Path) -> dict:
    """One more release and rebuild under the torch profiler (the kernels already compiled); where the device
    waited, written to `out_file`."""
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_idle import write_profile_report

    compact = master_weights.CompactMasterWeights(pairs)
    compact.release()
    compact.rebuild()  # the runs gathered: the profiled round is a steady-state one
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _synchronize(device)
    with torch.profiler.profile(activities=activities, with_stack=True) as profiler:
        start = time.perf_counter()
        compact.release()
        compact.rebuild()
        _synchronize(device)
        wall = time.perf_counter() - start
    return write_profile_report(profiler, wall, "one release and rebuild", str(out_file))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen3-4B", help="a shape in examples/megatron/model_configs")
    parser.add_argument("--layers", type=int, help="layers of that shape (default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model, eager kernels only")
    parser.add_argument("--eager", action="store_true", help="time the eager kernels as well (GPU; slow)")
    parser.add_argument("--profile", type=Path, help="profile one release and rebuild of the ddp layout into this file")
    parser.add_argument("--out", type=Path, default=Path("master_weights.json"))
    args = parser.parse_args(argv)

    if args.smoke:
        device = torch.device("cpu")
        config = SMOKE_CONFIG
        runs = [("eager", master_weights._EAGER, "ddp", None), ("eager", master_weights._EAGER, "ddp", "copy"),
                ("eager", master_weights._EAGER, "ddp", "write")]
    else:
        device = torch.device("cuda")
        config = shape_config(args.model, args.layers)
        gpu = master_weights._kernels(device)
        # the step's copy back and the release: torch's copy then the split, against the split writing the weights
        runs = [("gpu", gpu, "ddp", None), ("gpu", gpu, "separate", None), ("gpu", gpu, "ddp", "copy"),
                ("gpu", gpu, "ddp", "write")]
        if args.eager:
            runs.insert(0, ("eager", master_weights._EAGER, "ddp", None))
    sizes = parameter_sizes(config)
    results = []
    for name, kernels, layout, copy_back in runs:
        pairs = make_pairs(sizes, device, layout)
        results.append({**time_kernels(name, kernels, pairs, device, args.repeats, copy_back), "layout": layout})
        del pairs
    report = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU", "torch": torch.__version__,
              "model": "tiny" if args.smoke else args.model, "layers": config["num_hidden_layers"],
              "tensors": len(sizes), "elements": sum(sizes), "runs": results}
    if args.profile:
        pairs = make_pairs(sizes, device, "ddp")
        report["profile"] = profile_round(pairs, device, args.profile)
        del pairs
    if device.type == "cuda":
        report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    args.out.write_text(json.dumps(report, indent=2))
    for run in report["runs"]:
        print(f"{run['kernels']:>9} {run['layout']:>8} {run['copy_back'] or '':>5} ({run['runs_of_masters']:4d} runs):"
              f" release {run['release_s'] * 1e3:8.1f} ms, rebuild {run['rebuild_s'] * 1e3:8.1f} ms, "
              f"freed {run['freed_gib']:.2f} GiB, exact {run['exact']}")
    return 0 if all(run["exact"] for run in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
