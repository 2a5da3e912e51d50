"""The whole RL step, our Megatron backend against the host's FSDP2 backend, through the host's own trainer.

For each strategy of `--strategies`, in its own process with its own Ray, the host's GRPO trainer
(skyrl-train's `RayPPOTrainer`, through `skyrl_megatron.launch.run_experiment` with the demo's task and
prompts, skyrl_megatron/demo/) runs `--warmup` + `--steps` steps. Each step: generation by the host's vLLM
engines, scoring (the policy's and the reference's logprobs), training (GRPO with a KL loss against the
reference) and the weight sync into the engines; policy, reference and engines colocated on the same GPUs
(`colocate_all`: the engines sleep while the trainers work, the trainers sit in CPU memory while the engines
sample). The host times every phase (`timing/*`); the medians over the measured steps are tabulated.

    megatron: our Megatron-Core policy and reference workers (trainer.strategy=megatron)
    fsdp2:    the host's FSDP2 policy and reference workers (trainer.strategy=fsdp2), at their best

What makes the comparison fair: both strategies run the same command but for the trainer backend.
- Same model and data: one random-weight checkpoint of a published shape (examples/megatron/model_configs,
  with the test tokenizer padded to its vocabulary), created once in `--workdir`; the same prompt file; the
  same seed.
- Same generation: the same vLLM engine configuration (the demo's `vllm_overrides`: one engine per GPU,
  tensor parallel 1, sleep mode, `gpu_memory_utilization` 0.5; with CUDA graphs, where the demo runs
  eager), the same batch (`--prompts` x
  `--samples`), the same sampling (temperature 1, top-p 1), and every reply exactly `--max-tokens` long
  (`ignore_eos`: random weights end a few replies early, at different places on each side), so both sides
  train on the same number of tokens (checked: `tokens` per strategy).
- Same algorithm and placement: GRPO with a KL loss, the same optimizer settings, `--optimizer-steps`
  mini-batches per step, bf16; the host's own offload/backload and sleep/wake-up around each phase; the
  host's CUDA IPC weight sender into vLLM's `load_weights`. No checkpoint saves inside the step.
- What differs is the trainer backend, each at its best on these GPUs:
  megatron: packed micro-batches of `--token-budget` tokens (scoring 4x as many: it keeps no activations),
  our default fused kernels and attention, no recompute, data parallel over the GPUs (a tensor-parallel
  layout is one override away: trainer.policy.megatron_config.tensor_model_parallel_size=2);
  fsdp2: as bench/policy_bench.py's `fsdp2` case: flash_attention_2 with sample packing (through
  bench/flash_attn_standin where flash-attn has no CUDA build for the installed torch), no activation
  checkpointing (trainer.gradient_checkpointing=false; the host's default is on), micro-batches of about the
  same tokens as ours (the divisor of the mini-batch's rows nearest `--token-budget` / row length; scoring
  4x), fewer where the shape ran out of memory on one H200 (`FSDP2_FITS`); `--fsdp-train-rows` /
  `--fsdp-forward-rows` set them.
- Not in the step: start-up (Ray, engines, workers, weight conversion), recorded apart.

Reported per strategy: the median seconds of each `timing/*` phase over the measured steps, the part of
the step the host leaves untimed (sleep, wake-up, offloads between its phases), the whole step, tokens/s of
the whole step (prompt + reply tokens, per GPU), generated tokens/s during generation, the most GPU memory in
use at any time (nvidia-smi), the train-inference logprob gap, and start-up seconds. Written to
`$OUT/rl_step.json` and `$OUT/rl_step.md`, with each strategy's `run.log`, `metrics.jsonl` and
`overrides.json` under `$OUT/<strategy>/`; device, date, commit, versions and command are recorded.

On a GPU machine, after `bench/device_setup.sh` parts 1, 2, v1, v2, v3 (one call each), in the call of v4
(a later call on the same warm machine: `source bench/device_setup.sh env`):

    source bench/device_setup.sh v4 && python bench/rl_step_bench.py --model Qwen3-0.6B --steps 6 --strategies megatron,fsdp2 --out $OUT

A device call has 10 minutes. Qwen3-0.6B runs both strategies in one call; at Qwen3-4B one strategy per call on
the same warm machine (the checkpoint and our conversion cache stay in --workdir), the two reports merged
afterwards (the merge refuses reports whose settings or device differ):

    python bench/rl_step_bench.py --model Qwen3-4B --steps 2 --strategies megatron --timeout 560 --out $OUT
    python bench/rl_step_bench.py --model Qwen3-4B --steps 2 --strategies fsdp2 --timeout 560 --out $OUT
    python bench/rl_step_bench.py --render megatron_out/rl_step.json fsdp2_out/rl_step.json --out merged

A MoE shape at a depth that fits one H200 beside the engine (`--layers`: the published widths, the first N layers),
ours without and with R3 (skyrl 0.4: the vLLM servers return each token's experts and scoring and training replay
them; each report has the train-inference gap per step):

    python bench/rl_step_bench.py --model Qwen3-30B-A3B --layers 4 --strategies megatron --timeout 900 --out $OUT/moe
    python bench/rl_step_bench.py --model Qwen3-30B-A3B --layers 4 --strategies megatron --timeout 900 --out $OUT/moe_r3 \
        trainer.policy.megatron_config.moe_config.routing_replay=r3

(`--strategies megatron,fsdp2` at 4B where a call may run 15 minutes.) A strategy past `--timeout` is stopped
(its processes' stacks to `<strategy>/stacks_at_timeout.txt`) and the steps it finished still count, flagged as
incomplete. `--gpus 2` puts policy and reference on both GPUs (data parallel) with one engine per GPU.
`--placement separate` gives the engines GPUs of their own (one engine on each of `--gpus` more GPUs, awake
throughout, the weights by NCCL broadcast instead of CUDA IPC; the host offloads nothing between phases): on a
2-GPU machine, `--gpus 1 --placement separate`. Extra arguments are Hydra overrides for both strategies (e.g.
generator.enforce_eager=true for the demo's eager engines).

Two runs side by side on a 2-GPU machine, one GPU each: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0 (and =1),
a --workdir each (a strategy's run directory is cleared at its start); the memory peak reads the visible GPUs only.
On skyrl 0.4 give the second run its own router metrics port (two vllm-routers starting together both took port
29000 and the second exited): generator.inference_engine.router_init_kwargs={prometheus_port: 29100}, and its own
vLLM server ports (both servers probe from 8000 at once; the second run's trainer then reached no engine):
SKYRL_VLLM_START_PORT=8100 in its environment.

What Qwen3-4B needs on one H200 (141 GiB; estimates from bench/policy_bench.py's measured peaks, not yet
measured colocated): while vLLM samples, its pool of gpu_memory_utilization 0.5 (about 70 GiB: 8 GB of bf16
weights, the rest KV cache, far more than 128 replies of 1k tokens need) beside the trainers' CUDA contexts,
the trainers being offloaded. While the trainers work, vLLM sleeps (its weights in CPU memory, its KV cache
freed) and the reference is offloaded during training: the policy's training peak was 92 GiB for ours (bf16
weights, fp32 gradients, distributed Adam with fp32 master weights, activations of 8k tokens) and 111 GiB for
FSDP2 (fp32 parameters, gradients and Adam, 4 packed rows), so about 20 GiB of headroom for FSDP2 beside the
sleeping engine. Host memory holds what is offloaded: 4B's Adam state and master weights (about 48-64 GB), the
reference and vLLM's weights (8 GB each): about 65-80 GB of the machine's 128 GiB. Disk: the 8 GB checkpoint
and our conversion cache in --workdir.

The flash_attn stand-in comes first on the fsdp2 run's PYTHONPATH, which its engine processes inherit too: vLLM on
CUDA imports its own kernels (vllm.vllm_flash_attn), not flash_attn, so the engines run the same code in both runs.

CPU smoke (`--smoke`, CI: tests/host03/test_rl_step_bench_host.py): a tiny model, our CPU HF engine, the
megatron strategy only (the host's FSDP2 workers need CUDA), the policy on one rank and no reference worker
(no KL loss: one process fewer to start), a few steps of a few tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl_megatron.config import SCORING_BUDGET_FACTOR  # ours; FSDP2's scoring micro-batches get as many tokens

from gpu_examples import run_with_stacks_on_timeout  # bench/, beside this file
from policy_bench import (
    MODEL_CONFIGS, SMOKE_MODEL, environment, flash_attn_for_fsdp2, fsdp2_best_overrides, nearest_divisor,
    pythonpath_first, write_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = {
    "megatron": "ours: Megatron-Core policy and reference workers",
    "fsdp2": "the host's FSDP2 workers at their best (flash_attention_2 with sample packing, no activation "
             "checkpointing, large micro-batches)",
}
CHILD_OVERRIDES = "bench_overrides.json"  # in a strategy's run directory: what its process runs with
STEP_KEY = "trainer/global_step"  # the host logs it once per step, with the step's timings
# The host's timed phases directly inside `timing/step` (skyrl-train 0.3.1's `RayPPOTrainer.train`); the rest of
# the step is the colocated run's sleep, wake-up and offloads, which it does not time
TOP_LEVEL_PHASES = ("generate", "postprocess_generator_output", "convert_to_training_input", "fwd_logprobs_values_reward",
                    "apply_reward_kl_penalty", "compute_advantages_and_returns", "train_critic_and_policy",
                    "save_checkpoints", "save_hf_model", "update_ref_with_policy", "sync_weights", "eval")
UNTIMED = "untimed"  # our name for the step's remainder
PHASE_LABELS = {
    "generate": "generation (engines)",
    "postprocess_generator_output": "rewards",
    "convert_to_training_input": "batch assembly",
    "fwd_logprobs_values_reward": "scoring: ref + policy logprobs",
    "compute_advantages_and_returns": "advantages",
    "train_critic_and_policy": "training",
    "policy_train": "of which the policy's ppo_train",
    "sync_weights": "weight sync",
    UNTIMED: "sleep, wake-up, offloads (untimed by the host)",
    "step": "whole step",
}
PROMPT_TOKENS = 25  # the demo's prompts with the test tokenizer's chat template: 20-30 tokens
# Tokens per FSDP2 micro-batch (training, scoring) that fit one H200 without activation checkpointing, where a shape
# fits fewer than ours: Qwen3-4B ran out of memory at 8 training rows of ~1.1k tokens and ran at 4, scoring at 16
# (bench/policy_bench.py, docs/benchmarks.md)
FSDP2_FITS = {"Qwen3-4B": (4 * 1081, 16 * 1081)}
DEFAULT_WORKDIR = Path("/tmp/rl_step_bench")  # not under $OUT: the device tool would copy the checkpoint back


@dataclass(frozen=True)
class StepShape:
    """One RL step's batch: `prompts` x `samples` replies of `max_tokens` tokens, trained in `optimizer_steps`
    mini-batches."""

    prompts: int = 16
    samples: int = 8
    max_tokens: int = 1024
    optimizer_steps: int = 2

    @property
    def rows(self) -> int:
        return self.prompts * self.samples


SMOKE_SHAPE = StepShape(prompts=4, samples=2, max_tokens=8, optimizer_steps=2)


@dataclass(frozen=True)
class BenchSettings:
    """What every strategy of a run shares; reports are merged only where these are equal."""

    model: str
    shape: StepShape
    gpus: int  # 0: the CPU smoke run
    engine: str  # vllm | hf (our HF engine on the GPU) | cpu (our CPU engine, --smoke)
    token_budget: int
    steps: int
    warmup: int
    extra: tuple[str, ...] = ()
    fsdp_train_rows: int | None = None
    fsdp_forward_rows: int | None = None
    layers: int | None = None  # the shape's first N layers (MoE widths at a depth that fits); None: all of them
    placement: str = "colocated"  # colocated: trainers and engines share `gpus`; separate: the engines on `gpus` more

    @property
    def smoke(self) -> bool:
        return self.gpus == 0

    @property
    def devices(self) -> int:
        """The GPUs the run takes: `gpus`, twice as many where the engines have GPUs of their own."""
        return self.gpus * (2 if self.placement == "separate" else 1)

    @property
    def model_label(self) -> str:
        return model_label(self.model, self.layers)

    @property
    def checkpoint_name(self) -> str:
        return self.model if self.layers is None else f"{self.model}-{self.layers}L"


def model_label(model: str, layers: int | None) -> str:
    """The shape's name, with its depth where the run kept only its first `layers` layers."""
    return model if layers is None else f"{model}, {layers} layers"


