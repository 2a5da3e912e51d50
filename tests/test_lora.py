"""LoRA on the Megatron backend (CPU, gloo, fp32 unless stated).

One spawn of ranks per world size and layout trains LoRA adapters for three steps with the host's
objective, then exports them merged and as a PEFT adapter. Checked here, against a world-1 run:
losses and grad norms under TP2 (+SP), PP2 and EP2 (Qwen3-MoE); the frozen base is bitwise
unchanged and only adapters sit in the optimizer; the merged export, the PEFT adapter and our HF
engine's adapter sync (its own merge, MoE experts included, on any peft) reproduce the trained Megatron
model's logits in Hugging Face; a TP2 checkpoint (adapters only) resumes under PP2 with the loss the
TP2 run had continuing. The engine's merge also: replaces, never stacks, adapters; matches peft's on a
dense rsLoRA adapter; refuses what it cannot merge by its adapter_config.json key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from skyrl_megatron.model.adapters.lora import LoraConfigError, LoraSpec
from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model, run_on_ranks

ROWS, PROMPT, RESPONSE = 8, 6, 6
STEPS = 3
# Adam turns rounding noise in near-zero gradient elements into weight differences of order lr: 1e-3
# keeps layouts within TRAIN_RTOL over three steps and still moves the logits far past LOGIT_ATOL.
LR = 1e-3
TRAIN_RTOL = 1e-5
LOGIT_ATOL = 1e-4
RANK, ALPHA = 4, 8.0
HOST_OVERRIDES = (
    "trainer.algorithm.use_kl_loss=true",
    "trainer.algorithm.kl_loss_coef=0.1",
    "trainer.algorithm.use_entropy_loss=true",
    "trainer.algorithm.entropy_loss_coef=0.01",
)
LOGIT_BATCH, LOGIT_SEQ = 2, 12
DISTRIBUTED_OPTIMIZER = {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True, "average_in_collective": True}


def _spec(lora_type: str = "lora") -> LoraSpec:
    return LoraSpec(rank=RANK, alpha=ALPHA, lora_type=lora_type, seed=3)


def _logit_tokens() -> torch.Tensor:
    return torch.randint(0, 256, (LOGIT_BATCH, LOGIT_SEQ), generator=torch.Generator().manual_seed(7))


# ----------------------------------------------------------------------------------------------
# What a rank does
# ----------------------------------------------------------------------------------------------


class _Session:
    """A LoRA policy on this rank's groups: model, optimizer, schedule, runner and the host objective."""

    def __init__(self, hf_dir: str, layout: dict, lora: LoraSpec, dtype: str = "fp32"):
        from skyrl_megatron.cli import compose_config
        from skyrl_megatron.compute.losses import ObjectiveSettings, PolicyObjective
        from skyrl_megatron.compute.runner import ModelRunner
        from skyrl_megatron.hosts import current
        from skyrl_megatron.model.build import ModelSpec, build_model
        from skyrl_megatron.optim import OptimizerSettings
        from skyrl_megatron.parallel import ParallelConfig, initialize_model_parallel
        from skyrl_megatron.testing.policy_steps import max_seq_len_override

        self.parallel = ParallelConfig(**layout)
        initialize_model_parallel(self.parallel, seed=5)
        spec = ModelSpec(
            hf_dir, parallel=self.parallel, dtype=dtype, wrap_with_ddp=True, ddp_config=DISTRIBUTED_OPTIMIZER, lora=lora
        )
        self.built = build_model(spec)
        max_seq_len = max_seq_len_override(PROMPT + RESPONSE)
        host_cfg = compose_config([f"trainer.policy.optimizer_config.lr={LR}", max_seq_len, *HOST_OVERRIDES])
        cfg = current().our_view(host_cfg)  # what our workers read, on either host
        settings = OptimizerSettings.from_host_config(cfg.trainer.policy.optimizer_config, {}, 100, dtype)
        self.optimizer = settings.build_optimizer(self.built.chunks)
        self.scheduler = settings.build_scheduler(self.optimizer)
        self.runner = ModelRunner(self.built.chunks, self.parallel)
        self.runner.attach_optimizer(self.optimizer)
        self.objective = PolicyObjective(ObjectiveSettings.from_algorithm_config(host_cfg.trainer.algorithm))
        self.batch, self.rows = _dp_share(make_rl_batch(ROWS, PROMPT, RESPONSE, seed=5))

    def old_logprobs(self) -> torch.Tensor:
        """The current policy's logprobs of the whole batch (zeros outside the last stage, which has no loss)."""
        from skyrl_megatron.compute.runner import MicroBatching

        scored = self.runner.response_logprobs(
            self.batch["sequences"], self.batch["attention_mask"], RESPONSE, MicroBatching(micro_batch_size=3)
        )
        full = torch.zeros(ROWS, RESPONSE)
        if scored is not None:
            full[self.rows] = scored
        return full

    def train(self, old_logprobs: torch.Tensor, steps: int) -> list[dict]:
        from megatron.core import parallel_state as ps

        from skyrl_megatron.compute.runner import MicroBatching
        from skyrl_megatron.optim import optimizer_step

        response = {k: v for k, v in self.batch.items() if k not in ("sequences", "attention_mask")}
        response["action_log_probs"] = old_logprobs[self.rows]
        response["base_action_log_probs"] = response["action_log_probs"] - 0.1 * response["loss_mask"]
        history = []
        for _ in range(steps):
            metrics = self.runner.train_mini_batch(
                self.batch["sequences"],
                self.batch["attention_mask"],
                response,
                self.objective,
                MicroBatching(micro_batch_size=3),
                dp_group=ps.get_data_parallel_group(),
            )
            step = optimizer_step(self.optimizer, self.scheduler)
            assert not step.skipped
            history.append({**metrics, "grad_norm": step.grad_norm})
        return history

    def logits(self) -> torch.Tensor | None:
        """Full-vocabulary logits of a fixed token batch (on the last pipeline stage, else None)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        from skyrl_megatron.compute.schedule import forward_only

        positions = torch.arange(LOGIT_SEQ).unsqueeze(0)
        tokens = _logit_tokens()
        outputs = forward_only(
            self.built.chunks,
            [tokens[i : i + 1] for i in range(LOGIT_BATCH)],
            lambda model, micro_batch: model(micro_batch, positions, None),
            lambda output, micro_batch: gather_from_tensor_model_parallel_region(output).float(),
            seq_length=LOGIT_SEQ,
            micro_batch_size=1,
        )
        return torch.cat(outputs)[..., :256] if outputs else None

    def frozen_snapshot(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self._named_parameters() if not p.requires_grad}

    def _named_parameters(self):
        for index, chunk in enumerate(self.built.chunks):
            for name, param in chunk.named_parameters():
                yield f"{index}.{name}", param

    def exports(self, out_dir: Path) -> dict:
        """Merged HF weights (stream and save_hf_model) and the PEFT adapter directory."""
        import torch.distributed as dist

        from skyrl_megatron.checkpoint import save_hf_model
        from skyrl_megatron.weights import iter_hf_weights, iter_weight_buckets

        merged = {name: tensor.clone() for name, tensor in iter_hf_weights(self.built, device="cpu")}
        adapter_buckets = iter_weight_buckets(self.built, 4096, device="cpu", adapters_only=True)
        adapter_names = [name for bucket in adapter_buckets for name in bucket.names]
        save_hf_model(out_dir / "merged", self.built)
        save_hf_model(out_dir / "peft", self.built, adapters_only=True)
        first = dist.get_rank() == 0
        return {
            "merged": merged if first else None,
            "adapter_names": adapter_names,
            "merged_dir": str(out_dir / "merged"),
            "peft_dir": str(out_dir / "peft"),
        }


def _dp_share(batch: dict) -> tuple[dict, slice]:
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = slice(dp_rank * ROWS // dp, (dp_rank + 1) * ROWS // dp)
    return {k: v[rows] for k, v in batch.items()}, rows


def _train_and_export(
    hf_dir: str, layout: dict, out_dir: str, lora_type: str = "lora", checkpoint: str | None = None
) -> dict:
    """Three steps from the base model (with a checkpoint after the second when asked), then exports."""
    session = _Session(hf_dir, layout, _spec(lora_type))
    frozen = session.frozen_snapshot()
    old = session.old_logprobs()
    history = session.train(old, STEPS - 1 if checkpoint else STEPS)
    if checkpoint:
        from skyrl_megatron.checkpoint import save_checkpoint

        save_checkpoint(checkpoint, session.built.chunks, session.optimizer, session.scheduler, step=STEPS - 1)
        history += session.train(old, 1)
    trainable = [name for name, p in session._named_parameters() if p.requires_grad]
    after = session.frozen_snapshot()
    return {
        "history": history,
        "old_logprobs": old,
        "base_unchanged": frozen.keys() == after.keys() and all(torch.equal(frozen[k], after[k]) for k in frozen),
        "frozen_count": len(frozen),
        "non_adapter_trainable": [name for name in trainable if ".adapter." not in name],
        "logits": session.logits(),
        **session.exports(Path(out_dir)),
        "footprint": _footprint(session),
        "adam_state_bytes": _adam_state_bytes(session.optimizer),  # fp32: the main params are the params
    }


def _footprint(session: _Session):
    from skyrl_megatron.model.adapters.lora import measure_footprint

    return measure_footprint(session.built.chunks, bf16=session.built.config.bf16, distributed_optimizer=True)


def _resume(hf_dir: str, layout: dict, checkpoint: str, old_logprobs: torch.Tensor) -> list[dict]:
    """Load a LoRA checkpoint saved under another layout and take the next step."""
    from skyrl_megatron.checkpoint import load_checkpoint

    session = _Session(hf_dir, layout, _spec())
    frozen = session.frozen_snapshot()
    state = load_checkpoint(checkpoint, session.built.chunks, session.optimizer, session.scheduler)
    assert state.step == STEPS - 1
    assert all(torch.equal(frozen[k], v) for k, v in session.frozen_snapshot().items()), "loading touched the base"
    return session.train(old_logprobs, 1)


def _bf16_step(hf_dir: str) -> dict:
    """World-1 bf16: dtypes of the frozen base, the adapters and the optimizer's state after one step."""
    session = _Session(hf_dir, {}, _spec(), dtype="bf16")
    frozen = session.frozen_snapshot()
    session.train(session.old_logprobs(), 1)
    main_params = [param for _, param in _optimizer_states(session.optimizer)]
    params = dict(session._named_parameters())
    return {
        "frozen_dtypes": {p.dtype for p in frozen.values()},
        "adapter_dtypes": {p.dtype for p in params.values() if p.requires_grad},
        "base_unchanged": all(torch.equal(frozen[k], params[k].detach()) for k in frozen),
        "optimizer_bytes": _adam_state_bytes(session.optimizer) + sum(p.nbytes for p in main_params),
        "main_dtypes": {p.dtype for p in main_params},
        "footprint": _footprint(session),
    }


