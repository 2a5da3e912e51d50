"""Compact master weights (`master_weights.py`): fp32 masters kept as bf16 weight + int16 remainder.

The split is checked bit for bit on adversarial values; on a tiny bf16 Qwen3 (CPU, Megatron DDP and
the distributed optimizer) training with the masters compacted must equal training without, bit for
bit (weights, Adam state, losses), with a skipped step, an offload round trip and checkpoints saved
with the feature on and loaded with it off (and the reverse) in between.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from skyrl_megatron import master_weights
from skyrl_megatron.master_weights import join_master, split_master
from skyrl_megatron.testing import run_on_ranks


def _floats(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def _adversarial_masters() -> torch.Tensor:
    special = []
    for sign in (0, 1 << 31):
        for magnitude in (
            0x00000000,  # zero
            0x7F800000,  # inf
            0x7F7FFFFF,  # the largest finite float: rounds up to inf
            0x00000001, 0x00007FFF, 0x00008000, 0x00018000, 0x0000FFFF, 0x007FFFFF,  # subnormals
            0x00807FFF, 0x007F8000,  # around the smallest normal
            0x3F7FFFFF, 0x3F7F8000, 0x3F7FFF7F,  # carries into the next exponent (1.0)
            0x3F808000, 0x3F818000,  # ties to even: down (even upper half), up (odd upper half)
            0x3F807FFF, 0x3F808001, 0x3F80FFFF, 0x3F800001,  # just around a rounding boundary
            0x4B7F8000, 0x4B7FFFFF, 0x00FF8000,
        ):
            special.append(sign | magnitude)
    generator = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(1 << 31), (1 << 31) - 1, (200_000,), dtype=torch.int64, generator=generator)
    random_values = random_bits.to(torch.int32).view(torch.float32)
    random_values = random_values[~torch.isnan(random_values)]  # every finite magnitude and sign, and inf
    ties = (torch.randint(0, 1 << 16, (5000,), generator=generator, dtype=torch.int32) << 16) | 0x8000
    ties = ties.view(torch.float32)
    scaled = torch.randn(50_000, generator=generator) * torch.logspace(-30, 30, 50_000)
    return torch.cat([_floats(special), random_values, ties[~torch.isnan(ties)], scaled])


def _use_kernels(monkeypatch, kernels: str) -> None:
    """"eager" (4M-element chunks) or "eager-7" (chunk borders everywhere); the GPU's Triton kernels run under
    Triton's interpreter (`_TRITON_CHECK`)."""
    chosen = {
        "eager": master_weights._EAGER,
        "eager-7": dataclasses.replace(master_weights._EAGER, chunk=7),
    }[kernels]
    monkeypatch.setattr(master_weights, "_kernels", lambda device: chosen)


@pytest.mark.parametrize("kernels", ["eager", "eager-7"])
def test_split_and_join_are_bitwise_exact_on_adversarial_values(monkeypatch, kernels):
    _use_kernels(monkeypatch, kernels)
    masters = _adversarial_masters()
    model = masters.to(torch.bfloat16)  # round to nearest even, as Megatron copies masters into the model
    remainder, ties = split_master(masters, model)
    assert remainder.dtype == torch.int16 and remainder.numel() == masters.numel()
    assert ties.numel() > 0  # ties rounded down to an even weight: the one remainder int16 lacks
    rebuilt = join_master(model, remainder, ties)
    assert torch.equal(rebuilt.view(torch.int32), masters.view(torch.int32))
    # the model weight is untouched and the sign of zero survives
    assert torch.equal(_floats([0x80000000]).view(torch.int32), join_master(
        _floats([0x80000000]).to(torch.bfloat16), *split_master(_floats([0x80000000]), _floats([0x80000000]).to(torch.bfloat16))
    ).view(torch.int32))


def test_the_eager_split_marks_ties_and_foreign_weights_per_element(monkeypatch):
    """Its per-element statuses: 0 in range, 1 a tie rounded down, OUT_OF_RANGE a weight not its master rounded
    (the Triton split keeps the same statuses per block: `_TRITON_CHECK`)."""
    _use_kernels(monkeypatch, "eager")
    split = master_weights._kernels(torch.device("cpu")).split
    # 1 + 2^-23 (rounds down, in range), a tie rounded down to even, a tie rounded up to even, 1.0 whose model says 2.0
    masters = _floats([0x3F800001, 0x3F808000, 0x3F818000, 0x3F800000])
    model = masters.to(torch.bfloat16)
    model[3] = 2.0
    remainder, status = split(masters.view(torch.int32), model.view(torch.int16))
    assert status.dtype == torch.int8 and status.tolist() == [0, 1, 0, master_weights.OUT_OF_RANGE]
    assert remainder.tolist()[:3] == [1, -(1 << 15), -(1 << 15)]
    for length in (1, 7, 4099):  # every output as long as its input
        values = torch.randn(length)
        remainder, status = split(values.view(torch.int32), values.to(torch.bfloat16).view(torch.int16))
        assert remainder.shape == status.shape == (length,) and int(status.max()) <= 1


