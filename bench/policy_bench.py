"""Policy forward and training: our Megatron workers against the host's FSDP2 workers.

Both sides run what the host trainer runs between two generation steps, through its own code: the
host's `RayPPOTrainer.build_models` creates the policy actor group for the strategy
(`trainer.strategy=megatron`: our workers; `trainer.strategy=fsdp2`: the host's FSDP2 workers), then `fwd_logprobs_values_reward` scores the batch (the "forward" phase: the
policy's logprobs of the responses) and `train_critic_and_policy` trains on it (the "train" phase: forward,
backward and the optimizer step, one mini-batch: skyrl-train 0.3.1's workers run it as `ppo_train`, skyrl 0.4's as
`forward_backward` then `optim_step`; either host, the one installed). Each case gets a fresh Ray.

The batch is RL-shaped: `--rows` sequences, prompts of 3/4 to all of `--prompt-tokens` (left
padded), responses drawn log-uniformly between `--min-response` and `--max-response` tokens (a
long tail: the median is the geometric mean of the bounds, a few rows are near the maximum).
Weights are random, saved once as an HF checkpoint of the published shape (`--layers N` keeps the
first N layers: MoE widths at a depth that fits, e.g. Qwen3-30B-A3B with 8 layers).

Backends (see BACKENDS): `megatron` (ours); `fsdp2`, the host's FSDP2 workers as a tuned user runs
them: flash_attention_2 with sample packing (the host unpads each micro-batch's rows into one
sequence and runs FlashAttention-2's varlen kernels; logprobs through flash-attn's Triton cross
entropy), no activation checkpointing; `fsdp2_sdpa`, the host's defaults where flash-attn is
missing: HF SDPA on padded micro-batches; `fsdp2_loop`, no host at all: the plain FSDP2 loop of
bench/fsdp2_loop.py with the same kernels (FFD token-budget packing, fused AdamW), what the host's
workers cost against a loop written for speed. Where flash-attn has no CUDA build for the installed
torch (the lent GPUs), the `fsdp2` and `fsdp2_loop` cases run with bench/flash_attn_standin
(flash-attn's API on PyTorch's own FlashAttention-2 kernels) first on their PYTHONPATH / sys.path.

Reported per case and phase: median seconds over `--steps` steps after `--warmup` (excluded);
tokens/s/GPU over the real (unpadded) tokens; MFU against the bf16 matmul peak measured on this GPU
at start, and against the datasheet's dense bf16 peak (model FLOPs: 2 x matmul parameters per token,
active experts only, plus causal attention, times 3 for training; recompute not counted); peak memory allocated per GPU during the phase. Which path ran is recorded
(Transformer Engine or our TE-free spec; FSDP2's attention implementation).

    python bench/policy_bench.py --model Qwen3-1.7B --cases megatron:world1,fsdp2:world1
    python bench/policy_bench.py --model Qwen3-4B --cases megatron:dp2,megatron:tp2,fsdp2:dp2,fsdp2_sdpa:dp2
    python bench/policy_bench.py --model Qwen3-30B-A3B --layers 8 --cases megatron:ep2,megatron:tp2ep2,fsdp2:dp2
    python bench/policy_bench.py --model Qwen3-4B --cases megatron:world1,fsdp2:world1,fsdp2_loop:world1
    python bench/policy_bench.py --smoke     # CPU, tiny shapes: ours and the plain loop (the host's FSDP2 needs CUDA)
    # EP2 with the all-to-alls' sizes on the device (moe_config.device_all_to_all) against without:
    python bench/policy_bench.py --model Qwen3-30B-A3B --layers 8 --cases megatron:ep2,megatron:ep2@a2a_dev \
        --variant a2a_dev='trainer.policy.megatron_config.moe_config.device_all_to_all=true'
    # EP2 with each MoE layer's tokens in two halves, one half's all-to-all under the other half's experts
    # (moe_config.overlap_all_to_all) against without; tp2ep2 the same way:
    python bench/policy_bench.py --model Qwen3-30B-A3B --layers 8 --cases megatron:ep2,megatron:ep2@overlap \
        --variant overlap='trainer.policy.megatron_config.moe_config.overlap_all_to_all=true'

`--markdown FILE` writes (or replaces) this run's section in FILE (docs/benchmarks.md), and `--chart`
a PNG of tokens/s/GPU per case and phase.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = ROOT / "examples" / "megatron" / "model_configs"
SMOKE_MODEL = "tiny-qwen3"


# ----------------------------------------------------------------------------------------------
# The batch
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchShape:
    rows: int = 64
    prompt_tokens: int = 256
    min_response: int = 64
    max_response: int = 4096
    samples_per_prompt: int = 8
    seed: int = 0

    @property
    def prompts(self) -> int:
        return self.rows // self.samples_per_prompt


def rl_batch(shape: BatchShape, vocab_size: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses with long-tailed lengths, in the host's layout."""
    g = torch.Generator().manual_seed(shape.seed)
    width = shape.prompt_tokens + shape.max_response
    low, high = math.log(shape.min_response), math.log(shape.max_response)
    response_lengths = torch.exp(low + (high - low) * torch.rand(shape.rows, generator=g)).round().long()
    prompt_lengths = torch.randint(shape.prompt_tokens * 3 // 4, shape.prompt_tokens + 1, (shape.rows,), generator=g)
    sequences = torch.randint(1, vocab_size, (shape.rows, width), generator=g)
    attention_mask = torch.zeros(shape.rows, width, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompt_lengths.tolist(), response_lengths.tolist())):
        attention_mask[row, shape.prompt_tokens - prompt : shape.prompt_tokens + response] = 1
    sequences = sequences.masked_fill(attention_mask == 0, pad_token_id)
    loss_mask = attention_mask[:, shape.prompt_tokens :].clone()
    # GRPO-like: one advantage per sequence, on its response tokens
    advantages = torch.randn(shape.rows, 1, generator=g).expand(-1, shape.max_response) * loss_mask
    return {
        "sequences": sequences,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "response_mask": loss_mask.clone(),
        "advantages": advantages.contiguous(),
        # the host's GRPO sets returns to the advantages; its FSDP workers read both
        "returns": advantages.contiguous(),
    }


# ----------------------------------------------------------------------------------------------
# Model FLOPs
# ----------------------------------------------------------------------------------------------


def forward_flops(arch, attention_mask: torch.Tensor) -> float:
    """Model FLOPs of one forward over the real tokens of `attention_mask` (each row one sequence):
    2 per matmul parameter per token (active experts only; the output layer counted, embeddings not)
    plus causal attention (QK^T and AV, 2 x 2 x L^2 / 2 x heads x head_dim per layer)."""
    h = arch.hidden_size
    attention_projections = h * (2 * arch.num_attention_heads + 2 * arch.num_kv_heads) * arch.head_dim  # q, k, v, o
    mlp = 0
    for layer in range(arch.num_layers):
        if arch.is_moe_layer(layer):
            mlp += 3 * h * arch.moe_ffn_hidden_size * arch.experts_per_token + h * arch.num_experts  # + router
        else:
            mlp += 3 * h * arch.ffn_hidden_size
    matmul_params = arch.num_layers * attention_projections + mlp + arch.vocab_size * h
    lengths = attention_mask.sum(dim=1).double()
    tokens = float(lengths.sum())
    attention = 2.0 * arch.num_layers * arch.num_attention_heads * arch.head_dim * float((lengths**2).sum())
    return 2.0 * matmul_params * tokens + attention


def measured_bf16_peak_tflops(size: int = 8192, warmup_seconds: float = 1.0, seconds: float = 3.0) -> float | None:
    """The bf16 matmul rate this GPU sustains (the MFU denominator); None without CUDA.

    Timed over seconds, after a second of warm-up, so that the clock has settled where it stays
    under a training step's load: a burst of 50 matmuls (75 ms, the first method) read 717 to 780
    TFLOP/s on identical H200s.
    """
    if not torch.cuda.is_available():
        return None
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")

    def matmuls_for(duration: float) -> tuple[int, float]:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration:
            for _ in range(10):
                a @ b
            torch.cuda.synchronize()
            count += 10
        return count, time.perf_counter() - start

    matmuls_for(warmup_seconds)
    count, elapsed = matmuls_for(seconds)
    del a, b
    torch.cuda.empty_cache()
    return 2 * size**3 * count / elapsed / 1e12


# ----------------------------------------------------------------------------------------------
# Cases: a backend and a layout
# ----------------------------------------------------------------------------------------------