def fsdp2_rows(b: BenchSettings) -> tuple[int, int]:
    """Rows per FSDP2 training and scoring micro-batch: about our token budget's worth (a divisor of the
    mini-batch's rows per GPU for training, as the host requires), capped by `FSDP2_FITS`."""
    row_tokens = b.shape.max_tokens + PROMPT_TOKENS
    train_tokens, forward_tokens = b.token_budget, SCORING_BUDGET_FACTOR * b.token_budget
    fit = FSDP2_FITS.get(b.model) if b.layers is None else None
    if fit:
        train_tokens, forward_tokens = min(train_tokens, fit[0]), min(forward_tokens, fit[1])
    gpus = max(b.gpus, 1)
    mini_rows = b.shape.rows // b.shape.optimizer_steps // gpus
    train = b.fsdp_train_rows or nearest_divisor(mini_rows, train_tokens / row_tokens)
    forward = b.fsdp_forward_rows or min(max(1, round(forward_tokens / row_tokens)), b.shape.rows // gpus)
    return train, forward


def shared_overrides(b: BenchSettings, run_dir: Path, model_dir: Path) -> list[str]:
    """What both strategies run with: the demo's GRPO on `b.gpus` GPUs with its engines (CPU: the demo's CPU
    run), and the bench's batch, sampling and run settings."""
    from skyrl_megatron.demo.__main__ import run_overrides
    from skyrl_megatron.demo.task import DEMO_PROMPTS
    from skyrl_megatron.hosts import current

    shape = b.shape
    bench = [
        f"trainer.train_batch_size={shape.prompts}",
        f"trainer.policy_mini_batch_size={shape.prompts // shape.optimizer_steps}",
        f"generator.n_samples_per_prompt={shape.samples}",
        f"generator.sampling_params.max_generate_length={shape.max_tokens}",
        *current().engine_sampling_overrides({"ignore_eos": True}),  # every reply max_tokens long on both sides
        "trainer.use_sample_packing=true",
        "trainer.gradient_checkpointing=false",  # FSDP2's switch (the host's default is on); ours recomputes nothing by default
        "trainer.ckpt_interval=0",
        "trainer.hf_save_interval=-1",
        "trainer.resume_mode=none",
        "trainer.run_name=rl-step-bench",
        # one rank each on CPU (the smoke run's start-up); data parallel over the GPUs, as FSDP2 shards
        "trainer.policy.megatron_config.tensor_model_parallel_size=1",
        "trainer.ref.megatron_config.tensor_model_parallel_size=1",
    ]
    if b.engine == "vllm":  # generation at its best for both sides: CUDA graphs (the demo runs eager to start sooner)
        bench.append("generator.enforce_eager=false")
    if b.smoke:  # CI's start-up: the policy on one rank, no reference worker (no KL loss)
        bench += ["trainer.placement.policy_num_gpus_per_node=1", "trainer.algorithm.use_kl_loss=false"]
    if b.placement == "separate":  # the engines on GPUs of their own, awake throughout: the host's nccl backend
        bench.append("trainer.placement.colocate_all=false")  # then broadcasts instead of sharing by CUDA IPC
    return run_overrides(run_dir, model_dir, run_dir / DEMO_PROMPTS, b.warmup + b.steps, 0, gpus=b.gpus, extra=bench,
                         engine="vllm" if b.engine == "vllm" else "hf")


def strategy_overrides(strategy: str, b: BenchSettings, workdir: Path) -> list[str]:
    """The trainer backend, at its best (see the module docstring)."""
    if strategy == "megatron":
        cache = workdir / "conversion_cache"  # a rerun on the same machine skips the HF -> Megatron conversion
        return [
            "trainer.strategy=megatron",
            *(f"trainer.{role}.megatron_config.{key}={value}" for role in ("policy", "ref")
              for key, value in (("max_tokens_per_microbatch", b.token_budget), ("checkpoint_cache_dir", cache),
                                 # no activation recompute, said (skyrl 0.4's default is full recompute)
                                 ("transformer_config_kwargs.recompute_granularity", "null"))),
            # rows per micro-batch: unused where the token budget is set (the host checks they divide)
            "trainer.micro_train_batch_size_per_gpu=1",
            "trainer.micro_forward_batch_size_per_gpu=1",
        ]
    return fsdp2_best_overrides(*fsdp2_rows(b))


def run_config(strategy: str, b: BenchSettings, run_dir: Path, model_dir: Path, workdir: Path) -> list[str]:
    """Everything `strategy`'s process hands the host, the user's overrides last."""
    from skyrl_megatron.demo.__main__ import merged

    return merged(merged(shared_overrides(b, run_dir, model_dir), strategy_overrides(strategy, b, workdir)),
                  list(b.extra))


# ----------------------------------------------------------------------------------------------
# One strategy's run (a process of its own) and what it measured
# ----------------------------------------------------------------------------------------------


def run_child(run_dir: Path) -> int:
    """The process of one strategy: the host trainer with the overrides the parent wrote to `run_dir`."""
    from skyrl_megatron.demo.__main__ import host_log_warnings_only, quiet_console

    # the engines' configuration into the run's log (attention backend, CUDA graph mode, KV cache): this is a log file
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    quiet_console()
    overrides = json.loads((run_dir / CHILD_OVERRIDES).read_text())
    host_log_warnings_only()
    from skyrl_megatron.cli import checked_config

    cfg = checked_config(overrides)  # the parent checked ours; a ConfigError here (the host's) ends in the log
    from skyrl_megatron.demo.experiment import experiment_class
    from skyrl_megatron.launch import run_experiment

    # the demo's experiment (task, prompt file, per-step metrics.jsonl) with the trainer that asks the workers
    # nothing: the host's FSDP2 workers have none of our methods, and the demo's checks would cost step time
    run_experiment(cfg, experiment_class(run_dir, checked=False), in_driver=True, log_to_driver=True, quiet=True)
    return 0


class DeviceMemoryPeak:
    """While active: the most memory in use on any of the run's GPUs (those CUDA_VISIBLE_DEVICES names, where it
    names them by index: another run may have the others), from nvidia-smi every 200 ms (the engines' pool and
    the trainers' together, whatever the process); None without nvidia-smi."""

    def __enter__(self) -> "DeviceMemoryPeak":
        self.peak_mib: float | None = None
        self._process = None
        if shutil.which("nvidia-smi"):
            self._process = subprocess.Popen(
                ["nvidia-smi", *visible_gpus_option(), "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                 "-lms", "200"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                used = float(line.strip())
            except ValueError:
                continue
            self.peak_mib = max(used, self.peak_mib or 0.0)

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._reader.join(timeout=10)

    @property
    def peak_gib(self) -> float | None:
        return None if self.peak_mib is None else self.peak_mib / 1024


def run_strategy(strategy: str, b: BenchSettings, workdir: Path, model_dir: Path, out: Path,
                 flash_attn_site: str | None, timeout: int) -> dict[str, Any]:
    """Run `strategy` in a process of its own (a fresh Ray); its log, metrics and overrides go to out/<strategy>/."""
    from skyrl_megatron.demo.experiment import read_metrics
    from skyrl_megatron.demo.task import DEMO_PROMPTS, write_prompts

    run_dir = (workdir / "runs" / strategy).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    write_prompts(run_dir / DEMO_PROMPTS, (b.warmup + b.steps) * b.shape.prompts)  # the same file for every strategy
    overrides = run_config(strategy, b, run_dir, model_dir, workdir)
    (run_dir / CHILD_OVERRIDES).write_text(json.dumps(overrides))
    strategy_out = out / strategy
    strategy_out.mkdir(parents=True, exist_ok=True)
    (strategy_out / "overrides.json").write_text(json.dumps(overrides, indent=1) + "\n")
    env = {}
    if strategy == "fsdp2" and flash_attn_site:  # its Ray workers inherit the driver's environment
        env["PYTHONPATH"] = pythonpath_first(flash_attn_site, os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(run_dir)]
    print(f"{time.strftime('%H:%M:%S')} {strategy}: {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    with environment(env), DeviceMemoryPeak() as memory, (strategy_out / "run.log").open("w") as log:
        code = run_with_stacks_on_timeout(argv, log, timeout, strategy_out / "stacks_at_timeout.txt")
    wall = time.perf_counter() - started
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        shutil.copyfile(metrics, strategy_out / "metrics.jsonl")
    result = summarise(read_metrics(metrics), b)
    result.update(exit=code, wall_seconds=wall, device_memory_peak_gib=memory.peak_gib, environment=env,
                  overrides=overrides)
    logged = result.pop("all_step_seconds")
    result["startup_seconds"] = wall - sum(logged) if logged else None  # and the shutdown, a few seconds
    print(f"{time.strftime('%H:%M:%S')} {strategy}: exit {code}, {result['measured_steps']} steps measured"
          + (f", step {result['phases']['step']['median']:.2f} s" if result["measured_steps"] else ""), flush=True)
    return result


def summarise(records: list[dict], b: BenchSettings) -> dict[str, Any]:
    """Medians over the measured steps (the last record of each step after the warm-up) of every timed phase,
    the step's untimed remainder, tokens and tokens/s; flags a partial run."""
    from skyrl_megatron.demo.experiment import MEAN_GAP

    by_step = {r["step"]: r for r in records if STEP_KEY in r}
    measured = [by_step[step] for step in sorted(by_step) if step > b.warmup]
    result: dict[str, Any] = {"measured_steps": len(measured), "complete": len(measured) == b.steps,
                              "all_step_seconds": [r["timing/step"] for r in by_step.values() if "timing/step" in r]}
    if not measured:
        return result
    names = [key[len("timing/"):] for key in measured[0] if key.startswith("timing/")
             and all(key in r for r in measured)]
    seconds = {name: [r[f"timing/{name}"] for r in measured] for name in names}
    seconds[UNTIMED] = [r["timing/step"] - sum(r.get(f"timing/{name}", 0.0) for name in TOP_LEVEL_PHASES)
                        for r in measured]
    result["phases"] = {name: {"seconds": values, "median": statistics.median(values)}
                        for name, values in seconds.items()}
    step = result["phases"]["step"]["median"]
    tokens = statistics.median(r["throughput/tokens"] for r in measured)
    generated = statistics.median(r["generate/avg_num_tokens"] for r in measured) * b.shape.rows
    losses = [r.get("policy/final_loss") for r in measured]
    result.update(
        tokens=tokens,
        generated_tokens=generated,
        tokens_per_s_per_gpu=tokens / step / max(b.devices, 1),
        generated_tokens_per_s=generated / result["phases"]["generate"]["median"],
        train_inference_gap=statistics.median(r[MEAN_GAP] for r in measured) if MEAN_GAP in measured[0] else None,
        losses_finite=all(isinstance(loss, (int, float)) and math.isfinite(loss) for loss in losses),
    )
    return result


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


def visible_gpus_option() -> list[str]:
    """nvidia-smi's `-i` for the GPUs CUDA_VISIBLE_DEVICES names by index (PCI order: the job sets
    CUDA_DEVICE_ORDER=PCI_BUS_ID, nvidia-smi's order), else nothing (all of them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").replace(" ", "")
    return ["-i", visible] if visible and all(part.isdigit() for part in visible.split(",")) else []


def device_description(gpus: int) -> str:
    """The GPUs the run uses (nvidia-smi: no CUDA context in this process), or the CPU for the smoke run."""
    if not gpus:
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    found = []
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", *visible_gpus_option(), "--query-gpu=name,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True, check=False)
        found = [line.strip() for line in query.stdout.splitlines() if line.strip()]
    if len(found) < gpus:
        raise SystemExit(f"rl_step_bench: --gpus {gpus}, but nvidia-smi lists {len(found)} GPU(s) here; "
                         "use --smoke for the CPU check")
    return f"{found[0]} x {gpus}"


def source_commit() -> str:
    """The checked-out commit (with '+changes' when the tracked files differ), or 'unknown' without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout here; give --commit)"
    return head + ("+changes" if changed else "")


def versions() -> dict[str, str | None]:
    from skyrl_megatron.hosts import detect

    host = detect().release.distribution
    names = ("torch", "transformers", "vllm", "megatron-core", host)
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return {"host": host, **found}


def settings_record(b: BenchSettings) -> dict[str, Any]:
    record = dataclasses.asdict(b)
    record["extra"] = list(b.extra)
    if not b.smoke:
        from skyrl_megatron.demo.__main__ import vllm_overrides

        record["engine_overrides"] = vllm_overrides(b.gpus) if b.engine == "vllm" else []
    record["fsdp2_rows"] = dict(zip(("train", "forward"), fsdp2_rows(b)))
    return record


def phase_order(results: dict[str, dict]) -> list[str]:
    """Every phase any strategy timed, the known ones in the step's order."""
    known = [name for name in PHASE_LABELS if name not in ("step",)]
    found = {name for r in results.values() for name in r.get("phases", {})}
    return [n for n in known if n in found] + sorted(found - set(PHASE_LABELS)) + (["step"] if "step" in found else [])


def markdown(report: dict) -> str:
    s = report["settings"]
    shape = s["shape"]
    results = report["strategies"]
    names = list(results)
    compared = "megatron" in results and "fsdp2" in results
    runs = {name: r.get("run", report["run"]) for name, r in results.items()}
    if all(run == report["run"] for run in runs.values()):
        provenance = [f"Commit {report['run']['commit']}. Command: `{report['run']['command']}`"]
    else:  # merged from separate calls
        provenance = [f"- {name}: {run['date']}, commit {run['commit']}, `{run['command']}`" for name, run in runs.items()]
    described = {
        "megatron": f"megatron: packed micro-batches of {s['token_budget']} tokens (scoring {SCORING_BUDGET_FACTOR}x).",
        "fsdp2": f"fsdp2: flash_attention_2 with packing ({report.get('fsdp_flash_attn')}), "
                 f"{s['fsdp2_rows']['train']} rows per training and {s['fsdp2_rows']['forward']} per scoring "
                 "micro-batch, no activation checkpointing.",
    }
    lines = [
        f"### RL step: {model_label(s['model'], s.get('layers'))}, {report['device']}, {report['run']['date']}",
        "",
        *provenance,
        "",
        f"Per step: {shape['prompts']} prompts x {shape['samples']} samples, every reply {shape['max_tokens']} tokens "
        f"(ignore_eos), {shape['optimizer_steps']} optimizer steps; "
        + ("the policy on one rank and our CPU engine, no reference (the CPU smoke run)" if not s["gpus"] else
           f"policy, reference and the {s['engine']} engines (one per GPU) colocated on {s['gpus']} GPU(s)"
           if s.get("placement", "colocated") == "colocated" else
           f"policy and reference on {s['gpus']} GPU(s), the {s['engine']} engines (one per GPU) on {s['gpus']} more, "
           "weights by NCCL broadcast")
        + f". Median of {s['steps']} steps after {s['warmup']} warm-up. Versions: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if k != "host" and v) + ". "
        + " ".join(text for name, text in described.items() if name in results),
        "",
        "| phase | " + " | ".join(f"{name} s" for name in names) + (" | fsdp2 / megatron |" if compared else " |"),
        "|---|" + "---|" * (len(names) + compared),
    ]

    def row(label: str, values: list[float | None], fmt: str, ratio: bool) -> str:
        cells = ["-" if v is None else fmt.format(v) for v in values]
        if compared:
            mine, theirs = values[names.index("megatron")], values[names.index("fsdp2")]
            cells.append(f"{theirs / mine:.2f}x" if ratio and mine and theirs else "")
        return f"| {label} | " + " | ".join(cells) + " |"

    for phase in phase_order(results):
        label = PHASE_LABELS.get(phase, phase)
        label = f"**{label}**" if phase == "step" else label
        values = [r.get("phases", {}).get(phase, {}).get("median") for r in results.values()]
        lines.append(row(label, values, "{:.2f}", ratio=True))
    lines += [
        row("tokens per step (prompt + reply)", [r.get("tokens") for r in results.values()], "{:,.0f}", False),
        row("tokens/s per GPU, whole step", [r.get("tokens_per_s_per_gpu") for r in results.values()], "{:,.0f}", False),
        row("generated tokens/s", [r.get("generated_tokens_per_s") for r in results.values()], "{:,.0f}", False),
        row("GPU memory in use, max GiB", [r.get("device_memory_peak_gib") for r in results.values()], "{:.1f}", False),
        row("train-inference gap, mean abs logprob", [r.get("train_inference_gap") for r in results.values()], "{:.4f}", False),
        row("outside the steps: start-up, first sync, shutdown, s", [r.get("startup_seconds") for r in results.values()],
            "{:.0f}", False),
    ]
    notes = []
    for name, r in results.items():
        if r.get("exit") != 0 or not r.get("complete"):
            notes.append(f"- {name}: exit {r.get('exit')}, {r.get('measured_steps', 0)} of {s['steps']} steps "
                         f"measured (see {name}/run.log)")
    tokens = {r.get("tokens") for r in results.values() if r.get("tokens")}
    if len(tokens) > 1:
        notes.append(f"- the strategies trained on different token counts ({sorted(tokens)}): not comparable")
    if compared:
        notes.insert(0, "- the ratio column: fsdp2's seconds over megatron's (above 1: megatron is faster)")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "rl_step.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "rl_step.md").write_text(markdown(report))


def merge_reports(reports: list[dict]) -> dict:
    """One report of the strategies of several runs (one call each); refused where anything but the trainer
    backend differed (model, batch, engines, GPUs, steps)."""
    first = reports[0]
    for other in reports[1:]:
        for key in ("settings", "device"):
            if other[key] != first[key]:
                differ = ([k for k in first[key] if first[key][k] != other[key].get(k)]
                          if isinstance(first[key], dict) else [key])
                raise SystemExit(f"--render: the runs differ in {key} ({', '.join(differ)}); only runs of the same "
                                 "settings on the same device compare")
    merged = {**first, "strategies": {}}
    for report in reports:
        for name, result in report["strategies"].items():
            merged["strategies"][name] = {**result, "run": result.get("run", report["run"])}
        merged["fsdp_flash_attn"] = merged.get("fsdp_flash_attn") or report.get("fsdp_flash_attn")
    return merged


# ----------------------------------------------------------------------------------------------


def create_checkpoint(model: str, model_dir: Path, on_gpu: bool, layers: int | None = None) -> None:
    """The random-weight checkpoint (the shape's first `layers` layers), once per --workdir; on the GPU in a process
    that exits before the runs (no CUDA memory held here while they run)."""
    if (model_dir / "config.json").exists():
        return
    if not on_gpu:
        write_checkpoint(model, model_dir, True, layers)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as builder:
        builder.submit(write_checkpoint, model, model_dir, False, layers).result()


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen3-0.6B", help="a shape in examples/megatron/model_configs")
    parser.add_argument("--layers", type=int, help="keep the shape's first N layers (e.g. MoE widths that fit)")
    parser.add_argument("--strategies", default="megatron,fsdp2", help="comma-separated: " + ", ".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=2, help="measured steps per strategy")
    parser.add_argument("--warmup", type=int, default=1, help="steps before them, not measured")
    parser.add_argument("--prompts", type=int, default=StepShape.prompts, help="prompts per step")
    parser.add_argument("--samples", type=int, default=StepShape.samples, help="replies per prompt")
    parser.add_argument("--max-tokens", type=int, default=StepShape.max_tokens, help="tokens per reply (all of them)")
    parser.add_argument("--optimizer-steps", type=int, default=StepShape.optimizer_steps,
                        help="mini-batches per step (optimizer steps)")
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=1, help="GPUs of the policy and the reference")
    parser.add_argument("--placement", choices=("colocated", "separate"), default="colocated",
                        help="colocated: the engines share the trainers' GPUs (CUDA IPC); separate: one engine on each "
                             "of --gpus more GPUs, weights by NCCL broadcast")
    parser.add_argument("--engine", choices=("auto", "vllm", "hf"), default="vllm",
                        help="the host's vLLM (default) or our HF engine; auto: vLLM where installed")
    parser.add_argument("--token-budget", type=int, default=8192, help="ours: tokens per training micro-batch")
    parser.add_argument("--fsdp-train-rows", type=int, help="fsdp2: rows per training micro-batch (default: see above)")
    parser.add_argument("--fsdp-forward-rows", type=int, help="fsdp2: rows per scoring micro-batch")
    parser.add_argument("--fsdp-flash-attn", choices=("auto", "standin", "installed"), default="auto",
                        help="fsdp2's flash_attn (as bench/policy_bench.py's option)")
    parser.add_argument("--timeout", type=int, default=540, help="seconds per strategy; the steps done by then count")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                        help="checkpoint, conversion cache and run directories (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="report, logs and metrics (required)")
    parser.add_argument("--commit", help="the commit to record (default: git's, where this is a checkout)")
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny model, our CPU engine, megatron only")
    parser.add_argument("--render", type=Path, nargs="+", metavar="REPORT_JSON",
                        help="run nothing: merge these reports' strategies into --out")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # one strategy's process (the parent starts it)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both strategies")
    return parser.parse_args(argv)


def bench_settings(args) -> BenchSettings:
    """The run's settings from the command line, every bad value named before anything heavy runs."""
    from skyrl_megatron.demo.__main__ import pick_engine

    strategies = args.strategies.split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise SystemExit(f"--strategies: {', '.join(unknown) or 'none'} not one of {', '.join(STRATEGIES)}")
    if args.smoke and args.placement != "colocated":
        raise SystemExit("--smoke runs on CPU with our CPU engine in the trainer's place: "
                         "--placement separate needs GPUs")
    if args.smoke and "fsdp2" in strategies:
        raise SystemExit("--smoke runs on CPU, where the host's FSDP2 workers cannot (they need CUDA): "
                         "use --smoke --strategies megatron")
    if not args.smoke and not (MODEL_CONFIGS / f"{args.model}.json").exists():
        known = sorted(p.stem for p in MODEL_CONFIGS.glob("*.json"))
        raise SystemExit(f"--model {args.model}: no {MODEL_CONFIGS / (args.model + '.json')}; one of {', '.join(known)}")
    shape = SMOKE_SHAPE if args.smoke else StepShape(args.prompts, args.samples, args.max_tokens, args.optimizer_steps)
    gpus = 0 if args.smoke else args.gpus
    positive = {"--steps": args.steps, "--prompts": args.prompts, "--samples": args.samples,
                "--max-tokens": args.max_tokens, "--optimizer-steps": args.optimizer_steps,
                "--token-budget": args.token_budget, "--timeout": args.timeout,
                **({"--layers": args.layers} if args.layers is not None else {}),
                **{name: rows for name, rows in (("--fsdp-train-rows", args.fsdp_train_rows),
                                                 ("--fsdp-forward-rows", args.fsdp_forward_rows)) if rows is not None}}
    bad = [f"{name} {value}" for name, value in positive.items() if value < 1] + (["--warmup"] if args.warmup < 0 else [])
    if bad:
        raise SystemExit(f"rl_step_bench: {', '.join(bad)}: must be positive (--warmup: 0 or more)")
    if shape.prompts % shape.optimizer_steps or (shape.rows // shape.optimizer_steps) % max(gpus, 1):
        raise SystemExit(f"--prompts {shape.prompts}: must split into --optimizer-steps {shape.optimizer_steps} "
                         f"mini-batches whose {shape.samples} samples per prompt divide over {max(gpus, 1)} GPU(s)")
    mini_rows = shape.rows // shape.optimizer_steps // max(gpus, 1)
    if args.fsdp_train_rows and mini_rows % args.fsdp_train_rows:
        raise SystemExit(f"--fsdp-train-rows {args.fsdp_train_rows}: must divide the {mini_rows} rows of a mini-batch "
                         "per GPU (the host accumulates gradients over whole micro-batches)")
    return BenchSettings(
        model=SMOKE_MODEL if args.smoke else args.model, shape=shape, gpus=gpus,
        engine="cpu" if args.smoke else pick_engine(args.engine, gpus), token_budget=args.token_budget,
        steps=args.steps, warmup=args.warmup, extra=tuple(args.overrides), fsdp_train_rows=args.fsdp_train_rows,
        fsdp_forward_rows=args.fsdp_forward_rows, layers=None if args.smoke else args.layers, placement=args.placement,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child)
    if args.out is None:
        raise SystemExit("rl_step_bench: --out DIR is required (the report, logs and metrics go there)")
    if args.render:
        report = merge_reports([json.loads(path.read_text()) for path in args.render])
        write_report(report, args.out)
        print(markdown(report))
        return 0

    from skyrl_megatron.config import ConfigError
    from skyrl_megatron.demo.__main__ import check_before_the_model_exists

    b = bench_settings(args)
    strategies = args.strategies.split(",")
    device = device_description(b.devices)
    workdir = args.workdir.resolve()
    model_dir = workdir / "models" / b.checkpoint_name
    for strategy in strategies:  # our checks and the host's light parse, before the checkpoint is made
        try:
            check_before_the_model_exists(run_config(strategy, b, workdir / "runs" / strategy, model_dir, workdir),
                                          model_dir)
        except ConfigError as err:
            raise SystemExit(f"rl_step_bench: {strategy}: {err}") from None
    started = time.perf_counter()
    create_checkpoint(b.model, model_dir, on_gpu=bool(b.gpus), layers=b.layers)
    print(f"checkpoint {model_dir} ready ({time.perf_counter() - started:.0f} s)", flush=True)
    flash_attn_site, flash_attn_used = None, None
    if "fsdp2" in strategies:
        flash_attn_site, flash_attn_used = flash_attn_for_fsdp2(args.fsdp_flash_attn, workdir)
    command = "python bench/rl_step_bench.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    run = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "commit": args.commit or source_commit(), "command": command}
    report = {"device": device, "run": run, "versions": versions(), "settings": settings_record(b),
              "fsdp_flash_attn": flash_attn_used, "strategies": {}}
    for strategy in strategies:
        report["strategies"][strategy] = {**run_strategy(strategy, b, workdir, model_dir, args.out, flash_attn_site,
                                                         args.timeout), "run": run}
        write_report(report, args.out)  # after each strategy: a later one cut short keeps what came before
    print(markdown(report))
    ok = all(r["exit"] == 0 and r["complete"] and r.get("losses_finite") for r in report["strategies"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
