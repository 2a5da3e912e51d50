"""Each example script's layout, scaled down to 2 GPUs, through 2 GRPO steps of the demo.

For every planned example (examples/megatron/run_qwen3_*.sh): its Megatron settings at sizes that fit
2 GPUs and its model cut to a few layers of the published widths (``bench/example_layouts.py``); a
random-weight HF checkpoint of that shape; ``python -m skyrl_megatron.demo --gpus 2 --model <it>`` for
2 steps (the host's trainer, our policy/ref workers, our HF engines colocated, CUDA IPC sync), with
1024-token generations so the micro-batches fill the token budget as in a real run. The planner's
estimate of that layout is set against the workers' measured peaks (``memory/*`` metrics).

    python bench/gpu_examples.py --out /tmp/out/examples [--only 235b] [--gpus 2]

Writes ``<out>/<script>/{run.log,metrics.jsonl,plan.txt}`` and ``<out>/examples.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from example_layouts import EXAMPLES, ScaledExample, planned_peak, scale_example, write_model_config

STEPS = 2
RUN_SETTINGS = ("trainer.hf_save_interval=-1",)
# Random weights rarely sample EOS, so every reply has the full length: 1024 tokens fill the token budget
# as in a real run, which matters where activations are kept (no recompute); under full recompute they
# are a few hundred MiB whatever the length, and 256 tokens cut the generation time by 4.
LONG_REPLIES, SHORT_REPLIES = 1024, 256
MODELS = Path("/tmp/gpu_examples_models")  # not under $OUT: the device tool would copy them back


def demo_arguments(example: ScaledExample, model_dir: Path, run_dir: Path, generate_length: int = LONG_REPLIES) -> list[str]:
    """The demo command line of one scaled example (no checkpoints: 2 steps need none)."""
    return ["--gpus", str(example.gpus), "--model", str(model_dir), "--out", str(run_dir), "--fresh",
            "--steps", str(STEPS), "--ckpt-interval", "0", *example.overrides, *RUN_SETTINGS,
            f"generator.sampling_params.max_generate_length={generate_length}"]  # fmt: skip


def create_model(example: ScaledExample, model_dir: Path, cpu: bool) -> None:
    """Random bf16 weights of the scaled shape, with the test tokenizer padded to the published vocabulary."""
    from transformers import AutoConfig

    from policy_bench import write_random_checkpoint

    write_random_checkpoint(AutoConfig.for_model(**example.model_config), model_dir, cpu=cpu)


def measured_peaks(metrics_file: Path) -> dict[str, float]:
    """The largest of each ``memory/*`` metric over the run's steps, and the seconds of each step."""
    peaks: dict[str, float] = {}
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.startswith("memory/") and isinstance(value, (int, float)):
                peaks[key] = max(value, peaks.get(key, 0.0))
        if "timing/step" in record:
            peaks[f"step_{record['step']}_s"] = record["timing/step"]
    return peaks


def reply_length(example: ScaledExample) -> int:
    return SHORT_REPLIES if example.setting("transformer_config_kwargs.recompute_granularity") == "full" else LONG_REPLIES


def timed_create_model(example: ScaledExample, model_dir: Path, cpu: bool) -> float:
    started = time.perf_counter()
    create_model(example, model_dir, cpu)
    return time.perf_counter() - started


def run_with_stacks_on_timeout(argv: list[str], log, timeout: int, stacks_file: Path) -> int | str:
    """Run the demo; past `timeout`, every Python stack of the run (the demo and its Ray workers) goes to
    `stacks_file` before the processes are stopped, so a stalled run says where it stood.

    The demo runs with the host's INFO log (phase timestamps) and ``PYTHONFAULTHANDLER=1``, which its Ray
    workers inherit: SIGABRT then makes each process print its threads' stacks to its stderr (the demo's
    into `log`, the workers' into Ray's worker logs).
    """
    env = {**os.environ, "LOG_LEVEL": "INFO", "PYTHONFAULTHANDLER": "1"}
    demo = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        return demo.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    subprocess.run(["pkill", "-ABRT", "-f", "ray::"], check=False)
    demo.send_signal(signal.SIGABRT)
    time.sleep(10)  # the handlers write, Ray flushes its worker logs
    with stacks_file.open("w") as out:
        for err in sorted(Path("/tmp/ray/session_latest/logs").glob("worker-*.err")):
            text = err.read_text(errors="replace")
            if "Thread 0x" in text or "Current thread" in text:
                start = min(i for i in (text.find("Thread 0x"), text.find("Current thread")) if i >= 0)
                out.write(f"== {err.name}\n{text[start:][-20000:]}\n")
    demo.kill()
    subprocess.run(["pkill", "-KILL", "-f", "ray::"], check=False)
    # the killed driver's local cluster (raylet, GCS) would outlive it
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], check=False, capture_output=True)
    return "timeout"


def run_example(example: ScaledExample, script: Path, work: Path, model_ready, gpu_memory_gib: float, timeout: int,
                generate_length: int) -> dict:
    """One scaled example's 2 steps; `model_ready` is the future of its checkpoint's creation (seconds)."""
    model_dir = MODELS / script.stem
    created = model_ready.result()
    planned, plan_text = planned_peak(example, write_model_config(example, work / "scaled_config.json"), gpu_memory_gib)
    (work / "plan.txt").write_text(plan_text)
    run_dir = Path("/tmp/gpu_examples") / script.stem
    argv = [sys.executable, "-m", "skyrl_megatron.demo", *demo_arguments(example, model_dir, run_dir, generate_length)]
    (work / "command.txt").write_text(" ".join(argv) + "\n")
    started = time.perf_counter()
    with (work / "run.log").open("w") as log:
        code = run_with_stacks_on_timeout(argv, log, timeout, work / "stacks_at_timeout.txt")
    seconds = time.perf_counter() - started
    metrics = run_dir / "metrics.jsonl"
    measured = measured_peaks(metrics) if metrics.exists() else {}
    if metrics.exists():
        (work / "metrics.jsonl").write_text(metrics.read_text())
    return {"script": script.name, "layers": example.layers, "model": example.model, "overrides": example.overrides,
            "planner_args": example.planner_args, "planned_gib": planned, "measured": measured, "exit": code,
            "run_s": seconds, "model_create_s": created, "generate_length": generate_length}  # fmt: skip


def table(results: list[dict]) -> str:
    rows = ["| example (scaled) | layout on 2 GPUs | exit | planner total (of which overhead) | measured policy peak "
            "allocated: train / optimizer step / scoring | reserved (max) | run s |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        m, p = r["measured"], r["planned_gib"]
        layout = " ".join(a for a in r["planner_args"][4:] if a != "--nodes")
        peaks = " / ".join(f"{m.get(f'memory/policy_{phase}_peak_allocated_gib', float('nan')):.1f}"
                           for phase in ("training", "optimizer_step", "scoring"))
        reserved = max((v for k, v in m.items() if k.startswith("memory/policy_") and "reserved" in k), default=float("nan"))
        rows.append(f"| {r['script']} ({r['model']}, {r['layers']} layers) | `{layout}` | {r['exit']} | "
                    f"{p['total']:.1f} ({p['overhead']:.1f}) | {peaks} | {reserved:.1f} | {r['run_s']:.0f} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--only", default="", help="run the scripts whose name contains one of these (comma-separated)")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per example run")
    parser.add_argument("--full-size", action="store_true",
                        help="every layer of the published model (e.g. run_qwen3_30b_a3b_1node.sh on 8 GPUs)")
    parser.add_argument("--generate-length", type=int, default=0,
                        help=f"tokens per reply (0: {LONG_REPLIES} without recompute, {SHORT_REPLIES} with full recompute)")
    args = parser.parse_args()
    import multiprocessing

    import torch

    gpu_memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    wanted = args.only.split(",")
    scripts = [s for s in sorted(EXAMPLES.glob("run_qwen3_*.sh")) if any(part in s.name for part in wanted)]
    works = {s: args.out / s.stem for s in scripts}
    examples = {s: scale_example(s, works[s] / "launch", args.gpus, full_size=args.full_size) for s in scripts}
    results = []
    # The first checkpoint is built on the idle GPUs (a 6B-parameter one takes 90 s on the CPU) by a process
    # that exits before the first run; each later one on the CPU while the example before it runs.
    spawn = multiprocessing.get_context("spawn")
    ready = {}
    if scripts:
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as gpu_builder:
            ready[scripts[0]] = gpu_builder.submit(timed_create_model, examples[scripts[0]], MODELS / scripts[0].stem, False)
            ready[scripts[0]].result()
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        ready |= {s: pool.submit(timed_create_model, examples[s], MODELS / s.stem, True) for s in scripts[1:]}
        for script in scripts:
            length = args.generate_length or reply_length(examples[script])
            results.append(run_example(examples[script], script, works[script], ready[script], gpu_memory_gib,
                                       args.timeout, length))
            shutil.rmtree(MODELS / script.stem, ignore_errors=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=2))
            (args.out / "examples.md").write_text(table(results))
            print(table(results[-1:]), flush=True)
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
