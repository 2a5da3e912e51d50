"""`multi_tensor`: Megatron's no-TE/no-Apex optimizer ops on PyTorch's foreach kernels.

The ops must give bitwise Megatron's local ops' results (CPU) without reading a value on the host;
on a real model, one optimizer step with clipping must leave the same weights and Adam state, with a
number of host reads that no longer grows with the number of parameter tensors, none of them before
the update is queued.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron import multi_tensor
from skyrl_megatron.testing import run_on_ranks
from skyrl_megatron.testing.host_syncs import HostSyncProbe

NOOP = torch.zeros(1, dtype=torch.int)


def _grads(n: int = 40, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(int(torch.randint(1, 300, (1,), generator=g)), generator=g) * (i + 1) for i in range(n)]


def _local_l2_norm(tensor_lists):
    """megatron.core.utils.local_multi_tensor_l2_norm's arithmetic (it hard-codes device='cuda')."""
    norms = [torch.norm(t) for tensors in tensor_lists for t in tensors]
    return torch.tensor([float(torch.norm(torch.tensor(norms)))], dtype=torch.float)


def test_l2_norm_equals_megatrons_local_norm_bitwise_without_reading_the_host():
    grads = _grads()
    with HostSyncProbe() as probe:
        norm, per_tensor = multi_tensor.l2_norm(2048 * 32, NOOP, [grads], False)
    assert probe.found == []
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.equal(norm, _local_l2_norm([grads]))
    with HostSyncProbe() as probe:  # the probe sees the local op's reads: one per tensor, and the total
        _local_l2_norm([grads])
    assert len(probe.found) >= len(grads)


def test_l2_norm_over_several_devices_is_megatrons_host_side_norm(monkeypatch):
    from megatron.core import utils as megatron_utils

    calls = []
    monkeypatch.setattr(megatron_utils, "local_multi_tensor_l2_norm", lambda *a: calls.append(a) or ("local", None))
    grads = _grads(n=3)
    on_meta = torch.empty(4, device="meta")  # a second device, as with optimizer CPU offload
    assert multi_tensor.l2_norm(0, NOOP, [grads + [on_meta]], False) == ("local", None) and len(calls) == 1
    assert multi_tensor.l2_norm(0, NOOP, [grads], False)[0].device == NOOP.device and len(calls) == 1


def test_l2_norm_of_nothing_is_zero_on_the_flags_device():
    norm, _ = multi_tensor.l2_norm(0, NOOP, [[]], False)
    assert torch.equal(norm, torch.zeros(1)) and norm.device == NOOP.device


@pytest.mark.parametrize("factor", [0.37, 1.0, torch.tensor(0.25)], ids=["float", "one", "tensor"])
def test_scale_in_place_and_into_lower_precision_equals_the_local_op(factor):
    from megatron.core.utils import local_multi_tensor_scale

    grads, expected = _grads(seed=1), _grads(seed=1)
    with HostSyncProbe() as probe:
        multi_tensor.scale(0, NOOP, [grads, grads], factor)  # clipping scales the grads in place
    local_multi_tensor_scale(0, NOOP, [expected, expected], factor)
    assert probe.found == [] and all(torch.equal(a, b) for a, b in zip(grads, expected))

    main = _grads(seed=2)  # fp32 main params -> bf16 model params (Megatron's copy is a scale by 1.0)
    ours = [torch.empty_like(t, dtype=torch.bfloat16) for t in main]
    theirs = [torch.empty_like(t, dtype=torch.bfloat16) for t in main]
    multi_tensor.scale(0, NOOP, [main, ours], factor)
    local_multi_tensor_scale(0, NOOP, [main, theirs], factor)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_install_replaces_only_megatrons_local_ops(monkeypatch):
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    fused_kernel = object()  # stands for TE's or Apex's op, which must stay
    monkeypatch.setattr(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", fused_kernel)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", None)
    monkeypatch.setattr(megatron_optimizer, "multi_tensor_scale_impl", local_multi_tensor_scale)

    replaced = multi_tensor.install()
    assert sorted(replaced) == ["megatron.core.optimizer.clip_grads.l2_norm_impl",
                                "megatron.core.optimizer.clip_grads.multi_tensor_scale_tensor_impl",
                                "megatron.core.optimizer.optimizer.multi_tensor_scale_impl"]
    assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
    assert clip_grads.multi_tensor_scale_impl is fused_kernel
    assert clip_grads.multi_tensor_scale_tensor_impl is multi_tensor.scale  # the norm stays on the device
    assert megatron_optimizer.multi_tensor_scale_impl is multi_tensor.scale
    assert multi_tensor.install() == []  # idempotent


