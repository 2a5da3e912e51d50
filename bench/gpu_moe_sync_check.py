"""MoE at EP1 without device-to-host syncs (issue 17): the sync check, and the step time before and after.

A Qwen3-30B-A3B-shaped Megatron model (hidden 2048, 128 experts, top-8, expert FFN 768, 8 layers as
in the session-9 runs, vocabulary 32k, random weights, bf16, one GPU, EP1, our TE-free spec with
grouped experts) scores and trains on a packed RL batch (`ModelRunner.response_logprobs`, and
forward + backward through `ModelRunner.train_mini_batch`; no optimizer step):

1. `layer_sync_check`: each MoE layer alone, forward and backward on the hidden states it saw in
   that step, under `torch.cuda.set_sync_debug_mode("error")`, once per path:
   `new` (the counts stay on the device, `model/moe/layer.py`) must make no sync; `old` (the
   dispatcher copies them to the host and waits, as before) shows the sync the check is for.
   The first sync of each layer is reported with its stack.
2. `step_syncs`: every synchronising call of one whole training step (new path) under the
   "warn" mode, grouped by call site (the MoE files' share and the rest: micro-batch planning,
   loss totals, ...), to show what is left of the host-boundness.
3. `timing`: median seconds of a scoring pass, a training step and the MoE layers alone (forward +
   backward), old and new path on the same model, and the GPU's busy share of a training step
   (kernel time / wall).

Prediction (to be measured, not a result): the old path waits once per MoE layer and forward
(after the first permutation, with attention, router and permutation still queued), so the host
idles until the GPU drains and the GPU then idles while the host launches the experts' kernels.
Removing the token regrouping's syncs (eight per layer and forward, `model/moe/token_sort.py`) saved
18% of a training step and 35% of a scoring pass (session 9, run C); the remaining wait is the first
of each such group and carried most of the drain, so we expect about a third to a half of that
again: scoring 10-25% faster, a training step 5-15% faster (its backward had no such wait), the
MoE layers alone 1.1-1.4x, and the GPU's busy share of a step up by 5-15 points. More with smaller
micro-batches, where launching dominates; nothing where the GPU is the bound. The reasoning is in
docs/perf_notes.md (issue 17).

Measured (H200, 2026-11-27, session 16; docs/results/s16_2026-11-27/moe_ep1/): the prediction failed as far
as that run shows: the new path was slower (step 0.180 vs 0.151 s, scoring 0.055 vs 0.051 s, MoE layers alone
0.122 vs 0.086 s), timed old first then new; and CUDA's sync debug mode saw no sync on either path (Megatron
waits on an Event, which it does not report). Since then the paths alternate within each repeat, the GPU
layer check also records explicit waits, and each path gets a kernel summary of one profiled step.

    python bench/gpu_moe_sync_check.py [--tokens 8192] [--rows 16] [--layers 8] [--path both|old|new] [--out FILE]
    python bench/gpu_moe_sync_check.py --smoke    # CPU, a tiny model of the same structure, fp32:
        the sync check there is the CPU probe (`testing/host_syncs.HostSyncProbe`), timing is not meaningful
Exit status 1 when the new path made a sync in an MoE layer (or no MoE layer kept its counts on the device).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
             num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, vocab_size=32768,
             max_position_embeddings=40960, norm_topk_prob=True, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
SMOKE_SHAPE = dict(SHAPE, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128, vocab_size=256)


def init_single_rank(device: str) -> None:
    """One process as rank 0 of 1 (a free port), with Megatron's groups for world 1 (also used by
    gpu_scoring_graph_check.py)."""
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed(device)
    initialize_model_parallel(ParallelConfig(), seed=0)


def build(shape: dict, layers: int, dtype: str):
    """Config-only model (random weights, no checkpoint written), wrapped in DDP as the policy runs it."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from transformers import Qwen3MoeConfig

    from skyrl_megatron.model.build import ModelSpec, install_patches, make_provider
    from skyrl_megatron.model.conversion.bridge_import import import_bridge
    from skyrl_megatron.parallel import ParallelConfig
    from skyrl_megatron.runtime import current_runtime

    config = Qwen3MoeConfig(num_hidden_layers=layers, **shape)
    config.architectures = ["Qwen3MoeForCausalLM"]  # the bridge picks its converter by architecture
    spec = ModelSpec("<config only>", parallel=ParallelConfig(), dtype=dtype, wrap_with_ddp=True, load_weights=False,
                     ddp_config={"use_distributed_optimizer": True, "grad_reduce_in_fp32": True})
    install_patches(spec, current_runtime())
    provider = make_provider(spec, import_bridge().AutoBridge.from_hf_config(config))
    return provider.provide_distributed_model(ddp_config=DistributedDataParallelConfig(**spec.ddp_config),
                                              wrap_with_ddp=True, bf16=dtype == "bf16")


def _pg_objective(log_probs, entropy, batch, totals):
    loss = -(log_probs * batch["advantages"] * batch["loss_mask"]).sum() / totals.tokens
    return loss, {"loss": loss.detach().double()}


