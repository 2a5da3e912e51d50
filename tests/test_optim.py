"""Optimizer and LR schedule from the host's optimizer config; the skip-on-non-finite optimizer step.

The schedules must give the learning rate transformers' `get_scheduler` gives (what the host's FSDP
backend uses), Adam must run with the configured betas, and a NaN gradient must leave the weights,
the optimizer state and the schedule untouched.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from skyrl_megatron.optim import SCHEDULER_DECAY_STYLES, OptimizerSettings, OptimizerSettingsError
from skyrl_megatron.testing import run_on_ranks

HOST = {
    "lr": 1e-3,
    "adam_betas": [0.9, 0.999],
    "weight_decay": 1e-2,
    "max_grad_norm": 1.0,
    "num_warmup_steps": 3,
    "scheduler": "constant_with_warmup",
}


def _settings(steps: int = 10, dtype: str = "fp32", kwargs=None, **host) -> OptimizerSettings:
    return OptimizerSettings.from_host_config({**HOST, **host}, kwargs or {}, num_training_steps=steps, dtype=dtype)


def _megatron_lrs(settings: OptimizerSettings, steps: int) -> list[float]:
    """The LR of each optimizer step 0..steps-1 (the scheduler advances after each step)."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=settings.config.lr)
    scheduler = settings.build_scheduler(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return lrs


def _transformers_lrs(name: str, lr: float, warmup: int, steps: int, **specific) -> list[float]:
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = get_scheduler(
        name, optimizer, num_warmup_steps=warmup, num_training_steps=steps, scheduler_specific_kwargs=specific
    )
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("name", sorted(SCHEDULER_DECAY_STYLES))
def test_every_host_scheduler_gives_transformers_learning_rates(name):
    specific = {"min_lr": 1e-4} if name == "cosine_with_min_lr" else {}
    settings = _settings(steps=12, scheduler=name, **specific)
    megatron = _megatron_lrs(settings, 12)
    expected = _transformers_lrs(name, HOST["lr"], HOST["num_warmup_steps"], 12, **specific)
    assert megatron == pytest.approx(expected, rel=1e-12, abs=1e-15)
    if name != "constant":
        assert megatron[0] == 0.0 and megatron[3] == pytest.approx(1e-3)  # warmup from 0, then the peak


def test_cosine_and_linear_decay_values():
    # lr 1, 2 warmup steps, 6 steps: warmup 0, 1/2; decay over steps 2..6
    cosine = _megatron_lrs(_settings(steps=6, lr=1.0, num_warmup_steps=2, scheduler="cosine"), 6)
    linear = _megatron_lrs(_settings(steps=6, lr=1.0, num_warmup_steps=2, scheduler="linear"), 6)
    decay = [(step - 2) / 4 for step in range(2, 6)]
    assert cosine == pytest.approx([0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * r)) for r in decay])
    assert linear == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])
    floored_settings = _settings(steps=6, lr=1.0, num_warmup_steps=2, scheduler="cosine_with_min_lr", min_lr=0.2)
    floored = _megatron_lrs(floored_settings, 6)
    assert floored[4] == pytest.approx(0.2 + 0.8 * 0.5) and min(floored[2:]) >= 0.2


def test_host_values_and_overrides_reach_the_optimizer_config():
    config = _settings(adam_betas=[0.8, 0.95], weight_decay=0.05, max_grad_norm=2.0).config
    assert (config.lr, config.adam_beta1, config.adam_beta2) == (1e-3, 0.8, 0.95)
    assert (config.weight_decay, config.clip_grad, config.min_lr) == (0.05, 2.0, 0.0)
    assert not config.bf16 and config.params_dtype == torch.float32

    overridden = _settings(kwargs={"lr": 3e-4, "adam_beta2": 0.98, "clip_grad": 0.0, "min_lr": 1e-5}).config
    assert (overridden.lr, overridden.adam_beta2, overridden.clip_grad, overridden.min_lr) == (3e-4, 0.98, 0.0, 1e-5)

    bf16 = _settings(dtype="bf16").config
    assert bf16.bf16 and bf16.params_dtype == torch.bfloat16 and bf16.main_params_dtype == torch.float32
    assert _settings(max_grad_norm=None).config.clip_grad == 0.0  # null: no clipping


