"""skyrl 0.4 as the host: the adapter, activation, the typed config with our keys, validation, the CLI.

Runs in `.venv-skyrl04` (skyrl[skyrl-train] 0.4.0, the real host), as `make test`'s second leg.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from skyrl_megatron.cli import compose_config
from skyrl_megatron.config import ConfigError, MegatronWorkerConfig
from skyrl_megatron.hosts import current
from skyrl_megatron.validation import validate_config

MC = "trainer.policy.megatron_config"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def base(tmp_path, hf_config_dir):
    return [
        "trainer.strategy=megatron",
        f"trainer.policy.model.path={hf_config_dir()}",
        f"{MC}.runtime=cpu",
        "trainer.logger=console",
        f"trainer.export_path={tmp_path}/export",
        f"trainer.ckpt_path={tmp_path}/ckpt",
    ]


def test_the_adapter_is_skyrl_0_4():
    host = current()
    assert host.release.label == "skyrl 0.4.x"
    assert host.megatron_worker_module == "skyrl.backends.skyrl_train.workers.megatron.megatron_worker"


_ACTIVATION_PROBE = textwrap.dedent(
    """
    import json, skyrl_megatron
    skyrl_megatron.activate()
    from skyrl.backends.skyrl_train.workers.megatron.megatron_worker import PolicyWorker, RefWorker, CriticWorker
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import PolicyWorker as FsdpPolicy
    from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase
    actor = PolicyWorker.__ray_actor_class__
    print(json.dumps({
        "megatron": [c.__ray_actor_class__.__module__ for c in (PolicyWorker, RefWorker, CriticWorker)],
        "on_host_base": issubclass(actor, PolicyWorkerBase),
        "fsdp": FsdpPolicy.__ray_actor_class__.__module__,
    }))
    """
)


def test_activation_gives_the_megatron_strategy_our_workers_and_leaves_fsdp_alone():
    out = subprocess.run([sys.executable, "-c", _ACTIVATION_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["megatron"] == ["skyrl_megatron.workers.policy", "skyrl_megatron.workers.ref", "skyrl_megatron.workers.critic"]
    assert report["on_host_base"] is True
    assert report["fsdp"] == "skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker"


def test_our_keys_have_their_0_3_1_names_and_defaults(base):
    cfg = compose_config(base)
    ours = yaml.safe_load((REPO / "config" / "megatron" / "policy.yaml").read_text())
    section = cfg.trainer.policy.megatron_config
    for key in ("runtime", "virtual_pipeline_model_parallel_size", "sequence_parallel", "fused_kernels",
                "checkpoint_cache_dir", "force_reconvert", "max_tokens_per_microbatch", "attention_kernel", "manual_gc", "forward_max_tokens_per_microbatch",
                "logits_chunk_mib"):
        expected = "cpu" if key == "runtime" else ours[key]
        assert getattr(section, key) == expected, key
    worker = MegatronWorkerConfig.from_host_config(current().our_view(cfg), "policy")
    assert dataclasses.asdict(worker.moe_config) == ours["moe_config"]
    assert cfg.trainer.critic.megatron_config.runtime == "auto"  # the critic has a section too
    # the host's own fields keep their types and defaults
    assert section.tensor_model_parallel_size == 1 and section.lora_config.merge_lora is True
    assert section.transformer_config_kwargs["recompute_granularity"] == "full"  # the host's default


def test_the_same_overrides_as_on_0_3_1_reach_our_worker_config(base):
    cfg = compose_config(base + [
        f"{MC}.tensor_model_parallel_size=2",
        f"{MC}.virtual_pipeline_model_parallel_size=null",
        f"{MC}.fused_kernels=[rope]",
        f"{MC}.attention_kernel=varlen",
        f"{MC}.max_tokens_per_microbatch=4096",
        f"{MC}.moe_config.token_dispatcher=allgather",
        f"{MC}.ddp_config.bucket_size=1000000",
        f"{MC}.lora_config.weight_sync=adapters",
        "trainer.remove_microbatch_padding=false",
    ])
    view = current().our_view(cfg)
    worker = MegatronWorkerConfig.from_host_config(view, "policy")
    assert worker.tensor_model_parallel_size == 2 and worker.fused_kernels == ["rope"]
    assert worker.max_tokens_per_microbatch == 4096 and worker.attention_kernel == "varlen"
    assert worker.moe_config.token_dispatcher == "allgather"
    assert worker.ddp_config["bucket_size"] == 1000000 and worker.ddp_config["use_distributed_optimizer"] is True
    assert worker.lora_config.weight_sync == "adapters"
    assert view.trainer.use_sample_packing is False  # the host's remove_microbatch_padding, under our name


def test_the_hosts_moe_and_lora_fields_keep_their_meaning(base):
    cfg = compose_config(base + [
        f"{MC}.moe_token_dispatcher_type=allgather",
        f"{MC}.moe_router_dtype=fp64",
        f"{MC}.moe_aux_loss_coeff=0.01",
        f"{MC}.moe_router_load_balancing_type=aux_loss",
        f"{MC}.freeze_moe_router=true",
        f"{MC}.lora_config.merge_lora=false",
    ])
    worker = MegatronWorkerConfig.from_host_config(current().our_view(cfg), "policy")
    moe = worker.moe_config
    assert (moe.token_dispatcher, moe.router_dtype, moe.aux_loss_coeff, moe.load_balancing_type, moe.freeze_router) == (
        "allgather", "fp64", 0.01, "aux_loss", True)
    assert worker.lora_config.weight_sync == "adapters"
    # our own key wins where both are set
    cfg = compose_config(base + [f"{MC}.moe_token_dispatcher_type=allgather", f"{MC}.moe_config.token_dispatcher=alltoall"])
    assert MegatronWorkerConfig.from_host_config(current().our_view(cfg), "policy").moe_config.token_dispatcher == "alltoall"


def test_the_hosts_async_checkpoint_keys_turn_on_ours(base):
    """skyrl 0.4's `async_dist_ckpt_save` is our `async_save`; its `async_save_prestage_to_cpu` is what ours
    always does (the training process copies the state to host memory), so it is taken and has no effect."""
    for extra in ([f"{MC}.async_dist_ckpt_save=true"], [f"{MC}.async_save=true"],
                  [f"{MC}.async_dist_ckpt_save=true", f"{MC}.async_save_prestage_to_cpu=true"]):
        cfg = compose_config(base + extra)
        validate_config(cfg)
        assert MegatronWorkerConfig.from_host_config(current().our_view(cfg), "policy").async_save is True
    assert MegatronWorkerConfig.from_host_config(current().our_view(compose_config(base)), "policy").async_save is False


def test_a_good_config_passes_ours_and_the_hosts_validation(base):
    validate_config(compose_config(base))


def test_a_typo_in_our_section_names_the_closest_key(base):
    with pytest.raises(ConfigError, match=r"trainer.policy.megatron_config.fused_kernel: unknown key. Fix: did you mean 'fused_kernels'\?"):
        compose_config(base + [f"{MC}.fused_kernel=[rope]"])


def test_bad_sizes_are_named_as_on_0_3_1(base):
    with pytest.raises(ConfigError, match=r"is not divisible by TP\*PP\*CP = 3\*1\*1"):
        validate_config(compose_config(base + [f"{MC}.tensor_model_parallel_size=3"]))
    with pytest.raises(ConfigError, match=r"ddp_config.grad_reduce_in_fp3: not a field of Megatron's DistributedDataParallelConfig"):
        validate_config(compose_config(base + [f"{MC}.ddp_config.grad_reduce_in_fp3=true"]))


def test_a_setting_of_the_hosts_own_backend_that_we_lack_is_refused_by_name(base):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(base + [f"{MC}.fp8=e4m3", f"{MC}.mtp_num_layers=1"]))
    message = str(err.value)
    assert "trainer.policy.megatron_config.fp8: 'e4m3': a setting of skyrl 0.4.x's built-in Megatron backend" in message
    assert "trainer.policy.megatron_config.mtp_num_layers" in message
    assert "python -m skyrl.train.entrypoints.main_base" in message


def test_the_hosts_own_checks_run_and_read_as_ours(base):
    with pytest.raises(ConfigError, match=r"\(host check\): .*WANDB_API_KEY"):
        validate_config(compose_config([a for a in base if a != "trainer.logger=console"] + ["trainer.logger=wandb"]))


def test_engine_settings_are_named_as_skyrl_0_4_spells_them(base):
    """Our checks read 0.3.1's flat generator keys; a 0.4 user is told the key under inference_engine."""
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(base + ["generator.engine=cpu", "generator.inference_engine.weight_sync_backend=nccl"]))
    message = str(error.value)
    assert ("generator.inference_engine.weight_sync_backend: is 'nccl' but generator.engine=cpu needs 'gloo'" in message
            and "Fix: set generator.inference_engine.weight_sync_backend=gloo." in message), message