def test_release_reads_each_groups_checks_at_once_and_rebuilds_exactly(monkeypatch):
    """Several masters, groups smaller than one master and chunks of 7: one host read per group, a
    master whose model weight is not its rounding kept in fp32, every other one rebuilt bit for bit."""
    from skyrl_megatron.master_weights import CompactMasterWeights

    _use_kernels(monkeypatch, "eager-7")
    monkeypatch.setattr(master_weights, "_GROUP_ELEMENTS", 60_000)
    values = _adversarial_masters()
    pieces = [values[i : i + 40_000].clone() for i in range(0, values.numel(), 40_000)]
    pairs = [(torch.nn.Parameter(piece, requires_grad=False), piece.to(torch.bfloat16)) for piece in pieces]
    pairs[1] = (pairs[1][0], -pairs[1][1])  # not its master rounded: kept in fp32
    expected = [master.detach().clone() for master, _ in pairs]
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.numel()) or real_tolist(self))
    masters = CompactMasterWeights(pairs)
    masters.release()
    assert len(reads) == -(-len(pieces) // 2)  # two 40k masters reach 60k elements: a group
    # each master its own run, gathered into the run's buffer and split whole: the released ones' storage freed
    held = [m.untyped_storage().nbytes() for m, _ in pairs]
    assert len(pieces) >= 3 and held == [0, 4 * 40_000] + [0] * (len(pieces) - 2)
    masters.rebuild()
    for (master, _), want in zip(pairs, expected):
        assert torch.equal(master.view(torch.int32), want.view(torch.int32))


def _record_splits_and_reads(monkeypatch) -> list[str]:
    """The eager kernels with each split and each host read of a group's checks recorded, in order; a group of
    1,000 elements."""
    events = []
    eager = master_weights._EAGER

    def split(bits, upper):
        events.append("split")
        return eager.split(bits, upper)

    monkeypatch.setattr(master_weights, "_kernels", lambda device: dataclasses.replace(eager, split=split))
    monkeypatch.setattr(master_weights, "_GROUP_ELEMENTS", 1000)
    real_read = master_weights.HostChecks.read
    monkeypatch.setattr(master_weights.HostChecks, "read", lambda self: events.append("read") or real_read(self))
    return events


def test_each_groups_checks_are_read_after_the_next_groups_split_is_queued(monkeypatch):
    """The device splits the next group while the host settles this one: with one master a group, the reads
    come one split behind (on a GPU a read then waits for its own group only: pinned, behind an event)."""
    from skyrl_megatron.master_weights import CompactMasterWeights

    events = _record_splits_and_reads(monkeypatch)
    values = _adversarial_masters()
    pairs = [(torch.nn.Parameter(piece.clone(), requires_grad=False), piece.to(torch.bfloat16))
             for piece in torch.split(values[:4000], 1000)]  # four separate storages: four runs, four groups
    expected = _bits(pairs)
    masters = CompactMasterWeights(pairs)
    masters.release()
    assert events == ["split", "split", "read", "split", "read", "split", "read", "read"]
    assert all(_holds_nothing(master) for master, _ in pairs)
    masters.rebuild()
    _assert_exact(pairs, expected)


def test_the_steps_copy_back_is_the_release_part_by_part_each_last_group_read_once_more_is_queued(monkeypatch):
    """Inside `writing_models` (the optimizer step) each part's copy back is its release: every model weight
    written as its master rounded (torch's rounding), the part's last group left unread until the next part's
    call (or the step's closing release), never split twice; the other part's weights untouched until its call.
    Outside (a checkpoint load's copy, say) nothing happens and the caller copies."""
    from skyrl_megatron.master_weights import CompactMasterWeights

    events = _record_splits_and_reads(monkeypatch)
    values = _adversarial_masters()[:4000]
    values = values[values.abs() < 1e30]  # room for a step
    pairs = [(torch.nn.Parameter(piece.clone(), requires_grad=False), piece.to(torch.bfloat16))
             for piece in torch.split(values, 1000)]  # four storages: four runs, four groups
    masters = CompactMasterWeights(pairs, parts=[0, 0, 1, 1])
    masters.release()
    masters.rebuild()
    generator = torch.Generator().manual_seed(3)
    for master, _ in pairs:  # the step's update
        master.data.add_(torch.randn(master.shape, generator=generator))
    expected, before = _bits(pairs), [model.clone() for _, model in pairs]

    assert not masters.round_into_models(0)  # outside the step
    assert all(torch.equal(model, old) for (_, model), old in zip(pairs, before))
    events.clear()
    with masters.writing_models():
        assert masters.round_into_models(0)
        assert events == ["split", "split", "read"]  # the part's last group not read yet
        assert all(torch.equal(model, want.view(torch.float32).to(torch.bfloat16))
                   for (_, model), want in zip(pairs[:2], expected[:2]))
        assert all(torch.equal(model, old) for (_, model), old in zip(pairs[2:], before[2:]))
        assert _holds_nothing(pairs[0][0]) and not _holds_nothing(pairs[1][0])
        assert masters.round_into_models(1)
        assert events == ["split", "split", "read", "split", "read", "split", "read"]
        assert all(_holds_nothing(master) for master, _ in pairs[:3]) and not _holds_nothing(pairs[3][0])
    masters.release()  # the step's closing release: the last group read, nothing split again
    assert events == ["split", "split", "read", "split", "read", "split", "read", "read"]
    assert all(_holds_nothing(master) for master, _ in pairs)
    assert all(torch.equal(model.view(torch.int16), want.view(torch.float32).to(torch.bfloat16).view(torch.int16))
               for (_, model), want in zip(pairs, expected))
    masters.rebuild()
    _assert_exact(pairs, expected)


def test_a_model_weight_that_is_not_its_master_rounded_is_refused():
    masters = torch.tensor([1.0, 2.0, 3.0])
    assert split_master(masters, torch.tensor([1.0, 2.5, 3.0], dtype=torch.bfloat16)) is None
    assert split_master(masters, -masters.to(torch.bfloat16)) is None
    nan = torch.tensor([float("nan")])
    parts = split_master(nan, nan.to(torch.bfloat16))  # refused, or else exact
    assert parts is None or torch.equal(join_master(nan.to(torch.bfloat16), *parts).view(torch.int32), nan.view(torch.int32))
    empty = torch.empty(0)
    remainder, ties = split_master(empty, empty.to(torch.bfloat16))
    assert remainder.numel() == 0 and join_master(empty.to(torch.bfloat16), remainder, ties).numel() == 0


# ----------------------------------------------------------------------------------------------
# Runs: model shards back to back in one buffer (as in Megatron's DDP), one kernel call per run
# ----------------------------------------------------------------------------------------------

_TIE_DOWN = 0x3F808000  # 1.00390625 + half an ulp: a tie rounded down to an even weight


def _back_to_back(pieces: list[list[torch.Tensor]]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(master, model shard) pairs: the masters separate fp32 tensors (as Megatron's optimizer allocates
    them), each list's model shards views of one bf16 buffer, each shard starting at a multiple of 64
    elements (Megatron's DDP padding), the first and last element of every master a tie rounded down."""
    pairs = []
    for storage in pieces:
        starts, end = [], 0
        for piece in storage:
            starts.append(end)
            end = -(-(end + piece.numel()) // 64) * 64
        buffer = torch.zeros(end, dtype=torch.bfloat16)
        for piece, start in zip(storage, starts):
            master = piece.clone()
            master.view(torch.int32)[[0, -1]] = _TIE_DOWN
            buffer[start : start + master.numel()] = master.to(torch.bfloat16)
            pairs.append((torch.nn.Parameter(master, requires_grad=False), buffer[start : start + master.numel()]))
    return pairs


def _counting(monkeypatch, kernels) -> dict[str, int]:
    """Use `kernels`, counting the calls of each function."""
    calls = {"split": 0, "tie_mask": 0, "join": 0}

    def counted(name):
        function = getattr(kernels, name)

        def call(*args):
            calls[name] += 1
            return function(*args)

        return call

    counting = dataclasses.replace(kernels, **{name: counted(name) for name in calls})
    monkeypatch.setattr(master_weights, "_kernels", lambda device: counting)
    return calls


def _holds_nothing(master: torch.Tensor) -> bool:
    """A released master: its run's buffer's storage resized to nothing (the master keeps its shape)."""
    return master.untyped_storage().nbytes() == 0


def _bits(pairs) -> list[torch.Tensor]:
    return [master.detach().view(torch.int32).clone() for master, _ in pairs]


def _assert_exact(pairs, expected) -> None:
    for (master, _), want in zip(pairs, expected, strict=True):
        assert torch.equal(master.detach().view(torch.int32), want)


def test_a_release_and_rebuild_make_one_kernel_call_per_run_not_per_tensor(monkeypatch):
    """Every release and rebuild is one kernel call per run, the first release after attach too (it gathers the
    optimizer's separate masters into each run's buffer first); from then on the masters stay views of it."""
    from skyrl_megatron.master_weights import CompactMasterWeights

    calls = _counting(monkeypatch, master_weights._EAGER)
    values = _adversarial_masters()
    sizes = [1000, 37, 4096, 129, 64, 2500, 7, 300]
    cut = torch.split(values[: sum(sizes) * 2], sizes * 2)
    pairs = _back_to_back([list(cut[: len(sizes)]), list(cut[len(sizes) :])])  # two buffers: two runs
    parameters, expected = [master for master, _ in pairs], _bits(pairs)
    masters = CompactMasterWeights(pairs)
    assert masters.runs == 2
    storages = None
    for _ in range(3):
        calls.update(split=0, tie_mask=0, join=0)
        for master in parameters:  # as the step hands them over (fp32 copies where the gradient buffer is bf16)
            master.grad = torch.zeros_like(master)
        masters.release()
        # (no tensor in these assertions: a released master's repr would read freed memory)
        assert all(_holds_nothing(master) for master in parameters) and len(masters.stored_tensors()) == 2 * 2
        assert [tuple(master.shape) for master in parameters] == [(n,) for n in sizes * 2]
        assert all(master.grad is None for master in parameters)  # no gradient memory held between steps
        masters.rebuild()
        assert calls == {"split": 2, "tie_mask": 2, "join": 2}  # every run has ties
        _assert_exact(pairs, expected)
        # no per-tensor re-pointing after the first gather: the same storage objects, released and given back
        storages = storages or [master.untyped_storage()._cdata for master in parameters]
        assert [master.untyped_storage()._cdata for master in parameters] == storages
    # the same Parameter objects (Adam's state is keyed by them), each run's masters views of one buffer
    assert all(a is b for a, b in zip(parameters, [master for master, _ in pairs], strict=True))
    first, second = parameters[: len(sizes)], parameters[len(sizes) :]
    for run in (first, second):
        assert len({master.untyped_storage().data_ptr() for master in run}) == 1
    assert first[0].untyped_storage().data_ptr() != second[0].untyped_storage().data_ptr()


def test_released_runs_are_left_alone_by_a_second_release_and_follow_a_master_given_other_storage(monkeypatch):
    """Released runs (their buffers' storage freed) are not split again by a release without a rebuild between; a
    writing materialise rebuilds and releases them exactly; a master given storage of its own after a rebuild has
    its run gathered into a buffer again at the next release (its new values kept, bit for bit): one call a run."""
    from skyrl_megatron.master_weights import CompactMasterWeights

    calls = _counting(monkeypatch, master_weights._EAGER)
    values = _adversarial_masters()
    sizes = [1000, 37, 4096, 129]
    pairs = _back_to_back([list(torch.split(values[: sum(sizes)], sizes))])
    parameters, expected = [master for master, _ in pairs], _bits(pairs)
    masters = CompactMasterWeights(pairs)
    masters.release()
    calls.update(split=0, tie_mask=0, join=0)
    masters.release()
    assert calls["split"] == 0 and masters.released and all(_holds_nothing(master) for master in parameters)
    with masters.materialised():
        _assert_exact(pairs, expected)
    assert masters.released and all(_holds_nothing(master) for master in parameters)
    masters.rebuild()
    _assert_exact(pairs, expected)

    # a master given a tensor of its own (as a load that replaced `.data` would): its run is gathered again
    own = parameters[2].detach().clone()
    parameters[2].data = own
    calls.update(split=0, tie_mask=0, join=0)
    masters.release()
    assert calls["split"] == 1 and all(_holds_nothing(master) for master in parameters)
    masters.rebuild()
    _assert_exact(pairs, expected)
    assert len({master.untyped_storage().data_ptr() for master in parameters}) == 1  # views of one buffer again
    calls.update(split=0, tie_mask=0, join=0)
    masters.release()
    masters.rebuild()
    assert calls["split"] == 1 and calls["join"] == 1
    _assert_exact(pairs, expected)


def test_a_read_only_materialise_returns_the_masters_to_their_remainders_without_splitting_again(monkeypatch):
    """A save reads the masters: inside the read-only block they are exact; after it each run is released again with
    what stood for it (the same remainder and tie tensors), with no split kernel and no read of its checks; the next
    rebuild is exact."""
    from skyrl_megatron.master_weights import CompactMasterWeights

    calls = _counting(monkeypatch, master_weights._EAGER)
    values = _adversarial_masters()
    sizes = [1000, 37, 4096, 129]
    pairs = _back_to_back([list(torch.split(values[: sum(sizes)], sizes))])
    expected = _bits(pairs)
    masters = CompactMasterWeights(pairs)
    masters.release()
    assert calls["split"] == 1 and masters.released
    stored = masters.stored_tensors()
    assert len(stored) == 2  # one remainder and one list of ties for the run
    settled = []
    monkeypatch.setattr(master_weights, "_settle", lambda group, checks: settled.append(group) or (0, 0))
    for _ in range(2):
        calls.update(split=0, tie_mask=0, join=0)
        with masters.materialised(read_only=True):
            _assert_exact(pairs, expected)
        assert calls == {"split": 0, "tie_mask": 0, "join": 1} and not settled
        assert masters.released and all(_holds_nothing(master) for master, _ in pairs)
        assert all(a is b for a, b in zip(masters.stored_tensors(), stored, strict=True))
    monkeypatch.undo()
    masters.rebuild()
    _assert_exact(pairs, expected)


def _corrupt(model: torch.Tensor, index: int) -> None:
    """Flip an exponent bit: the weight is no longer its master rounded."""
    model.view(torch.int16)[index] ^= 0x4000


def test_runs_are_exact_across_their_borders_and_a_failing_run_stays_in_fp32(monkeypatch):
    """Adversarial values cut into shards of odd lengths (padding between them), ties at every border,
    runs capped by the group size; a run whose model weight was written by something else keeps all of
    its masters in fp32 (exact), the others are released; once the weight is right again, it is too."""
    from skyrl_megatron.master_weights import CompactMasterWeights

    _use_kernels(monkeypatch, "eager-7")
    monkeypatch.setattr(master_weights, "_GROUP_ELEMENTS", 50_000)
    values = _adversarial_masters()
    generator = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 2000, (200,), generator=generator).tolist()
    cut = list(torch.split(values[: sum(sizes)], sizes))
    pairs = _back_to_back([cut[:120], cut[120:]])
    expected = _bits(pairs)
    masters = CompactMasterWeights(pairs)
    assert 4 <= masters.runs < 10  # capped by the group size, and apart per buffer
    masters.release()  # gathered into one buffer per run
    masters.rebuild()
    _assert_exact(pairs, expected)

    victim = 50  # a master in the middle of a run: its whole run stays in fp32
    _corrupt(pairs[victim][1], 3)
    masters.release()
    kept = [i for i, (master, _) in enumerate(pairs) if not _holds_nothing(master)]
    assert victim in kept and len(pairs) > len(kept) > 1
    storage = pairs[victim][0].untyped_storage().data_ptr()
    assert all(pairs[i][0].untyped_storage().data_ptr() == storage for i in kept)  # the run, as a whole
    masters.rebuild()
    _assert_exact(pairs, expected)

    _corrupt(pairs[victim][1], 3)  # right again
    masters.release()
    assert all(_holds_nothing(master) for master, _ in pairs)
    masters.rebuild()
    _assert_exact(pairs, expected)


def test_an_offload_parks_a_kept_run_whole(monkeypatch):
    """Masters kept in fp32 are views of their run's buffer: the offloader parks (and frees) that whole
    buffer, not only the first view it meets, along with the released runs' remainders."""
    from skyrl_megatron.master_weights import CompactMasterWeights
    from skyrl_megatron.workers.offload import ModelOffloader

    values = _adversarial_masters()
    cut = list(torch.split(values[:20_000], [3000, 5000, 2000] * 2))
    pairs = _back_to_back([cut[:3], cut[3:]])
    expected = _bits(pairs)
    masters = CompactMasterWeights(pairs)
    masters.release()
    masters.rebuild()
    _corrupt(pairs[4][1], 0)  # the second run stays in fp32: three views of one buffer
    masters.release()
    assert [_holds_nothing(master) for master, _ in pairs] == [True] * 3 + [False] * 3
    kept_buffer = pairs[3][0].untyped_storage().nbytes()
    assert kept_buffer == 4 * (3008 + 5056 + 2000)  # the run's span: its shards and the padding between
    to_park = kept_buffer + sum(t.untyped_storage().nbytes() for t in masters.stored_tensors())
    optimizer = torch.optim.Adam([master for master, _ in pairs])
    monkeypatch.setitem(master_weights._ATTACHED, optimizer, masters)
    offloader = ModelOffloader([])
    offloader.offload(model=False, optimizer=True, optimizer_obj=optimizer, pin_memory=False)
    held = [t.untyped_storage().nbytes() for t in [master for master, _ in pairs] + masters.stored_tensors()]
    assert held == [0] * len(held)
    assert sum(p.host.numel() * p.host.element_size() for p in offloader._parked["optimizer"]) == to_park
    offloader.backload(model=False, optimizer=True, optimizer_obj=optimizer)
    _corrupt(pairs[4][1], 0)
    masters.rebuild()
    _assert_exact(pairs, expected)


# ----------------------------------------------------------------------------------------------
# On a model (CPU ranks)
# ----------------------------------------------------------------------------------------------

SEQ = 16
HOST_OPTIMIZER = {"lr": 1e-2, "adam_betas": [0.8, 0.95], "weight_decay": 0.1, "max_grad_norm": 1.0,
                  "num_warmup_steps": 1, "scheduler": "cosine"}
# Megatron's unfused cross-entropy: the fused one is torch.compile'd, which costs a fresh CPU rank ~20 s
UNFUSED_LOSS = {"cross_entropy_loss_fusion": False}
# the step schedule both runs take: a poisoned (non-finite, skipped) step in the middle
STEPS = ("train", "train", "poison", "train", "train")


def _build(hf_dir: str, compact: bool, *, dtype: str = "bf16", distributed_optimizer: bool = True, parallel=None,
           compact_adam: bool = False):
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.optim import OptimizerSettings
    from skyrl_megatron.parallel import ParallelConfig

    built = build_model(ModelSpec(
        hf_dir, parallel=parallel or ParallelConfig(), dtype=dtype, transformer_overrides=UNFUSED_LOSS, wrap_with_ddp=True,
        ddp_config={"use_distributed_optimizer": distributed_optimizer, "grad_reduce_in_fp32": True},
    ))
    settings = OptimizerSettings.from_host_config(HOST_OPTIMIZER, {}, num_training_steps=8, dtype=dtype)
    optimizer = settings.build_optimizer(built.chunks, compact_master_weights=compact, compact_adam=compact_adam)
    return built, optimizer, settings.build_scheduler(optimizer)


def _step(built, optimizer, scheduler, rank: int, poison: bool = False):
    """One optimizer step on this rank's fixed tokens; (loss, StepResult)."""
    from megatron.core.distributed import finalize_model_grads

    from skyrl_megatron.optim import optimizer_step

    (model,) = built.chunks
    tokens = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(10 + rank))
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens[:, :-1], torch.arange(SEQ).unsqueeze(0), None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    finalize_model_grads([model])
    if poison:
        next(model.parameters()).main_grad.view(-1)[0] = float("nan")
    return loss.item(), optimizer_step(optimizer, scheduler)


def _optimizer_params(optimizer) -> list[torch.Tensor]:
    from skyrl_megatron.optim import torch_optimizers

    return [p for inner in torch_optimizers(optimizer) for g in inner.param_groups for p in g["params"]]


def _state(built, optimizer) -> dict:
    """Model weights, fp32 masters and Adam state (the masters rebuilt for the copy when compact)."""
    from skyrl_megatron.master_weights import masters_materialised
    from skyrl_megatron.optim import torch_optimizers

    with masters_materialised(optimizer):
        masters = [p.detach().clone() for p in _optimizer_params(optimizer)]
        adam = [
            {k: v.clone() for k, v in inner.state[p].items()}
            for inner in torch_optimizers(optimizer) for g in inner.param_groups for p in g["params"]
        ]
    weights = {name: p.detach().clone() for name, p in built.chunks[0].named_parameters()}
    return {"weights": weights, "masters": masters, "adam": adam}


def _held_bytes(optimizer) -> dict[str, int]:
    """Storage the optimizer holds: its fp32 masters, their remainders and Adam's state (each storage once: with
    compact adam the moments are views of one buffer per run)."""
    from skyrl_megatron.master_weights import compact_masters_of
    from skyrl_megatron.optim import torch_optimizers

    masters = compact_masters_of(optimizer)
    stored = masters.stored_tensors() if masters is not None else []
    state = [v for inner in torch_optimizers(optimizer) for s in inner.state.values() for v in s.values()]
    return {
        "masters": sum(p.untyped_storage().nbytes() for p in _optimizer_params(optimizer)),
        "remainders": sum(t.untyped_storage().nbytes() for t in stored),
        "adam": sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                     for t in state if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()}.values()),
    }


