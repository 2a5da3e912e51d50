"""Megatron optimizer and learning-rate schedule from the host's optimizer config, and one step.

The host (`trainer.policy.optimizer_config`) speaks in transformers' terms: `lr`, `adam_betas`,
`weight_decay`, `max_grad_norm`, `num_warmup_steps` and a transformers scheduler name. This module
maps that onto Megatron's `OptimizerConfig` and `OptimizerParamScheduler` so that the same config
gives the same learning rate at every step as the host's FSDP backend (`transformers.get_scheduler`),
and lets `megatron_config.optimizer_config_kwargs` override any derived `OptimizerConfig` field.

`optimizer_step` runs Megatron's optimizer step so that a step with a non-finite gradient norm is
skipped (and reported) instead of writing NaNs into the weights, reducing the gradient norm once and,
where the update is torch's fused Adam, leaving the clip and the skip to it and reading the norm only after the
update is queued.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from skyrl_megatron import arrivals, multi_tensor, optimizer_prebuilt, state_changes
from skyrl_megatron.compact_adam import attach_compact_adam, compact_adam_of
from skyrl_megatron.master_weights import attach, chained_parts, compact_masters_of, refusal

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # megatron is imported lazily: importing it costs seconds
    from megatron.core.optimizer import OptimizerConfig

# transformers scheduler name -> Megatron lr_decay_style. Megatron's linear warmup from 0 and its
# cosine/linear decay towards min_lr reproduce transformers' lambdas step for step.
SCHEDULER_DECAY_STYLES: dict[str, str] = {
    "constant_with_warmup": "constant",
    "constant": "constant",
    "cosine": "cosine",
    "cosine_with_min_lr": "cosine",
    "linear": "linear",
}
# transformers' "constant" schedule has no warmup phase even when num_warmup_steps is set.
_SCHEDULERS_WITHOUT_WARMUP = frozenset({"constant"})
_DECAYING_STYLES = frozenset({"cosine", "linear"})

_PRECISIONS = {"bf16": True, "bfloat16": True, "fp32": False, "float32": False}


class OptimizerSettingsError(ValueError):
    """The optimizer config cannot be turned into a Megatron optimizer and schedule."""


@dataclass(frozen=True)
class LrSchedule:
    """The arguments of Megatron's OptimizerParamScheduler that the host config decides."""

    decay_style: str  # Megatron's lr_decay_style
    warmup_steps: int
    decay_steps: int  # steps over which the decay runs (the whole training run)


