"""`make demo` (``python -m skyrl_megatron.demo``): the main job, on a CPU box, end to end.

1. Creates (once) a tiny Qwen3-shaped HF checkpoint with random weights and a prompt file for a task
   with a verifiable reward (the share of digits in the reply, a registered skyrl-gym environment).
2. Runs the host's GRPO trainer (skyrl-train) with ``trainer.strategy=megatron``: the policy on 2
   Megatron ranks (TP=2 + sequence parallel, gloo), a reference worker, and a CPU inference engine that
   receives the policy's weights after every step through the host's broadcast sender.
3. Prints one line per step (reward, loss, KL, grad norm, tokens/s, whether the engine holds the
   policy's weights bitwise, and how far the engine's logprobs are from the trainer's), saves
   checkpoints and the HF export of the final policy, and plots the reward per step.

``--ppo`` trains with PPO instead: GAE advantages from a Megatron critic (one more rank, started from
the policy's checkpoint with a fresh value head), the value loss column beside the policy's.

``--gpu`` runs the same GRPO on 1 GPU: a Qwen3-0.6B-shaped policy (random weights, bf16), its reference
and the inference engine colocated, the weights sent by CUDA IPC after every step. The engine is the
host's vLLM where vLLM is installed (``--engine vllm``; one engine per GPU, tensor parallel size 1),
else our HF engine (``--engine hf``). ``--gpus 2`` spreads it over 2 GPUs: the policy and the reference
with tensor parallelism 2 (+ sequence parallel), one engine per GPU.
``--model DIR`` trains an existing HF checkpoint (its tokenizer included) instead of the generated one.
``--no-weight-check`` skips the per-step weight comparison of step 3, which hashes every tensor on both sides
inside the step the host times (its seconds are ``timing/weight_check`` when it runs): for step times.

Rerunning the same command continues from the last checkpoint (``--fresh`` starts over). Extra
arguments are Hydra overrides, e.g. ``trainer.policy.megatron_config.pipeline_model_parallel_size=2``;
they replace the demo's own value of a key.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

from skyrl_megatron.demo.task import DEMO_PROMPTS, write_prompts

PROMPTS_PER_STEP = 8
SAMPLES_PER_PROMPT = 4


def demo_overrides(run_dir: Path, model_dir: Path, prompts: Path, steps: int, ckpt_interval: int) -> list[str]:
    run_dir = run_dir.resolve()
    return [
        f"trainer.policy.model.path={model_dir.resolve()}",
        f"data.train_data=['{prompts.resolve()}']",
        "data.val_data=[]",
        # policy on 2 ranks (TP=2 + SP), reference on 1, one CPU engine; nothing colocated
        "trainer.placement.colocate_all=false",
        "trainer.placement.colocate_policy_ref=false",
        "trainer.placement.policy_num_gpus_per_node=2",
        "trainer.placement.ref_num_gpus_per_node=1",
        "trainer.policy.megatron_config.runtime=cpu",
        "trainer.ref.megatron_config.runtime=cpu",
        "trainer.policy.megatron_config.tensor_model_parallel_size=2",
        "trainer.bf16=false",
        "generator.engine=cpu",
        "generator.weight_sync_backend=gloo",
        "generator.model_dtype=float32",
        "generator.num_inference_engines=1",
        "generator.inference_engine_tensor_parallel_size=1",
        f"generator.n_samples_per_prompt={SAMPLES_PER_PROMPT}",
        "generator.sampling_params.max_generate_length=8",
        "generator.sampling_params.logprobs=0",  # the engine reports logprobs; compared with the trainer's
        # GRPO with a KL loss against the reference
        "trainer.algorithm.advantage_estimator=grpo",
        "trainer.algorithm.use_kl_loss=true",
        "trainer.algorithm.kl_loss_coef=0.001",
        "trainer.policy.optimizer_config.lr=1e-2",
        "trainer.policy.optimizer_config.weight_decay=0.0",
        f"trainer.train_batch_size={PROMPTS_PER_STEP}",
        f"trainer.policy_mini_batch_size={PROMPTS_PER_STEP // 2}",  # two optimizer steps per GRPO step
        f"trainer.micro_train_batch_size_per_gpu={PROMPTS_PER_STEP * SAMPLES_PER_PROMPT // 2}",
        f"trainer.micro_forward_batch_size_per_gpu={PROMPTS_PER_STEP * SAMPLES_PER_PROMPT}",
        "trainer.max_prompt_length=64",
        "trainer.epochs=1",
        "trainer.eval_interval=-1",
        "trainer.eval_before_train=false",
        # checkpoints (resume: latest) and the HF export of the final policy
        f"trainer.ckpt_interval={ckpt_interval}",
        f"trainer.hf_save_interval={steps}",
        f"trainer.ckpt_path={run_dir / 'ckpts'}",
        f"trainer.export_path={run_dir / 'exports'}",
        "trainer.resume_mode=latest",
        "trainer.run_name=cpu-demo",
        "trainer.seed=42",
    ]


# Qwen3-0.6B's widths and depth (the tiny tokenizer's vocabulary): the --gpu model
QWEN3_0_6B_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


def gpu_overrides(gpus: int = 1) -> list[str]:
    """On `gpus` GPUs: the policy (bf16), the reference and our HF engines colocated (the host offloads
    the trainers while the engines sample, and sleeps the engines while they work); the weights after
    every step by CUDA IPC (the host's sender and receiver). With 2 GPUs the policy and the reference
    are tensor parallel over both and each GPU holds one engine. They replace the CPU settings."""
    return [
        "trainer.placement.colocate_all=true",
        "trainer.placement.colocate_policy_ref=true",
        f"trainer.placement.policy_num_gpus_per_node={gpus}",
        f"trainer.placement.ref_num_gpus_per_node={gpus}",
        "trainer.policy.megatron_config.runtime=cuda",
        "trainer.ref.megatron_config.runtime=cuda",
        f"trainer.policy.megatron_config.tensor_model_parallel_size={gpus}",
        f"trainer.ref.megatron_config.tensor_model_parallel_size={gpus}",
        f"generator.num_inference_engines={gpus}",
        # rows per GPU when the layout is data parallel over the GPUs (the host checks it divides)
        f"trainer.micro_train_batch_size_per_gpu={PROMPTS_PER_STEP * SAMPLES_PER_PROMPT // 2 // gpus}",
        f"trainer.micro_forward_batch_size_per_gpu={PROMPTS_PER_STEP * SAMPLES_PER_PROMPT // gpus}",
        "trainer.bf16=true",
        "generator.engine=gpu",
        "generator.batched=true",  # one generate() call for the step's prompts, not one per prompt
        "generator.weight_sync_backend=nccl",
        "generator.model_dtype=bfloat16",
        "trainer.policy.optimizer_config.lr=1e-4",
    ]


def vllm_overrides(gpus: int) -> list[str]:
    """The host's vLLM engines in place of our HF engine: one per GPU (tensor parallel size 1, so each
    holds whole tensors and its weights can be read back after a sync), sleeping while the trainers work
    (the host's default when colocated), in the host's own engine mode (`HostAdapter.vllm_engine_overrides`)."""
    from skyrl_megatron.hosts import current

    return [
        "generator.engine=auto",
        "generator.backend=vllm",
        f"generator.num_inference_engines={gpus}",
        "generator.inference_engine_tensor_parallel_size=1",
        *current().vllm_engine_overrides(),
        "generator.gpu_memory_utilization=0.5",
        "generator.enforce_eager=true",
    ]


def _has_trainer_transfer_api(vllm_version: str) -> bool:
    """skyrl 0.4's vLLM servers take weights through vLLM 0.30's trainer-side transfer API (``WeightSource``);
    an older vLLM has it only where something provides it (the benches' harness bridge onto vLLM 0.24)."""
    if _at_least(vllm_version, (0, 30)):
        return True
    import importlib

    try:
        return hasattr(importlib.import_module("vllm.distributed.weight_transfer.base"), "WeightSource")
    except ImportError:
        return False


def pick_engine(requested: str, gpus: int) -> str:
    """hf (our engine) or vllm: `requested` (auto: vLLM where it is installed, on GPUs only)."""
    if not gpus:
        if requested == "vllm":
            raise SystemExit("skyrl-megatron demo: --engine vllm needs --gpu (the CPU run uses our CPU engine)")
        return "hf"
    import importlib.metadata

    from skyrl_megatron.hosts import detect

    try:
        vllm_version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm_version = None
    # skyrl 0.4's vLLM servers sync weights through vLLM 0.30's trainer-side transfer API
    usable = vllm_version is not None and (detect().release.distribution != "skyrl" or _has_trainer_transfer_api(vllm_version))
    if requested == "vllm" and not usable:
        found = f"vllm {vllm_version}" if vllm_version else "no vllm"
        raise SystemExit(f"skyrl-megatron demo: --engine vllm: {found} with host {detect().release.distribution}; the host's "
                         "vLLM engines need vllm installed (skyrl 0.4: vllm >= 0.30); use --engine hf")
    if requested != "auto":
        return requested
    return "vllm" if usable else "hf"


def _at_least(version: str, minimum: tuple[int, int]) -> bool:
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= minimum


def merged(overrides: list[str], replacing: list[str]) -> list[str]:
    """`overrides` with each key that `replacing` sets taken from `replacing` (a key given twice is an error)."""
    new = dict(item.split("=", 1) for item in replacing)
    kept = [item for item in overrides if item.split("=", 1)[0] not in new]
    return kept + replacing


def with_small_prompt_file(overrides: list[str]) -> list[str]:
    """The demo's overrides plus the installed host's settings for a small prompt file (the demo writes
    skyrl-train 0.3.1's key names; skyrl 0.4's adapter takes them under its own)."""
    from skyrl_megatron.hosts import current

    return overrides + current().small_prompt_file_overrides()


def ppo_overrides(model_dir: Path, gpus: int = 0) -> list[str]:
    """PPO with GAE: a Megatron critic on 1 rank from the policy's checkpoint (value head drawn as the
    host draws it), its own optimizer, one value-loss step per policy step's mini-batch; on GPUs it
    shares the first GPU with the policy, the reference and the engine."""
    return [
        "trainer.algorithm.advantage_estimator=gae",
        "trainer.algorithm.gamma=1.0",
        "trainer.algorithm.lambd=1.0",
        "trainer.algorithm.value_clip=0.5",
        f"trainer.critic.model.path={model_dir.resolve()}",
        "trainer.placement.critic_num_gpus_per_node=1",
        f"trainer.critic.megatron_config.runtime={'cuda' if gpus else 'cpu'}",
        "trainer.critic.optimizer_config.lr=1e-3",
        "trainer.critic.optimizer_config.weight_decay=0.0",
        f"trainer.critic_mini_batch_size={PROMPTS_PER_STEP // 2}",
    ]


def run_overrides(run_dir: Path, model_dir: Path, prompts: Path, steps: int, ckpt_interval: int, *, gpus: int = 0,
                  ppo: bool = False, extra: list[str] = (), engine: str = "hf") -> list[str]:
    """Everything the demo hands the host: its own settings, those of `gpus` GPUs (0: the CPU run) and of
    the `engine` (hf | vllm), PPO's, the machine's, and last the user's `extra` overrides, each replacing
    the value of its key."""
    overrides = demo_overrides(run_dir, model_dir, prompts, steps, ckpt_interval)
    if gpus:
        overrides = merged(overrides, gpu_overrides(gpus))
        if engine == "vllm":
            overrides = merged(overrides, vllm_overrides(gpus))
    return merged(with_small_prompt_file(overrides + (ppo_overrides(model_dir, gpus) if ppo else [])), list(extra))


def check_before_the_model_exists(overrides: list[str], model_dir: Path) -> None:
    """Our checks (on the host's light parse) of everything but the checkpoint the demo is about to create:
    a bad value is named within a second, not after torch has loaded to write the model. The checks that
    read the model's shape run with the full config once it exists."""
    from skyrl_megatron.config import ConfigError
    from skyrl_megatron.validation import validate_ours_cheaply

    try:
        validate_ours_cheaply(overrides)
    except ConfigError as err:
        missing = repr(str(model_dir.resolve()))
        others = [problem for problem in err.problems if missing not in problem.message]
        if others:
            raise ConfigError(others) from None


def prepare(run_dir: Path, steps: int, gpu: bool = False, model: Path | None = None) -> tuple[Path, Path]:
    """The checkpoint (`model`, else tiny, or Qwen3-0.6B-shaped for --gpu; random weights) and the prompt
    file, created once per run directory (a rerun resumes on them)."""
    model_dir, prompts = model or run_dir / "model", run_dir / DEMO_PROMPTS
    if model is not None and not (model / "config.json").is_file():
        raise SystemExit(f"skyrl-megatron demo: --model {model}: no config.json there; give an HF checkpoint directory")
    if not (model_dir / "config.json").exists():
        from skyrl_megatron.testing import make_tiny_hf_model  # torch + transformers: only to create it

        make_tiny_hf_model("qwen3", model_dir, seed=0, **(QWEN3_0_6B_SHAPE if gpu else {}))
    if not prompts.exists():
        write_prompts(prompts, steps * PROMPTS_PER_STEP)
    return model_dir, prompts


def quiet_console() -> None:
    """One line per step and nothing a user cannot act on; each setting is read where the noise starts,
    so it is set before those libraries load."""
    _disable_progress_bars_here()
    # Ray reads its config flags when it loads: no metrics exporter in a local run (launch sets it too)
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    # vLLM's import-time notices on a machine without a GPU (no Triton driver, no vllm._C): the host imports vLLM
    # where it is installed, also when the demo runs our engine; errors still print
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # Ray's notice that it will stop clearing CUDA_VISIBLE_DEVICES for num_gpus=0 tasks: opt in (CPU run)
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    # Megatron-Core's import-time notices that TE/Apex are absent: the TE-free path is ours on purpose
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|apex).*not installed")


def host_log_warnings_only() -> None:
    """The host logs every phase of every step at INFO (its loguru set-up reads LOG_LEVEL), from its first
    import on; the demo prints its own line per step. LOG_LEVEL=INFO brings the host's log back."""
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    from loguru import logger  # the host's logger in this process (the trainer runs here)

    logger.remove()
    logger.add(sys.stderr, level=os.environ["LOG_LEVEL"])


def _disable_progress_bars_here() -> None:
    """tqdm's bars off in this process (the host trainer's, datasets' and transformers'), but not through
    TQDM_DISABLE, which Ray's workers would inherit: vLLM's ``LLM.generate`` divides by its bar's elapsed
    time, which a disabled bar leaves at 0."""
    from functools import partialmethod

    import tqdm.std

    tqdm.std.tqdm.__init__ = partialmethod(tqdm.std.tqdm.__init__, disable=True)


def main(argv: list[str] | None = None) -> int:
    quiet_console()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/demo"), help="run directory (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=16, help="GRPO steps of a fresh run (default: %(default)s)")
    parser.add_argument("--ckpt-interval", type=int, default=4, help="checkpoint every N steps (default: %(default)s)")
    parser.add_argument("--fresh", action="store_true", help="delete the run directory first")
    parser.add_argument("--ppo", action="store_true",
                        help="PPO with GAE and a Megatron critic instead of GRPO (use a run directory of its own)")
    parser.add_argument("--gpu", action="store_true",
                        help="on 1 GPU: a Qwen3-0.6B-shaped policy (bf16), ref and the inference engine colocated")
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=None,
                        help="--gpu on this many GPUs (2: policy and ref tensor parallel, one engine per GPU)")
    parser.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto",
                        help="the GPU run's inference engine: the host's vLLM or our HF engine "
                             "(auto: vLLM where installed)")
    parser.add_argument("--model", type=Path, default=None,
                        help="an HF checkpoint directory to train instead of the generated random-weight model")
    parser.add_argument("--no-weight-check", dest="weight_check", action="store_false",
                        help="skip the per-step comparison of the engine's weights with the policy's (SHA-256 of "
                             "every tensor on both sides, timed inside the host's step: timing/weight_check)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for the host config")
    args = parser.parse_args(argv)
    gpus = args.gpus or (1 if args.gpu else 0)
    engine = pick_engine(args.engine, gpus)

    from skyrl_megatron.cli import checked_config, report_config_error
    from skyrl_megatron.config import ConfigError
    run_dir: Path = args.out
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.model or run_dir / "model"
    if not (model_dir / "config.json").exists():
        # the demo creates its model with torch: the rest of the config is checked before that
        prompts = run_dir / DEMO_PROMPTS
        planned = run_overrides(run_dir, model_dir, prompts, args.steps, args.ckpt_interval, gpus=gpus, ppo=args.ppo,
                                extra=args.overrides, engine=engine)
        try:
            check_before_the_model_exists(planned, model_dir)
        except ConfigError as err:
            report_config_error(err)
            return 2
    model_dir, prompts = prepare(run_dir, args.steps, gpu=bool(gpus), model=args.model)
    steps = sum(1 for _ in prompts.open()) // PROMPTS_PER_STEP  # the prompt file fixes a run's length
    overrides = run_overrides(run_dir, model_dir, prompts, steps, args.ckpt_interval, gpus=gpus, ppo=args.ppo,
                              extra=args.overrides, engine=engine)
    host_log_warnings_only()
    try:
        cfg = checked_config(overrides)
    except ConfigError as err:
        report_config_error(err)
        return 2
    # the heavy imports (torch, Ray, the host trainer) only once the config is known to be good
    from skyrl_megatron.demo.experiment import (
        MEAN_GAP, REWARD, VALUE_LOSS_AFTER, VALUE_LOSS_BEFORE, experiment_class, plot_rewards, read_metrics,
    )
    from skyrl_megatron import exit_codes
    from skyrl_megatron.failures import Preempted, ReportedFailure
    from skyrl_megatron.launch import run_experiment

    metrics_file = run_dir / "metrics.jsonl"
    done_before = max((r["step"] for r in read_metrics(metrics_file) if REWARD in r), default=0)
    on_gpus = f"{gpus} GPU{'s' if gpus > 1 else ''}"
    policy = f"Megatron policy ({on_gpus}, bf16) + ref" if gpus else "Megatron policy (TP=2+SP) + ref"
    algorithm = f"PPO (GAE), {policy} + critic" if args.ppo else f"GRPO, {policy}"
    engine_name = "vLLM" if engine == "vllm" else "HF engine"
    where = f"{on_gpus}, {engine_name} colocated (CUDA IPC)" if gpus else "CPU (gloo), CPU engine"
    print(f"skyrl-megatron demo: {algorithm} on {where}; {steps} steps")
    print(f"run directory: {run_dir.resolve()}" + (f" (resuming: {done_before} steps logged)" if done_before else ""))
    started = time.perf_counter()
    if done_before >= steps:
        # the host would restart from its final checkpoint only to save it again one step further
        print(f"all {steps} steps were trained already; showing that run (--fresh starts over)")
    else:
        try:
            run_experiment(cfg, experiment_class(run_dir, weight_check=args.weight_check), in_driver=True,
                           log_to_driver=False, quiet=True)
        except Preempted as stopped:  # the preemption signal: the step's checkpoint is written
            print(f"skyrl-megatron demo: {stopped}", file=sys.stderr)
            return exit_codes.PREEMPTED
        except ReportedFailure as failure:  # a dead worker, or a worker's report (out of memory, a hang)
            print(f"skyrl-megatron demo: training failed: {failure}", file=sys.stderr)
            return exit_codes.FAILED

    records = [r for r in read_metrics(metrics_file) if REWARD in r]
    by_step = {r["step"]: r for r in records}
    subtitle = f"Megatron workers, {engine_name} on {on_gpus} (colocated)" if gpus else "Megatron workers, CPU engine"
    plot = plot_rewards(metrics_file, run_dir / "reward.png", subtitle)
    ordered = [by_step[s][REWARD] for s in sorted(by_step)]
    quarter = max(1, len(ordered) // 4)
    first, last = sum(ordered[:quarter]) / quarter, sum(ordered[-quarter:]) / quarter
    latest_file = run_dir / "ckpts" / "latest_ckpt_global_step.txt"
    latest = latest_file.read_text().strip() if latest_file.exists() else None  # none with ckpt_interval <= 0
    print(f"done in {time.perf_counter() - started:.0f} s: mean reward {first:.3f} (first {quarter} steps) -> "
          f"{last:.3f} (last {quarter} steps)")
    if args.weight_check:
        print(f"weight sync bitwise equal at every step: {all(r.get('sync/bitwise_equal') == 1.0 for r in records)}")
    else:
        print("weight sync: not compared (--no-weight-check)")
    gaps = [r[MEAN_GAP] for r in records if MEAN_GAP in r]
    if gaps:
        print(f"train-inference gap, mean |engine logprob - trainer logprob| per step: {min(gaps):.4f} to "
              f"{max(gaps):.4f} (mean {sum(gaps) / len(gaps):.4f})")
    if args.ppo:
        updates = [(r[VALUE_LOSS_BEFORE], r[VALUE_LOSS_AFTER]) for r in records if VALUE_LOSS_AFTER in r]
        if updates:
            before, after = (sum(pair[i] for pair in updates) / len(updates) for i in (0, 1))
            print(f"critic value loss on each step's batch: {before:.4f} before the critic's update -> "
                  f"{after:.4f} after (mean of {len(updates)} steps)")
    print(f"checkpoint: {run_dir.resolve() / 'ckpts' / f'global_step_{latest}' if latest else '(none)'}")
    exports = sorted((run_dir / "exports").glob("global_step_*"), key=lambda d: int(d.name.split("_")[-1]))
    print(f"HF export:  {(exports[-1] / 'policy').resolve() if exports else '(none)'}")
    print(f"reward plot: {plot.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