def _train(built, optimizer, scheduler, rank: int, offload_after: int | None = None) -> dict:
    from skyrl_megatron.workers.offload import ModelOffloader

    losses, results, states, held, parked = [], [], [], [], None
    for index, kind in enumerate(STEPS):
        loss, result = _step(built, optimizer, scheduler, rank, poison=kind == "poison")
        losses.append(loss)
        results.append((result.skipped, repr(result.grad_norm)))  # repr: nan == nan
        held.append(_held_bytes(optimizer))
        states.append(_state(built, optimizer))
        if index == offload_after:
            offloader = ModelOffloader(built.chunks)
            offloader.offload(model=True, optimizer=True, optimizer_obj=optimizer, pin_memory=False)
            parked = _held_bytes(optimizer)
            offloader.backload(model=True, optimizer=True, optimizer_obj=optimizer)
    return {"losses": losses, "results": results, "states": states, "held": held, "parked": parked}


def _reference_adam(optimizer, torch_first: bool = False) -> None:
    """Every torch step as `compact_adam.adam_step_reference` per parameter, with the step's skip flag and clip
    divisor, Adam's state made at the first step as torch makes it: what compact adam does to its runs.
    `torch_first`: the first step torch's own."""
    from skyrl_megatron.compact_adam import AdamScalars, adam_step_reference, initial_adam_step, scalar_table
    from skyrl_megatron.optim import torch_optimizers

    for adam in torch_optimizers(optimizer):
        calls = []

        def step(closure=None, adam=adam, real_step=adam.step, calls=calls):
            calls.append(1)
            if torch_first and len(calls) == 1:
                return real_step(closure)
            skip = getattr(adam, "found_inf", None)
            skip = torch.zeros(()) if skip is None else skip.reshape(())
            scale = getattr(adam, "grad_scale", None)
            with torch.no_grad():
                for group in adam.param_groups:
                    for param in group["params"]:
                        if param.grad is None:
                            continue
                        state = adam.state[param]
                        if not state:
                            state.update(step=initial_adam_step(param, group), exp_avg=torch.zeros_like(param),
                                         exp_avg_sq=torch.zeros_like(param))
                        scalars = AdamScalars(group["lr"], *group["betas"], group["eps"], group["weight_decay"],
                                              int(state["step"]) + 1)
                        adam_step_reference(param.data.view(-1), param.grad.view(-1), state["exp_avg"].view(-1),
                                            state["exp_avg_sq"].view(-1), [(0, param.numel(), 0)],
                                            scalar_table([scalars], param.device), skip,
                                            None if scale is None else scale.reshape(()))
                        if not skip:
                            state["step"] += 1

        adam.step = step