def _optimizer_states(optimizer):
    """(torch optimizer, main parameter) for every parameter this rank's Megatron optimizer steps."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in part.optimizer.param_groups:
            for param in group["params"]:
                yield part.optimizer, param


def _adam_state_bytes(optimizer) -> int:
    return sum(
        torch_optimizer.state[param]["exp_avg"].nbytes + torch_optimizer.state[param]["exp_avg_sq"].nbytes
        for torch_optimizer, param in _optimizer_states(optimizer)
    )


def _expert_tp_refused(hf_dir: str, layout: dict) -> str:
    """Building LoRA on experts split over expert-TP ranks fails with a clear error (the bridge's
    expert adapters would train with wrong gradients)."""
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, initialize_model_parallel

    parallel = ParallelConfig(**layout)
    initialize_model_parallel(parallel, seed=5)
    try:
        build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32", lora=_spec()))
    except LoraConfigError as exc:
        return str(exc)
    return "built"


def _through_cache(hf_dir: str, cache_root: str) -> dict:
    """Two LoRA builds through the conversion cache: the miss stores the base, the hit loads it."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.conversion.cache import CHECKPOINT_DIRNAME, ConversionCacheSettings
    from skyrl_megatron.parallel import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=5)
    spec = ModelSpec(hf_dir, dtype="fp32", lora=_spec(), cache=ConversionCacheSettings(root=cache_root))
    miss, hit = build_model(spec), build_model(spec)
    params = [{name: p.detach().clone() for name, p in built.chunks[0].named_parameters()} for built in (miss, hit)]
    return {
        "hits": (miss.load_report.hit, hit.load_report.hit),
        "identical": params[0].keys() == params[1].keys()
        and all(torch.equal(params[0][k], params[1][k]) for k in params[0]),
        "adapter_params": sum(".adapter." in name for name in params[1]),
        "cached_keys": list(load_tensors_metadata(str(Path(hit.load_report.entry) / CHECKPOINT_DIRNAME))),
    }