LAYOUTS = {
    # name: (GPUs, megatron overrides); FSDP2 shards over all the case's GPUs (dpN)
    "world1": (1, []),
    "dp2": (2, []),
    "dp4": (4, []),
    "tp2": (2, ["trainer.policy.megatron_config.tensor_model_parallel_size=2"]),
    "tp2dp2": (4, ["trainer.policy.megatron_config.tensor_model_parallel_size=2"]),
    "pp2": (2, ["trainer.policy.megatron_config.pipeline_model_parallel_size=2"]),
    # MoE: experts over 2 GPUs; attention data-parallel (ep2) or tensor-parallel (tp2ep2: experts
    # unsplit by TP, expert_tensor_parallel_size=1, so ETP x EP = 2 GPUs)
    "ep2": (2, ["trainer.policy.megatron_config.expert_model_parallel_size=2"]),
    "tp2ep2": (2, ["trainer.policy.megatron_config.tensor_model_parallel_size=2",
                   "trainer.policy.megatron_config.expert_model_parallel_size=2",
                   "trainer.policy.megatron_config.expert_tensor_parallel_size=1"]),
    "ep4": (4, ["trainer.policy.megatron_config.expert_model_parallel_size=4"]),
}

BACKENDS = {
    "megatron": "ours (Megatron-Core workers)",
    "fsdp2": "the host's FSDP2 at its best: flash_attention_2, sample packing, no activation checkpointing",
    "fsdp2_sdpa": "host defaults without flash-attn: HF SDPA on padded micro-batches",
    "fsdp2_loop": "plain FSDP2 loop (bench/fsdp2_loop.py): HF model, fully_shard, first-fit-decreasing token-budget "
                  "packing, varlen flash-attn, Triton cross entropy, fused AdamW, no activation checkpointing",
}
FSDP_BACKENDS = ("fsdp2", "fsdp2_sdpa")  # the host's FSDP2 workers
LOOP_BACKEND = "fsdp2_loop"  # no host: our own process group, any GPU count as DP
FSDP_SHORT = {"fsdp2": "FSDP2 at its best", "fsdp2_sdpa": "host defaults without flash-attn",
              LOOP_BACKEND: "plain FSDP2 loop"}
# who is compared with whom: ours against every FSDP2 side, the plain loop against the host's
COMPARED = {"megatron": ("fsdp2", LOOP_BACKEND, "fsdp2_sdpa"), LOOP_BACKEND: FSDP_BACKENDS}
# Dense bf16 peak of the datasheet (SXM parts), the MFU denominator the published figures use
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}


def datasheet_peak_tflops(device_name: str) -> float | None:
    return next((peak for part, peak in DATASHEET_BF16_TFLOPS.items() if part in device_name), None)


@dataclass(frozen=True)
class Case:
    backend: str  # a key of BACKENDS
    layout: str
    variant: str = ""  # a --variant name: extra host overrides for this case (one change to measure)

    @classmethod
    def parse(cls, text: str, variants: dict[str, list[str]] | None = None) -> "Case":
        text, _, variant = text.partition("@")
        if variant and variant not in (variants or {}):
            raise SystemExit(f"--cases: variant {variant!r} is not defined; add --variant {variant}='key=value;...'")
        backend, _, layout = text.partition(":")
        if backend not in BACKENDS:
            raise SystemExit(f"--cases: backend {backend!r} is not one of {', '.join(BACKENDS)} (e.g. megatron:tp2)")
        if layout not in LAYOUTS:
            raise SystemExit(f"--cases: layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        if backend in (*FSDP_BACKENDS, LOOP_BACKEND) and LAYOUTS[layout][1]:
            raise SystemExit(f"--cases: the FSDP2 path has no {layout}; use world1, dp2 or dp4")
        return cls(backend, layout, variant)

    @property
    def gpus(self) -> int:
        return LAYOUTS[self.layout][0]

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.layout}" + (f"@{self.variant}" if self.variant else "")


@dataclass(frozen=True)
class Settings:
    model_dir: str
    batch: BatchShape
    workdir: str
    cpu: bool
    token_budget: int  # ours: packed micro-batches of at most this many tokens
    fsdp_micro_rows: int  # fsdp2_sdpa: padded micro-batches of this many rows
    recompute: bool
    steps: int
    warmup: int
    variants: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    profile_dir: str | None = None  # profile one extra step per case and write its tables here
    profile_backends: tuple[str, ...] = ("megatron", "fsdp2", "fsdp2_loop")
    profile_phase: str = "step"  # what the profile covers: "step" (scoring pass + training), "forward" or "train"
    fsdp_packed_rows: int = 8  # fsdp2: rows per micro-batch, packed into one sequence by the host
    flash_attn_site: str | None = None  # fsdp2: put first on its workers' PYTHONPATH (the stand-in)
    fsdp_forward_rows: int | None = None  # fsdp2: rows per scoring micro-batch (None: fsdp_packed_rows)
    baseline_attention: str = "flash2"  # fsdp2, fsdp2_loop: "flash4" (flash-attn-4, as ours takes it) or "flash2"


FLASH4 = "flash4"
STANDIN_KERNEL_VARIABLE = "FLASH_ATTN_STANDIN_KERNEL"  # read by bench/flash_attn_standin's flash_attn_interface
PROFILED_PHASES = {"step": "one scoring pass + one training call", "forward": "one scoring pass",
                   "train": "one training call"}
ENV_PREFIX = "env:"  # a variant entry "env:NAME=VALUE" sets an environment variable for the case


def host_overrides(case: Case, s: Settings) -> list[str]:
    extra = [o for o in s.variants.get(case.variant, []) if not o.startswith(ENV_PREFIX)]
    return _base_overrides(case, s) + extra