def _compact_against_plain(rank, world, hf_dir, layout=None, compact_adam=False):
    from skyrl_megatron.master_weights import compact_masters_of, masters_materialised
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig(**(layout or {}))
    initialize_model_parallel(parallel, seed=0)
    built, optimizer, scheduler = _build(hf_dir, compact=False, parallel=parallel)
    if compact_adam:
        _reference_adam(optimizer)
    plain = _train(built, optimizer, scheduler, rank)
    built, optimizer, scheduler = _build(hf_dir, compact=True, parallel=parallel, compact_adam=compact_adam)
    initial = _held_bytes(optimizer)  # released as soon as the optimizer is built
    from skyrl_megatron.master_weights import chained_parts

    releases_written = []  # each step's copy back made by the release (`round_into_models`), by chain part
    hooked = [index for index, part in enumerate(chained_parts(optimizer)) if hasattr(part, "_skyrl_write_models")]
    for index in hooked:
        part = chained_parts(optimizer)[index]
        part._skyrl_write_models = (lambda real, index: lambda: releases_written.append(index) or real())(
            part._skyrl_write_models, index)
    compact = _train(built, optimizer, scheduler, rank, offload_after=1)
    numel = sum(p.numel() for p in built.chunks[0].parameters())
    with masters_materialised(optimizer):  # gathered: the masters of a run share one buffer
        masters = [p for p in _optimizer_params(optimizer) if p.numel()]
        runs = {"runs": compact_masters_of(optimizer).runs, "masters": len(masters),
                "buffers": len({p.untyped_storage().data_ptr() for p in masters})}
    parts = len(chained_parts(optimizer))
    from skyrl_megatron.compact_adam import compact_adam_of

    stepper = compact_adam_of(optimizer)
    return {"plain": plain, "compact": compact, "initial": initial, "numel": numel, "runs": runs,
            "releases_written": releases_written, "parts": parts, "hooked": hooked,
            "adopted_runs": None if stepper is None else stepper.adopted_runs}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    for name, weight in a["weights"].items():
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, b["weights"][name]), name
    assert len(a["masters"]) == len(b["masters"]) > 0
    for x, y in zip(a["masters"], b["masters"]):
        assert x.dtype == torch.float32 and torch.equal(x.view(torch.int32), y.view(torch.int32))
    for x, y in zip(a["adam"], b["adam"], strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,world,layout",
    [
        ("qwen3", 1, {}),
        ("qwen3", 2, {}),  # data parallel: the distributed optimizer shards the masters
        ("qwen3", 2, {"tensor": 2}),  # each rank's masters are its TP shards
        ("qwen3_moe", 2, {"expert": 2}),  # a chained optimizer: dense and expert parameters apart
    ],
)
def test_compact_masters_train_bitwise_like_fp32_masters(tmp_path, family, world, layout):
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model(family, tmp_path, seed=5))
    for result in run_on_ranks(_compact_against_plain, world, hf_dir, layout, timeout=600):
        _assert_compact_trained_as_plain(result, family, world, layout, compact_adam=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,world,layout",
    [
        ("qwen3", 1, {}),
        ("qwen3", 2, {}),  # data parallel: each rank steps its shard of every run
        ("qwen3_moe", 2, {"expert": 2}),  # a chained optimizer: both parts' runs stepped here
    ],
)
def test_compact_adam_trains_bitwise_like_its_definition_on_fp32_masters(tmp_path, family, world, layout):
    """Compact adam (the released runs stepped without rebuilding their masters) against fp32 masters stepped by
    `adam_step_reference` per parameter from the first step on: losses, norms, the skipped step, weights, masters
    and Adam's state bit for bit, through an offload round trip; every run adopted, every part copying back through
    the release."""
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model(family, tmp_path, seed=5))
    for result in run_on_ranks(_compact_against_plain, world, hf_dir, layout, True, timeout=600):
        _assert_compact_trained_as_plain(result, family, world, layout, compact_adam=True)
        assert result["adopted_runs"] == result["runs"]["runs"]