def test_a_norm_kept_on_the_device_stays_there_only_with_our_norm(monkeypatch):
    """TE's tensor-factor scale stays; with TE's or Apex's norm (not ours), no tensor scale is added."""
    from megatron.core.optimizer import clip_grads

    te_scale = object()
    monkeypatch.setattr(clip_grads, "l2_norm_impl", multi_tensor.l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", te_scale)
    assert "megatron.core.optimizer.clip_grads.multi_tensor_scale_tensor_impl" not in multi_tensor.install()
    assert clip_grads.multi_tensor_scale_tensor_impl is te_scale
    apex_norm = object()
    monkeypatch.setattr(clip_grads, "l2_norm_impl", apex_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", None)
    multi_tensor.install()
    assert clip_grads.multi_tensor_scale_tensor_impl is None


@pytest.mark.parametrize("factor", [0.25, 1.0])
def test_scale_by_a_device_factor_equals_the_float_factor(factor):
    generator = torch.Generator().manual_seed(2)
    grads = [torch.randn(7, 5, generator=generator), torch.randn(3, generator=generator)]
    by_float, by_tensor = [g.clone() for g in grads], [g.clone() for g in grads]
    multi_tensor.scale(2048, torch.zeros(1, dtype=torch.int), [by_float, by_float], factor)
    multi_tensor.scale(2048, torch.zeros(1, dtype=torch.int), [by_tensor, by_tensor], torch.tensor([factor]))
    assert all(torch.equal(a, b) for a, b in zip(by_float, by_tensor))


# ----------------------------------------------------------------------------------------------
# One clipped optimizer step on a real model (bf16, distributed optimizer, world 1)
# ----------------------------------------------------------------------------------------------


def _marked(step, found: list):
    from skyrl_megatron.testing.host_syncs import HostSync

    def marked(*args, **kwargs):
        found.append(HostSync("update", ""))
        return step(*args, **kwargs)

    return marked


def _step_both_ways(rank, world, hf_dir):
    from megatron.core.distributed import finalize_model_grads

    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.optim import OptimizerSettings, optimizer_step
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    host = {"lr": 1e-3, "weight_decay": 0.01, "max_grad_norm": 1e-3, "num_warmup_steps": 0, "scheduler": "constant"}
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0)

    def one_step():
        initialize_model_parallel(ParallelConfig(), seed=0)
        built = build_model(
            ModelSpec(hf_dir, dtype="bf16", transformer_overrides={"cross_entropy_loss_fusion": False},
                      wrap_with_ddp=True, ddp_config={"use_distributed_optimizer": True})
        )
        (model,) = built.chunks
        settings = OptimizerSettings.from_host_config(host, {}, num_training_steps=2, dtype="bf16")
        optimizer = settings.build_optimizer(built.chunks)
        scheduler = settings.build_scheduler(optimizer)
        model(tokens[:, :-1], positions[:, :-1], None, labels=tokens[:, 1:]).float().mean().backward()
        finalize_model_grads([model])
        adams = [inner.optimizer for inner in optimizer.chained_optimizers]
        from megatron.core.optimizer.optimizer import SEPARATE_GRAD_NORM_GROUPS

        for group in SEPARATE_GRAD_NORM_GROUPS:  # one read at the first step, cached for good: not this test's
            optimizer.has_grad_norm_group(group)
        with HostSyncProbe() as probe:
            for adam in adams:  # marks where the update is queued among the reads
                adam.step = _marked(adam.step, probe.found)
            result = optimizer_step(optimizer, scheduler)
        state = [v.clone() for inner in optimizer.chained_optimizers for s in inner.optimizer.state.values()
                 for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        # torch Adam's per-parameter step counters are host tensors (not fused/capturable): reading them
        # waits for nothing on a GPU, so they are left out
        reads = [s.what for s in probe.found if s.what == "update" or s.what in ("Tensor.item", "Tensor.__float__")
                 and not s.stack.rstrip().splitlines()[-2].endswith("in step_with_ready_grads")]
        return dict(grad_norm=result.grad_norm, skipped=result.skipped, reads=len(reads) - reads.count("update"),
                    reads_before_update=reads.index("update"),
                    params=[p.detach().clone() for p in model.parameters()], state=state,
                    tensors=sum(1 for _ in model.parameters()))

    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_scale

    def megatrons_local_ops():
        # Megatron's local ops, as without this module; its local scale stands for TE's tensor-factor scale,
        # so that both sides keep the norm on the device and clip by the same arithmetic
        clip_grads.multi_tensor_scale_tensor_impl = local_multi_tensor_scale
        return []

    saved_install = multi_tensor.install
    multi_tensor.install = megatrons_local_ops
    try:
        local = one_step()
    finally:
        multi_tensor.install = saved_install
        clip_grads.multi_tensor_scale_tensor_impl = None
    foreach = one_step()

    return dict(local=local, foreach=foreach, installed=clip_grads.l2_norm_impl is multi_tensor.l2_norm)


@pytest.mark.slow
def test_a_clipped_step_leaves_the_same_weights_and_reads_the_host_a_fixed_number_of_times(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=3))
    (report,) = run_on_ranks(_step_both_ways, 1, hf_dir, timeout=300)
    local, foreach = report["local"], report["foreach"]

    assert report["installed"]
    assert not local["skipped"] and not foreach["skipped"]
    assert local["grad_norm"] > 1e-3  # the clip (max_grad_norm 1e-3) scaled the gradients
    assert foreach["grad_norm"] == local["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(local["params"], foreach["params"]))
    assert len(local["state"]) == len(foreach["state"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(local["state"], foreach["state"]))
    # Megatron's local norm reads every gradient's norm on the host (once: the step clips by the norm of
    # its non-finite check); the foreach norm reads only the totals
    assert local["tensors"] <= local["reads"] < 2 * local["tensors"]
    assert foreach["reads"] <= 8 < local["tensors"]
    # the norm is read once the update is queued: a GPU does not drain before the clip and the update
    assert local["reads_before_update"] >= local["tensors"]
    assert foreach["reads_before_update"] == 0