@pytest.mark.parametrize(
    "change, message",
    [
        ({"scheduler": "polynomial"}, r"scheduler='polynomial' is not supported; use one of \['constant'"),
        ({"scheduler": "cosine_with_min_lr"}, "needs a floor: set optimizer_config.min_lr"),
        ({"scheduler": "cosine", "num_warmup_steps": 10}, "10 optimizer step.* num_warmup_steps=10"),
        ({"adam_betas": [0.9]}, r"adam_betas must be two numbers in \[0, 1\)"),
        ({"lr": None}, "optimizer_config.lr is required"),
    ],
)
def test_bad_host_config_names_the_key(change, message):
    with pytest.raises(OptimizerSettingsError, match=message):
        _settings(**change)


def test_bad_overrides_and_dtype_are_rejected():
    with pytest.raises(OptimizerSettingsError, match=r"unknown OptimizerConfig field\(s\) \['adam_beta3'\]"):
        _settings(kwargs={"adam_beta3": 0.5})
    with pytest.raises(OptimizerSettingsError, match="model dtype 'fp16'"):
        _settings(dtype="fp16")


# ----------------------------------------------------------------------------------------------
# On a real model (bf16, distributed optimizer, world 1)
# ----------------------------------------------------------------------------------------------


def _build_bf16_ddp_model(hf_dir, grad_reduce_in_fp32: bool = False):
    from skyrl_megatron.model.build import ModelSpec, build_model

    # Megatron's unfused cross-entropy: its fused one is torch.compile'd, and on CPU a fresh process
    # spends ~20 s probing the compiler before the first step (the loss is only a source of gradients)
    return build_model(
        ModelSpec(hf_dir, dtype="bf16", transformer_overrides={"cross_entropy_loss_fusion": False},
                  wrap_with_ddp=True,
                  ddp_config={"use_distributed_optimizer": True, "grad_reduce_in_fp32": grad_reduce_in_fp32})
    )


def _adam_and_skip(rank, world, hf_dir):
    from megatron.core.distributed import finalize_model_grads

    from skyrl_megatron.optim import optimizer_step
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(), seed=0)
    built = _build_bf16_ddp_model(hf_dir)
    (model,) = built.chunks
    host = {**HOST, "adam_betas": [0.8, 0.95], "num_warmup_steps": 0, "max_grad_norm": 0.0, "scheduler": "linear"}
    settings = OptimizerSettings.from_host_config(host, {}, num_training_steps=4, dtype="bf16")
    optimizer = settings.build_optimizer(built.chunks)
    scheduler = settings.build_scheduler(optimizer)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0)

    def backward(poison: bool):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(tokens[:, :-1], positions[:, :-1], None, labels=tokens[:, 1:]).float().mean().backward()
        finalize_model_grads([model])
        if poison:
            next(model.parameters()).main_grad.view(-1)[0] = float("nan")

    def snapshot():
        params = [p.detach().clone() for p in model.parameters()]
        adam = [
            {k: v.clone() for k, v in inner.optimizer.state[p].items()}
            for inner in optimizer.chained_optimizers
            for group in inner.optimizer.param_groups
            for p in group["params"]
        ]
        return params, adam

    inner_groups = [g for inner in optimizer.chained_optimizers for g in inner.optimizer.param_groups]
    report = {
        "betas": {tuple(g["betas"]) for g in inner_groups},
        "model_dtypes": {p.dtype for p in model.parameters()},
        "main_dtypes": {p.dtype for g in inner_groups for p in g["params"]},
        "fused": {(g["fused"], g["foreach"]) for g in inner_groups},  # torch's fused Adam kernel, not foreach
    }

    backward(poison=False)
    first = optimizer_step(optimizer, scheduler)
    # one Adam step from zero state: m = (1 - b1) g, v = (1 - b2) g^2 on the fp32 main grads
    moments_ok = []
    for inner in optimizer.chained_optimizers:
        for group in inner.optimizer.param_groups:
            for main_param in group["params"]:
                state, grad = inner.optimizer.state[main_param], main_param.grad
                moments_ok.append(
                    torch.allclose(state["exp_avg"], (1 - 0.8) * grad, rtol=1e-6, atol=0)
                    and torch.allclose(state["exp_avg_sq"], (1 - 0.95) * grad * grad, rtol=1e-6, atol=0)
                )
    report["moments_ok"] = moments_ok
    report["first"] = first

    params_before, adam_before = snapshot()
    backward(poison=True)
    report["poisoned"] = optimizer_step(optimizer, scheduler)
    params_after, adam_after = snapshot()
    report["params_untouched"] = all(torch.equal(a, b) for a, b in zip(params_before, params_after))
    report["adam_untouched"] = all(
        all(torch.equal(before[k], after[k]) for k in before) for before, after in zip(adam_before, adam_after)
    )
    report["steps_after_skip"] = scheduler.num_steps

    backward(poison=False)
    report["recovered"] = optimizer_step(optimizer, scheduler)
    report["params_finite"] = all(torch.isfinite(p).all().item() for p in model.parameters())
    report["steps_at_end"] = scheduler.num_steps
    return report