_TRITON_TRAINING = """
import os
import sys
sys.path.insert(0, TESTS)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from skyrl_megatron import compact_adam
from skyrl_megatron import compact_adam_kernels as kernels
# every run's layout with the pass's block table: queue_run_step takes the GPU's branch on these CPU tensors
compact_adam.run_layout = lambda spans, device: compact_adam.RunLayout(tuple(spans), kernels.block_table(spans, device))
passes, real_pass = [], kernels.adam_round_split
kernels.adam_round_split = lambda *args: passes.append(1) or real_pass(*args)
import test_master_weights as t
result = t._compact_against_plain(0, 1, HF_DIR, None, True)
t._assert_compact_trained_as_plain(result, "qwen3", 1, {}, compact_adam=True)
assert result["adopted_runs"] == result["runs"]["runs"] > 0
assert len(passes) == len(t.STEPS) * result["runs"]["runs"], len(passes)  # every step, the skipped one too
print("trained")
"""


@pytest.mark.slow
def test_compact_adam_trains_through_the_triton_pass_as_through_its_definition(tmp_path):
    """The training above at world 1 with every run stepped by the GPU's branch (the Triton pass under Triton's
    interpreter, the ties raised into the weights, found again from the pass's bits, the checks read together):
    bitwise the fp32 masters stepped by the eager definition, through a skipped step and an offload."""
    from skyrl_megatron.testing import last_word_under_triton_interpreter, make_tiny_hf_model
    from skyrl_megatron.testing.distributed import free_port

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path, seed=5))
    script = f"TESTS = {str(Path(__file__).parent)!r}\nHF_DIR = {hf_dir!r}\nPORT = {str(free_port())!r}\n"
    assert last_word_under_triton_interpreter(script + _TRITON_TRAINING, timeout=600) == "trained"


def _assert_compact_trained_as_plain(result, family, world, layout, compact_adam: bool) -> None:
    plain, compact = result["plain"], result["compact"]
    assert compact["losses"] == plain["losses"]
    assert compact["results"] == plain["results"]
    assert [skipped for skipped, _ in plain["results"]] == [kind == "poison" for kind in STEPS]
    for a, b in zip(plain["states"], compact["states"], strict=True):
        _assert_same_state(a, b)
    # between steps the fp32 masters hold no storage; the remainders take about half of it
    assert result["initial"]["masters"] == 0 and result["initial"]["remainders"] > 0
    for held_plain, held_compact in zip(plain["held"], compact["held"], strict=True):
        assert held_plain["remainders"] == 0 and held_plain["masters"] > 0
        assert held_compact["masters"] == 0
        assert held_plain["masters"] // 2 <= held_compact["remainders"] < held_plain["masters"] // 2 * 1.01
        # compact adam's moments: one buffer per run, the padding between its tensors included
        assert held_plain["adam"] <= held_compact["adam"] <= (held_plain["adam"] * 1.01 if compact_adam
                                                              else held_plain["adam"])
    # each rank's masters are its share of its model part: all of it without data parallelism
    shared, data_parallel = plain["held"][0]["masters"], world // layout.get("tensor", 1)
    assert shared == 4 * result["numel"] if data_parallel == 1 else 0 < shared < 4 * result["numel"]
    # the model shards lie back to back in DDP's buffer: a few runs, each one buffer of masters
    runs = result["runs"]
    assert runs["buffers"] == runs["runs"] <= 4 < runs["masters"], runs
    # the chain's last part (the chained MoE has two) copied back through the release at every step, the
    # poisoned one's too (its skip decided on the device, the update left out); an earlier part copies, but with
    # compact adam, whose released runs hold no masters to copy
    parts = result["parts"]
    assert parts == (2 if family == "qwen3_moe" else 1)
    written = list(range(parts)) if compact_adam else [parts - 1]
    assert result["hooked"] == written
    assert result["releases_written"] == written * len(STEPS), result["releases_written"]
    # offloaded, the remainders left with Adam's state (and came back: the later steps match)
    assert compact["parked"] == {"masters": 0, "remainders": 0, "adam": compact["parked"]["adam"]}
    assert compact["parked"]["adam"] < plain["held"][1]["adam"]


def _chunk_weights(chunks) -> dict[str, torch.Tensor]:
    return {f"{index}.{name}": p.detach().clone() for index, chunk in enumerate(chunks) for name, p in chunk.named_parameters()}


def _pipeline_training(rank, world, hf_dir, compact):
    from skyrl_megatron.testing.policy_steps import policy_steps

    return policy_steps(rank, world, hf_dir, {"pipeline": 2, "virtual_pipeline": 2}, {"micro_batch_size": 2},
                        dtype="bf16", compact_master_weights=compact, steps=3, lr=1e-2, inspect=_chunk_weights)


@pytest.mark.slow
def test_compact_masters_train_bitwise_like_fp32_masters_under_virtual_pipeline_stages(tmp_path):
    """PP2 x VPP2 through the policy's runner (the pipeline schedule, two model chunks per rank, each its own DDP
    buffer): the host's policy loss, its metrics and every stage's weights after three steps are those of fp32
    masters, bit for bit."""
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path, seed=5))
    plain, compact = (run_on_ranks(_pipeline_training, 2, hf_dir, flag, timeout=600) for flag in (False, True))
    for rank, (a, b) in enumerate(zip(plain, compact, strict=True)):
        assert a["history"] == b["history"], rank
        before, after = a["inspected"]
        assert len({name.split(".")[0] for name in after}) == 2  # two model chunks on this stage
        assert after.keys() == b["inspected"][1].keys()
        for name, weight in after.items():
            assert weight.dtype == torch.bfloat16 and torch.equal(weight, b["inspected"][1][name]), (rank, name)
        assert any(not torch.equal(after[name], before[name]) for name in after)  # it trained
    assert all(math.isfinite(step["grad_norm"]) for step in plain[0]["history"])