class MoeInputs:
    """Forward pre-hooks keeping each MoE layer's first input of a step (for the layers-alone runs)."""

    def __init__(self, layers):
        self.inputs: dict[int, torch.Tensor] = {}
        self.handles = [layer.register_forward_pre_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, index):
        def hook(module, args):
            self.inputs.setdefault(index, args[0].detach().clone())

        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


def layer_pass(layer, hidden: torch.Tensor) -> None:
    x = hidden.clone().requires_grad_()
    output, _ = layer(x)
    output.backward(torch.ones_like(output))


def _sync(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


def layer_sync_check(layers, inputs, on_gpu: bool) -> list[dict]:
    """Each MoE layer alone under the sync check: its first sync (GPU) or every host read (CPU probe)."""
    from skyrl_megatron.testing.host_syncs import HostSyncProbe

    found = []
    for index, layer in enumerate(layers):
        if on_gpu:
            # torch's sync debug mode names implicit syncs (.item(), .tolist(), value-sized ops) but not
            # an explicit Event/Stream wait, which is how Megatron's dispatcher waits for its counts
            # (session 16: the old path showed nothing); the probe records those waits.
            _sync(True)
            torch.cuda.set_sync_debug_mode("error")
            try:
                with HostSyncProbe() as probe:
                    layer_pass(layer, inputs[index])
                # only its explicit waits: its value reads also count host tensors, which on a GPU are no sync
                found += [{"layer": index, "what": s.what, "stack": s.stack} for s in probe.found
                          if s.what.endswith("synchronize")]
            except RuntimeError as error:
                if "synchroniz" not in str(error):
                    raise
                found.append({"layer": index, "what": str(error).splitlines()[0], "stack": traceback.format_exc()})
            finally:
                torch.cuda.set_sync_debug_mode("default")
        else:
            with HostSyncProbe() as probe:
                layer_pass(layer, inputs[index])
            found += [{"layer": index, "what": s.what, "stack": s.stack} for s in probe.found]
        layer.zero_grad(set_to_none=True)
    return found


def step_syncs(step, on_gpu: bool) -> dict:
    """Every sync of one step grouped by its innermost call site of ours or Megatron's."""
    sites: collections.Counter = collections.Counter()
    stacks: dict[str, str] = {}

    def site_of(stack: list) -> str:
        frames = [f for f in stack if "/torch/" not in f.filename and f.filename != __file__ and "warnings" not in f.filename]
        top = frames[-1] if frames else None
        return f"{top.filename.split('site-packages/')[-1]}:{top.lineno} {top.name}" if top else "?"

    def record(stack: list) -> None:
        site = site_of(stack)
        sites[site] += 1
        stacks.setdefault(site, "".join(traceback.format_list(stack[-8:])))

    if on_gpu:
        _sync(True)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            original = warnings.showwarning
            warnings.showwarning = lambda *a, **k: record(traceback.extract_stack()[:-1])
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = original
    else:
        from skyrl_megatron.testing.host_syncs import HostSyncProbe

        with HostSyncProbe() as probe:
            step()
        for s in probe.found:
            files = [line.strip() for line in s.stack.splitlines() if line.strip().startswith("File ")]
            site = files[-1] if files else "?"
            sites[site] += 1
            stacks.setdefault(site, s.stack)
    moe = sum(n for site, n in sites.items() if "/moe/" in site or "moe_layer" in site or "experts" in site)
    return {"total": sum(sites.values()), "in_moe_files": moe, "by_site": dict(sites.most_common(25)),
            "stacks": {site: stacks[site] for site, _ in sites.most_common(8) if site in stacks}}


def _seconds(fn, on_gpu: bool) -> float:
    _sync(on_gpu)
    start = time.perf_counter()
    fn()
    _sync(on_gpu)
    return time.perf_counter() - start


def timed_paths(fn, switch, paths: tuple[str, ...], on_gpu: bool, repeats: int) -> dict[str, float]:
    """Median seconds of `fn` per path, the paths alternating within each repeat (ABBA order), so that
    drift over the run (clocks, allocator growth) falls on both alike; session 16 timed old then new."""
    for path in paths:  # warm-up of each
        switch(path)
        fn()
    times: dict[str, list[float]] = {path: [] for path in paths}
    for repeat in range(repeats):
        for path in paths if repeat % 2 == 0 else tuple(reversed(paths)):
            switch(path)
            times[path].append(_seconds(fn, on_gpu))
    return {path: statistics.median(values) for path, values in times.items()}


def kernel_summary(step, top: int = 12) -> dict | None:
    """One profiled step (GPU): kernel time, kernel count, and the operators with the most device time."""
    try:
        from torch.profiler import ProfilerActivity, profile

        _sync(True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        ops = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
        return {
            "device_ms": round(sum(e.self_device_time_total for e in events) / 1e3, 2),
            "host_ops": sum(e.count for e in events if e.device_type.name == "CPU"),
            "top": [{"op": e.key[:80], "count": e.count, "device_ms": round(e.self_device_time_total / 1e3, 2),
                     "host_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in ops],
        }
    except Exception as error:  # noqa: BLE001 (a measurement extra; the timings stand without it)
        print(f"kernel summary not measured: {error}", file=sys.stderr)
        return None


def busy_share(step) -> float | None:
    """Kernel time / wall time of one step (GPU only; None where the profiler gives nothing)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        _sync(True)
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
        return round(kernel_us / 1e6 / wall, 3)
    except Exception as error:  # noqa: BLE001 (a measurement extra; the timings stand without it)
        print(f"busy share not measured: {error}", file=sys.stderr)
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="token budget of a packed micro-batch")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--path", choices=("both", "old", "new"), default="both", help="which paths to time")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model (checks the script)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    on_gpu = not args.smoke
    if on_gpu and not torch.cuda.is_available():
        parser.error("no GPU: use --smoke for the CPU check of this script")
    shape, dtype = (SHAPE, "bf16") if on_gpu else (SMOKE_SHAPE, "fp32")
    rows, prompt, response = (args.rows, args.tokens // args.rows // 2, args.tokens // args.rows // 2) if on_gpu else (4, 8, 8)
    layers_count = args.layers if on_gpu else 4
    budget = args.tokens if on_gpu else 64
    init_single_rank("cuda" if on_gpu else "cpu")

    from megatron.core import parallel_state as ps

    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.model.moe.layer import grouped_moe_layer_class, set_counts_on_device
    from skyrl_megatron.parallel import ParallelConfig
    from skyrl_megatron.testing.rl_batches import make_rl_batch

    chunks = build(shape, layers_count, dtype)
    layers = [m for m in chunks[0].modules() if isinstance(m, grouped_moe_layer_class())]
    out: dict = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "shape": {**shape, "num_hidden_layers": layers_count},
        "micro_batch_tokens": budget,
        "moe_layers": len(layers),
        "dispatchers": sorted({type(layer.token_dispatcher).__name__ for layer in layers}),
    }
    runner = ModelRunner(chunks, ParallelConfig())
    batch = make_rl_batch(rows, prompt, response, vocab_size=shape["vocab_size"], seed=1)
    out["tokens_per_step"] = int(batch["attention_mask"].sum())
    train = {"loss_mask": batch["loss_mask"], "advantages": batch["advantages"]}

    def step():
        runner.train_mini_batch(batch["sequences"], batch["attention_mask"], train, _pg_objective,
                                MicroBatching(max_tokens=budget), dp_group=ps.get_data_parallel_group())

    def score():
        with torch.no_grad():
            runner.response_logprobs(batch["sequences"], batch["attention_mask"], response, MicroBatching(max_tokens=budget))

    set_counts_on_device(chunks, True)
    capture = MoeInputs(layers)
    step()  # warm-up, and each MoE layer's input for the layers-alone runs
    capture.remove()
    inputs = capture.inputs

    out["layer_sync_check"] = {}
    for path in ("old", "new"):
        set_counts_on_device(chunks, path == "new")
        layer_pass(layers[0], inputs[0])  # warm: one-time host work (caches) is not what is checked
        out["layer_sync_check"][path] = layer_sync_check(layers, inputs, on_gpu)
    set_counts_on_device(chunks, True)
    out["step_syncs"] = step_syncs(step, on_gpu)

    def moe_layers_alone():
        for index, layer in enumerate(layers):
            layer_pass(layer, inputs[index])

    paths = ("old", "new") if args.path == "both" else (args.path,)

    def switch(path: str) -> None:
        set_counts_on_device(chunks, path == "new")

    measured = {name: timed_paths(fn, switch, paths, on_gpu, args.repeats)
                for name, fn in (("score_s", score), ("step_s", step), ("moe_layers_fwd_bwd_s", moe_layers_alone))}
    out["timing"] = {}
    for path in paths:
        switch(path)
        out["timing"][path] = {name: values[path] for name, values in measured.items()}
        out["timing"][path]["gpu_busy_share"] = busy_share(step) if on_gpu else None
        out["timing"][path]["kernels"] = kernel_summary(step) if on_gpu else None
    if args.path == "both":
        old, new = out["timing"]["old"], out["timing"]["new"]
        out["timing"]["speedup"] = {k: round(old[k] / new[k], 3) for k in ("score_s", "step_s", "moe_layers_fwd_bwd_s")}

    new_syncs = out["layer_sync_check"]["new"]
    ok = not new_syncs and out["dispatchers"] == ["DeviceCountsDispatcher"]
    out["ok"] = ok
    text = json.dumps(out, indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    summary = {k: out[k] for k in ("device", "moe_layers", "dispatchers", "tokens_per_step", "ok")}
    summary["timing"] = {p: {k: v for k, v in t.items() if k != "kernels"} if isinstance(t, dict) else t
                         for p, t in out["timing"].items()}
    summary["layer_syncs"] = {p: [(s["layer"], s["what"]) for s in v] for p, v in out["layer_sync_check"].items()}
    summary["step_syncs"] = {k: out["step_syncs"][k] for k in ("total", "in_moe_files", "by_site")}
    print(json.dumps(summary, indent=1, default=str))
    for s in new_syncs:
        print(f"new path: MoE layer {s['layer']}: {s['what']}\n{s['stack']}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