@pytest.mark.slow
def test_adam_betas_bf16_main_params_and_skipped_steps_on_a_model(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=1))
    (report,) = run_on_ranks(_adam_and_skip, 1, hf_dir, timeout=300)

    assert report["betas"] == {(0.8, 0.95)}
    assert report["model_dtypes"] == {torch.bfloat16} and report["main_dtypes"] == {torch.float32}
    assert report["fused"] == {(True, False)}
    assert report["moments_ok"] and all(report["moments_ok"])
    first, poisoned, recovered = report["first"], report["poisoned"], report["recovered"]
    assert not first.skipped and math.isfinite(first.grad_norm) and first.lr == pytest.approx(1e-3)

    assert poisoned.skipped and math.isnan(poisoned.grad_norm)
    assert report["params_untouched"] and report["adam_untouched"]
    assert report["steps_after_skip"] == 1  # the schedule did not advance
    assert poisoned.lr == pytest.approx(0.75e-3)  # linear decay over 4 steps, after one step

    assert not recovered.skipped and recovered.lr == pytest.approx(0.75e-3)
    assert report["params_finite"] and report["steps_at_end"] == 2


def _one_norm_pass_against_megatrons_step(rank, world, hf_dir, max_grad_norm, grad_reduce_in_fp32):
    """Two builds of one MoE model, EP2 (a chain of a dense and an expert optimizer, the dense one distributed
    over DP2): ours steps one (with our prebuilt-view shard copies, `optimizer_prebuilt.py`; with an fp32 gradient
    buffer the norm reads runs of it), Megatron's own `step()` the other (with Megatron's per-parameter copies and
    norms), on the same batches."""
    from unittest import mock

    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import clip_grads

    from skyrl_megatron.optim import optimizer_step
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(expert=2), seed=0)
    host = {**HOST, "num_warmup_steps": 0, "max_grad_norm": max_grad_norm, "scheduler": "constant"}
    sides = []
    for side in ("ours", "megatron"):
        built = _build_bf16_ddp_model(hf_dir, grad_reduce_in_fp32)
        settings = OptimizerSettings.from_host_config(host, {}, num_training_steps=4, dtype="bf16")
        with mock.patch("skyrl_megatron.optimizer_prebuilt.install", return_value="Megatron's") if side == "megatron" \
                else contextlib.nullcontext():
            optimizer = settings.build_optimizer(built.chunks)
        sides.append((built.chunks[0], optimizer, settings.build_scheduler(optimizer)))
    initial = [p.detach().clone() for p in sides[0][0].parameters()]
    generator = torch.Generator().manual_seed(rank)
    positions = torch.arange(15).unsqueeze(0)
    norms_reduced = []
    reduce_norm = clip_grads.get_grad_norm_fp32

    def counted(*args, **kwargs):
        norms_reduced.append(1)
        return reduce_norm(*args, **kwargs)

    report = {"ours": [], "megatron": [], "norm_reductions": []}
    for _ in range(2):
        tokens = torch.randint(0, 256, (2, 16), generator=generator)
        for (model, optimizer, scheduler), side in zip(sides, ("ours", "megatron")):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
            finalize_model_grads([model])
            if side == "ours":
                norms_reduced.clear()
                from skyrl_megatron import optim

                with mock.patch("megatron.core.optimizer.optimizer.get_grad_norm_fp32", counted), \
                        mock.patch.object(optim, "_step_then_read", wraps=optim._step_then_read) as on_the_device:
                    result = optimizer_step(optimizer, scheduler)
                report["norm_reductions"].append(len(norms_reduced))
                report["steps_on_the_device"] = report.get("steps_on_the_device", 0) + on_the_device.call_count
                report["ours"].append((result.grad_norm, result.skipped))
                parts = [part for part in optimizer.chained_optimizers if not getattr(part, "is_stub_optimizer", False)]
                report["norm_tensors"] = [len(part.get_grads_for_grad_norm()) for part in parts]
                report["norm_grads"] = [sum(p.grad is not None for p in part.get_parameters()) for part in parts]
            else:
                success, grad_norm, _ = optimizer.step()
                scheduler.step(increment=1)
                report["megatron"].append((grad_norm, not success))
    (ours, _, _), (megatrons, _, _) = sides
    report["params_equal"] = all(torch.equal(a, b) for a, b in zip(ours.parameters(), megatrons.parameters()))
    # one bf16 ulp: where fused Adam divides a gradient by the clip's inverse coefficient, its fp32 master may
    # differ from Megatron's product by an ulp, and the bf16 weight then rounds either way
    report["params_within_a_bf16_ulp"] = all(torch.allclose(a.float(), b.float(), rtol=2.0**-7, atol=0.0)
                                             for a, b in zip(ours.parameters(), megatrons.parameters()))
    report["params_moved"] = any(not torch.equal(p, q) for p, q in zip(ours.parameters(), initial))
    report["chained"] = len(sides[0][1].chained_optimizers)
    report["views"] = [hasattr(part, "_skyrl_shard_views") for _, optimizer, _ in sides for part in optimizer.chained_optimizers]
    # after the gather, DDP's bucket groups have nothing to post-process without TE: ours are told so once
    from skyrl_megatron.optimizer_prebuilt import _nothing_after_param_sync

    report["post_sync_skipped"] = [
        [group._post_param_sync is _nothing_after_param_sync for group in model.bucket_groups + model.expert_parallel_bucket_groups]
        for model, _, _ in sides]
    return report