def _checkpoints_across_the_switch(rank, world, hf_dir, root):
    """Save after 2 steps with the key on (off), load into a fresh model with it off (on), 2 more steps;
    and the weights-only load of a worker (`load_optimizer_states=False`), which reloads the masters."""
    from skyrl_megatron.checkpoint import load_checkpoint, save_checkpoint
    from skyrl_megatron.master_weights import compact_masters_of, masters_materialised
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(), seed=0)
    report = {}
    for saved_compact in (False, True):
        path = f"{root}/compact_{saved_compact}"
        built, optimizer, scheduler = _build(hf_dir, compact=saved_compact)
        for _ in range(2):
            _step(built, optimizer, scheduler, rank)
        saved_state = _state(built, optimizer)
        save_checkpoint(path, built.chunks, optimizer, scheduler, step=2)
        after_save = _held_bytes(optimizer)
        uninterrupted = [_step(built, optimizer, scheduler, rank) for _ in range(2)]

        built, optimizer, scheduler = _build(hf_dir, compact=not saved_compact)
        load_checkpoint(path, built.chunks, optimizer, scheduler)
        loaded_state, after_load = _state(built, optimizer), _held_bytes(optimizer)
        resumed = [_step(built, optimizer, scheduler, rank) for _ in range(2)]
        report[saved_compact] = {
            "saved": saved_state, "loaded": loaded_state, "after_save": after_save, "after_load": after_load,
            "uninterrupted": [(loss, r.skipped, r.grad_norm) for loss, r in uninterrupted],
            "resumed": [(loss, r.skipped, r.grad_norm) for loss, r in resumed],
            "resumed_state": _state(built, optimizer),
        }

    # weights only, through the worker's own load (`load_optimizer_states=False`): the masters restart
    # from the loaded weights
    from types import SimpleNamespace

    from skyrl_megatron.workers.training import TrainedRoleMixin

    built, optimizer, scheduler = _build(hf_dir, compact=True)
    worker = SimpleNamespace(built=built, optimizer=optimizer, scheduler=scheduler, manual_gc=None)
    TrainedRoleMixin._load_checkpoint(worker, f"{root}/compact_True", load_optimizer_states=False,
                                      load_lr_scheduler_states=True)
    weights_only = _state(built, optimizer)
    report["weights_only"] = {
        "released": compact_masters_of(optimizer).released,
        "masters_are_weights": all(
            torch.equal(master, model.float())
            for master, model in zip(weights_only["masters"], _bf16_shards(optimizer), strict=True)
        ),
        "weights": weights_only["weights"],
    }
    return report


def _bf16_shards(optimizer) -> list[torch.Tensor]:
    return [shard for part in optimizer.chained_optimizers for group in part.shard_float16_groups for shard in group]


@pytest.mark.slow
def test_checkpoints_are_interchangeable_with_and_without_compact_masters(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=5))
    (report,) = run_on_ranks(_checkpoints_across_the_switch, 1, hf_dir, str(tmp_path / "ckpt"), timeout=600)
    for saved_compact in (False, True):
        run = report[saved_compact]
        _assert_same_state(run["saved"], run["loaded"])  # the fp32 masters were saved and loaded exactly
        assert run["resumed"] == run["uninterrupted"]  # and the resumed steps are bitwise the same
        # the compact side is released again after the save, and after the load
        compact_held = run["after_save"] if saved_compact else run["after_load"]
        assert compact_held["masters"] == 0 and compact_held["remainders"] > 0
    # the same training with the key on and off: the two resumed runs agree too
    assert report[True]["resumed"] == report[False]["resumed"]
    _assert_same_state(report[True]["resumed_state"], report[False]["resumed_state"])
    weights_only = report["weights_only"]
    assert weights_only["released"] and weights_only["masters_are_weights"]
    for name, weight in weights_only["weights"].items():
        assert torch.equal(weight, report[True]["saved"]["weights"][name]), name


def _compact_adam_resumed(rank, world, hf_dir, root):
    """Two steps with compact adam, a save, two more; the same optimizer loads the save and takes the same two
    steps (its runs' state replaced under them: adopted again), and so does a fresh one; a fresh one that loads
    the weights only adopts its runs at its first step, their state made as torch's first step makes it."""
    from skyrl_megatron.checkpoint import load_checkpoint, save_checkpoint
    from skyrl_megatron.compact_adam import compact_adam_of
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(), seed=0)
    built, optimizer, scheduler = _build(hf_dir, compact=True, compact_adam=True)
    for _ in range(2):
        _step(built, optimizer, scheduler, rank)
    saved = _state(built, optimizer)
    save_checkpoint(root, built.chunks, optimizer, scheduler, step=2)
    uninterrupted = [_step(built, optimizer, scheduler, rank) for _ in range(2)]
    adopted = [compact_adam_of(optimizer).adopted_runs]
    # into the same optimizer (its runs' state replaced under them: adopted again), then into a fresh one
    load_checkpoint(root, built.chunks, optimizer, scheduler)
    again = [_step(built, optimizer, scheduler, rank) for _ in range(2)]
    adopted.append(compact_adam_of(optimizer).adopted_runs)
    built, optimizer, scheduler = _build(hf_dir, compact=True, compact_adam=True)
    load_checkpoint(root, built.chunks, optimizer, scheduler)
    loaded = _state(built, optimizer)
    resumed = [_step(built, optimizer, scheduler, rank) for _ in range(2)]
    adopted.append(compact_adam_of(optimizer).adopted_runs)
    # weights only (a worker's `load_optimizer_states=False`): no Adam state before the first step
    from types import SimpleNamespace

    from skyrl_megatron.workers.training import TrainedRoleMixin

    built, optimizer, scheduler = _build(hf_dir, compact=True, compact_adam=True)
    worker = SimpleNamespace(built=built, optimizer=optimizer, scheduler=scheduler, manual_gc=None)
    TrainedRoleMixin._load_checkpoint(worker, root, load_optimizer_states=False, load_lr_scheduler_states=True)
    weights_only = []
    for _ in range(2):
        _step(built, optimizer, scheduler, rank)
        weights_only.append(compact_adam_of(optimizer).adopted_runs)
    return {"saved": saved, "loaded": loaded, "adopted": adopted, "weights_only": weights_only,
            "uninterrupted": [(loss, r.skipped, r.grad_norm) for loss, r in uninterrupted],
            "again": [(loss, r.skipped, r.grad_norm) for loss, r in again],
            "resumed": [(loss, r.skipped, r.grad_norm) for loss, r in resumed]}


@pytest.mark.slow
def test_compact_adam_resumes_bitwise_from_its_checkpoint(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=5))
    (report,) = run_on_ranks(_compact_adam_resumed, 1, hf_dir, str(tmp_path / "ckpt"), timeout=600)
    _assert_same_state(report["saved"], report["loaded"])  # the moments' run buffers saved and loaded exactly
    assert report["resumed"] == report["again"] == report["uninterrupted"]
    assert report["adopted"][0] == report["adopted"][1] == report["adopted"][2] > 0
    assert report["weights_only"] == [report["adopted"][0]] * 2  # adopted at the first step, no state yet


def _compact_adam_from_partial_state(rank, world, hf_dir):
    """Compact adam where one master of the run has Adam state before the first step and the others not; against
    fp32 masters whose first step is torch's and the later ones `adam_step_reference`."""
    from skyrl_megatron.compact_adam import compact_adam_of, initial_adam_step
    from skyrl_megatron.optim import torch_optimizers
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(), seed=0)
    built, optimizer, scheduler = _build(hf_dir, compact=False)
    _reference_adam(optimizer, torch_first=True)
    plain = [_step(built, optimizer, scheduler, rank) for _ in range(3)]
    plain_state = _state(built, optimizer)
    built, optimizer, scheduler = _build(hf_dir, compact=True, compact_adam=True)
    (adam,) = torch_optimizers(optimizer)
    group = adam.param_groups[0]
    first = group["params"][0]
    adam.state[first] = {"step": initial_adam_step(first, group), "exp_avg": torch.zeros_like(first),
                         "exp_avg_sq": torch.zeros_like(first)}  # what torch's first step would make
    compact, adopted = [], []
    for _ in range(3):
        compact.append(_step(built, optimizer, scheduler, rank))
        adopted.append(compact_adam_of(optimizer).adopted_runs)
    return {"plain": [(loss, r.grad_norm) for loss, r in plain], "compact": [(loss, r.grad_norm) for loss, r in compact],
            "plain_state": plain_state, "compact_state": _state(built, optimizer), "adopted": adopted}