def _jobs(rank, world_size, jobs: dict) -> dict:
    """Several jobs of one world size in one spawn of ranks (start-up dominates a tiny model's run)."""
    from skyrl_megatron.parallel import init_distributed

    init_distributed("cpu")
    return {name: fn(*args) for name, (fn, args) in jobs.items()}


# ----------------------------------------------------------------------------------------------
# Fixtures: one spawn per world size / layout, shared by the tests
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def checkpoints(work) -> dict[str, str]:
    dirs = {}
    for family in ("qwen3", "qwen3_moe"):
        make_tiny_hf_model(family, work / family, seed=11)
        dirs[family] = str(work / family)
    return dirs


@pytest.fixture(scope="module")
def world1(checkpoints, work) -> dict:
    dense, moe = checkpoints["qwen3"], checkpoints["qwen3_moe"]
    jobs = {
        "lora": (_train_and_export, (dense, {}, str(work / "w1-lora"))),
        "canonical_lora": (_train_and_export, (dense, {}, str(work / "w1-canonical"), "canonical_lora")),
        "moe": (_train_and_export, (moe, {}, str(work / "w1-moe"))),
        "bf16": (_bf16_step, (dense,)),
        "cache": (_through_cache, (dense, str(work / "cache"))),
    }
    return run_on_ranks(_jobs, 1, jobs, timeout=600)


