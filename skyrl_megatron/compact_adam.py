"""AdamW straight on compact master weights: one run's step without writing its fp32 masters.

A run of compact masters (`master_weights`: back-to-back bf16 model shards of Megatron's parameter buffer, each
master stored as its weight and an int16 remainder) is stepped today by joining the masters into fp32, running
torch's fused AdamW over them and splitting them again. `queue_run_step` does the same update without the fp32
masters: on GPUs one Triton pass per run (`compact_adam_kernels`, 28 bytes a parameter against 44-48), on CPU the
eager chain of join, `adam_step_reference` and split, which is also the pass's definition: the two agree bit for bit.
`CompactAdam` puts it into a Megatron optimizer's step (`megatron_config.compact_adam`).

The update is AdamW's, in the order PyTorch's fused kernel takes it (decay, moments, bias-corrected step), in fp32
with the per-group scalars rounded to fp32 once (`AdamScalars`); each tensor of a run has its parameter group's
scalars, the padding between tensors is left alone. A non-finite gradient norm's skip and the clip's gradient
divisor are read on the device, as torch's fused Adam reads `found_inf` and `grad_scale`.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from skyrl_megatron import master_weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdamScalars:
    """One parameter group's AdamW settings at one step (`step` counts from 1)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    def row(self) -> list[float]:
        """The scalars the update reads, computed in double: [lr * weight decay, beta1, 1 - beta1, beta2, 1 - beta2,
        lr / (1 - beta1**step), sqrt(1 - beta2**step), eps]."""
        if self.step < 1:
            raise ValueError(f"AdamScalars.step counts from 1, got {self.step}")
        return [self.lr * self.weight_decay, self.beta1, 1.0 - self.beta1, self.beta2, 1.0 - self.beta2,
                self.lr / (1.0 - self.beta1**self.step), math.sqrt(1.0 - self.beta2**self.step), self.eps]


def scalar_table(groups: Sequence[AdamScalars], device: torch.device) -> Tensor:
    """fp32 [groups, 8]: each group's `AdamScalars.row`, rounded to fp32 once."""
    return torch.tensor([g.row() for g in groups], dtype=torch.float32).to(device)


Span = tuple[int, int, int]  # [start, stop) of one tensor in its run's span, and its parameter group's row


def adam_step_reference(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, spans: Sequence[Span],
                        hyper: Tensor, skip: Tensor, scale: Tensor | None) -> None:
    """AdamW over the `spans` of flat fp32 `master`, `exp_avg` and `exp_avg_sq` (in place), `grad` read; the
    definition the Triton pass follows operation for operation (IEEE division and square root, no fused
    multiply-adds). `skip`: a 0-d tensor, nonzero leaves every value as it was; `scale`: the gradient's divisor."""
    take = skip == 0
    for start, stop, group in spans:
        state = master[start:stop], exp_avg[start:stop], exp_avg_sq[start:stop]
        _store_where(take, state, _adamw(*state, grad[start:stop], hyper[group], scale))


