"""Shared fixtures. Nothing here touches a model hub: every checkpoint is built from a config."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from skyrl_megatron.hosts import current
from skyrl_megatron.hosts.skyrl_0_4 import SkyRL04

# Each host's own tests run only under it: tests/host04 with skyrl 0.4 (`.venv`, which also runs the
# host-independent rest), tests/host03 with skyrl-train 0.3.1 (`.venv-skyrl-train`); `make test` runs both.
collect_ignore = ["host03"] if isinstance(current(), SkyRL04) else ["host04"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def hf_config_dir(tmp_path: Path):
    """Factory: a directory holding only a tiny model's config.json (enough for config validation)."""
    from skyrl_megatron.testing import tiny_config

    def make(family: str = "qwen3", **overrides) -> str:
        out = tmp_path / f"{family}-{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        tiny_config(family, **overrides).to_json_file(out / "config.json")
        return str(out)

    return make


@pytest.fixture
def compose(tmp_path: Path):
    """Factory: the composed `skyrl-megatron` config with overrides, writing only under tmp_path."""
    from skyrl_megatron.cli import compose_config

    def make(*overrides: str):
        base = [f"trainer.export_path={tmp_path}/export", f"trainer.ckpt_path={tmp_path}/ckpt"]
        return compose_config(base + list(overrides))

    return make


MC = "trainer.policy.megatron_config"

# Bad values of our keys, each with the one line both hosts print for it: our checks run on either
# host's config (on skyrl 0.4 before its full parse, which imports torch), so the text is the same.
BAD_VALUES = {
    "runtime": ([f"{MC}.runtime=gpu"], f"{MC}.runtime: unknown runtime 'gpu'. Fix: use auto, cuda or cpu."),
    "fused_kernels": ([f"{MC}.fused_kernels=[rope,swigl]"],
                      f"{MC}.fused_kernels: unknown kernel 'swigl'. Fix: did you mean 'swiglu'? "
                      "(known: rms_norm, rope, qk_norm_rope, swiglu, swiglu_gemm, swiglu_gemm_training, swiglu_gemm_experts, logprobs, lse_gemm)."),
    "fused_kernels_moved": ([f"{MC}.fused_kernels=[rope,expert_gemm]"],
                            f"{MC}.fused_kernels: 'expert_gemm' is no longer a fused kernel: {MC}.moe_config.expert_gemms "
                            "chooses the MoE experts' GEMMs (auto by default: quack-kernels where it runs, else "
                            f"torch._grouped_mm). Fix: remove it from the list; set {MC}.moe_config.expert_gemms=quack "
                            "to require quack."),
    "expert_gemms": ([f"{MC}.moe_config.expert_gemms=quak"],
                     f"{MC}.moe_config.expert_gemms: unknown value 'quak'. Fix: use one of auto, quack, torch (did you "
                     "mean 'quack'?)."),
    "attention_kernel": ([f"{MC}.attention_kernel=flash3"],
                         f"{MC}.attention_kernel: unknown kernel 'flash3'. Fix: use one of auto, flash4, varlen, sdpa "
                         "(did you mean 'flash4'?)."),
    "tp_vs_gpus": (["trainer.placement.policy_num_gpus_per_node=3", f"{MC}.tensor_model_parallel_size=2"],
                   f"{MC}.tensor/pipeline/context_parallel_size: policy world size 3 (trainer.placement.policy_num_nodes "
                   "* policy_num_gpus_per_node) is not divisible by TP*PP*CP = 2*1*1 = 2. Fix: choose sizes whose "
                   "product divides 3, or change trainer.placement.policy_num_nodes * policy_num_gpus_per_node."),
    "tp_type": ([f"{MC}.tensor_model_parallel_size=two"],
                f"{MC}.tensor_model_parallel_size: must be a positive integer, got 'two'. Fix: set it to 1 or more."),
    "tokens_per_micro_batch": ([f"{MC}.max_tokens_per_microbatch=0"],
                               f"{MC}.max_tokens_per_microbatch: must be positive or null. Fix: set a token budget "
                               "such as 8192, or null to split by count."),
    "vpp": ([f"{MC}.virtual_pipeline_model_parallel_size=2"],
            f"{MC}.virtual_pipeline_model_parallel_size: virtual pipeline stages (2) need pipeline_model_parallel_size "
            "> 1. Fix: set pipeline_model_parallel_size >= 2 or virtual_pipeline_model_parallel_size=null."),
    "moe": ([f"{MC}.moe_config.token_dispatcher=alltoal"],
            f"{MC}.moe_config.token_dispatcher: unknown value 'alltoal'. Fix: use one of alltoall, allgather, flex "
            "(did you mean 'alltoall'?)."),
    "lora": ([f"{MC}.lora_config.lora_type=dora"],
             f"{MC}.lora_config.lora_type: unknown LoRA type 'dora'. Fix: use lora or canonical_lora."),
}