@pytest.fixture(scope="module")
def tp2(checkpoints, work) -> list[dict]:
    dense, layout = checkpoints["qwen3"], {"tensor": 2, "sequence_parallel": True}
    jobs = {
        "lora": (_train_and_export, (dense, layout, str(work / "tp2-lora"), "lora", str(work / "tp2-ckpt"))),
        "canonical_lora": (_train_and_export, (dense, layout, str(work / "tp2-canonical"), "canonical_lora")),
        "moe_expert_tp2": (_expert_tp_refused, (checkpoints["qwen3_moe"], layout)),
    }
    return run_on_ranks(_jobs, 2, jobs, timeout=600)


@pytest.fixture(scope="module")
def pp2(checkpoints, work, tp2) -> list[dict]:
    dense, layout = checkpoints["qwen3"], {"pipeline": 2}
    old = tp2[0]["lora"]["old_logprobs"]
    jobs = {
        "lora": (_train_and_export, (dense, layout, str(work / "pp2-lora"))),
        "resumed": (_resume, (dense, layout, str(work / "tp2-ckpt"), old)),
    }
    return run_on_ranks(_jobs, 2, jobs, timeout=600)


@pytest.fixture(scope="module")
def ep2(checkpoints, work) -> list[dict]:
    jobs = {"moe": (_train_and_export, (checkpoints["qwen3_moe"], {"expert": 2}, str(work / "ep2-moe")))}
    return run_on_ranks(_jobs, 2, jobs, timeout=600)


