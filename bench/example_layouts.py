"""The example launch scripts (examples/megatron/run_*.sh), read and scaled down to a few GPUs.

A script is run with a stand-in ``skyrl-megatron`` that records its arguments, so what is read is
exactly what a user's launch passes. Scaling keeps the script's Megatron settings (token budget,
recompute, expert layout, packing, whether a reference model runs) and its model's widths, and cuts
what a small machine cannot hold: parallel sizes above the GPU count come down to it, and the model
loses layers. The memory planner then estimates the scaled layout, for comparison with a run
(``bench/gpu_examples.py``).

Used by ``bench/gpu_examples.py`` (on GPUs) and ``tests/test_examples.py`` (on CPU).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "megatron"
MODEL_CONFIGS = EXAMPLES / "model_configs"
PLAN_PREFIX = "#   $ skyrl-megatron plan "
DEFAULT_MODEL = re.compile(r"^MODEL_PATH=\$\{MODEL_PATH:-([^}]+)\}$", re.MULTILINE)

# Layers each scaled model keeps: few enough that one run (model creation, conversion, 2 steps) stays
# within minutes; the widths, vocabulary and expert counts stay the published ones.
SCALED_LAYERS = {"Qwen3-1.7B": 28, "Qwen3-30B-A3B": 4, "Qwen3-235B-A22B": 2}
# Parallel sizes a scaled layout takes over, in the order they claim GPUs.
_SIZE_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
# Settings of the script a scaled run keeps besides every worker's megatron_config.
_KEPT_KEYS = ("trainer.use_sample_packing", "trainer.algorithm.use_kl_loss", "trainer.algorithm.kl_loss_coef")


def model_config_of(script: Path) -> Path:
    """The architecture JSON of the model a script trains by default (MODEL_PATH=${MODEL_PATH:-Qwen/<name>})."""
    (model_id,) = DEFAULT_MODEL.findall(script.read_text())
    return MODEL_CONFIGS / f"{Path(model_id).name}.json"


def launch_overrides(script: Path, workdir: Path, *extra: str) -> list[str]:
    """Run the script with a stand-in `skyrl-megatron` that records its arguments; return them."""
    bin_dir, model_dir, record = workdir / "bin", workdir / "model", workdir / "args"
    bin_dir.mkdir(parents=True)
    model_dir.mkdir()
    shutil.copy(model_config_of(script), model_dir / "config.json")
    stub = bin_dir / "skyrl-megatron"
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "$RECORD_ARGS"\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("LOGGER", "CKPT_DIR")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", HOME=str(workdir / "home"), MODEL_PATH=str(model_dir),
               DATA_DIR=str(workdir / "data"), RECORD_ARGS=str(record))  # fmt: skip
    subprocess.run(["bash", str(script), *extra], env=env, check=True, timeout=60)
    return record.read_text().split("\0")[:-1]


def plan_of(script: Path) -> tuple[list[str], str]:
    """The planner arguments and the pasted output in a script's header."""
    lines = script.read_text().splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.startswith(PLAN_PREFIX)]
    pasted = []
    for line in lines[start + 1 :]:
        if not line.startswith("#"):
            break
        pasted.append(line[4:])
    return shlex.split(lines[start][len(PLAN_PREFIX) :]), "\n".join(pasted)


@dataclass(frozen=True)
class ScaledExample:
    script: str
    model: str  # the published model whose widths the scaled one keeps
    layers: int
    gpus: int
    model_config: dict  # HF config.json of the scaled model
    overrides: list[str]  # the script's Megatron settings at the scaled sizes
    planner_args: list[str]  # `skyrl-megatron plan` arguments for exactly that layout (model path last)

    def setting(self, name: str, role: str = "policy") -> str | None:
        """The script's value of `megatron_config.<name>`; None where it is unset or set to `null`."""
        prefix = f"trainer.{role}.megatron_config.{name}="
        value = next((o[len(prefix):] for o in self.overrides if o.startswith(prefix)), None)
        return None if value == "null" else value