@pytest.mark.slow
def test_a_run_with_adam_state_on_some_masters_only_is_left_to_torch_until_its_state_is_whole(tmp_path):
    """Not adopted at the first step (torch's Adam steps the rebuilt run and completes its state), adopted from the
    second on: bit for bit fp32 masters stepped the same way."""
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path, seed=5))
    (report,) = run_on_ranks(_compact_adam_from_partial_state, 1, hf_dir, timeout=300)
    assert report["adopted"] == [0, 1, 1]  # the tiny model's masters: one run
    assert report["compact"] == report["plain"]
    _assert_same_state(report["plain_state"], report["compact_state"])


# ----------------------------------------------------------------------------------------------
# Where compact master weights cannot apply
# ----------------------------------------------------------------------------------------------

MC = "trainer.policy.megatron_config"


def test_the_config_check_refuses_compact_masters_where_they_cannot_apply(compose, hf_config_dir):
    from skyrl_megatron.config import ConfigError
    from skyrl_megatron.validation import validate_config

    gpus = (*(f"trainer.placement.{role}_num_gpus_per_node=4" for role in ("policy", "ref", "critic")),
            "generator.inference_engine_tensor_parallel_size=4")
    base = (*gpus, f"trainer.policy.model.path={hf_config_dir()}", f"{MC}.compact_master_weights=true")
    validate_config(compose(*base))  # our defaults: bf16, distributed optimizer, torch Adam
    with pytest.raises(ConfigError) as info:
        validate_config(compose(
            *base, f"{MC}.ddp_config.use_distributed_optimizer=false", "trainer.bf16=false",
            f"{MC}.optimizer_config_kwargs.use_precision_aware_optimizer=true",
            f"{MC}.optimizer_config_kwargs.optimizer_cpu_offload=true",
        ))
    message = str(info.value)
    key = f"{MC}.compact_master_weights"
    assert message.count(key) == 4
    for fix in ("use_distributed_optimizer=true", "trainer.bf16=true", "use_precision_aware_optimizer=false",
                "optimizer_cpu_offload=false"):
        assert fix in message


@pytest.mark.parametrize(
    ("role", "megatron_config", "bf16", "named"),
    [
        ("ref", {}, True, "the reference model has no optimizer"),
        ("policy", {"optimizer_config_kwargs": {"optimizer": "sgd"}}, True, "optimizer='sgd'"),
        ("policy", {"optimizer_config_kwargs": {"fp16": True}}, True, "needs bf16"),
        ("policy", {}, False, "needs bf16"),
        ("critic", {"ddp_config": {"use_distributed_optimizer": True, "use_megatron_fsdp": True}}, True, "use_megatron_fsdp"),
        ("policy", {"ddp_config": {}}, True, "distributed optimizer"),
    ],
)
def test_each_refusal_names_the_key(role, megatron_config, bf16, named):
    from omegaconf import OmegaConf

    from skyrl_megatron.config import MegatronWorkerConfig, _compact_master_weight_problems

    mc = MegatronWorkerConfig.from_mapping({
        "ddp_config": {"use_distributed_optimizer": True}, **megatron_config, "compact_master_weights": True,
    })
    cfg = OmegaConf.create({"trainer": {"bf16": bf16}})
    prefix = f"trainer.{role}.megatron_config"
    problems = _compact_master_weight_problems(cfg, role, prefix, mc)
    assert len(problems) == 1 and problems[0].key == f"{prefix}.compact_master_weights"
    assert named in str(problems[0])
    mc.compact_master_weights = "yes"
    assert "must be true, false or auto" in str(_compact_master_weight_problems(cfg, role, prefix, mc)[0])
    mc.compact_master_weights = "auto"  # settles on fp32 masters where they cannot be compact, with no error
    assert _compact_master_weight_problems(cfg, role, prefix, mc) == []


@pytest.mark.parametrize(
    ("role", "megatron_config", "named"),
    [
        ("ref", {}, "the reference model has no optimizer"),
        ("policy", {"compact_master_weights": False}, "compact_master_weights=auto"),
        ("critic", {"ddp_config": {"grad_reduce_in_fp32": False}}, "grad_reduce_in_fp32=true"),
        ("policy", {"compact_adam": "yes"}, "must be true, false or auto"),
    ],
)
def test_compact_adam_refusals_name_the_key_and_the_fix(role, megatron_config, named):
    from skyrl_megatron.config import MegatronWorkerConfig, _compact_adam_problems

    mc = MegatronWorkerConfig.from_mapping({"ddp_config": {"grad_reduce_in_fp32": True}, "compact_adam": True,
                                            **megatron_config})
    prefix = f"trainer.{role}.megatron_config"
    problems = _compact_adam_problems(role, prefix, mc)
    assert len(problems) == 1 and problems[0].key == f"{prefix}.compact_adam" and named in str(problems[0])
    mc.compact_adam = False
    assert _compact_adam_problems(role, prefix, mc) == []
    mc.compact_adam = "auto"  # settles on torch's Adam over the rebuilt masters where it cannot run, with no error
    assert _compact_adam_problems(role, prefix, mc) == []


def _build_refusals(rank, world, hf_dir):
    from skyrl_megatron.optim import OptimizerSettingsError
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    from skyrl_megatron.master_weights import compact_masters_of

    init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(), seed=0)
    messages = []
    for kwargs in ({"distributed_optimizer": False}, {"dtype": "fp32"}):
        try:
            _build(hf_dir, compact=True, **kwargs)
            messages.append(None)
        except OptimizerSettingsError as error:
            messages.append(str(error))
    # "auto" (the default) compacts where it can and quietly keeps fp32 masters where it cannot
    auto = [compact_masters_of(_build(hf_dir, compact="auto", **kwargs)[1]) is not None
            for kwargs in ({}, {"distributed_optimizer": False}, {"dtype": "fp32"})]
    # compact adam: never without the compact masters it steps, "auto" included
    for compact in (False, "auto"):
        try:
            _build(hf_dir, compact=compact, compact_adam=True, distributed_optimizer=compact is False)
            messages.append(None)
        except OptimizerSettingsError as error:
            messages.append(str(error))
    # compact adam "auto" (the default): on with the compact masters, quietly off without them
    from skyrl_megatron.compact_adam import compact_adam_of

    auto += [compact_adam_of(_build(hf_dir, compact="auto", compact_adam="auto", **kwargs)[1]) is not None
             for kwargs in ({}, {"distributed_optimizer": False})]
    return messages, auto


@pytest.mark.slow
def test_building_the_optimizer_refuses_what_compact_masters_cannot_handle(tmp_path):
    """The same rules at build time, for callers that skip the config check; `auto` follows them silently, and
    compact adam is refused without the compact masters."""
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3", tmp_path, seed=5))
    ((messages, auto),) = run_on_ranks(_build_refusals, 1, hf_dir, timeout=300)
    assert auto == [True, False, False, True, False]
    plain, fp32, adam_without, adam_auto_refused = messages
    assert "megatron_config.compact_master_weights" in plain and "use_distributed_optimizer: true" in plain
    assert "megatron_config.compact_master_weights" in fp32 and "bf16" in fp32
    assert "megatron_config.compact_adam needs compact master weights" in adam_without and "is false" in adam_without
    assert "megatron_config.compact_adam needs compact master weights" in adam_auto_refused
    assert "use_distributed_optimizer: true" in adam_auto_refused