# ----------------------------------------------------------------------------------------------
# Hugging Face side
# ----------------------------------------------------------------------------------------------


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_logit_tokens()).logits.float()


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _assert_exports_reproduce(results: list[dict], job: str, hf_dir: str, name: str) -> None:
    """Merged export, PEFT adapter (in peft, where it can load it) and our engine's adapter sync give the
    trained Megatron model's logits in HF."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from skyrl_megatron.engines.hf_engine import HFEngine

    megatron = next(r[job]["logits"] for r in results if r[job]["logits"] is not None)  # the last stage's
    result = results[0][job]  # rank 0 keeps the exported tensors
    base = _hf_logits(_hf_model(hf_dir))
    moved = (megatron - base).abs().max().item()
    assert moved > 100 * LOGIT_ATOL, f"{name}: training moved the logits by only {moved:.1e}: a vacuous check"

    merged_model = _hf_model(result["merged_dir"])
    diff = (_hf_logits(merged_model) - megatron).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{name}: merged export is {diff:.1e} off the Megatron logits"
    on_disk = {}
    for path in Path(result["merged_dir"]).glob("*.safetensors"):
        on_disk.update(load_file(path))
    assert on_disk.keys() == result["merged"].keys()
    assert all(torch.equal(on_disk[k], result["merged"][k]) for k in on_disk), "save_hf_model != iter_hf_weights"

    assert set(result["adapter_names"]) == set(load_file(Path(result["peft_dir"]) / "adapter_model.safetensors"))
    if job != "moe" or _peft_converts_per_expert_adapters():
        # peft before 0.21 (skyrl 0.4's 0.18.1) leaves per-expert adapters out of transformers 5's fused experts
        peft_model = PeftModel.from_pretrained(_hf_model(hf_dir), result["peft_dir"]).eval()
        diff = (_hf_logits(peft_model) - megatron).abs().max().item()
        assert diff <= LOGIT_ATOL, f"{name}: PEFT adapter is {diff:.1e} off the Megatron logits"
    engine = HFEngine(hf_dir, seed=0, attn_implementation="eager")  # what adapter sync (weight_sync=adapters) feeds
    asyncio.run(engine.load_adapter(result["peft_dir"]))
    diff = (_hf_logits(engine.model) - megatron).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{name}: the HF engine's adapter sync is {diff:.1e} off the Megatron logits"


def _peft_converts_per_expert_adapters() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft.utils.transformers_weight_conversion") is not None


def _assert_same_footprint(results: list[dict], job: str, reference: dict) -> None:
    """Parameter counts as at world 1; this rank's optimizer bytes as its optimizer really holds (the
    distributed optimizer pads its shards: a few elements per rank)."""
    for rank_result in results:
        footprint = rank_result[job]["footprint"]
        assert footprint.trainable_params == reference["footprint"].trainable_params
        assert footprint.total_params == reference["footprint"].total_params
        assert abs(footprint.optimizer_bytes - rank_result[job]["adam_state_bytes"]) <= 8 * len(results)


def _assert_same_training(got: list[dict], want: list[dict], name: str) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        for metric in ("final_loss", "policy_loss", "policy_kl", "grad_norm"):
            assert g[metric] == pytest.approx(w[metric], rel=TRAIN_RTOL, abs=1e-8), (
                f"{name} step {step} {metric}: {g[metric]} vs world-1 {w[metric]}"
            )


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


def _ours(cfg):
    """The composed config as our workers read it (the host's own on skyrl-train 0.3.1)."""
    from skyrl_megatron.hosts import current

    return current().our_view(cfg)


def test_spec_maps_host_keys_onto_megatron_targets(compose):
    cfg = _ours(compose(
        "trainer.policy.model.lora.rank=8",
        "trainer.policy.model.lora.alpha=32",
        "trainer.policy.model.lora.target_modules=[q_proj,k_proj,v_proj,down_proj]",
        "trainer.policy.megatron_config.lora_config.lora_type=lora",
    ))
    spec = LoraSpec.from_host_config(cfg)
    assert (spec.rank, spec.alpha, spec.scale) == (8, 32.0, 4.0)
    assert spec.megatron_targets() == ["linear_qkv", "linear_fc2"]
    assert LoraSpec.from_host_config(_ours(compose())) is None  # the host's default rank 0: no LoRA

    assert _spec().megatron_targets() == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    canonical = LoraSpec(rank=2, lora_type="canonical_lora", target_modules=("q_proj", "v_proj", "linear_fc2"))
    assert canonical.megatron_targets() == ["linear_q", "linear_v", "linear_fc2"]
    excluded = LoraSpec(rank=2, exclude_modules=("o_proj", "down_proj"))
    assert excluded.megatron_targets() == ["linear_qkv", "linear_fc1"]
    with pytest.raises(LoraConfigError, match="fused linear_qkv"):
        LoraSpec(rank=2, target_modules=("q_proj", "v_proj"))  # k_proj would be adapted too
    with pytest.raises(LoraConfigError, match="canonical_lora adapts"):
        LoraSpec(rank=2, lora_type="canonical_lora", target_modules=("linear_qkv",))
    with pytest.raises(LoraConfigError, match="weight_sync"):
        LoraSpec(rank=2, weight_sync="vllm")


def test_config_validation_names_the_lora_key(compose):
    from skyrl_megatron.config import LoraSettings, MegatronWorkerConfig, ModelShape, check_lora

    def problems(cfg, shape=None, **megatron):
        cfg = _ours(cfg)
        mc = MegatronWorkerConfig.from_host_config(cfg, "policy")
        return check_lora(cfg, "policy", dataclasses.replace(mc, **megatron), shape)

    lora = "trainer.policy.model.lora.rank=8"
    (problem,) = problems(compose(lora, "trainer.policy.model.lora.target_modules=[q_proj]"))
    assert problem.key == "trainer.policy.model.lora" and "k_proj" in problem.message
    wrong_names = problems(compose(), lora_config=LoraSettings(lora_type="qlora", weight_sync="disk"))
    assert [p.key for p in wrong_names] == [
        "trainer.policy.megatron_config.lora_config.lora_type",
        "trainer.policy.megatron_config.lora_config.weight_sync",
    ]
    assert problems(compose(lora)) == []

    moe = ModelShape("qwen3_moe", num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=8)
    (problem,) = problems(compose(lora), moe, tensor_model_parallel_size=2)  # expert TP follows TP
    assert problem.key == "trainer.policy.megatron_config.expert_tensor_parallel_size"
    assert problems(compose(lora), moe, tensor_model_parallel_size=2, expert_tensor_parallel_size=1) == []
    attention_only = compose(lora, "trainer.policy.model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
    assert problems(attention_only, moe, tensor_model_parallel_size=2) == []


def test_adapter_sync_of_expert_lora_into_our_engine_passes_the_config_check(compose):
    """Our HF engine merges a synced adapter itself (engines/lora_merge.py), per-expert adapters onto
    transformers 5's fused experts included, whatever peft is installed: nothing to refuse."""
    from skyrl_megatron.config import LoraSettings, MegatronWorkerConfig, ModelShape, check_lora

    moe = ModelShape("qwen3_moe", num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=8)
    dense = ModelShape("qwen3", num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=None)

    def problems(shape, weight_sync="adapters"):
        cfg = _ours(compose("trainer.policy.model.lora.rank=8", "generator.engine=cpu"))
        mc = MegatronWorkerConfig.from_host_config(cfg, "policy")
        return check_lora(cfg, "policy", dataclasses.replace(mc, lora_config=LoraSettings(weight_sync=weight_sync)), shape)

    assert problems(moe) == [] and problems(dense) == [] and problems(moe, "merged") == []


def _random_adapter(model_dir: str, out: Path, seed: int, modules: tuple[str, ...], **config) -> Path:
    """A PEFT LoRA directory laid out as our export writes it (expert adapters per expert), with random A
    and B on every weight of `modules`; `config` overrides adapter_config.json's keys."""
    from safetensors.torch import save_file

    from skyrl_megatron.engines.checkpoint_names import checkpoint_named_tensors

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in checkpoint_named_tensors(_hf_model(model_dir)).items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in modules:
            out_features, in_features = weight.shape
            tensors[f"base_model.model.{module}.lora_A.weight"] = 0.1 * torch.randn(RANK, in_features, generator=generator)
            tensors[f"base_model.model.{module}.lora_B.weight"] = 0.1 * torch.randn(out_features, RANK, generator=generator)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(modules), "bias": "none",
                "use_dora": False, "use_rslora": False, "modules_to_save": None, "task_type": "CAUSAL_LM", **config}
    (out / "adapter_config.json").write_text(json.dumps(settings))
    return out


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS_AND_ATTENTION = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


def test_engine_adapter_load_replaces_the_previous_one(checkpoints, tmp_path):
    """A second adapter applies to the base, not on top of the first: weights only the first adapted
    (here the experts) go back to the base, bitwise; loading the first again gives the same weights."""
    from skyrl_megatron.engines.hf_engine import HFEngine

    moe = checkpoints["qwen3_moe"]
    first = _random_adapter(moe, tmp_path / "first", 1, EXPERTS_AND_ATTENTION)
    second = _random_adapter(moe, tmp_path / "second", 2, ATTENTION)
    engine, fresh = HFEngine(moe), HFEngine(moe)
    base = asyncio.run(engine.named_weights())

    asyncio.run(engine.load_adapter(str(first)))
    with_first = asyncio.run(engine.named_weights())
    experts = [name for name in base if ".experts." in name]
    assert experts and all(not torch.equal(with_first[name], base[name]) for name in experts)
    assert not torch.equal(_hf_logits(engine.model), _hf_logits(fresh.model))

    asyncio.run(engine.load_adapter(str(second)))
    asyncio.run(fresh.load_adapter(str(second)))
    held, wanted = asyncio.run(engine.named_weights()), asyncio.run(fresh.named_weights())
    assert all(torch.equal(held[name], wanted[name]) for name in wanted), "the second adapter stacked on the first"
    assert all(torch.equal(held[name], base[name]) for name in experts)

    asyncio.run(engine.load_adapter(str(first)))
    again = asyncio.run(engine.named_weights())
    assert all(torch.equal(again[name], with_first[name]) for name in with_first)


def test_engine_merge_matches_peft_on_a_dense_rslora_adapter(checkpoints, tmp_path):
    """The engine's own merge against peft's, on what every peft loads (dense, rsLoRA's alpha / sqrt(r))."""
    from peft import PeftModel

    from skyrl_megatron.engines.hf_engine import HFEngine

    dense = checkpoints["qwen3"]
    adapter = _random_adapter(dense, tmp_path / "rslora", 3, EXPERTS_AND_ATTENTION, use_rslora=True)
    engine = HFEngine(dense, attn_implementation="eager")
    asyncio.run(engine.load_adapter(str(adapter)))
    expected = _hf_logits(PeftModel.from_pretrained(_hf_model(dense), str(adapter)).eval())
    assert (expected - _hf_logits(_hf_model(dense))).abs().max() > 100 * LOGIT_ATOL  # the adapter matters
    assert (_hf_logits(engine.model) - expected).abs().max() <= LOGIT_ATOL


@pytest.mark.parametrize(
    "key, value",
    [("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "lora_only"), ("lora_bias", True),
     ("target_parameters", ["mlp.experts.gate_up_proj"]), ("alpha_pattern", {"q_proj": 16}),
     ("init_lora_weights", "pissa"), ("peft_type", "LOHA")],
)
def test_engine_refuses_an_adapter_it_cannot_merge_by_its_key(checkpoints, tmp_path, key, value):
    from skyrl_megatron.engines.hf_engine import HFEngine
    from skyrl_megatron.engines.lora_merge import AdapterError

    moe = checkpoints["qwen3_moe"]
    adapter = _random_adapter(moe, tmp_path / "adapter", 4, EXPERTS_AND_ATTENTION, **{key: value})
    engine = HFEngine(moe)
    before = asyncio.run(engine.weight_digests())
    with pytest.raises(AdapterError, match=f"adapter_config.json: {key}="):
        asyncio.run(engine.load_adapter(str(adapter)))
    assert asyncio.run(engine.weight_digests()) == before


def test_engine_refuses_adapters_the_model_or_config_does_not_name(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    from skyrl_megatron.engines.hf_engine import HFEngine
    from skyrl_megatron.engines.lora_merge import AdapterError

    moe = checkpoints["qwen3_moe"]
    engine = HFEngine(moe)
    before = asyncio.run(engine.weight_digests())
    untargeted = _random_adapter(moe, tmp_path / "untargeted", 5, EXPERTS_AND_ATTENTION, target_modules=list(ATTENTION))
    with pytest.raises(AdapterError, match=r"experts\.\d+\.\w+_proj, which target_modules"):
        asyncio.run(engine.load_adapter(str(untargeted)))
    missing = _random_adapter(moe, tmp_path / "missing", 5, EXPERTS_AND_ATTENTION)
    tensors = load_file(str(missing / "adapter_model.safetensors"))
    for factor in ("A", "B"):  # an expert the model does not have
        tensors[f"base_model.model.model.layers.0.mlp.experts.99.gate_proj.lora_{factor}.weight"] = tensors[
            f"base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_{factor}.weight"].clone()
    save_file(tensors, str(missing / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"experts\.99\.gate_proj\.weight, which this model does not have"):
        asyncio.run(engine.load_adapter(str(missing)))
    assert asyncio.run(engine.weight_digests()) == before


@pytest.mark.slow
@pytest.mark.parametrize("job", ["lora", "canonical_lora", "moe"])
def test_world1_trains_only_adapters_and_exports_reproduce_logits(world1, checkpoints, job):
    result = world1[0][job]
    assert result["base_unchanged"] and result["frozen_count"] > 0
    assert result["non_adapter_trainable"] == []
    losses = [step["final_loss"] for step in result["history"]]
    assert losses[0] != losses[-1], "the adapters did not train"
    _assert_exports_reproduce(world1, job, checkpoints["qwen3_moe" if job == "moe" else "qwen3"], f"world1-{job}")


@pytest.mark.slow
def test_footprint_counts_adapters_and_optimizer_bytes(world1, checkpoints):
    config = json.loads((Path(checkpoints["qwen3"]) / "config.json").read_text())
    hidden, ffn, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * config["head_dim"]
    attn_out = config["num_attention_heads"] * config["head_dim"]
    # r x (in + out) per adapted matrix: fused qkv, proj, fused gate/up, down
    per_layer = RANK * ((hidden + qkv) + (attn_out + hidden) + (hidden + 2 * ffn) + (ffn + hidden))
    base_params = sum(p.numel() for p in _hf_model(checkpoints["qwen3"]).parameters())

    footprint = world1[0]["lora"]["footprint"]
    _assert_same_footprint(world1, "lora", world1[0]["lora"])
    assert footprint.trainable_params == layers * per_layer
    assert footprint.total_params == base_params + footprint.trainable_params
    assert footprint.optimizer_bytes == 8 * footprint.trainable_params  # fp32: two Adam moments
    assert footprint.full_finetune_optimizer_bytes == 8 * footprint.total_params
    assert footprint.as_metrics()["lora/trainable_fraction"] < 0.1

    bf16 = world1[0]["bf16"]
    assert bf16["frozen_dtypes"] == {torch.bfloat16} and bf16["adapter_dtypes"] == {torch.bfloat16}
    assert bf16["main_dtypes"] == {torch.float32} and bf16["base_unchanged"]
    # measured after a step: fp32 main copies and two fp32 moments of the adapters, nothing else
    assert bf16["optimizer_bytes"] == bf16["footprint"].optimizer_bytes == 12 * footprint.trainable_params


@pytest.mark.slow
def test_conversion_cache_holds_the_base_only(world1):
    result = world1[0]["cache"]
    assert result["hits"] == (False, True)
    assert result["identical"] and result["adapter_params"] > 0  # same base, same seeded adapters
    assert result["cached_keys"] and not [key for key in result["cached_keys"] if ".adapter." in key]


@pytest.mark.slow
@pytest.mark.parametrize("job", ["lora", "canonical_lora"])
def test_tp2_sp_matches_world1(tp2, world1, checkpoints, job):
    reference = world1[0][job]
    for rank_result in tp2:
        result = rank_result[job]
        assert result["base_unchanged"] and result["non_adapter_trainable"] == []
        _assert_same_training(result["history"], reference["history"], f"tp2-{job}")
    _assert_same_footprint(tp2, job, reference)
    _assert_exports_reproduce(tp2, job, checkpoints["qwen3"], f"tp2-{job}")


@pytest.mark.slow
def test_expert_adapters_split_by_expert_tp_are_refused(tp2):
    for rank_result in tp2:
        assert "expert_tensor_parallel_size=1" in rank_result["moe_expert_tp2"]


@pytest.mark.slow
def test_pp2_matches_world1_and_resumes_a_tp2_checkpoint(pp2, tp2, world1, checkpoints):
    reference = world1[0]["lora"]
    for rank_result in pp2:
        result = rank_result["lora"]
        assert result["base_unchanged"] and result["non_adapter_trainable"] == []
        _assert_same_training(result["history"], reference["history"], "pp2")
    _assert_same_footprint(pp2, "lora", reference)
    _assert_exports_reproduce(pp2, "lora", checkpoints["qwen3"], "pp2")

    continuing = tp2[0]["lora"]["history"][-1]
    for rank_result in pp2:
        _assert_same_training(rank_result["resumed"], [continuing], "tp2 checkpoint resumed under pp2")


@pytest.mark.slow
def test_ep2_moe_matches_world1(ep2, world1, checkpoints):
    reference = world1[0]["moe"]
    for rank_result in ep2:
        result = rank_result["moe"]
        assert result["base_unchanged"] and result["non_adapter_trainable"] == []
        _assert_same_training(result["history"], reference["history"], "ep2-moe")
    _assert_same_footprint(ep2, "moe", reference)
    _assert_exports_reproduce(ep2, "moe", checkpoints["qwen3_moe"], "ep2-moe")