def _scaled_sizes(overrides: list[str], role: str, gpus: int) -> dict[str, int]:
    """Each parallel size of `role` as the script sets it (1 if unset), reduced to fit `gpus`."""
    prefix = f"trainer.{role}.megatron_config."
    given = {o[len(prefix):].split("=", 1)[0]: int(o.split("=", 1)[1]) for o in overrides
             if o.startswith(prefix) and o.split("=", 1)[0].endswith("_size")}  # fmt: skip
    sizes, left = {}, gpus
    for key in _SIZE_KEYS:
        sizes[key] = min(given.get(key, 1), left)
        left //= sizes[key]
    ep = min(given.get("expert_model_parallel_size", 1), gpus)
    sizes["expert_model_parallel_size"] = ep
    if "expert_tensor_parallel_size" in given:
        sizes["expert_tensor_parallel_size"] = min(given["expert_tensor_parallel_size"], gpus // ep)
    return {key: value for key, value in sizes.items() if key in given or value != 1}


def scale_example(script: Path, workdir: Path, gpus: int = 2, full_size: bool = False) -> ScaledExample:
    """`script`'s layout on `gpus` GPUs of one node with its model cut to `SCALED_LAYERS` layers, or with
    all of the published model's layers (`full_size`: e.g. the 30B-A3B script on one 8-GPU node)."""
    overrides = launch_overrides(script, workdir)
    model_json = model_config_of(script)
    name = model_json.stem
    config = json.loads(model_json.read_text())
    if not full_size:
        config["num_hidden_layers"] = SCALED_LAYERS[name]
    kept = [o for o in overrides if o.split("=", 1)[0] in _KEPT_KEYS]
    for role in ("policy", "ref"):
        prefix = f"trainer.{role}.megatron_config."
        sizes = _scaled_sizes(overrides, role, gpus)
        for override in overrides:
            key = override.split("=", 1)[0]
            if key.startswith(prefix) and key[len(prefix):] not in sizes:
                kept.append(override)
        kept += [f"{prefix}{key}={value}" for key, value in sizes.items()]
    scaled = ScaledExample(script.name, name, config["num_hidden_layers"], gpus, config, kept, [])
    return ScaledExample(**{**scaled.__dict__, "planner_args": _planner_args(scaled)})


def planner_layout_args(setting: Callable[[str], str | None], gpus: int) -> list[str]:
    """`skyrl-megatron plan` flags of a one-node layout given as megatron_config settings (`setting(name)`: the
    value set for `megatron_config.<name>`, None where unset): the example scripts' and the policy bench's."""

    def size(key: str, default: str = "1") -> str:
        return setting(key) or default

    args = ["--nodes", "1", "--gpus-per-node", str(gpus),
            "--tp", size("tensor_model_parallel_size"), "--pp", size("pipeline_model_parallel_size"),
            "--cp", size("context_parallel_size"), "--ep", size("expert_model_parallel_size")]  # fmt: skip
    if setting("expert_tensor_parallel_size"):
        args += ["--etp", setting("expert_tensor_parallel_size")]
    return args


def _planner_args(example: ScaledExample) -> list[str]:
    args = planner_layout_args(example.setting, example.gpus)
    tokens = example.setting("max_tokens_per_microbatch")
    if tokens:
        args += ["--micro-batch-tokens", tokens]
    recompute = example.setting("transformer_config_kwargs.recompute_granularity")
    if recompute:
        args += ["--recompute", recompute]
    return args


def write_model_config(example: ScaledExample, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(example.model_config, indent=2))
    return path


def planned_peak(example: ScaledExample, config_path: Path, gpu_memory_gib: float) -> tuple[dict[str, float], str]:
    """The planner's per-GPU estimate of the scaled layout (GiB by category) and its printed plan."""
    import contextlib
    import io

    from skyrl_megatron.planner.cli import estimate_from_argv, main as plan_main
    from skyrl_megatron.planner.memory import GIB

    argv = ["--model", str(config_path), *example.planner_args, "--gpu-memory-gib", f"{gpu_memory_gib:g}"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        plan_main(argv)
    result = estimate_from_argv(argv)
    figures = {key: getattr(result, key) / GIB for key in ("params", "grads", "optimizer", "activations", "transient", "optimizer_step", "overhead")}
    figures["total"] = result.total / GIB
    return figures, printed.getvalue()