def test_the_packing_flag_is_named_as_skyrl_0_4_spells_it(base):
    """Context parallelism needs packing; on 0.4 that is remove_microbatch_padding (use_sample_packing is only an alias)."""
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(base + [f"{MC}.context_parallel_size=2", "trainer.remove_microbatch_padding=false"]))
    message = str(error.value)
    assert "Fix: set trainer.remove_microbatch_padding=true or context_parallel_size=1." in message, message
    assert "use_sample_packing" not in message
    with pytest.raises(ConfigError) as error:  # one GPU: only the sizes are left to fix
        validate_config(compose_config(base + [f"{MC}.context_parallel_size=2", "trainer.remove_microbatch_padding=true"]))
    assert "needs sample packing" not in str(error.value) and "TP*PP*CP = 1*1*2" in str(error.value), str(error.value)


def test_the_cli_reports_a_bad_key_and_exits_2(tmp_path, hf_config_dir):
    out = subprocess.run(
        [sys.executable, "-m", "skyrl_megatron.cli", "trainer.strategy=megatron",
         f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.tensor_model_paralel_size=2"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "skyrl-megatron: invalid skyrl-megatron config: trainer.policy.megatron_config.tensor_model_paralel_size: unknown key. Fix: did you mean 'tensor_model_parallel_size'?" in out.stderr
    assert not (tmp_path / "ckpts").exists()


def test_the_hosts_router_replay_is_our_r2(base):
    cfg = compose_config(base + [f"{MC}.moe_enable_routing_replay=true"])
    assert MegatronWorkerConfig.from_host_config(current().our_view(cfg), "policy").moe_config.routing_replay == "r2"


def test_a_colocated_gpu_engine_is_refused_before_ray_with_the_key(base):
    """Sharing a GPU with the trainers needs 0.3.1's CUDA IPC sender; on 0.4 our engine takes its own GPU."""
    with pytest.raises(ConfigError, match=r"trainer.placement.colocate_all: generator.engine=gpu shares a GPU .* only on skyrl-train 0.3.1.*Fix: set trainer.placement.colocate_all=false"):
        validate_config(compose_config(base + ["generator.engine=gpu", "generator.inference_engine.weight_sync_backend=nccl",
                                               "trainer.placement.colocate_all=true"]))


def test_the_same_command_line_works_on_both_hosts(base):
    """0.3.1's flat engine keys are accepted under their 0.4 names: one command serves both hosts."""
    cfg = compose_config(base + ["generator.weight_sync_backend=gloo", "generator.num_inference_engines=2",
                                 "generator.inference_engine_tensor_parallel_size=1", "generator.model_dtype=float32"])
    engine = cfg.generator.inference_engine
    assert (engine.weight_sync_backend, engine.num_engines, engine.tensor_parallel_size, engine.model_dtype) == \
        ("gloo", 2, 1, "float32")


def test_skyrls_router_start_can_read_the_prefill_decode_flag_of_vllm_routers_args():
    """skyrl 0.4.0's `VLLMRouter.start` reads `RouterArgs.pd_disaggregation`, which vllm-router 0.1.17 lacks
    (AttributeError at the first run with vLLM servers); the adapter's fixes give it, reading False."""
    import inspect

    from skyrl.backends.skyrl_train.inference_servers.vllm_router import VLLMRouter
    from vllm_router.router_args import RouterArgs

    from skyrl_megatron.hosts import current

    current().apply_compat_fixes()
    args = RouterArgs(worker_urls=["http://127.0.0.1:1"])
    assert "pd_disaggregation" in inspect.getsource(VLLMRouter.start)  # gone upstream: drop the fix
    assert args.pd_disaggregation is False and args.vllm_pd_disaggregation is False