@pytest.mark.slow
@pytest.mark.parametrize("grad_reduce_in_fp32", [False, True], ids=["bf16_grads", "fp32_grads"])
@pytest.mark.parametrize("clipped", [True, False], ids=["clipped", "unclipped"])
def test_our_step_reduces_the_norm_once_and_updates_as_megatrons_step_does(tmp_path, clipped, grad_reduce_in_fp32):
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3_moe", tmp_path / "moe", seed=3))
    max_norm = 0.05 if clipped else 1e3
    reports = run_on_ranks(_one_norm_pass_against_megatrons_step, 2, hf_dir, max_norm, grad_reduce_in_fp32, timeout=300)
    for report in reports:
        assert report["chained"] == 2  # dense and expert optimizers
        assert report["views"] == [True, True, False, False]  # ours prebuilt both parts' copies; Megatron's side not
        ours_groups, megatrons_groups = report["post_sync_skipped"]
        assert ours_groups and all(ours_groups) and not any(megatrons_groups)
        assert report["norm_reductions"] == [1, 1]  # Megatron's step() alone reduces it once more
        assert report["steps_on_the_device"] == 2  # the norm stayed on the device until the update was queued
        assert not any(skipped for _, skipped in report["ours"] + report["megatron"])
        if grad_reduce_in_fp32:
            # the norm summed over a few runs of DDP's fp32 buffer instead of per-parameter norms: the same sum of
            # squares in another order
            assert all(tensors < grads / 2 for tensors, grads in zip(report["norm_tensors"], report["norm_grads"]))
            assert [norm for norm, _ in report["ours"]] == pytest.approx([float(norm) for norm, _ in report["megatron"]], rel=1e-6)
        else:
            assert report["norm_tensors"] == report["norm_grads"]  # fp32 copies of bf16 gradients stay apart
            assert report["ours"] == report["megatron"]
        assert all((norm > max_norm) == clipped for norm, _ in report["ours"])  # clipping was active, or not
        assert report["params_moved"]
        # unclipped: bitwise Megatron's step; clipped: Adam's division by the inverse coefficient, within an ulp
        assert report["params_equal"] if not clipped else report["params_within_a_bf16_ulp"]


def test_contiguous_runs_join_only_views_that_meet_in_memory():
    from skyrl_megatron.optimizer_prebuilt import contiguous_runs

    buffer = torch.randn(100)
    # DDP's order: the last parameter first in memory; a gap of padding after the third; one view not contiguous
    views = [buffer[30:40], buffer[10:30], buffer[0:10], buffer[44:60], buffer[60:80].view(4, 5).t()]
    other = torch.randn(7)  # its own storage, right after nothing
    runs = contiguous_runs([*views, other])
    shapes = sorted(tuple(run.shape) for run in runs)
    assert shapes == [(5, 4), (7,), (16,), (40,)]
    assert any(run.data_ptr() == buffer.data_ptr() and run.numel() == 40 for run in runs)
    squares = sum(float(v.double().square().sum()) for v in [*views, other])
    assert sum(float(r.double().square().sum()) for r in runs) == pytest.approx(squares, rel=1e-12)
    assert contiguous_runs([]) == []
