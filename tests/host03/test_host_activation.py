"""`activate()` routes trainer.strategy=megatron to our workers through the host's own code path."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import pytest

# Runs the host's real BasePPOExp._setup_trainer (through a subclass, as users write them) up to the
# point where it has imported the worker classes for the strategy, then reports which classes it got.
_PROBE = textwrap.dedent(
    """
    import json, sys, tempfile
    from omegaconf import OmegaConf
    {activate}
    from skyrl_train.entrypoints.main_base import BasePPOExp

    class Captured(Exception):
        pass

    class UserExp(BasePPOExp):
        def __init__(self, cfg):  # skip tokenizer/dataset loading: only worker selection is probed
            self.cfg = cfg

        def get_tracker(self):  # the host calls this right after importing the worker classes
            frame = sys._getframe(1)
            found = {{}}
            for name in ("PolicyWorker", "CriticWorker", "RefWorker"):
                actor_class = frame.f_locals[name]
                # the host's worker modules export Ray actor classes; report the user class inside
                cls = actor_class.__ray_metadata__.modified_class.__mro__[1]
                found[name] = f"{{cls.__module__}}.{{cls.__qualname__}}"
            raise Captured(found)

    tmp = tempfile.mkdtemp()
    cfg = OmegaConf.create({{"trainer": {{"strategy": "{strategy}", "export_path": tmp, "ckpt_path": tmp}}}})
    try:
        UserExp(cfg)._setup_trainer()
    except Captured as found:
        print(json.dumps(found.args[0]))
    """
)


def _probe(strategy: str, activate: bool) -> dict:
    code = _PROBE.format(strategy=strategy, activate="import skyrl_megatron; skyrl_megatron.activate()" if activate else "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_megatron_strategy_gets_our_workers_in_a_fresh_process():
    classes = _probe("megatron", activate=True)
    assert classes == {
        "PolicyWorker": "skyrl_megatron.workers.policy.MegatronPolicyWorker",
        "CriticWorker": "skyrl_megatron.workers.critic.MegatronCriticWorker",
        "RefWorker": "skyrl_megatron.workers.ref.MegatronRefWorker",
    }


def test_fsdp2_strategy_still_gets_the_hosts_workers():
    classes = _probe("fsdp2", activate=True)
    assert classes == {
        "PolicyWorker": "skyrl_train.workers.fsdp.fsdp_worker.FSDPPolicyWorkerBase",
        "CriticWorker": "skyrl_train.workers.fsdp.fsdp_worker.FSDPCriticWorkerBase",
        "RefWorker": "skyrl_train.workers.fsdp.fsdp_worker.FSDPRefWorkerBase",
    }


def test_without_activation_the_host_cannot_import_its_own_megatron_path():
    """Sanity check of the probe: the host's built-in Megatron module fails on megatron-core 0.19."""
    code = _PROBE.format(strategy="megatron", activate="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "megatron" in out.stderr


def test_entry_point_group_declares_megatron():
    eps = importlib.metadata.entry_points(group="skyrl_train.strategies")
    (ep,) = [ep for ep in eps if ep.name == "megatron"]
    spec = ep.load()()
    assert spec["policy"] == "skyrl_megatron.workers:PolicyWorker"
    assert spec["strategy"] == "megatron"


@pytest.mark.slow
def test_activation_reaches_ray_worker_processes():
    """Ray tasks run in fresh worker processes: the setup hook must activate there too, and the host's
    batches cross to them and back."""
    code = textwrap.dedent(
        """
        import json, ray, skyrl_megatron
        skyrl_megatron.activate()
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

        import torch
        from skyrl_train.training_batch import TensorBatch, TrainingInputBatch

        @ray.remote
        def which():
            import os
            from skyrl_train.workers.megatron.megatron_worker import MegatronPolicyWorker
            return MegatronPolicyWorker.__module__, os.environ.get("SKYRL_MEGATRON_ACTIVE")

        @ray.remote
        def score(batch):  # a worker's side of a dispatch: the batch in, an output batch back
            from skyrl_train.training_batch import TensorBatch, TrainingOutputBatch
            output = TrainingOutputBatch({"output": batch["sequences"].float() * batch["loss_mask"]})
            output.metadata = {"rows": len(batch), "got": type(batch).__name__}
            return output, TensorBatch.__reduce__.__module__

        generator = torch.Generator().manual_seed(0)
        batch = TrainingInputBatch({
            "sequences": torch.randint(0, 1000, (4, 4096), generator=generator),
            "loss_mask": torch.rand(4, 4096, generator=generator).bfloat16(),
        })
        batch.metadata = {"response_length": 4096}
        output, worker_reduce = ray.get(score.remote(batch))
        expected = batch["sequences"].float() * batch["loss_mask"]
        print(json.dumps({
            "worker": ray.get(which.remote()),
            "driver_reduce": TensorBatch.__reduce__.__module__,
            "worker_reduce": worker_reduce,
            "output": [type(output).__name__, output.metadata, torch.equal(output["output"], expected)],
        }))
        ray.shutdown()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "worker": ["skyrl_megatron.workers.policy", "1"],
        # batches cross processes through our reduction on both sides (hosts/batch_pickling.py)
        "driver_reduce": "skyrl_megatron.hosts.batch_pickling",
        "worker_reduce": "skyrl_megatron.hosts.batch_pickling",
        "output": ["TrainingOutputBatch", {"rows": 4, "got": "TrainingInputBatch"}, True],
    }


_COMPAT_PROBE = textwrap.dedent(
    """
    import json, types
    import skyrl_megatron; skyrl_megatron.activate()
    from skyrl_megatron.testing import make_tiny_tokenizer
    import skyrl_train.distributed.utils as host_distributed_utils
    import skyrl_train.entrypoints.main_base as main_base
    from skyrl_megatron.hosts.skyrl_train_0_3 import standalone_process_group

    tokenizer = make_tiny_tokenizer()
    chat = [{"role": "user", "content": "hi"}]
    # a function living in a host module (as SkyRLGymGenerator and PromptDataset do)
    host_module = types.ModuleType("skyrl_train.generators.probe")
    exec("def tokenize(tok, chat):\\n    return tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)",
         host_module.__dict__)
    print(json.dumps({
        "host_call": type(host_module.tokenize(tokenizer, chat)).__name__,
        "our_call": type(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)).__name__,
        "host_asked_for_dict": type(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)).__name__,
        "process_group_fixed": host_distributed_utils.init_custom_process_group is standalone_process_group,
        "engine_factory_routed": getattr(main_base.create_ray_wrapped_inference_engines_from_config,
                                         "_skyrl_megatron_routed", False),
    }))
    """
)


def _run_probe(code: str) -> dict:
    """Run `code` in a fresh interpreter; its last stdout line is a JSON report."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_compat_fixes_for_the_pinned_host_are_in_place_after_activation():
    """transformers-5 chat templates for host callers only; the torch>=2.10 process-group fix; engine routing."""
    assert _run_probe(_COMPAT_PROBE) == {
        "host_call": "list",
        "our_call": "BatchEncoding",
        "host_asked_for_dict": "BatchEncoding",
        "process_group_fixed": True,
        "engine_factory_routed": True,
    }