@dataclass(frozen=True)
class OptimizerSettings:
    """A Megatron `OptimizerConfig` plus the LR schedule, derived from the host's config."""

    config: OptimizerConfig  # final: the pass-through overrides are applied
    schedule: LrSchedule

    @classmethod
    def from_host_config(
        cls,
        optimizer_config: Mapping[str, Any],
        optimizer_config_kwargs: Mapping[str, Any] | None,
        num_training_steps: int,
        dtype: str,
    ) -> "OptimizerSettings":
        """Derive the settings; `optimizer_config_kwargs` (OptimizerConfig fields) win over derived values.

        `optimizer_config` is the host's `trainer.<role>.optimizer_config` (a DictConfig or a dict);
        `num_training_steps` counts optimizer steps (the host's total mini-batch steps).
        """
        from megatron.core.optimizer import OptimizerConfig

        if dtype not in _PRECISIONS:
            raise OptimizerSettingsError(f"model dtype {dtype!r} is not one of {sorted(_PRECISIONS)}")
        bf16 = _PRECISIONS[dtype]
        derived: dict[str, Any] = dict(
            optimizer="adam",
            lr=float(_required(optimizer_config, "lr")),
            weight_decay=float(optimizer_config.get("weight_decay", 0.0)),
            # max_grad_norm: null turns clipping off, as 0 does in Megatron
            clip_grad=float(optimizer_config.get("max_grad_norm") or 0.0),
            bf16=bf16,
            # bf16 model params with fp32 main params, grads and Adam moments (Megatron's default
            # for a mixed-precision optimizer; the precision-aware optimizer needs TE)
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
        )
        derived.update(_adam_betas(optimizer_config))
        overrides = dict(optimizer_config_kwargs or {})
        min_lr = overrides.pop("min_lr", None)
        if min_lr is None:
            min_lr = optimizer_config.get("min_lr")
        # Megatron copies min_lr into every param group, where None would break the scheduler
        derived["min_lr"] = float(min_lr) if min_lr is not None else 0.0

        known = {f.name for f in dataclasses.fields(OptimizerConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise OptimizerSettingsError(
                f"optimizer_config_kwargs: unknown OptimizerConfig field(s) {unknown}"
            )
        config = OptimizerConfig(**{**derived, **overrides})
        schedule = _lr_schedule(
            str(optimizer_config.get("scheduler", "constant_with_warmup")),
            warmup_steps=int(optimizer_config.get("num_warmup_steps", 0) or 0),
            num_training_steps=num_training_steps,
            has_min_lr=min_lr is not None,
        )
        return cls(config=config, schedule=schedule)

    def build_optimizer(self, chunks: Sequence[torch.nn.Module], *, compact_master_weights: bool | str = False,
                        compact_adam: bool | str = False):
        """Megatron's optimizer over the DDP-wrapped model chunks (one per virtual pipeline stage).

        `compact_master_weights` keeps the fp32 masters as bf16 weight + int16 remainder between
        steps (`master_weights.py`; `optimizer_step` rebuilds them for the step): True there or an
        error, "auto" wherever this optimizer allows it. `compact_adam` steps them without rebuilding them
        (`compact_adam.py`) where they run on fp32 gradients: True there or an error, "auto" wherever they do.

        Whether the optimizer is distributed must agree with how the DDP grad buffers were laid
        out, so it follows `ddp_config.use_distributed_optimizer`; asking for a distributed
        optimizer over buffers laid out for a plain one is an error.
        """
        from megatron.core.optimizer import get_megatron_optimizer

        ddp_config = getattr(chunks[0], "ddp_config", None)
        if ddp_config is None:
            raise OptimizerSettingsError(
                "the model chunks are not wrapped in Megatron DDP; build them with wrap_with_ddp=True"
            )
        config = self.config
        if config.use_distributed_optimizer and not ddp_config.use_distributed_optimizer:
            raise OptimizerSettingsError(
                "optimizer_config_kwargs.use_distributed_optimizer=True needs "
                "ddp_config.use_distributed_optimizer=True (the grad buffers are laid out for it)"
            )
        if ddp_config.use_distributed_optimizer and not config.use_distributed_optimizer:
            config = dataclasses.replace(config, use_distributed_optimizer=True)
        multi_tensor.install()  # without TE/Apex: foreach kernels, not a host read per gradient
        optimizer = get_megatron_optimizer(config, list(chunks))
        use_fused_torch_adam(optimizer)
        # the per-tensor work Megatron's distributed optimizer repeats every step, done once (a MoE has thousands)
        kept = {reason for part in chained_parts(optimizer) if (reason := optimizer_prebuilt.install(part))}
        if kept:
            logger.info("optimizer: Megatron's per-tensor methods kept (%s)", ", ".join(sorted(kept)))
        reason = refusal(optimizer) if compact_master_weights else "compact_master_weights is false"
        adam_reason = _compact_adam_refusal(optimizer) if compact_adam and reason is None else None
        if compact_adam is True and adam_reason is not None:
            raise OptimizerSettingsError(f"megatron_config.compact_adam cannot be used: {adam_reason}")
        if adam_reason is not None:
            logger.info("compact adam (auto): off, %s", adam_reason)
        adam_here = bool(compact_adam) and reason is None and adam_reason is None
        if reason is None:
            masters = attach(optimizer)
            parts = chained_parts(optimizer)
            # the chain's last optimizer copies its masters back through their release (where ours copies): an
            # earlier part's release would read its checks before the next part's update is queued, and the
            # device would wait for that launch (4 ms under the experts' AdamW at 4 MoE layers on an H100). With
            # compact adam every part does: their released runs hold no fp32 masters to copy, and in steady state
            # no run is left for an earlier part's release to split
            for index in range(len(parts)) if adam_here else [len(parts) - 1]:
                optimizer_prebuilt.write_models_with(parts[index], functools.partial(masters.round_into_models, index))
            if adam_here:
                grads_of = {}
                for part in parts:
                    grads_of.update(optimizer_prebuilt.main_grad_views(part) or {})
                attach_compact_adam(optimizer, masters, grads_of)
        elif compact_adam is True:
            raise OptimizerSettingsError(f"megatron_config.compact_adam needs compact master weights, which cannot "
                                         f"be used here: {reason}")
        elif compact_master_weights is True:
            raise OptimizerSettingsError(f"megatron_config.compact_master_weights cannot be used: {reason}")
        elif compact_master_weights:
            logger.info("compact master weights (auto): off, %s", reason)
        return optimizer

    def build_scheduler(self, optimizer):
        """Megatron's OptimizerParamScheduler for this schedule (the LR of step 0 is set at once)."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        weight_decay = self.config.weight_decay
        return OptimizerParamScheduler(
            optimizer,
            init_lr=0.0,  # warmup starts from 0, as in transformers
            max_lr=self.config.lr,
            min_lr=self.config.min_lr,
            lr_warmup_steps=self.schedule.warmup_steps,
            lr_decay_steps=self.schedule.decay_steps,
            lr_decay_style=self.schedule.decay_style,
            start_wd=weight_decay,
            end_wd=weight_decay,
            wd_incr_steps=self.schedule.decay_steps,
            wd_incr_style="constant",
            # a resumed run continues the schedule it was saved with
            use_checkpoint_opt_param_scheduler=True,
        )


def _compact_adam_refusal(optimizer) -> str | None:
    """Why `compact_adam` cannot step this optimizer's compact masters, or None (each run's param groups and
    gradients are checked again when it is first stepped, and a run that does not fit stays with torch's Adam)."""
    for part in chained_parts(optimizer):
        if getattr(part, "is_stub_optimizer", False):
            continue
        if optimizer_prebuilt.main_grad_views(part) is None:
            return "Megatron's per-tensor optimizer methods are kept on this optimizer (optimizer_prebuilt)"
        if not part.ddp_config.grad_reduce_in_fp32:
            return "it reads fp32 gradients: set ddp_config.grad_reduce_in_fp32=true"
    return None


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (chained, distributed or plain), or a torch one itself
    (their state arrived, where it was on its way back to the device: `arrivals`)."""
    if optimizer is None:
        return []
    arrivals.settle(optimizer)
    if hasattr(optimizer, "chained_optimizers"):
        return [o for chained in optimizer.chained_optimizers for o in torch_optimizers(chained)]
    return [optimizer.optimizer] if hasattr(optimizer, "optimizer") else [optimizer]


def use_fused_torch_adam(optimizer) -> int:
    """Run torch's fused Adam kernel where Megatron fell back to torch's Adam/AdamW; returns the groups switched.

    Without TE or Apex, Megatron builds `torch.optim.AdamW` with torch's default, the foreach
    implementation: about ten multi-tensor passes over the fp32 state per step and per-parameter step
    counters on the host. `fused=True` (torch's own single-pass kernel, on CUDA and CPU) does the same
    update in one pass. Groups whose parameters are not all floating point on a device the fused kernel
    supports, and capturable ones (CUDA graphs), are left as they are. Called again after a checkpoint
    load (the saved param groups replace the flags, and step counters may come from the host).
    """
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    switched = 0
    for torch_optimizer in torch_optimizers(optimizer):
        if type(torch_optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in torch_optimizer.param_groups:
            params = group["params"]
            eligible = params and all(p.is_floating_point() and p.device.type in supported for p in params)
            if eligible and not (group.get("fused") or group.get("capturable") or group.get("differentiable")):
                group["fused"], group["foreach"] = True, False
                switched += 1
            if group.get("fused"):  # the fused kernel counts steps on the parameters' device
                for param in params:
                    state = torch_optimizer.state.get(param)
                    if state and "step" in state and state["step"].device != param.device:
                        state["step"] = state["step"].to(param.device, torch.float32)
    return switched


@dataclass(frozen=True)
class StepResult:
    grad_norm: float | None  # the total gradient norm before clipping (None only without grads)
    num_zeros_in_grad: int | None  # only when OptimizerConfig.log_num_zeros_in_grad is set
    skipped: bool  # the update was not applied (non-finite grad norm)
    lr: float | None  # the learning rate this step used


def optimizer_step(optimizer, scheduler) -> StepResult:
    """Apply one optimizer step unless the gradient norm is non-finite; advance the LR schedule only
    after an applied update.

    Megatron's bf16/fp32 optimizers only skip on overflow under fp16 loss scaling: with a NaN or
    inf gradient they would clip by a NaN coefficient and write NaNs into every weight. The norm
    is therefore computed first (all ranks agree on it: it is all-reduced over the model-parallel
    group) and the step is skipped on all ranks alike. Gradients must already be finalised
    (`finalize_model_grads`).

    Compact master weights are rebuilt first (the main grads are attached to the masters, so their
    shapes must be back) and released again: those of the chain's last optimizer as the step copies them into
    the model (one pass rounds each into its weight and splits it), the others after the step. With compact adam
    (`compact_adam.py`) the runs it steps stay released throughout: their update is one pass each.
    State brought back from host memory may still be arriving (`arrivals`): the step waits for it first.
    """
    arrivals.settle(optimizer)
    state_changes.record()
    masters = compact_masters_of(optimizer)
    if masters is None:
        return _step(optimizer, scheduler)
    stepper = compact_adam_of(optimizer)
    masters.rebuild(leave=stepper.begin() if stepper is not None else ())
    result = None
    try:
        with masters.writing_models():
            result = _step(optimizer, scheduler)
            return result
    finally:
        if stepper is not None:
            stepper.finish(applied=result is not None and not result.skipped)
        masters.release()


def _step(optimizer, scheduler) -> StepResult:
    lr = current_lr(optimizer)
    found_inf = optimizer.prepare_grads()
    grad_norm = optimizer.get_grad_norm()
    if isinstance(grad_norm, torch.Tensor) and not found_inf and _skips_on_the_device(optimizer):
        return _step_then_read(optimizer, scheduler, grad_norm, lr)
    # read before the update; the clip still takes the tensor, as Megatron's own step would
    norm = float(grad_norm) if isinstance(grad_norm, torch.Tensor) else grad_norm
    if found_inf or norm is None or not math.isfinite(norm):
        return StepResult(grad_norm=norm, num_zeros_in_grad=None, skipped=True, lr=lr)
    if _needs_megatrons_own_step(optimizer):
        # prepare_grads is idempotent for the bf16/fp32 optimizers: step() repeats it and the norm
        update_successful, _, num_zeros_in_grad = optimizer.step()
    else:
        update_successful, num_zeros_in_grad = _step_with_norm(optimizer, grad_norm)
    if update_successful:
        scheduler.step(increment=1)
    return StepResult(
        grad_norm=float(norm),
        num_zeros_in_grad=num_zeros_in_grad,
        skipped=not update_successful,
        lr=lr,
    )


def _step_then_read(optimizer, scheduler, grad_norm: torch.Tensor, lr: float | None) -> StepResult:
    """The step with the gradient norm still on the device, read once the update is queued. Reading it first
    drained the device, which then idled while the host launched the clip and the update (11 ms in 5 gaps of a
    4-layer MoE training call on an H100).

    Torch's fused Adam takes both decisions on the device: `found_inf` (the norm is not finite) makes it leave
    the weights, moments and step counts as they were, and `grad_scale` divides each gradient as it reads it
    (writing the result back), so the clip is 1 / min(1, max_norm / (norm + 1e-6)) there instead of a separate
    pass multiplying every gradient, which Megatron's TE path makes even when it does not clip (on an H100 at the
    4-layer MoE: 9.1 ms for that pass, +5 ms for the kernel's write-back). Unclipped steps are bitwise Megatron's;
    a clipped gradient divided by the inverse coefficient may differ from Megatron's product by one ulp. The
    schedule advances only after an applied step, as on the host path."""
    skip = (~torch.isfinite(grad_norm)).reshape(()).to(torch.float32)
    adams = []
    for part in chained_parts(optimizer):
        if getattr(part, "is_stub_optimizer", False):
            continue
        adam = part.optimizer
        adam.found_inf = skip
        if part.config.clip_grad > 0.0:
            coefficient = (part.config.clip_grad / (grad_norm + 1.0e-6)).clamp_max_(1.0)
            adam.grad_scale = coefficient.reciprocal().reshape(())
        adams.append(adam)
    try:
        update_queued = optimizer.step_with_ready_grads()
    finally:
        for adam in adams:
            adam.__dict__.pop("found_inf", None)
            adam.__dict__.pop("grad_scale", None)
    norm = float(grad_norm)  # the one read: the update is already queued behind it
    applied = update_queued and math.isfinite(norm)
    if applied:
        scheduler.step(increment=1)
    return StepResult(grad_norm=norm, num_zeros_in_grad=None, skipped=not applied, lr=lr)


def _skips_on_the_device(optimizer) -> bool:
    """Whether the clip and a non-finite norm's skip can be left to the update: every part updates through
    torch's fused Adam (it takes `found_inf` and `grad_scale`) on plain `.grad`s, and no feature reads the norm
    or the gradients on the host before the update (Megatron's own step for separate norm groups and the skip
    threshold, counting zeros)."""
    if optimizer.config.log_num_zeros_in_grad or _needs_megatrons_own_step(optimizer):
        return False
    parts = [part for part in chained_parts(optimizer) if not getattr(part, "is_stub_optimizer", False)]
    return bool(parts) and all(
        not part.config.use_precision_aware_optimizer
        and type(getattr(part, "optimizer", None)) in (torch.optim.Adam, torch.optim.AdamW)
        and all(group.get("fused") for group in part.optimizer.param_groups)
        for part in parts
    )


def _needs_megatrons_own_step(optimizer) -> bool:
    """Features whose handling `_step_with_norm` does not restate: norm groups clipped on their own
    (multi-token prediction) and skipping a step above a norm threshold."""
    from megatron.core.optimizer.optimizer import SEPARATE_GRAD_NORM_GROUPS

    return any(optimizer.has_grad_norm_group(group) for group in SEPARATE_GRAD_NORM_GROUPS) or any(
        math.isfinite(getattr(part.config, "grad_norm_skip_threshold", math.inf)) for part in chained_parts(optimizer)
    )


def _step_with_norm(optimizer, grad_norm: float | torch.Tensor) -> tuple[bool, int | None]:
    """The rest of Megatron's `step()` once the grads are prepared and their norm is known: clip by that
    norm, count zeros if asked, update. Megatron's own `step()` would prepare the grads and reduce their
    norm a second time (a pass over every main grad and an all-reduce); clipping by the same norm gives
    the same update bitwise."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for part in chained_parts(optimizer):
        config = part.config
        if getattr(part, "is_stub_optimizer", False) or config.clip_grad <= 0.0:
            continue
        params = part.get_parameters()
        if not params:
            continue
        # Megatron-FSDP's parameters always carry their grads apart (decoupled), as with precision-aware Adam
        decoupled = config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 or (
            config.use_precision_aware_optimizer and getattr(params[0], "__fsdp_param__", False)
        )
        if decoupled:
            clip_grad_by_total_norm_fp32(params, config.clip_grad, grad_norm, use_decoupled_grad=decoupled)
        else:
            _clip_by_total_norm(params, config.clip_grad, grad_norm)
    num_zeros_in_grad = optimizer.count_zeros() if optimizer.config.log_num_zeros_in_grad else None
    return optimizer.step_with_ready_grads(), num_zeros_in_grad


def _clip_by_total_norm(params, max_norm: float, total_norm: float | torch.Tensor) -> None:
    """Megatron's `clip_grad_by_total_norm_fp32` for plain `.grad`s, through the same scale ops and arithmetic
    (a norm on the device: min(1, coefficient) there, always applied), without its per-gradient DTensor
    conversion and type check (a Python call and a grad-mode switch for each of a MoE's thousands of
    parameters, every step)."""
    from megatron.core.optimizer import clip_grads

    coefficient = max_norm / (total_norm + 1.0e-6)
    if isinstance(coefficient, torch.Tensor):
        coefficient.clamp_max_(1.0)
        op = clip_grads.multi_tensor_scale_tensor_impl
    elif coefficient >= 1.0:
        return
    else:
        op = clip_grads.multi_tensor_scale_impl
    grads = [param.grad for param in params if param.grad is not None]
    if grads:
        overflow = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        clip_grads.multi_tensor_applier(op, overflow, [grads, grads], coefficient)


def current_lr(optimizer) -> float | None:
    from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging

    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    return float(lr) if lr is not None else None


def _required(optimizer_config: Mapping[str, Any], key: str) -> Any:
    value = optimizer_config.get(key)
    if value is None:
        raise OptimizerSettingsError(f"optimizer_config.{key} is required")
    return value


def _adam_betas(optimizer_config: Mapping[str, Any]) -> dict[str, float]:
    betas = optimizer_config.get("adam_betas")
    if betas is None:
        return {}
    betas = [float(b) for b in betas]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise OptimizerSettingsError(
            f"optimizer_config.adam_betas must be two numbers in [0, 1), got {betas}"
        )
    return {"adam_beta1": betas[0], "adam_beta2": betas[1]}


def _lr_schedule(name: str, *, warmup_steps: int, num_training_steps: int, has_min_lr: bool) -> LrSchedule:
    if name not in SCHEDULER_DECAY_STYLES:
        raise OptimizerSettingsError(
            f"optimizer_config.scheduler={name!r} is not supported; use one of {sorted(SCHEDULER_DECAY_STYLES)}"
        )
    if name == "cosine_with_min_lr" and not has_min_lr:
        raise OptimizerSettingsError(
            "optimizer_config.scheduler='cosine_with_min_lr' needs a floor: set optimizer_config.min_lr "
            "(or megatron_config.optimizer_config_kwargs.min_lr)"
        )
    if warmup_steps < 0:
        raise OptimizerSettingsError(f"optimizer_config.num_warmup_steps must be >= 0, got {warmup_steps}")
    decay_style = SCHEDULER_DECAY_STYLES[name]
    if name in _SCHEDULERS_WITHOUT_WARMUP:
        warmup_steps = 0
    if decay_style in _DECAYING_STYLES and num_training_steps <= warmup_steps:
        raise OptimizerSettingsError(
            f"optimizer_config.scheduler={name!r} decays over the steps after warmup, but the run has "
            f"{num_training_steps} optimizer step(s) and num_warmup_steps={warmup_steps}"
        )
    # Megatron requires warmup < decay steps even for a constant schedule, where decay_steps is unused
    decay_steps = max(num_training_steps, warmup_steps + 1)
    return LrSchedule(decay_style=decay_style, warmup_steps=warmup_steps, decay_steps=decay_steps)