def _adamw(param: Tensor, avg: Tensor, avg_sq: Tensor, grad: Tensor, row: Tensor,
           scale: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """One element-wise AdamW update with a group's scalars `row`: (param, exp_avg, exp_avg_sq) after it."""
    g = grad if scale is None else grad / scale
    decayed = param - row[0] * param
    new_avg = row[1] * avg + row[2] * g
    new_avg_sq = row[3] * avg_sq + row[4] * g * g
    denom = _sqrt_rn(new_avg_sq) / row[6] + row[7]
    return decayed - row[5] * new_avg / denom, new_avg, new_avg_sq


def _store_where(take: Tensor, state: Sequence[Tensor], updated: Sequence[Tensor]) -> None:
    """Each of `state` (param, exp_avg, exp_avg_sq) its updated value where `take`, as it was elsewhere."""
    for old, new in zip(state, updated, strict=True):
        old.copy_(torch.where(take, new, old))


_CHUNK = 1 << 22  # elements per eager pass over a run (bounds its temporaries)


def _adam_step_by_group(master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                        members: Sequence[tuple[int, Tensor]], hyper: Tensor, skip: Tensor,
                        scale: Tensor | None) -> None:
    """`adam_step_reference` over a whole run at once per parameter group (`members`: each group's row and a mask of
    its elements over the span), chunk by chunk: the same element-wise operations, without a dozen torch calls per
    tensor of the run (a MoE's run holds hundreds)."""
    applied = skip == 0
    covered = members[0][1].numel()  # up to the last tensor's end (what lies beyond is padding)
    for start in range(0, covered, _CHUNK):
        stop = min(start + _CHUNK, covered)
        state = master[start:stop], exp_avg[start:stop], exp_avg_sq[start:stop]
        for group, mask in members:
            _store_where(mask[start:stop] & applied, state, _adamw(*state, grad[start:stop], hyper[group], scale))


def _sqrt_rn(values: Tensor) -> Tensor:
    """fp32 square roots rounded to nearest (through fp64, exact for fp32 inputs): PyTorch's vectorized CPU sqrt
    is not always (640 of 100k uniform values one ulp off on an AVX-512 machine)."""
    return values.double().sqrt().float()


class CompactAdamError(RuntimeError):
    """A step left a master that its weight and an int16 remainder cannot hold (a NaN from the update)."""


@dataclass(frozen=True)
class RunLayout:
    """A run's tensors ([start, stop) and parameter group each) and, on GPUs, the pass's block table over them
    (elsewhere each group's mask over the span, for the eager step): built once per run (`run_layout`), the spans
    do not change between steps."""

    spans: tuple[Span, ...]
    blocks: "compact_adam_kernels.Blocks | None"  # noqa: F821 (imported only where Triton runs)
    members: tuple[tuple[int, Tensor], ...] = ()  # (group, bool mask over the span) of each group present


def run_layout(spans: Sequence[Span], device: torch.device) -> RunLayout:
    if device.type != "cuda":
        span = max((stop for _, stop, _ in spans), default=0)
        masks: dict[int, Tensor] = {}
        for start, stop, group in spans:
            masks.setdefault(group, torch.zeros(span, dtype=torch.bool, device=device))[start:stop] = True
        return RunLayout(tuple(spans), None, tuple(sorted(masks.items(), key=lambda item: item[0])))
    from skyrl_megatron import compact_adam_kernels as kernels

    return RunLayout(tuple(spans), kernels.block_table(spans, device))


@dataclass
class QueuedStep:
    """A run's step queued on the device; `settle` reads its checks (with other runs') and finds its ties."""

    remainder: Tensor
    stats: Tensor  # int64 [worst status, new ties], on the device
    found: object  # what `compact_adam_kernels.tie_indices` needs; on CPU the tie indices themselves (None: NaN)


def queue_run_step(model: Tensor, remainder: Tensor, ties: Tensor, grad: Tensor, exp_avg: Tensor,
                   exp_avg_sq: Tensor, layout: RunLayout, hyper: Tensor, skip: Tensor,
                   scale: Tensor | None = None) -> QueuedStep:
    """One AdamW step of a run held as `model` (flat bf16 over the run's span), `remainder` and the indices of its
    ties rounded down, queued without a host read: `model`, `remainder` (on GPUs), `exp_avg` and `exp_avg_sq` (flat
    fp32 over the span) change in place, `grad` (flat fp32 over the span) is read; `settle` gives the new remainder
    and ties."""
    if layout.blocks is not None:
        from skyrl_megatron import compact_adam_kernels as kernels

        upper = model.view(torch.int16)
        if ties.numel():  # the weight one up over -2**15 is the listed tie's master: the pass needs no list
            upper[ties] += 1
        return QueuedStep(*kernels.adam_round_split(upper, remainder, grad, exp_avg, exp_avg_sq, layout.blocks,
                                                    hyper, skip, scale))
    master = master_weights.join_master(model, remainder, ties)
    if layout.members:
        _adam_step_by_group(master, grad, exp_avg, exp_avg_sq, layout.members, hyper, skip, scale)
    else:
        adam_step_reference(master, grad, exp_avg, exp_avg_sq, layout.spans, hyper, skip, scale)
    split = master_weights.split_master(master, model, write_model=True)
    if split is None:
        return QueuedStep(remainder, torch.tensor([master_weights.OUT_OF_RANGE, 0]), None)
    return QueuedStep(split[0], torch.tensor([0, split[1].numel()]), split[1])


def settle(queued: Sequence[QueuedStep], checks: "master_weights.HostChecks | None" = None
           ) -> list[tuple[Tensor, Tensor]]:
    """(remainder, tie indices) of each queued step, after one host read of all their checks (`checks`: their
    stats already on their way to the host, in order)."""
    if not queued:
        return []
    if checks is None:
        checks = master_weights.HostChecks([step.stats for step in queued])
    values = checks.read()
    results = []
    for step, worst, count in zip(queued, values[0::2], values[1::2]):
        if worst >= master_weights.OUT_OF_RANGE:
            raise CompactAdamError(_NAN_MESSAGE)
        if isinstance(step.found, Tensor):  # found on CPU already
            results.append((step.remainder, step.found))
        else:
            from skyrl_megatron import compact_adam_kernels as kernels

            results.append((step.remainder, kernels.tie_indices(step.found, count)))
    return results


def step_compact_run(model: Tensor, remainder: Tensor, ties: Tensor, grad: Tensor, exp_avg: Tensor,
                     exp_avg_sq: Tensor, spans: Sequence[Span], hyper: Tensor, skip: Tensor,
                     scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`queue_run_step` and `settle` of one run: its new (remainder, tie indices)."""
    layout = run_layout(spans, model.device)
    return settle([queue_run_step(model, remainder, ties, grad, exp_avg, exp_avg_sq, layout, hyper, skip, scale)])[0]


_NAN_MESSAGE = ("compact master weights: the optimizer step produced a master that is NaN (finite gradients, "
                "moments and settings do not): check optimizer_config.lr and the betas")


# ----------------------------------------------------------------------------------------------
# In a Megatron optimizer: the released runs stepped in place of torch's Adam
# ----------------------------------------------------------------------------------------------


def _group_refusal(adam, group: dict) -> str | None:
    """Why this torch param group's update is not `adam_step_reference`'s, or None."""
    if type(adam) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(adam).__name__} is not torch's Adam/AdamW"
    if group.get("amsgrad") or group.get("maximize") or group.get("capturable") or group.get("differentiable"):
        return "amsgrad, maximize, capturable or differentiable is set"
    decoupled = type(adam) is torch.optim.AdamW or group.get("decoupled_weight_decay")
    if group.get("weight_decay", 0.0) and not decoupled:
        return "Adam's L2 weight decay (not AdamW's decoupled one)"
    if any(isinstance(group[key], Tensor) for key in ("lr", "eps", "weight_decay")) or \
            any(isinstance(beta, Tensor) for beta in group["betas"]):
        return "a tensor learning rate or beta"
    return None


@dataclass
class _Adopted:
    """A released run whose Adam state lives in run-wide buffers, the members' state entries views of them."""

    run: object  # master_weights._Run
    layout: RunLayout
    grad: Tensor  # flat fp32 over the run's span in DDP's gradient buffer
    exp_avg: Tensor
    exp_avg_sq: Tensor
    steps: list[Tensor]  # the members' step counters (torch's state), advanced after each applied step
    step: int  # the steps applied so far, on the host
    marks: tuple  # the first member's state entries as adopted: another object there means the state was replaced


class CompactAdam:
    """AdamW on a Megatron optimizer's released runs of compact masters, each stepped in one pass
    (`queue_run_step`) where torch's Adam would step its rebuilt fp32 masters.

    `optim.optimizer_step` asks `begin()` which runs to leave released (`CompactMasterWeights.rebuild(leave=)`);
    inside each chain part's torch step those runs' masters are left out of the param groups and queued here with
    the step's skip flag and clip divisor (`found_inf`, `grad_scale`, as torch's fused Adam reads them; without
    them, no skip and gradients already clipped in place); `finish()` reads the runs' checks once and advances the
    step counters. A run is adopted at its first step released: its members' moments are copied into one buffer
    per moment over the run's span and the state entries become views of it (checkpoints and offloads read and
    park them as before); before any step those buffers start at zero and the step counters are made as torch's
    first step makes them. A run whose members' state was replaced since (a checkpoint load) is adopted again."""

    def __init__(self, masters, parts: Sequence, grads_of: dict[int, Tensor]):
        """`parts`: the Megatron optimizers of the chain, by index as the masters know them; `grads_of`: id of
        each main shard -> its fp32 gradient view in DDP's buffer (`optimizer_prebuilt`)."""
        self._masters, self._grads_of = masters, grads_of
        # each part's torch optimizer (None for a stub): not the Megatron parts, which own this object's lifetime
        self._adams = [None if getattr(part, "is_stub_optimizer", False) else getattr(part, "optimizer", None)
                       for part in parts]
        self._adopted: dict[int, _Adopted] = {}
        self._refused: dict[int, str] = {}  # run id -> why torch steps it, for good
        self._stepping: dict[int, list[_Adopted]] = {}  # part index -> its runs stepped here this step
        # per part: (the runs and the groups' param lists it was built for, each group's params without the runs')
        self._kept_params: dict[int, tuple[tuple, tuple, list[list]]] = {}
        # per chain part stepped: its runs' queued steps and their checks on the way to the host
        self._queued: list[tuple[list[_Adopted], list[QueuedStep], master_weights.HostChecks]] = []
        self._logged: set[str] = set()
        for index, adam in enumerate(self._adams):
            if adam is not None:
                real_step = adam.step
                adam.step = lambda closure=None, _index=index, _real=real_step: self._torch_step(_index, _real, closure)

    @property
    def adopted_runs(self) -> int:
        return len(self._adopted)

    def begin(self) -> set[int]:
        """The ids of the runs this step updates here (left released by the rebuild)."""
        self._stepping = {}
        with torch.no_grad():
            for index, adam in enumerate(self._adams):
                if adam is None:
                    continue
                for run in self._masters.released_runs(index):
                    adopted = self._current(run, index)
                    if adopted is not None:
                        self._stepping.setdefault(index, []).append(adopted)
        return {id(adopted.run) for runs in self._stepping.values() for adopted in runs}

    def finish(self, applied: bool) -> None:
        """After the step: the queued runs' new remainders and ties (one host read), and their step counters
        advanced where the update was applied."""
        queued, self._queued, self._stepping = self._queued, [], {}
        with torch.no_grad():
            for runs, steps, checks in queued:
                for adopted, (remainder, ties) in zip(runs, settle(steps, checks)):
                    piece = adopted.run.piece
                    piece.remainder, piece.tie_indices = remainder, ties
            if applied and queued:
                stepped = [adopted for runs, _, _ in queued for adopted in runs]
                for adopted in stepped:
                    adopted.step += 1
                torch._foreach_add_([step for adopted in stepped for step in adopted.steps], 1.0)

    def _current(self, run, index: int) -> _Adopted | None:
        adopted = self._adopted.get(id(run))
        if adopted is not None and adopted.run is run and self._marks(run, index) == adopted.marks:
            return adopted
        if id(run) in self._refused:
            return None
        reason, for_good = self._adopt(run, index)
        if reason is None:
            return self._adopted[id(run)]
        if for_good:  # (a run with Adam state on some masters only is looked at again: torch's step completes it)
            self._refused[id(run)] = reason
            self._log_once(f"compact adam: a run of {len(run.members)} masters stays with torch's Adam: {reason}")
        return None

    def _marks(self, run, index: int) -> tuple:
        state = self._adams[index].state.get(run.members[0].master, {})
        return tuple(id(state.get(key)) for key in ("exp_avg", "exp_avg_sq", "step"))

    def _adopt(self, run, index: int) -> tuple[str | None, bool]:
        """Adopt `run`; (None, _) where it was, else (why not, whether for good)."""
        adam = self._adams[index]
        group_of = {id(p): g for g, group in enumerate(adam.param_groups) for p in group["params"]}
        members = run.members
        if any(id(m.master) not in group_of for m in members):
            return "a master outside its optimizer's param groups", True
        groups = [group_of[id(m.master)] for m in members]
        for g in set(groups):
            reason = _group_refusal(adam, adam.param_groups[g])
            if reason is not None:
                return reason, True
        states = [adam.state.get(m.master) for m in members]
        if not any(states):  # no step taken yet: the state torch's first step would make, in the run's buffers
            states = [adam.state[m.master] for m in members]
            for m, state, g in zip(members, states, groups):
                state["step"] = initial_adam_step(m.master, adam.param_groups[g])
        elif any(not state or not {"exp_avg", "exp_avg_sq", "step"} <= state.keys() for state in states):
            return "some of its masters have Adam state and some not yet", False
        grads = [self._grads_of.get(id(m.master)) for m in members]
        first = grads[0]
        if any(g is None or g.dtype != torch.float32 or not g.is_contiguous() for g in grads) or any(
                g.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or g.storage_offset() - first.storage_offset() != m.offset for g, m in zip(grads, members)):
            return "its gradients are not an fp32 stretch of DDP's buffer laid out as the weights", True
        steps = [state["step"] for state in states]
        device = run.model.device
        counts = torch.stack([step.reshape(()).to(device, torch.float64) for step in steps]).unique()  # one read
        if counts.numel() != 1:
            return "its masters have taken different numbers of steps", False
        previous = self._adopted.get(id(run))
        buffers = []
        for key in ("exp_avg", "exp_avg_sq"):
            buffer = getattr(previous, key) if previous is not None and previous.run is run else \
                torch.zeros(run.span, dtype=torch.float32, device=device)
            for m, state in zip(members, states):
                view = buffer[m.offset : m.offset + m.numel]
                if key in state:
                    view.copy_(state[key].reshape(-1))
                state[key] = view.view(m.master.shape)
            buffers.append(buffer)
        spans = [(m.offset, m.offset + m.numel, g) for m, g in zip(members, groups)]
        grad = first.as_strided((run.span,), (1,), first.storage_offset())
        self._adopted[id(run)] = _Adopted(run, run_layout(spans, device), grad, *buffers, steps, int(counts.item()),
                                          self._marks(run, index))
        return None, False

    def _torch_step(self, index: int, real_step, closure=None):
        """Torch's step of chain part `index` without the masters of the runs stepped here, which are queued."""
        runs = self._stepping.get(index)
        if not runs:
            return real_step(closure)
        adam = self._adams[index]
        saved = [group["params"] for group in adam.param_groups]
        for group, kept in zip(adam.param_groups, self._params_kept(index, runs, saved)):
            group["params"] = kept
        try:
            loss = real_step(closure)
        finally:
            for group, params in zip(adam.param_groups, saved):
                group["params"] = params
        with torch.no_grad():
            device = runs[0].run.model.device
            skip = getattr(adam, "found_inf", None)
            skip = torch.zeros((), device=device) if skip is None else skip.reshape(())
            scale = getattr(adam, "grad_scale", None)
            tables: dict[int, Tensor] = {}
            steps = []
            for adopted in runs:
                step = adopted.step + 1
                if step not in tables:
                    tables[step] = _hyper_table(adam.param_groups, step, device)
                piece = adopted.run.piece
                steps.append(queue_run_step(adopted.run.model, piece.remainder, piece.tie_indices, adopted.grad,
                                            adopted.exp_avg, adopted.exp_avg_sq, adopted.layout, tables[step], skip,
                                            None if scale is None else scale.reshape(())))
            # the checks start for the host now, behind this part's passes only (read in `finish`)
            self._queued.append((runs, steps, master_weights.HostChecks([step.stats for step in steps])))
        return loss

    def _params_kept(self, index: int, runs: list[_Adopted], params: list[list]) -> list[list]:
        """Each param group's parameters without the masters of `runs` (built again only when the runs or the
        groups' lists change: the same every step in between)."""
        run_ids = tuple(id(adopted.run) for adopted in runs)
        cached = self._kept_params.get(index)
        if cached is None or cached[0] != run_ids or len(cached[1]) != len(params) or \
                any(a is not b for a, b in zip(cached[1], params)):
            left_out = {id(m.master) for adopted in runs for m in adopted.run.members}
            cached = run_ids, tuple(params), [[p for p in group if id(p) not in left_out] for group in params]
            self._kept_params[index] = cached
        return cached[2]

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.info(message)


def initial_adam_step(param: Tensor, group: dict) -> Tensor:
    """Adam's step counter as torch's first step creates it: on the parameter's device for the fused and
    capturable implementations, on the host otherwise."""
    on_device = group.get("fused") or group.get("capturable")
    return torch.zeros((), dtype=torch.float32, device=param.device if on_device else None)


def _hyper_table(param_groups: Sequence[dict], step: int, device: torch.device) -> Tensor:
    """Every torch param group's `AdamScalars` row at `step`, on the device without waiting for it (pinned)."""
    rows = torch.tensor([AdamScalars(g["lr"], *g["betas"], g["eps"], g.get("weight_decay", 0.0), step).row()
                         for g in param_groups], dtype=torch.float32)
    if device.type != "cuda":
        return rows
    return rows.pin_memory().to(device, non_blocking=True)


# the CompactAdam of each optimizer that has one (weak: the optimizer owns its lifetime)
_ATTACHED: "weakref.WeakKeyDictionary[object, CompactAdam]" = weakref.WeakKeyDictionary()


def attach_compact_adam(optimizer, masters, grads_of: dict[int, Tensor]) -> CompactAdam:
    """Step this optimizer's released runs of compact masters (`masters`) here from now on."""
    stepper = CompactAdam(masters, master_weights.chained_parts(optimizer), grads_of)
    _ATTACHED[optimizer] = stepper
    return stepper


def compact_adam_of(optimizer) -> CompactAdam | None:
    return None if optimizer is None else _ATTACHED.get(optimizer)