_IMPORTED_FIRST_PROBE = textwrap.dedent(
    """
    import json
    import skyrl_train.distributed.utils as host_distributed_utils
    import skyrl_train.training_batch as training_batch
    import skyrl_megatron; skyrl_megatron.activate()
    from skyrl_megatron.hosts.skyrl_train_0_3 import standalone_process_group

    print(json.dumps({
        "process_group_fixed": host_distributed_utils.init_custom_process_group is standalone_process_group,
        "batches_pickled_once": training_batch.TensorBatch.__reduce__.__module__,
    }))
    """
)


def test_host_modules_imported_before_activation_are_fixed_by_it():
    assert _run_probe(_IMPORTED_FIRST_PROBE) == {
        "process_group_fixed": True,
        "batches_pickled_once": "skyrl_megatron.hosts.batch_pickling",
    }


_FSDP2_PROBE = textwrap.dedent(
    """
    import json, tempfile
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM, Qwen3Config
    import skyrl_megatron
    skyrl_megatron.activate()
    from skyrl_train.distributed import fsdp_strategy, fsdp_utils

    def tiny():
        config = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=16, vocab_size=64)
        return AutoModelForCausalLM.from_config(config)

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    found = {"no_split_type": type(tiny()._no_split_modules).__name__}
    try:
        fsdp_utils.apply_fsdp2.__wrapped__(tiny(), {"mesh": mesh}, {})  # the host's own function
        found["host_unfixed"] = "ok"
    except TypeError as error:
        found["host_unfixed"] = str(error)
    model = tiny()
    fsdp_strategy.apply_fsdp2(model, {"mesh": mesh}, {})  # what the host's FSDP2 strategy calls
    found["sharded_layers"] = sum(isinstance(layer, FSDPModule) for layer in model.model.layers)
    found["root_sharded"] = isinstance(model, FSDPModule)
    dist.destroy_process_group()
    print(json.dumps(found))
    """
)


def test_hosts_fsdp2_strategy_shards_transformers5_models_after_activation():
    """transformers 5 gives every model a *set* of no-split classes; the host's FSDP2 wrap indexed it."""
    assert _run_probe(_FSDP2_PROBE) == {
        "no_split_type": "set",
        "host_unfixed": "'set' object is not subscriptable",
        "sharded_layers": 2,
        "root_sharded": True,
    }


_LIGHT_ACTIVATION_PROBE = textwrap.dedent(
    """
    import json, sys
    import skyrl_megatron; skyrl_megatron.activate()
    heavy = ("torch", "transformers", "peft", "skyrl_train.distributed.fsdp_utils", "skyrl_train.distributed.utils")
    print(json.dumps(sorted(name for name in heavy if name in sys.modules)))
    """
)


def test_activation_imports_nothing_heavy():
    """Activation runs in every Ray worker process's set-up hook: the host fixes wait for the host's own
    imports (it cost each process about 7 s of CPU when they imported torch, transformers and peft)."""
    assert _run_probe(_LIGHT_ACTIVATION_PROBE) == []