def case_environment(case: Case, s: Settings) -> dict[str, str]:
    """The variant's environment variables (e.g. `env:PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`),
    and for `fsdp2` the flash_attn stand-in first on PYTHONPATH (its Ray workers inherit it)."""
    pairs = (o[len(ENV_PREFIX):].partition("=") for o in s.variants.get(case.variant, []) if o.startswith(ENV_PREFIX))
    values = {name: value for name, _, value in pairs}
    if case.backend == "fsdp2" and s.flash_attn_site:
        values["PYTHONPATH"] = pythonpath_first(s.flash_attn_site, values.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")))
        if s.baseline_attention == FLASH4:
            values[STANDIN_KERNEL_VARIABLE] = FLASH4  # the stand-in's calls go to flash-attn-4's kernels
    return values


def pythonpath_first(site: str, rest: str) -> str:
    """A PYTHONPATH value with `site` before `rest` (fsdp2's flash_attn stand-in before anything installed)."""
    return os.pathsep.join(p for p in (site, rest) if p)


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """Set `values` in this process's environment while active; each case starts its own Ray, whose
    workers inherit it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _base_overrides(case: Case, s: Settings) -> list[str]:
    gpus = case.gpus
    common = [
        f"trainer.policy.model.path={s.model_dir}",
        f"trainer.ckpt_path={s.workdir}/ckpt",
        f"trainer.export_path={s.workdir}/export",
        "trainer.placement.colocate_all=false",
        "trainer.placement.colocate_policy_ref=false",
        f"trainer.placement.policy_num_gpus_per_node={gpus}",
        "trainer.algorithm.use_kl_loss=false",  # the policy group alone
        "trainer.algorithm.advantage_estimator=grpo",
        f"generator.n_samples_per_prompt={s.batch.samples_per_prompt}",
        f"trainer.train_batch_size={s.batch.prompts}",
        f"trainer.policy_mini_batch_size={s.batch.prompts}",  # one optimizer step per train phase
        f"trainer.max_prompt_length={s.batch.prompt_tokens}",
        f"generator.sampling_params.max_generate_length={s.batch.max_response}",
        f"trainer.gradient_checkpointing={str(s.recompute).lower()}",
        "trainer.policy.optimizer_config.lr=1e-6",
        "trainer.bf16=" + ("false" if s.cpu else "true"),
    ]
    rows_per_gpu = s.batch.rows // gpus
    if case.backend == "fsdp2":
        rows = min(s.fsdp_packed_rows, rows_per_gpu)
        forward_rows = min(s.fsdp_forward_rows or s.fsdp_packed_rows, rows_per_gpu)
        return common + fsdp2_best_overrides(rows, forward_rows)
    if case.backend == "fsdp2_sdpa":
        return common + [
            "trainer.strategy=fsdp2",
            "trainer.flash_attn=false",  # HF SDPA
            "trainer.use_sample_packing=false",  # the host packs only with flash-attn
            f"trainer.micro_train_batch_size_per_gpu={s.fsdp_micro_rows}",
            f"trainer.micro_forward_batch_size_per_gpu={s.fsdp_micro_rows}",
        ]
    megatron = [
        "trainer.strategy=megatron",
        f"trainer.policy.megatron_config.max_tokens_per_microbatch={s.token_budget}",
        f"trainer.policy.megatron_config.checkpoint_cache_dir={s.workdir}/conversion_cache",
        "trainer.micro_train_batch_size_per_gpu=1",
        "trainer.micro_forward_batch_size_per_gpu=1",
    ]
    if s.cpu:
        megatron.append("trainer.policy.megatron_config.runtime=cpu")
    if s.recompute:
        megatron += [
            "+trainer.policy.megatron_config.transformer_config_kwargs.recompute_granularity=full",
            "+trainer.policy.megatron_config.transformer_config_kwargs.recompute_method=uniform",
            "+trainer.policy.megatron_config.transformer_config_kwargs.recompute_num_layers=1",
        ]
    else:  # said, not left to the host's default (skyrl 0.4's is full recompute)
        megatron.append("trainer.policy.megatron_config.transformer_config_kwargs.recompute_granularity=null")
    return common + megatron + LAYOUTS[case.layout][1]


def fsdp2_best_overrides(train_rows: int, forward_rows: int) -> list[str]:
    """The host's FSDP2 workers at their best (`fsdp2`): FlashAttention-2 varlen kernels on each micro-batch's
    rows packed into one sequence, `train_rows` / `forward_rows` rows per training / scoring micro-batch. Activation
    checkpointing follows `trainer.gradient_checkpointing` (the host's default is on: set it off where memory
    allows). Their workers need flash_attn importable: the installed CUDA build or `flash_attn_for_fsdp2`'s
    stand-in first on PYTHONPATH."""
    return [
        "trainer.strategy=fsdp2",
        "trainer.flash_attn=true",  # FlashAttention-2 varlen kernels
        "trainer.use_sample_packing=true",  # each micro-batch's rows unpadded into one sequence
        f"trainer.micro_train_batch_size_per_gpu={train_rows}",
        f"trainer.micro_forward_batch_size_per_gpu={forward_rows}",
    ]


def compose(case: Case, s: Settings):
    from skyrl_megatron.cli import compose_config
    from skyrl_megatron.validation import validate_config
    from skyrl_megatron.validation import validate_host_config

    cfg = compose_config(host_overrides(case, s))
    validate_config(cfg)
    validate_host_config(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------
# Measured workers: the real worker classes plus one read-only method for peak memory
# ----------------------------------------------------------------------------------------------


def peak_since_last_call(allocator_peak_gib: float, drained_phase_peaks: dict[str, float]) -> float:
    """The larger of the allocator's counter and every phase peak a worker recorded (`PhasePeaks.drain()`)."""
    recorded = [gib for key, gib in drained_phase_peaks.items() if key.endswith("_peak_allocated_gib")]
    return max([allocator_peak_gib, *recorded])


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# The caching allocator's own counters (torch.cuda.memory_stats): a cudaMalloc or cudaFree inside a pass
# costs far more than a cached block, and cudaFree waits for the device; counted per phase call to tell
# a pass-to-pass spread from the allocator's growth (zeros without CUDA).
ALLOCATOR_COUNTERS = {"cuda_mallocs": "num_device_alloc", "cuda_frees": "num_device_free", "alloc_retries": "num_alloc_retries"}


def allocator_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_COUNTERS.items()}


def counts_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in ALLOCATOR_COUNTERS}