@pytest.fixture(params=sorted(BAD_VALUES))
def bad_value(request) -> tuple[list[str], str]:
    """(overrides, the whole line `skyrl-megatron` prints for them), one bad value of ours per test."""
    overrides, problem = BAD_VALUES[request.param]
    return overrides, f"skyrl-megatron: invalid skyrl-megatron config: {problem}"


@dataclass(frozen=True)
class PythonRun:
    returncode: int
    stderr: str  # without the import-time lines
    imported: frozenset[str]  # every module the process imported
    stdout: str = ""

    def loaded(self, package: str) -> bool:
        """Whether the process imported `package` or any module inside it."""
        return any(name == package or name.startswith(package + ".") for name in self.imported)


@pytest.fixture
def run_python(tmp_path: Path):
    """Factory: `python -X importtime <args>` in a fresh process of this environment, importing this
    checkout (not an installed copy); what it imported is read from Python's own import log."""

    def run(*args: str) -> PythonRun:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        out = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        lines = out.stderr.splitlines()
        imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
        imported.discard("imported package")  # the log's header line
        rest = "\n".join(line for line in lines if not line.startswith("import time:"))
        return PythonRun(out.returncode, rest, frozenset(imported), out.stdout)

    return run



@pytest.fixture
def demo_run_dir(tmp_path: Path) -> Path:
    """A run directory the demo resumes on: a tiny model's config.json and a prompt file (the demo
    would otherwise create them first, importing torch to write the weights)."""
    from skyrl_megatron.demo.task import write_prompts
    from skyrl_megatron.testing import tiny_config

    run_dir = tmp_path / "demo"
    (run_dir / "model").mkdir(parents=True)
    tiny_config("qwen3").to_json_file(run_dir / "model" / "config.json")
    write_prompts(run_dir / "data" / "prompts.jsonl", 8)
    return run_dir


@pytest.fixture
def bench_smoke(tmp_path: Path):
    """`run(script, out, patch="pass", timeout=120)`: a bench script's `main(['--smoke', '--out', out])` in a
    fresh interpreter (its ranks are forked: a process that has run torch's CPU thread pool, as pytest's
    has, must not fork), the script loaded as module `script` and `patch` (Python, may name `script`)
    applied to it first."""
    root = Path(__file__).resolve().parents[1]

    def run(script: Path, out: Path, patch: str = "pass", timeout: int = 120) -> subprocess.CompletedProcess:
        code = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('script', {str(script)!r}); "
                "script = importlib.util.module_from_spec(spec); sys.modules['script'] = script; "
                f"spec.loader.exec_module(script); {patch}; sys.exit(script.main(['--smoke', '--out', {str(out)!r}]))")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        env.pop("MASTER_PORT", None)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=tmp_path)

    return run


@pytest.fixture
def stand_in_worker():
    """`make(megatron_config={...}, use_sample_packing=False, placement={...})`: our worker mixin with a real
    `MegatronWorkerConfig` (defaults plus the given keys) and no model, for the parts of a worker that
    read only its config (micro-batching, the pass guard)."""
    import types

    from skyrl_megatron.config import MegatronWorkerConfig
    from skyrl_megatron.workers.base import MegatronWorkerMixin
    from skyrl_megatron.workers.memory_peaks import PhasePeaks
    from skyrl_megatron.workers.python_gc import ManualGc

    def make(megatron_config: dict | None = None, use_sample_packing: bool = False,
             placement: dict | None = None) -> MegatronWorkerMixin:
        worker = MegatronWorkerMixin()
        worker.role, worker.worker_name = "policy", "policy worker rank 0/1"
        worker.megatron_cfg = MegatronWorkerConfig.from_mapping(megatron_config or {})
        trainer = types.SimpleNamespace(micro_forward_batch_size_per_gpu=2, micro_train_batch_size_per_gpu=1,
                                        use_sample_packing=use_sample_packing, placement=placement or {})
        worker.__dict__["_host_cfg"] = types.SimpleNamespace(trainer=trainer)
        worker.phase_peaks = PhasePeaks()
        worker.manual_gc = ManualGc() if worker.megatron_cfg.manual_gc else None
        return worker

    return make