_TRITON_CHECK = """
import dataclasses
import torch
from skyrl_megatron import master_weights
from skyrl_megatron.master_weights import CompactMasterWeights
from skyrl_megatron.master_weights_kernels import (_BLOCK, _TIE_BLOCK, join, round_and_split_with_stats,
                                                   split_with_stats, tie_indices)

generator = torch.Generator().manual_seed(0)
tie = lambda upper: (upper << 16) | 0x8000  # the lower half exactly half way: a tie
special = torch.tensor([0x3F800001, tie(0x3F80), tie(0x3F81), 0x7F7FFFFF, 0x00008000, 0x80000000 - (1 << 32),
                        0x7F800000, 0x00000001], dtype=torch.int64).to(torch.int32).view(torch.float32)
random_bits = torch.randint(-(1 << 31), (1 << 31) - 1, (3 * _BLOCK + 77,), dtype=torch.int64, generator=generator)
values = random_bits.to(torch.int32).view(torch.float32)
values = torch.cat([special, values[~torch.isnan(values)], (torch.randn(5000, generator=generator) * 1e3)])
ties = tie(torch.randint(0, 1 << 15, (300,), generator=generator, dtype=torch.int32)).view(torch.float32)
values = torch.cat([values, ties])[torch.randperm(values.numel() + 300, generator=generator)]
cases = 0
for length in (1, 7, _BLOCK - 1, _BLOCK, _BLOCK + 1, values.numel()):
    masters = values[:length]
    model = masters.to(torch.bfloat16)
    for foreign in (False, True):  # a model weight that is not its master rounded: the worst status 2
        if foreign:
            model = model.clone()
            model[length // 2] = -model[length // 2] if model[length // 2] != 0 else 1.0
        bits, upper = masters.view(torch.int32), model.view(torch.int16)
        remainder, stats, checks = split_with_stats(bits, upper)
        want_remainder, status = master_weights._split_chunk(bits, upper)
        want = master_weights._chunk_stats(status)
        assert torch.equal(remainder, want_remainder), (length, foreign)
        # the tie count holds where the worst status is in range (elsewhere the run stays in fp32)
        assert stats.dtype == torch.int64 and stats[0] == want[0] and (stats[0] == 2) == foreign, (length, stats, want)
        assert foreign or stats[1] == want[1] == int((status == 1).sum()), (length, stats, want)
        if not foreign:  # the ties' indices, ascending, from the blocks holding one
            assert torch.equal(tie_indices(bits, upper, checks, int(stats[1])), (status == 1).nonzero().view(-1))
            # the split that writes the model weight itself: the master rounded as torch rounds it, the same split
            written = torch.full_like(upper, 0x1234)
            got = round_and_split_with_stats(bits, written)
            assert torch.equal(written, upper) and torch.equal(got[0], remainder) and torch.equal(got[1], stats), length
            assert torch.equal(got[2], checks), length
        cases += 1
# the join: every length above through the split's remainders and ties; the ties of the lowest weight (-0.0's
# pattern, whose stored value wraps below int32's range until raised) and more ties than one correction program
extreme = torch.tensor([0x80008000 - (1 << 32), 0x80000000 - (1 << 32), 0x7F7F8000], dtype=torch.int64).to(torch.int32)
many_ties = tie(2 * torch.randint(0, 0x7F80 // 2, (_TIE_BLOCK + 5,), generator=generator, dtype=torch.int32))  # even, finite
for bits in (values.view(torch.int32), extreme, many_ties):
    masters = bits.view(torch.float32)
    model = masters.to(torch.bfloat16)
    upper = model.view(torch.int16)
    remainder, stats, checks = split_with_stats(bits, upper)
    found = tie_indices(bits, upper, checks, int(stats[1]))
    assert int(stats[0]) < 2 and torch.equal(join(upper, remainder, found), bits), bits.numel()
    assert found.numel() > _TIE_BLOCK or bits is not many_ties  # every one a tie rounded down
    cases += 1
assert join(upper[:0], remainder[:0], found[:0]).numel() == 0
# the kernels in their places: split_master / join_master and a CompactMasterWeights over runs of back-to-back
# shards (64-element padding between them), through the GPU's kernel set, bit for bit
kernels = master_weights._on_gpu()
assert kernels.split_with_stats is split_with_stats and kernels.join_with_ties is join
master_weights._kernels = lambda device: kernels
model = values.to(torch.bfloat16)
remainder, tie_indices = master_weights.split_master(values, model)
want_ties = (master_weights._split_chunk(values.view(torch.int32), model.view(torch.int16))[1] == 1).nonzero().view(-1)
assert tie_indices.numel() > 100 and torch.equal(tie_indices, want_ties)  # ties of even weights round down
assert torch.equal(master_weights.join_master(model, remainder, tie_indices).view(torch.int32), values.view(torch.int32))
assert master_weights.split_master(values, -model) is None
master_weights._GROUP_ELEMENTS = 2000  # several groups: each read after the next one's split
sizes = torch.randint(1, 600, (24,), generator=generator).tolist()
buffer = torch.zeros(sum(-(-size // 64) * 64 for size in sizes), dtype=torch.bfloat16)
pairs, start = [], 0
for piece in torch.split(values[: sum(sizes)], sizes):
    buffer[start : start + piece.numel()] = piece.to(torch.bfloat16)
    pairs.append((torch.nn.Parameter(piece.clone(), requires_grad=False), buffer[start : start + piece.numel()]))
    start += -(-piece.numel() // 64) * 64
expected = [master.detach().view(torch.int32).clone() for master, _ in pairs]
compact = CompactMasterWeights(pairs)
assert compact.runs > 2
for corrupt in (False, False, True):  # tensor by tensor, then whole runs; then a foreign weight keeps its run
    if corrupt:
        pairs[5][1].view(torch.int16)[0] ^= 0x4000
    compact.release()
    kept = [i for i, (master, _) in enumerate(pairs) if master.untyped_storage().nbytes()]
    assert (5 in kept and len(kept) < len(pairs)) if corrupt else not kept, kept
    if corrupt:
        pairs[5][1].view(torch.int16)[0] ^= 0x4000
    compact.rebuild()
    assert all(torch.equal(master.detach().view(torch.int32), want) for (master, _), want in zip(pairs, expected))
    cases += 1
# a step's copy back made by the release: the masters moved, each model weight written as the master rounded
for master, _ in pairs:
    master.data.add_(torch.randn(master.shape, generator=generator) * 1e-2)
expected = [master.detach().view(torch.int32).clone() for master, _ in pairs]
with compact.writing_models():
    assert compact.round_into_models(0)
compact.release()
assert not any(master.untyped_storage().nbytes() for master, _ in pairs)
assert all(torch.equal(model, want.view(torch.float32).to(torch.bfloat16)) for (_, model), want in zip(pairs, expected))
compact.rebuild()
assert all(torch.equal(master.detach().view(torch.int32), want) for (master, _), want in zip(pairs, expected))
print(cases + 2)
"""


def test_the_triton_kernels_split_and_join_as_the_eager_ones_do_bitwise():
    """The GPU's kernels (`master_weights_kernels`) under Triton's interpreter: the split's remainders and
    [worst status, ties] equal to the elementwise split and its torch reductions at lengths around a block's, with
    a foreign weight; the ties' indices from its per-block checks equal to a search of every element; the join
    (ties raised, the lowest weight's wrap included) gives every master back; the split that writes the model weight
    writes the master rounded as torch rounds it and splits as the plain one; then split_master / join_master, a
    release and rebuild over runs (groups read behind the next one's split, a foreign weight) and a step's copy
    back made by the release through them."""
    from skyrl_megatron.testing import last_word_under_triton_interpreter

    assert last_word_under_triton_interpreter(_TRITON_CHECK, timeout=300) == "20"


def test_the_gpu_kernel_set_splits_and_joins_with_the_triton_passes(monkeypatch):
    """On CUDA the split and its checks, the tie search and the join are our Triton passes; CPU keeps the eager
    chunks."""
    from skyrl_megatron.master_weights_kernels import join, split_with_stats, tie_indices

    from skyrl_megatron.master_weights_kernels import round_and_split_with_stats

    on_gpu, on_cpu = master_weights._kernels(torch.device("cuda")), master_weights._kernels(torch.device("cpu"))
    assert (on_gpu.split_with_stats, on_gpu.tie_indices, on_gpu.join_with_ties) == (split_with_stats, tie_indices, join)
    assert on_gpu.round_and_split_with_stats is round_and_split_with_stats
    assert on_cpu.split_with_stats is None and on_cpu.tie_indices is None and on_cpu.join_with_ties is None
    assert on_cpu.round_and_split_with_stats is None