def process_start_time() -> float | None:
    """Wall-clock time at which this process was created (Linux's /proc; whole seconds of boot time), or None."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


# A worker's start-up, in the order the host drives it: the process exists; the actor's class arrives (its
# modules imported) and `__init__` runs; `init_worker_process_group` (ours: Megatron's groups as well);
# `init_model` (weights, wrappers, optimizer). Wall-clock stamps; the driver makes them relative to its own start.
STARTUP_STAMPS = ("process_created", "actor_init_entered", "actor_init_done", "process_group_entered",
                  "process_group_done", "init_model_entered", "init_model_done")


def startup_timeline(stamps: dict[str, float | None], driver_started: float) -> dict[str, float | None]:
    """Seconds after the driver asked for the workers at which each stage of `STARTUP_STAMPS` ended."""
    return {name: None if stamps.get(name) is None else round(stamps[name] - driver_started, 2) for name in STARTUP_STAMPS}


class _Measured:
    """Read-only additions to a worker class: peak memory, the path that ran, the time each phase
    spends inside the worker (against the driver's, the rest is dispatch and collection), and an
    optional profile of one step."""

    def __init__(self, *args, **kwargs):
        self._bench_startup = {"process_created": process_start_time(), "actor_init_entered": time.time()}
        super().__init__(*args, **kwargs)
        self._bench_startup["actor_init_done"] = time.time()

    def init_worker_process_group(self, *args, **kwargs):
        self._bench_startup["process_group_entered"] = time.time()
        result = super().init_worker_process_group(*args, **kwargs)
        self._bench_startup["process_group_done"] = time.time()
        return result

    def init_model(self, *args, **kwargs):
        self._bench_startup["init_model_entered"] = time.time()
        result = super().init_model(*args, **kwargs)
        self._bench_startup["init_model_done"] = time.time()
        return result

    def bench_startup(self) -> dict[str, float | None]:
        return dict(self._bench_startup)

    # The phases' calls: scoring is `forward`; training is `ppo_train` on skyrl-train 0.3.1, `forward_backward`
    # per mini-batch with an `optim_step` after each on skyrl 0.4. A phase's calls add up from the driver's
    # `bench_begin(phase)`; a timed call inside another (0.3.1's FSDP2 `ppo_train` calls its own
    # `forward_backward`) is part of the outer one.
    def forward(self, *args, **kwargs):
        return self._bench_timed("forward", super().forward, args, kwargs)

    def ppo_train(self, *args, **kwargs):
        return self._bench_timed("train", super().ppo_train, args, kwargs)

    def forward_backward(self, *args, **kwargs):
        return self._bench_timed("train", super().forward_backward, args, kwargs)

    def optim_step(self, *args, **kwargs):
        return self._bench_timed("train", super().optim_step, args, kwargs)

    def empty_cache(self, *args, **kwargs):
        """Timed apart: the host's trainer asks after each scoring and training call, outside those calls
        (part of the driver's seconds, not the worker's); kept as "<phase>:empty_cache"."""
        started = time.perf_counter()
        result = super().empty_cache(*args, **kwargs)
        key = f"{self.__dict__.get('_bench_phase', '')}:empty_cache"
        seconds = self.__dict__.setdefault("_bench_seconds", {})
        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - started
        return result

    def bench_begin(self, phase: str) -> None:
        self.__dict__["_bench_phase"] = phase
        self.__dict__.setdefault("_bench_seconds", {})[phase] = 0.0
        self.__dict__["_bench_seconds"][f"{phase}:empty_cache"] = 0.0
        self.__dict__.setdefault("_bench_allocator", {})[phase] = dict.fromkeys(ALLOCATOR_COUNTERS, 0)

    def _bench_timed(self, phase: str, fn, args, kwargs):
        if self.__dict__.get("_bench_inside"):
            return fn(*args, **kwargs)
        self._bench_inside = True
        try:
            _synchronize()
            counts, started = allocator_counts(), time.perf_counter()
            result = fn(*args, **kwargs)
            _synchronize()
        finally:
            self._bench_inside = False
        seconds, allocator = self.__dict__.setdefault("_bench_seconds", {}), self.__dict__.setdefault("_bench_allocator", {})
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - started
        earlier = allocator.get(phase, dict.fromkeys(ALLOCATOR_COUNTERS, 0))
        allocator[phase] = {name: earlier[name] + n for name, n in counts_between(counts, allocator_counts()).items()}
        return result

    def bench_worker_seconds(self) -> dict[str, float]:
        return dict(self.__dict__.get("_bench_seconds", {}))

    def bench_allocator_calls(self) -> dict[str, dict[str, int]]:
        """Per phase, the allocator's cudaMalloc / cudaFree / retry counts since its `bench_begin`."""
        return dict(self.__dict__.get("_bench_allocator", {}))

    def bench_peak_memory(self) -> float:
        """GiB allocated at the peak since the last call (0 without CUDA).

        Our workers reset the allocator's peak counter at the start of each phase they measure
        (`workers/memory_peaks.py`: scoring, each training pass, the optimizer step), so after a
        training call the counter holds the optimizer step's peak alone; their own record of each
        phase's peak, drained here, holds the passes before it (the host's FSDP2 workers keep none)."""
        if not torch.cuda.is_available():
            return 0.0
        phase_peaks = getattr(self, "phase_peaks", None)
        peak = peak_since_last_call(torch.cuda.max_memory_allocated() / 2**30,
                                    phase_peaks.drain() if phase_peaks is not None else {})
        torch.cuda.reset_peak_memory_stats()
        return peak

    def bench_path(self) -> dict[str, Any]:
        """Which implementation ran: TE or not, and the attention kernel family."""
        model = getattr(self, "model", None)
        threads = {"torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
        if hasattr(self, "built"):  # ours
            from skyrl_megatron.model.conversion.bridge_import import have_transformer_engine

            te = have_transformer_engine() and torch.cuda.is_available()
            # the packed kernel the model was built with (megatron_config.attention_kernel, model/layers/attention.py)
            packed = {"sdpa": "masked SDPA"}.get(self.built.segment_kernel, self.built.segment_kernel)
            attention = "TE" if te else f"ours (SDPA / {packed})"
            from skyrl_megatron.model.layers.attention import flash4_passed_over

            dtype = next(self.built.chunks[0].parameters()).dtype
            return {"transformer_engine": te, "attention": attention,
                    "flash4_passed_over": None if te else flash4_passed_over(self.runtime, dtype),
                    "fused_kernels": list(self.built.fused_kernels), "expert_gemms": self.built.expert_gemms,
                    "weights": dataclasses.asdict(self.built.load_report),
                    "process_groups": dict(getattr(self, "init_parallel_seconds", {})), **threads}
        config = getattr(getattr(model, "model", model), "config", None)
        path = {"transformer_engine": False, "attention": getattr(config, "_attn_implementation", "unknown"),
                "sample_packing": bool(getattr(model, "use_sample_packing", False)), **threads}
        if getattr(config, "_experts_implementation", None):  # MoE: transformers' experts kernel
            path["experts"] = config._experts_implementation
        interface = sys.modules.get("flash_attn.flash_attn_interface")
        if path["attention"] == "flash_attention_2" and interface is not None:
            standin_kernel = "flash-attn-4" if os.environ.get(STANDIN_KERNEL_VARIABLE) == FLASH4 else "torch FA2"
            path["flash_attn"] = (f"stand-in: {standin_kernel} varlen" if hasattr(interface, "UnsupportedByStandIn")
                                  else f"flash-attn {sys.modules['flash_attn'].__version__}")
        from skyrl_megatron import host_api

        torch_utils = sys.modules.get(host_api.torch_utils_module)
        triton_ce = getattr(torch_utils, "FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False)
        path["logprobs"] = "flash-attn Triton cross entropy" if triton_ce else "torch"
        return path

    def bench_profile_start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        _synchronize()
        self._bench_profiler = profile(activities=activities, with_stack=bool(os.environ.get("BENCH_PROFILE_STACK")))
        self._bench_profiler.__enter__()
        self._bench_profile_started = time.perf_counter()

    def bench_profile_stop(self, out_file: str | None, covered: str = "step") -> dict[str, float]:
        """Stop profiling; rank 0 writes the top operators by device and by host time to `out_file`.
        Returns the wall time and the summed device (kernel) time: their gap is the time the GPU
        waited on the host."""
        _synchronize()
        wall = time.perf_counter() - self._bench_profile_started
        profiler, self._bench_profiler = self._bench_profiler, None
        profiler.__exit__(None, None, None)
        import gpu_idle  # bench/, beside this file

        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        return gpu_idle.write_profile_report(profiler, wall, f"{PROFILED_PHASES[covered]}, rank 0",
                                             out_file if rank0 else None)


@contextlib.contextmanager
def hf_sdpa_for_eager():
    """While active, the host's `HFModelWrapper` loads its model with HF SDPA attention where it
    would pick eager (`fsdp2_sdpa`, trainer.flash_attn=false). The host offers flash_attention_2 or
    eager, which materialises [heads, L, L] fp32 scores per layer and runs out of memory on 4k-token
    rows. SDPA is the host's default without flash-attn; flash_attention_2 (`fsdp2`) passes through."""
    import importlib

    from skyrl_megatron import host_api

    model_wrapper = importlib.import_module(host_api.hf_model_wrapper_module)
    original = model_wrapper.AutoModelForCausalLM

    class _SdpaInsteadOfEager:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            if kwargs.get("attn_implementation") == "eager":
                kwargs["attn_implementation"] = "sdpa"
            return original.from_pretrained(*args, **kwargs)

    model_wrapper.AutoModelForCausalLM = _SdpaInsteadOfEager
    try:
        yield
    finally:
        model_wrapper.AutoModelForCausalLM = original


class _HostFSDPWithSdpa:
    def init_model(self, *args, **kwargs):
        with hf_sdpa_for_eager():
            return super().init_model(*args, **kwargs)


def host_fsdp_policy_base() -> type:
    """The installed host's FSDP2 policy worker class (skyrl-train 0.3.1 or skyrl 0.4), before Ray wraps it."""
    import importlib

    from skyrl_megatron import host_api

    return importlib.import_module(host_api.strategy_worker_modules["fsdp2"]).FSDPPolicyWorkerBase


def measured_policy_class(backend: str):
    import ray

    if backend == "megatron":
        from skyrl_megatron.workers.policy import MegatronPolicyWorker as base

        bases = (_Measured, base)
    else:
        base = host_fsdp_policy_base()
        bases = (_Measured, _HostFSDPWithSdpa, base)
    return ray.remote(num_gpus=1)(type(f"Measured{base.__name__}", bases, {}))


# ----------------------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def started_policy(case: Case, s: Settings, tokenizer):
    """Ray and the host trainer with `case`'s policy workers built; Ray shut down on leaving. Yields the trainer,
    the seconds the build took and the driver's clock when it began."""
    import ray

    from skyrl_megatron.launch import initialize_ray
    from skyrl_megatron.testing.host_trainer import host_trainer

    cfg = compose(case, s)
    with environment(case_environment(case, s)):
        initialize_ray(cfg, log_to_driver=False)
    try:
        trainer = host_trainer(cfg, tokenizer, total_training_steps=100)
        started, driver_started = time.perf_counter(), time.time()
        trainer.build_models(measured_policy_class(case.backend), None, None)
        yield trainer, time.perf_counter() - started, driver_started
    finally:
        ray.shutdown()


def run_case(case: Case, s: Settings, tokenizer, batch: dict[str, torch.Tensor], arch, peak_tflops) -> dict:
    import ray

    from skyrl_megatron.testing.host_trainer import training_input

    with started_policy(case, s, tokenizer) as (trainer, init_seconds, driver_started):
        policy = trainer.policy_model
        path = ray.get(policy.async_run_ray_method("pass_through", "bench_path"))[0]
        startups = [startup_timeline(stamps, driver_started)
                    for stamps in ray.get(policy.async_run_ray_method("pass_through", "bench_startup"))]
        weights = path.get("weights")  # ours: how the weights came (cache hit, conversion, load), seconds
        print(f"  {case.name} started in {init_seconds:.1f} s" + (f"; weights: {json.dumps(weights)}" if weights else "")
              + (f"; process groups: {json.dumps(path['process_groups'])}" if path.get("process_groups") else "")
              + (f"; flash-attn-4 installed, not taken: {path['flash4_passed_over']}" if path.get("flash4_passed_over")
                 else ""),
              flush=True)
        # rank 0, and the rank whose actor came up last (the host creates the others once rank 0 is up)
        latest = max(range(len(startups)), key=lambda rank: startups[rank]["actor_init_entered"] or 0.0)
        for rank in sorted({0, latest}):
            print(f"  {case.name} start-up, rank {rank}, s after the driver asked: {json.dumps(startups[rank])}", flush=True)

        def peak() -> float:
            return max(ray.get(policy.async_run_ray_method("pass_through", "bench_peak_memory")))

        peaks: dict[str, float] = {"forward": 0.0, "train": 0.0}
        # what skyrl 0.4's trainer reads besides the tensors (0.3.1's ignores them): the prompts' rows, and the
        # whole batch as one mini-batch (one optimizer step, as `trainer.policy_mini_batch_size` says)
        step_metadata = {"uids": [str(row // s.batch.samples_per_prompt) for row in range(s.batch.rows)],
                         "policy_mini_batch_boundaries": [(0, s.batch.rows)]}

        def begin(phase: str) -> None:
            ray.get(policy.async_run_ray_method("pass_through", "bench_begin", phase))

        def worker_seconds() -> dict[str, float]:
            per_rank = ray.get(policy.async_run_ray_method("pass_through", "bench_worker_seconds"))
            return {phase: max(r[phase] for r in per_rank) for phase in per_rank[0]}

        def allocator_calls() -> dict[str, dict[str, int]]:  # per phase, the most on any rank
            per_rank = ray.get(policy.async_run_ray_method("pass_through", "bench_allocator_calls"))
            return {phase: {name: max(r[phase][name] for r in per_rank) for name in ALLOCATOR_COUNTERS}
                    for phase in per_rank[0]}

        def step(number: int, profiled: str | None = None) -> tuple[dict[str, float], dict[str, float], dict]:
            """One scoring pass and one training call; `profiled` ("step", "forward", "train") is profiled."""
            data = training_input(batch, s.batch.max_response, global_step=number + 1, **step_metadata)
            begin("forward")
            if profiled in ("step", "forward"):
                start_profile()
            start = time.perf_counter()
            data = trainer.fwd_logprobs_values_reward(data)
            driver = {"forward": time.perf_counter() - start}
            if profiled == "forward":
                profiles.append(stop_profile(profiled))
            peaks["forward"] = max(peaks["forward"], peak())
            begin("train")
            if profiled == "train":
                start_profile()
            start = time.perf_counter()
            status = trainer.train_critic_and_policy(data)
            driver["train"] = time.perf_counter() - start
            if profiled in ("step", "train"):
                profiles.append(stop_profile(profiled))
            peaks["train"] = max(peaks["train"], peak())
            if not math.isfinite(status["policy_loss"]):
                raise RuntimeError(f"{case.name}: non-finite policy loss at step {number}")
            return driver, worker_seconds(), status

        profile_file = profile_path(case, s)
        profiles: list[dict] = []

        def start_profile() -> None:  # on every rank
            ray.get(policy.async_run_ray_method("pass_through", "bench_profile_start"))

        def stop_profile(phase: str) -> dict:  # rank 0 writes its operator tables
            summary = ray.get(policy.async_run_ray_method("pass_through", "bench_profile_stop", profile_file, phase))[0]
            return {**summary, "file": profile_file, "phase": phase}

        peak()
        phases: dict[str, list[float]] = {"forward": [], "train": []}
        in_worker: dict[str, list[float]] = {"forward": [], "train": []}
        allocations: dict[str, list[dict[str, int]]] = {"forward": [], "train": []}
        emptying: dict[str, list[float]] = {"forward": [], "train": []}  # the host's empty_cache calls, in the driver's time
        for number in range(s.warmup + s.steps):
            driver, worker, status = step(number)
            calls = allocator_calls()
            if number >= s.warmup:
                for phase in phases:
                    phases[phase].append(driver[phase])
                    in_worker[phase].append(worker[phase])
                    allocations[phase].append(calls[phase])
                    emptying[phase].append(worker.get(f"{phase}:empty_cache", 0.0))
            print(f"  {case.name} step {number}{' (warm-up)' if number < s.warmup else ''}: "
                  f"forward {driver['forward']:.2f} s ({worker['forward']:.2f} in worker, "
                  f"{calls['forward']['cuda_mallocs']} cudaMalloc, "
                  f"{worker.get('forward:empty_cache', 0.0):.3f} s emptying the cache), "
                  f"train {driver['train']:.2f} s ({worker['train']:.2f} in worker, "
                  f"{calls['train']['cuda_mallocs']} cudaMalloc, "
                  f"{worker.get('train:empty_cache', 0.0):.3f} s emptying the cache), "
                  f"loss {status['policy_loss']:.4f}", flush=True)
        profile = None
        if s.profile_dir is not None and case.backend in s.profile_backends:
            step(s.warmup + s.steps, profiled=s.profile_phase)  # one more step, its profiled phase timed apart
            profile = profiles[-1]
            print(f"  {case.name} profiled {s.profile_phase}: {json.dumps(profile)}", flush=True)

    result = case_result(case, path, batch, arch, peak_tflops, phases, in_worker, peaks)
    result.update(init_seconds=init_seconds, startup=startups, profile=profile)
    for phase, calls in allocations.items():
        result["phases"][phase]["allocator_calls"] = calls
        result["phases"][phase]["empty_cache_seconds"] = emptying[phase]
    return result


def case_result(case: Case, path: dict, batch: dict[str, torch.Tensor], arch, peak_tflops, seconds: dict[str, list[float]],
                in_worker: dict[str, list[float]], peaks: dict[str, float]) -> dict:
    """One case's report entry: per phase the medians, tokens/s/GPU over the real tokens, MFU and peak memory."""
    tokens = int(batch["attention_mask"].sum())
    flops = forward_flops(arch, batch["attention_mask"])
    datasheet = datasheet_peak_tflops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    result = {"case": case.name, "backend": case.backend, "layout": case.layout, "variant": case.variant,
              "gpus": case.gpus, "path": path, "tokens": tokens, "phases": {}}
    for phase, times in seconds.items():
        median = statistics.median(times)
        phase_flops = flops * (3 if phase == "train" else 1)
        result["phases"][phase] = {
            "seconds": times,
            "median_seconds": median,
            "worker_seconds": in_worker[phase],
            "median_worker_seconds": statistics.median(in_worker[phase]),
            "tokens_per_s_per_gpu": tokens / median / case.gpus,
            "mfu": None if peak_tflops is None else phase_flops / median / case.gpus / (peak_tflops * 1e12),
            "mfu_datasheet": None if datasheet is None else phase_flops / median / case.gpus / (datasheet * 1e12),
            "peak_gib": peaks[phase],
        }
    return result


def run_loop_case(case: Case, s: Settings, batch: dict[str, torch.Tensor], arch, peak_tflops) -> dict:
    """The plain FSDP2 loop (bench/fsdp2_loop.py) on `case.gpus` spawned ranks; its phases are timed inside the
    ranks (no dispatch: driver and worker seconds are the same), the slowest rank's."""
    import fsdp2_loop  # bench/, beside this file

    from skyrl_megatron.testing.distributed import THREADS_ENV_VAR, run_on_ranks

    if s.variants.get(case.variant):
        raise SystemExit(f"--cases {case.name}: variants set host overrides; the plain FSDP2 loop has no host")
    profiled = s.profile_dir is not None and case.backend in s.profile_backends
    profile_file = profile_path(case, s)
    settings = fsdp2_loop.LoopSettings(s.model_dir, s.token_budget, s.batch.prompt_tokens, s.steps, s.warmup,
                                       flash_attn_site=s.flash_attn_site, attention_kernel=s.baseline_attention,
                                       profile_phase=s.profile_phase if profiled else None,
                                       profile_heading=f"{PROFILED_PHASES[s.profile_phase]}, rank 0",
                                       profile_file=profile_file)
    threads = str(max(1, (os.cpu_count() or 1) // case.gpus))  # run_on_ranks' default is one per rank
    measured = run_on_ranks(fsdp2_loop.measure, case.gpus, settings, batch, timeout=3600,
                            backend="gloo" if s.cpu else "nccl", env={THREADS_ENV_VAR: threads})[0]
    for number, (forward, train, loss) in enumerate(zip(measured.seconds["forward"], measured.seconds["train"],
                                                         measured.losses)):
        print(f"  {case.name} step {s.warmup + number}: forward {forward:.2f} s, train {train:.2f} s, "
              f"loss {loss:.4f}", flush=True)
        if not math.isfinite(loss):
            raise RuntimeError(f"{case.name}: non-finite policy loss at step {s.warmup + number}")
    result = case_result(case, measured.path, batch, arch, peak_tflops, measured.seconds, measured.seconds,
                         measured.peak_gib)
    if measured.profile is not None:
        result["profile"] = {**measured.profile, "file": profile_file, "phase": s.profile_phase}
        print(f"  {case.name} profiled {s.profile_phase}: {json.dumps(result['profile'])}", flush=True)
    return result


# ----------------------------------------------------------------------------------------------
# The checkpoint and the report
# ----------------------------------------------------------------------------------------------


def model_config(model: str, layers: int | None = None):
    """The HF config of a shape in MODEL_CONFIGS; with `layers`, its first `layers` layers (the
    published widths at a depth that fits). Built from the edited JSON, so that derived per-layer
    fields (layer_types) follow the new depth."""
    from transformers import AutoConfig

    data = json.loads((MODEL_CONFIGS / f"{model}.json").read_text())
    if layers is not None:
        data["num_hidden_layers"] = layers
        data.pop("layer_types", None)
        if data.get("max_window_layers") is not None:
            data["max_window_layers"] = min(data["max_window_layers"], layers)
    return AutoConfig.for_model(**data)


def write_checkpoint(model: str, out_dir: Path, cpu: bool, layers: int | None = None) -> Path:
    from skyrl_megatron.testing import make_tiny_hf_model

    if model == SMOKE_MODEL:
        return Path(make_tiny_hf_model("qwen3", out_dir, seed=0))
    return write_random_checkpoint(model_config(model, layers), out_dir, cpu)


def write_random_checkpoint(config, out_dir: Path, cpu: bool) -> Path:
    """Random bf16 weights of `config` (built on the GPU unless `cpu`) and the test tokenizer padded to its
    vocabulary."""
    from transformers import AutoModelForCausalLM

    from skyrl_megatron.testing.tokenizer import save_tiny_tokenizer

    torch.manual_seed(0)
    with torch.device("cpu" if cpu else "cuda"):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf_model.save_pretrained(out_dir)
    del hf_model
    if not cpu:
        torch.cuda.empty_cache()
    save_tiny_tokenizer(out_dir, vocab_size=config.vocab_size)
    return out_dir


def markdown_section(report: dict) -> str:
    b = report["batch"]
    lines = [
        f"### {report['model']}, {report['device']} x {report['max_gpus']}, {report['date']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Batch: {b['rows']} sequences, prompts {b['prompt_tokens'] * 3 // 4}-{b['prompt_tokens']} tokens, responses "
        f"log-uniform {b['min_response']}-{b['max_response']} ({report['tokens']} real tokens, "
        f"{b['rows'] * (b['prompt_tokens'] + b['max_response'])} padded). bf16 peak measured: "
        f"{report['peak_tflops']:.0f} TFLOP/s"
        + (f" (datasheet dense bf16: {report['datasheet_tflops']:.0f})" if report.get("datasheet_tflops") else "")
        + f". Recompute: {'on' if report['recompute'] else 'off'}. "
        + (f"Host: {report['host']}. " if report.get("host") else "")
        + f"Median of {report['steps']} steps after {report['warmup']} warm-up.",
        *micro_batch_lines(report),
        *(f"Variant `{name}`: `{'; '.join(overrides)}`." for name, overrides in report["variants"].items()),
        *([f"The checkpoint was converted before the cases ({report['converted_first_seconds']:.1f} s): every case "
           "of ours started from the conversion cache."] if "converted_first_seconds" in report else []),
        "",
        "| case | path | phase | s | in worker, s | tokens/s/GPU | MFU | MFU (datasheet) | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["cases"]:
        for phase, p in r["phases"].items():
            mfu = "-" if p["mfu"] is None else f"{100 * p['mfu']:.1f}%"
            datasheet = "-" if p.get("mfu_datasheet") is None else f"{100 * p['mfu_datasheet']:.1f}%"
            worker = f"{p['median_worker_seconds']:.2f}" if "median_worker_seconds" in p else "-"
            lines.append(f"| {r['case']} | {path_cell(r['path'])} | {phase} | {p['median_seconds']:.2f} | {worker} | "
                         f"{p['tokens_per_s_per_gpu']:,.0f} | {mfu} | {datasheet} | {p['peak_gib']:.1f} |")
    for name, error in report.get("failed", {}).items():
        lines.append(f"| {name} | - | failed: {_error_line(error)} | - | - | - | - | - | - |")
    ratios = speedups(report["cases"])
    if ratios:
        lines += ["", "Against each FSDP2 side on the same GPUs, named in brackets (tokens/s ratio; memory ratio, "
                      "lower is better):", ""]
        for (ours, theirs), phase_ratio in ratios.items():
            cells = ", ".join(f"{phase} {speed:.2f}x speed, {memory:.2f}x memory" for phase, (speed, memory) in phase_ratio.items())
            label = f" ({FSDP_SHORT[theirs.partition(':')[0]]})" if is_current(report) else ""
            lines.append(f"- {ours} vs {theirs}{label}: {cells}")
    return "\n".join(lines) + "\n"


def is_current(report: dict) -> bool:
    """Reports from before the `fsdp2` / `fsdp2_sdpa` split called the padded SDPA baseline `fsdp2`."""
    return "fsdp_packed_rows" in report


def micro_batch_lines(report: dict) -> list[str]:
    if "token_budget" not in report:
        return []
    if not is_current(report):
        return [f"Micro-batches: ours packed, at most {report['token_budget']} tokens each; FSDP2 padded, "
                f"{report['fsdp_micro_rows']} rows each."]
    packed = report.get("fsdp_packed_tokens", {})
    backends = {r["backend"] for r in report["cases"]} | {name.partition(":")[0] for name in report.get("failed", {})}
    backends |= {name.partition(":")[0] for name in report.get("composed_only", [])}
    described = {
        "megatron": f"`megatron`: {BACKENDS['megatron']}, packed micro-batches of at most {report['token_budget']} tokens.",
        "fsdp2": f"`fsdp2`: {BACKENDS['fsdp2']}; {report['fsdp_packed_rows']} rows per micro-batch packed into one "
                 f"sequence ({packed.get('mean', 0):,.0f} tokens on average, {packed.get('max', 0):,} at most)"
                 + (f"; scoring {report['fsdp_forward_rows']} rows per micro-batch"
                    if report.get("fsdp_forward_rows", report["fsdp_packed_rows"]) != report["fsdp_packed_rows"] else "")
                 + (f"; flash_attn: {report['fsdp_flash_attn']}" if report.get("fsdp_flash_attn") else "") + ".",
        "fsdp2_sdpa": f"`fsdp2_sdpa`: {BACKENDS['fsdp2_sdpa']}, {report['fsdp_micro_rows']} rows each.",
        LOOP_BACKEND: f"`{LOOP_BACKEND}`: {BACKENDS[LOOP_BACKEND]}; micro-batches of at most {report['token_budget']} "
                      f"tokens in training, {4 * report['token_budget']} in scoring.",
    }
    return [" ".join(text for name, text in described.items() if name in backends)]


def path_cell(path: dict) -> str:
    """What ran, compactly: attention kernel, TE, fusions (ours); packing, flash-attn build, experts, logprobs (FSDP2)."""
    cell = path["attention"] + (", TE" if path["transformer_engine"] else "")
    if "fused_kernels" in path:
        cell += ", fused: " + (" ".join(path["fused_kernels"]) or "none")
    if "sample_packing" in path:
        cell += ", packed" if path["sample_packing"] else ", padded"
    if "flash_attn" in path:
        cell += f" ({path['flash_attn']})"
    if path.get("experts") or path.get("expert_gemms"):  # the host's experts kernel, or ours (moe_config.expert_gemms)
        cell += f", experts: {path.get('experts') or path['expert_gemms']}"
    if path.get("logprobs", "").startswith("flash-attn"):
        cell += ", Triton CE"
    return cell


def case_label(report: dict, r: dict) -> str:
    """Chart label: which FSDP2 configuration, not only the backend key."""
    names = {"megatron": "ours", "fsdp2": "FSDP2 best (FA2 packed)", "fsdp2_sdpa": "FSDP2 SDPA padded",
             LOOP_BACKEND: "plain FSDP2 loop"}
    if not is_current(report) and r["backend"] == "fsdp2":
        names["fsdp2"] = names["fsdp2_sdpa"]
    return f"{names.get(r['backend'], r['backend'])} {r['layout']}" + (f"@{r['variant']}" if r["variant"] else "")


def _error_line(error: str) -> str:
    """The exception line of a (Ray) traceback, without terminal colours."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in error.splitlines()]
    lines = [line for line in lines if line]
    exceptions = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return (exceptions[-1] if exceptions else lines[0] if lines else "")[:160].replace("|", "/")


def speedups(cases: list[dict]) -> dict[tuple[str, str], dict[str, tuple[float, float]]]:
    """Each of our cases against each FSDP2 side's plain case on as many GPUs, and the plain FSDP2 loop against
    the host's FSDP2 (`COMPARED`)."""
    fsdp = {(r["backend"], r["gpus"]): r for r in cases if r["backend"] in FSDP_SHORT and not r["variant"]}
    ratios = {}
    for r, backend in ((r, b) for r in cases for b in COMPARED.get(r["backend"], ())):
        theirs = fsdp.get((backend, r["gpus"]))
        if theirs is None:
            continue
        ratios[(r["case"], theirs["case"])] = {
            phase: (p["tokens_per_s_per_gpu"] / theirs["phases"][phase]["tokens_per_s_per_gpu"],
                    p["peak_gib"] / theirs["phases"][phase]["peak_gib"] if theirs["phases"][phase]["peak_gib"] else float("nan"))
            for phase, p in r["phases"].items()
        }
    return ratios


def replace_section(markdown_file: Path, key: str, section: str) -> None:
    """Put `section` between this run's markers in `markdown_file` (appended the first time)."""
    begin, end = f"<!-- policy_bench {key} begin -->", f"<!-- policy_bench {key} end -->"
    text = markdown_file.read_text() if markdown_file.exists() else ""
    block = f"{begin}\n{section}{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    markdown_file.write_text(text)


def plot(report: dict, out_file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    phases = ["forward", "train"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(cases), 3.6))
    width = 0.8 / len(phases)
    for i, phase in enumerate(phases):
        values = [r["phases"][phase]["tokens_per_s_per_gpu"] for r in cases]
        ax.bar([x + i * width for x in range(len(cases))], values, width, label=phase)
    ax.set_xticks([x + width * (len(phases) - 1) / 2 for x in range(len(cases))], [case_label(report, r) for r in cases],
                  rotation=15, ha="right")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(f"{report['model']} on {report['device']} ({report['date']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_file, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------


def token_budget_rows(attention_mask: torch.Tensor, token_budget: int) -> int:
    """fsdp2's default rows per packed micro-batch: the divisor of the batch's rows (the host
    accumulates gradients over rows / micro rows micro-batches) whose mean packed size is nearest,
    by ratio, to our token budget."""
    rows = attention_mask.shape[0]
    return nearest_divisor(rows, token_budget / (float(attention_mask.sum()) / rows))


def nearest_divisor(rows: int, target: float) -> int:
    """The divisor of `rows` nearest to `target` by ratio (the smaller one on a tie)."""
    divisors = [d for d in range(1, rows + 1) if rows % d == 0]
    return min(divisors, key=lambda d: (abs(math.log(d / max(target, 1e-9))), d))


def packed_micro_batch_tokens(attention_mask: torch.Tensor, rows: int) -> dict[str, float]:
    """Tokens per fsdp2 micro-batch at world 1: the host chunks the batch by `rows` in order."""
    sizes = [int(chunk.sum()) for chunk in attention_mask.split(rows)]
    return {"mean": statistics.mean(sizes), "max": max(sizes), "count": len(sizes)}


def profile_path(case: Case, s: Settings) -> str:
    """Where a case's profile report goes: one file per case under `--profile`."""
    return str(Path(s.profile_dir or ".") / f"profile_{case.name.replace(':', '_').replace('@', '_')}.txt")


def installed_host() -> str:
    """The host release whose trainer (and FSDP2 workers) the cases run through, e.g. "skyrl 0.4.0"."""
    import importlib.metadata

    from skyrl_megatron.hosts import current

    distribution = current().release.distribution
    return f"{distribution} {importlib.metadata.version(distribution)}"


def flash_attn_for_fsdp2(choice: str, workdir: Path) -> tuple[str | None, str]:
    """Where fsdp2's workers find flash_attn: (a directory for the front of PYTHONPATH or None, what it is)."""
    import importlib.util

    placeholder = sys.modules.get("flash_attn_2_cuda")  # the host adapter's compat fixes register one without a file
    built = (getattr(placeholder, "__file__", None) is not None if placeholder is not None
             else importlib.util.find_spec("flash_attn_2_cuda") is not None)
    if choice == "installed" or (choice == "auto" and built):
        if not built:
            raise SystemExit("--fsdp-flash-attn installed: flash-attn's CUDA extension (flash_attn_2_cuda) is not "
                             "importable here; use --fsdp-flash-attn standin")
        import flash_attn

        return None, f"flash-attn {flash_attn.__version__} (CUDA build)"
    spec = importlib.util.spec_from_file_location("flash_attn_standin_assemble", ROOT / "bench" / "flash_attn_standin" / "assemble.py")
    assemble = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(assemble)
    site = assemble.assemble(workdir / "flash_attn_standin")
    return str(site), "stand-in (bench/flash_attn_standin: PyTorch's FlashAttention-2 kernels, flash-attn's Triton cross entropy)"


def baseline_attention_kernel(choice: str, cpu: bool, flash_attn_site: str | None, host_side: bool) -> str:
    """The FSDP2 sides' attention kernel: flash-attn-4 wherever ours' `attention_kernel: auto` takes it (installed,
    an sm90/sm100 GPU) and the host's workers reach it (through the stand-in), so every side runs the same
    kernel; else FlashAttention-2 (`--baseline-attention flash2` asks for it)."""
    from skyrl_megatron.attention_kernels import SegmentKernel
    from skyrl_megatron.model.layers.attention import select_segment_kernel
    from skyrl_megatron.runtime import Device, Runtime

    if choice == "flash2" or cpu:
        return "flash2"
    if select_segment_kernel(Runtime(Device.CUDA), torch.bfloat16) is not SegmentKernel.FLASH4:  # ours' choice
        return "flash2"
    if host_side and flash_attn_site is None:
        raise SystemExit("--baseline-attention auto: flash-attn-4 runs ours, but the host's FSDP2 workers use an "
                         "installed flash-attn 2 build, which cannot take it; use --fsdp-flash-attn standin or "
                         "--baseline-attention flash2")
    return FLASH4


def publish(report: dict, markdown: Path | None, chart: Path | None) -> None:
    section = markdown_section(report)
    print(section)
    if markdown:
        replace_section(markdown, f"{report['model']} {report['device']} x{report['max_gpus']}", section)
    if chart and report["cases"]:
        plot(report, chart)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen3-1.7B", help="a shape in examples/megatron/model_configs")
    parser.add_argument("--cases", help="backend:layout, comma-separated; backends: " + ", ".join(BACKENDS) +
                        " (default: megatron:world1,fsdp2:world1,fsdp2_loop:world1,fsdp2_sdpa:world1; with --smoke: "
                        "megatron:tp2, fsdp2_loop:world1 and dp2 run, the host's two FSDP2 cases composed only)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--min-response", type=int, default=64)
    parser.add_argument("--max-response", type=int, default=4096)
    # 8192 by default: about the positions of one FSDP2 micro-batch (2 rows x 4352), so both sides
    # hold a similar activation footprint; Qwen3-4B at 16k does not fit one H200 without recompute
    parser.add_argument("--token-budget", type=int, default=8192, help="ours: tokens per packed micro-batch")
    parser.add_argument("--fsdp-micro-rows", type=int, default=2, help="fsdp2_sdpa: padded rows per micro-batch")
    # fsdp2 packs each micro-batch's rows into one sequence; the host cuts micro-batches by rows, not
    # tokens. By default: the rows whose packed micro-batch holds on average as many tokens as our
    # --token-budget (8 rows of this batch's ~1.1k mean, ~8.6k tokens), so both sides run about as
    # many micro-batches of a similar activation footprint. On the 4B at world1 larger micro-batches
    # leave less headroom (no activation checkpointing, 16 B/param of FSDP2 state, a [tokens,
    # 151936] logits tensor): try --fsdp-packed-rows 16 where it fits and keep the faster.
    parser.add_argument("--fsdp-packed-rows", type=int,
                        help="fsdp2: rows per packed micro-batch (default: token-budget equivalent, see above)")
    # Scoring keeps no activations for backward: when ours scores with a larger budget
    # (--variant ...forward_max_tokens_per_microbatch=N), give FSDP2's scoring as many rows (N / 1.1k).
    parser.add_argument("--fsdp-forward-rows", type=int,
                        help="fsdp2: rows per scoring micro-batch (default: --fsdp-packed-rows)")
    parser.add_argument("--fsdp-flash-attn", choices=("auto", "standin", "installed"), default="auto",
                        help="fsdp2's flash_attn: the installed CUDA build, or bench/flash_attn_standin (PyTorch's "
                             "FA2 kernels); auto: the build where its CUDA extension imports, else the stand-in")
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the run's work directory (model, conversion cache), removed at the end otherwise")
    parser.add_argument("--baseline-attention", choices=("auto", "flash2"), default="auto",
                        help="fsdp2 and fsdp2_loop: auto takes flash-attn-4 where ours' attention_kernel auto takes it "
                             "(the same kernel on every side), flash2 keeps FlashAttention-2 kernels")
    parser.add_argument("--layers", type=int, help="keep the model's first N layers (e.g. MoE widths that fit)")
    parser.add_argument("--recompute", action="store_true", help="activation recompute on both sides")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME='KEY=VALUE;...'",
                        help="named extra host overrides, used as backend:layout@NAME in --cases")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="profile one extra step per case (torch.profiler); operator tables to DIR")
    parser.add_argument("--profile-backends", default="megatron,fsdp2,fsdp2_loop",
                        help="with --profile: which backends' cases to profile (a long FSDP2 step makes a large trace)")
    parser.add_argument("--profile-phase", choices=tuple(PROFILED_PHASES), default="step",
                        help="with --profile: profile the scoring pass and training call (step) or one of them")
    parser.add_argument("--convert-first", action=argparse.BooleanOptionalAction, default=True,
                        help="where ours runs in more than one case, convert the checkpoint in a start-up of its own "
                             "before any case is timed, so that each of ours starts from the conversion cache alike")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int,
                        help="steps run before the measured ones (default 2, 1 with --smoke): after a single warm-up "
                             "the first measured step was often a case's slowest (up to 1.5x its later ones)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny model and batch; the host's FSDP2 cases composed only")
    parser.add_argument("--out", type=Path, default=Path("policy_bench.json"))
    parser.add_argument("--markdown", type=Path, help="write this run's section into this file")
    parser.add_argument("--chart", type=Path, help="PNG of tokens/s/GPU per case and phase")
    parser.add_argument("--render", type=Path, metavar="REPORT_JSON",
                        help="run nothing: write --markdown / --chart from a report an earlier run wrote")
    args = parser.parse_args(argv)
    if args.render:
        report = json.loads(args.render.read_text())
        publish(report, args.markdown, args.chart)
        return 0

    variants = {}
    for text in args.variant:
        name, _, overrides = text.partition("=")
        variants[name] = [o for o in overrides.split(";") if o]
    default_cases = ("megatron:tp2,fsdp2_loop:world1,fsdp2_loop:dp2,fsdp2:world1,fsdp2_sdpa:world1" if args.smoke
                     else "megatron:world1,fsdp2:world1,fsdp2_loop:world1,fsdp2_sdpa:world1")
    cases = [Case.parse(text, variants) for text in (args.cases or default_cases).split(",")]
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 2
    cpu = args.smoke or not torch.cuda.is_available()
    if cpu and not args.smoke:
        raise SystemExit("no GPU here: use --smoke for the CPU check")
    model = SMOKE_MODEL if args.smoke else args.model
    if not args.smoke and not (MODEL_CONFIGS / f"{model}.json").exists():
        known = sorted(p.stem for p in MODEL_CONFIGS.glob("*.json"))
        raise SystemExit(f"--model {model}: no {MODEL_CONFIGS / (model + '.json')}; one of {', '.join(known)}")
    batch_shape = BatchShape(args.rows, args.prompt_tokens, args.min_response, args.max_response)
    if args.smoke:
        batch_shape = BatchShape(rows=8, prompt_tokens=8, min_response=2, max_response=16, samples_per_prompt=2)
    if batch_shape.rows % batch_shape.samples_per_prompt:
        raise SystemExit(f"--rows must be a multiple of {batch_shape.samples_per_prompt} (samples per prompt)")
    gpus = torch.cuda.device_count() if not cpu else max(case.gpus for case in cases)
    too_big = [case.name for case in cases if case.gpus > gpus]
    if too_big:
        raise SystemExit(f"--cases {', '.join(too_big)} need more than the {gpus} GPU(s) here")

    from loguru import logger  # the host trainer's logger: one INFO line per phase otherwise
    from transformers import AutoTokenizer

    from skyrl_megatron.planner.arch import ModelArch

    logger.remove()
    logger.add(sys.stderr, level=os.environ.get("LOG_LEVEL", "WARNING"))

    workdir = Path(tempfile.mkdtemp(prefix="policy_bench_"))
    model_dir = write_checkpoint(model, workdir / "model", cpu, None if args.smoke else args.layers)
    if args.layers and not args.smoke:
        model = f"{model} ({args.layers} layers)"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    arch = ModelArch.from_hf_config(json.loads((model_dir / "config.json").read_text()), name=model)
    batch = rl_batch(batch_shape, arch.vocab_size, tokenizer.pad_token_id)
    packed_rows = args.fsdp_packed_rows or token_budget_rows(batch["attention_mask"], args.token_budget)
    flash_attn_site, flash_attn_used = None, None
    if not cpu and any(case.backend in ("fsdp2", LOOP_BACKEND) for case in cases):
        flash_attn_site, flash_attn_used = flash_attn_for_fsdp2(args.fsdp_flash_attn, workdir)
    baseline_attention = baseline_attention_kernel(args.baseline_attention, cpu, flash_attn_site,
                                                   any(case.backend == "fsdp2" for case in cases))
    if baseline_attention == FLASH4 and flash_attn_used:
        flash_attn_used += f"; attention through flash-attn-4 ({STANDIN_KERNEL_VARIABLE}={FLASH4})"
    settings = Settings(str(model_dir), batch_shape, str(workdir), cpu, args.token_budget, args.fsdp_micro_rows,
                        args.recompute, args.steps, args.warmup, variants,
                        str(args.profile) if args.profile else None, tuple(args.profile_backends.split(",")),
                        args.profile_phase, packed_rows, flash_attn_site, args.fsdp_forward_rows, baseline_attention)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    peak_tflops = measured_bf16_peak_tflops()

    report = {
        "model": model,
        "device": torch.cuda.get_device_name(0) if not cpu else f"CPU ({platform.processor() or platform.machine()})",
        "max_gpus": max(case.gpus for case in cases),
        "date": datetime.date.today().isoformat(),
        "command": "python bench/policy_bench.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "batch": dataclasses.asdict(batch_shape),
        "tokens": int(batch["attention_mask"].sum()),
        "peak_tflops": peak_tflops or float("nan"),
        "datasheet_tflops": datasheet_peak_tflops(torch.cuda.get_device_name(0)) if not cpu else None,
        "recompute": args.recompute,
        "token_budget": args.token_budget,
        "fsdp_micro_rows": args.fsdp_micro_rows,
        "fsdp_packed_rows": packed_rows,
        "fsdp_forward_rows": args.fsdp_forward_rows or packed_rows,
        "fsdp_packed_tokens": packed_micro_batch_tokens(batch["attention_mask"], packed_rows),
        "fsdp_flash_attn": flash_attn_used,
        "baseline_attention": baseline_attention,
        "layers": args.layers,
        "variants": variants,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "host": installed_host(),
        "cases": [],
        "composed_only": [],
        "failed": {},
    }
    try:
        run_cases(cases, settings, tokenizer, batch, arch, peak_tflops, report, args)
    finally:
        # model, conversion cache, the host's checkpoints: tens of GB a run on a 64 GB disk
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    publish(report, args.markdown, args.chart)
    return 0


def convert_once(case: Case, s: Settings, tokenizer) -> float:
    """Start `case`'s workers and stop them: the HF checkpoint's conversion is stored in the run's conversion cache,
    so that every case after it starts from a cache hit. Seconds taken."""
    with started_policy(case, s, tokenizer) as (_, seconds, _):
        return seconds


def conversion_case(cases, args) -> Case | None:
    """The case whose start-up converts the checkpoint before any case is timed (`--convert-first`): the first of
    ours, where ours runs more than once (else its one case converts, as a user's first run does)."""
    ours = [case for case in cases if case.backend == "megatron"]
    return ours[0] if args.convert_first and len(ours) > 1 else None


def run_cases(cases, settings, tokenizer, batch, arch, peak_tflops, report: dict, args) -> None:
    """Each case in turn into `report`, written to `args.out` after every case."""
    cpu = settings.cpu
    first = conversion_case(cases, args)
    if first is not None:
        # The case that converts the checkpoint stores the cache entry in its own start-up and runs its steps in
        # that process; the others load the entry. Converting first in a process of its own starts them alike.
        report["converted_first_seconds"] = convert_once(first, settings, tokenizer)
        print(f"{time.strftime('%H:%M:%S')} converted the checkpoint first ({first.name}'s start-up, "
              f"{report['converted_first_seconds']:.1f} s): every case of ours starts from the cache", flush=True)
    for case in cases:
        if cpu and case.backend in FSDP_BACKENDS:
            compose(case, settings)  # the host's FSDP2 workers need CUDA; the config must still hold
            report["composed_only"].append(case.name)
            print(f"{case.name}: config composed and validated; not run (the host's FSDP2 workers need CUDA)")
        else:
            print(f"{time.strftime('%H:%M:%S')} {case.name}", flush=True)
            try:
                if case.backend == LOOP_BACKEND:
                    report["cases"].append(run_loop_case(case, settings, batch, arch, peak_tflops))
                else:
                    report["cases"].append(run_case(case, settings, tokenizer, batch, arch, peak_tflops))
            except Exception as error:  # noqa: BLE001 -- one failed case (say, out of memory) must not lose the others
                if args.smoke:
                    raise
                report["failed"][case.name] = f"{type(error).__name__}: {str(error)[-2000:]}"
                print(f"{case.name} FAILED: {report['failed'][case.name]}", flush=True)
        for written in ("ckpt", "export"):  # the host's saves: the next case needs none of them
            shutil.rmtree(Path(settings.workdir) / written, ignore_errors=True)
        # written after every case: a run cut short by a time limit keeps what it measured
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
