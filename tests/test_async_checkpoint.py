"""Checkpoints written in the background (`checkpoint/async_save.py`, `megatron_config.async_save`).

A tiny Qwen3 trains with the plain (non-distributed) optimizer, whose Adam moments are the live tensors a
background write could read after the next step changed them. Asserted:
* training goes on while a save is in flight: with the writer held back, the next step runs before the
  write finishes, and the checkpoint still holds the state of the step it was taken at, bitwise equal to
  a synchronous save of that state (two background saves in a row, the second finalizing the first);
* a rank killed (SIGKILL) during a background write leaves the previous checkpoint published and the
  host's pointer naming it; the run resumed from it repeats the next step bitwise;
* a checkpoint saved in the background under TP=2 loads under another layout (world 1) and saves there
  (synchronously) to the same global tensors;
* with Megatron's distributed optimizer (one rank per data-parallel group, and DP2, where the ranks'
  ranges cut parameters), the save that describes the optimizer state where it is (no gather) writes what
  Megatron's gather writes, bitwise, in the foreground and in the background.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from skyrl_megatron.testing import DistributedTestError, run_on_ranks
from skyrl_megatron.testing.checkpoint_steps import (
    TP2_SP,
    WORLD1,
    global_tensors,
    local_params,
    setup_training,
    train_step,
)

pytestmark = pytest.mark.slow

HOLD_S = 120  # a held writer gives up after this long (a broken test, never reached when it passes)


def _hold_writer(release):
    """Megatron's file writer, held until `release` is set (after writing, when `write_first`)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.write_preloaded_data

    def held(*args, **kwargs):
        assert release.wait(HOLD_S), "the test never released the checkpoint writer"
        return original(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(held)


def _saves_while_training(rank, world, hf_dir, root, layout):
    """Step 1; sync save; background save with the writer held; step 2 (the save still in flight);
    release; background save 2 (finalizes 1); sync save 2."""
    import threading

    from skyrl_megatron.checkpoint import AsyncCheckpointSaver, save_checkpoint

    root = Path(root)
    built, optimizer, scheduler, batches = setup_training(hf_dir, layout, distributed_optimizer=False)
    train_step(built.chunks, optimizer, scheduler, batches)
    save_checkpoint(root / "sync1", built.chunks, optimizer, scheduler, step=1)
    release = threading.Event()
    _hold_writer(release)
    saver = AsyncCheckpointSaver()
    saver.save(root / "async1", built.chunks, optimizer, scheduler, step=1, extra={"tag": "b"})
    first = saver.last_timings
    held_from = time.perf_counter()
    in_flight_before_step = not saver.write_done()
    train_step(built.chunks, optimizer, scheduler, batches)
    in_flight_after_step = not saver.write_done()
    published_while_in_flight = (root / "async1").exists()
    held_s = time.perf_counter() - held_from
    release.set()
    saver.save(root / "async2", built.chunks, optimizer, scheduler, step=2)
    async1_published_by_second_save = (root / "async1").exists()
    save_checkpoint(root / "sync2", built.chunks, optimizer, scheduler, step=2)
    saver.finalize()
    return {
        "in_flight_before_step": in_flight_before_step,
        "in_flight_after_step": in_flight_after_step,
        "published_while_in_flight": published_while_in_flight,
        "async1_published_by_second_save": async1_published_by_second_save,
        "timings": (dataclasses.asdict(first), dataclasses.asdict(saver.last_timings)),
        "held_s": held_s,
    }


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from skyrl_megatron.testing import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"), seed=5))


@pytest.fixture(scope="module")
def tp2_saves(hf_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2_saves")
    results = run_on_ranks(_saves_while_training, 2, hf_dir, str(root), TP2_SP, timeout=300)
    return root, results


def test_training_goes_on_while_a_save_is_written_and_the_save_holds_its_step(tp2_saves, tmp_path):
    from skyrl_megatron.checkpoint import read_checkpoint_metadata, verify_checkpoint

    root, results = tp2_saves
    for result in results:
        timings, held_s = result.pop("timings"), result.pop("held_s")
        assert result == {"in_flight_before_step": True, "in_flight_after_step": True,
                          "published_while_in_flight": False, "async1_published_by_second_save": True}
        # each save's account (the trainer logs it): the first had none before it; the second finished the
        # first, whose write was held while the step trained
        first, second = timings
        assert first["previous_write_s"] == first["finish_previous_s"] == 0.0
        assert second["previous_write_s"] >= held_s > 0
        assert second["finish_previous_s"] > 0
        for save in timings:
            assert save["capture_s"] > 0 and save["staged_gib"] > 0 and save["write_s"] == 0.0
    for step in (1, 2):
        background, synchronous = root / f"async{step}", root / f"sync{step}"
        verify_checkpoint(background)
        assert read_checkpoint_metadata(background).step == step
        written = global_tensors(background, tmp_path / f"a{step}.pt")
        expected = global_tensors(synchronous, tmp_path / f"s{step}.pt")
        assert written.keys() == expected.keys()
        assert any(".exp_avg" in key for key in written)  # the optimizer's moments are in it
        for key, tensor in expected.items():
            assert torch.equal(written[key], tensor), (step, key)
    # the two steps differ: a save that read the live state after step 2 would not match sync1
    assert not torch.equal(*(global_tensors(root / f"sync{s}", tmp_path / f"d{s}.pt")["decoder.final_layernorm.weight"]
                             for s in (1, 2)))
    assert read_checkpoint_metadata(root / "async1").extra == {"tag": "b"}
    assert not list(root.glob(".*"))  # no partial directory left


def _killed_during_a_background_write(rank, world, hf_dir, root, reference_file):
    """In the host's layout: step 1 saved in the background and published (the trainer writes the
    pointer); step 2 trained (its weights kept for the test); its save started, the pointer written
    too early (the window a trainer's kill can hit), then the process is killed mid-write."""
    import threading

    from skyrl_megatron.checkpoint import AsyncCheckpointSaver
    from skyrl_megatron.checkpoint.latest import TRAINER_STATE_FILE, publish_latest, step_dir

    built, optimizer, scheduler, batches = setup_training(hf_dir, WORLD1, distributed_optimizer=False)
    saver = AsyncCheckpointSaver()
    train_step(built.chunks, optimizer, scheduler, batches)
    saver.save(step_dir(root, 1) / "policy", built.chunks, optimizer, scheduler, step=1)
    (step_dir(root, 1) / TRAINER_STATE_FILE).write_bytes(b"host state")
    saver.finalize()
    publish_latest(root, 1)
    loss, _ = train_step(built.chunks, optimizer, scheduler, batches)
    torch.save({"loss": loss, "params": local_params(built.chunks)}, reference_file)
    _hold_writer(threading.Event())  # never released
    saver.save(step_dir(root, 2) / "policy", built.chunks, optimizer, scheduler, step=2)
    (step_dir(root, 2) / TRAINER_STATE_FILE).write_bytes(b"host state")
    publish_latest(root, 2)
    os.kill(os.getpid(), signal.SIGKILL)


def _resume_latest_and_step(rank, world, hf_dir, root):
    from skyrl_megatron.checkpoint import load_checkpoint
    from skyrl_megatron.checkpoint.latest import read_latest, repair_latest, step_dir

    repaired = repair_latest(root, ["policy"])
    latest = read_latest(root)
    assert repair_latest(root, ["policy"]) is None  # a pointer at a complete checkpoint stays
    built, optimizer, scheduler, batches = setup_training(hf_dir, WORLD1, distributed_optimizer=False)
    state = load_checkpoint(step_dir(root, latest) / "policy", built.chunks, optimizer, scheduler)
    loss, _ = train_step(built.chunks, optimizer, scheduler, batches)
    return {"repaired": repaired, "latest": latest, "step": state.step, "loss": loss,
            "params": local_params(built.chunks)}


def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint_bitwise(hf_dir, tmp_path):
    from skyrl_megatron.checkpoint.latest import INCOMPLETE_SUFFIX

    root, reference_file = tmp_path / "ckpts", tmp_path / "step2.pt"
    with pytest.raises(DistributedTestError, match="rank 0: exited without reporting a result \\(killed by signal SIGKILL\\)"):
        run_on_ranks(_killed_during_a_background_write, 1, hf_dir, str(root), str(reference_file), timeout=300)
    assert not (root / "global_step_2" / "policy").exists()  # never published
    assert (root / "global_step_2" / ".policy.partial").is_dir()

    (resumed,) = run_on_ranks(_resume_latest_and_step, 1, hf_dir, str(root), timeout=300)
    assert resumed["latest"] == 1 and resumed["step"] == 1
    assert "2 -> 1" in resumed["repaired"] and "step 2 (policy: no checkpoint" in resumed["repaired"]
    assert (root / f".global_step_2{INCOMPLETE_SUFFIX}").is_dir() and not (root / "global_step_2").exists()
    reference = torch.load(reference_file)
    assert resumed["loss"] == reference["loss"]
    for name, param in reference["params"].items():
        assert torch.equal(resumed["params"][name], param), name


def _load_and_save_again(rank, world, hf_dir, ckpt_dir, resave_dir):
    from skyrl_megatron.checkpoint import load_checkpoint, save_checkpoint

    built, optimizer, scheduler, _ = setup_training(hf_dir, WORLD1, distributed_optimizer=False)
    state = load_checkpoint(ckpt_dir, built.chunks, optimizer, scheduler)
    save_checkpoint(resave_dir, built.chunks, optimizer, scheduler, step=state.step, extra=state.extra)
    return {"saved_layout_tensor": state.saved_layout.tensor, "rng_restored": state.rng_restored}


def test_a_background_save_loads_under_another_layout(hf_dir, tp2_saves, tmp_path):
    root, _ = tp2_saves
    (result,) = run_on_ranks(_load_and_save_again, 1, hf_dir, str(root / "async2"), str(tmp_path / "world1"),
                             timeout=300)
    assert result == {"saved_layout_tensor": 2, "rng_restored": False}
    saved, resaved = global_tensors(root / "async2", tmp_path / "a.pt"), global_tensors(tmp_path / "world1", tmp_path / "b.pt")
    assert saved.keys() == resaved.keys()
    for key, tensor in saved.items():
        assert torch.equal(tensor, resaved[key]), key


def _distributed_optimizer_saves(rank, world, hf_dir, root, layout):
    """Megatron's distributed optimizer: a save through Megatron's own gather of the optimizer state, one
    without it (the default), and a background save taken at step 1 whose write runs while step 2 changes
    the optimizer's tensors it was taken from. Returns how many parameters this rank's data-parallel
    ranges cut (their state is assembled from pieces)."""
    import contextlib
    import threading

    import skyrl_megatron.checkpoint.megatron_state as megatron_state
    from skyrl_megatron.checkpoint import AsyncCheckpointSaver, save_checkpoint
    from skyrl_megatron.checkpoint.optimizer_state import distributed_optimizers, pieces_of

    root = Path(root)
    built, optimizer, scheduler, batches = setup_training(hf_dir, layout, distributed_optimizer=True)
    train_step(built.chunks, optimizer, scheduler, batches)
    without_gather = megatron_state.state_without_gather
    megatron_state.state_without_gather = lambda optimizer: contextlib.nullcontext()
    save_checkpoint(root / "gathered", built.chunks, optimizer, scheduler, step=1)
    megatron_state.state_without_gather = without_gather
    save_checkpoint(root / "direct", built.chunks, optimizer, scheduler, step=1)
    release = threading.Event()
    _hold_writer(release)
    saver = AsyncCheckpointSaver()
    saver.save(root / "background", built.chunks, optimizer, scheduler, step=1)
    train_step(built.chunks, optimizer, scheduler, batches)
    release.set()
    saver.finalize()
    buffers = [buffer for dist_optimizer in distributed_optimizers(optimizer) for buffer in dist_optimizer.buffers]
    return sum(len(pieces_of(buffer, where)) > 1 for buffer in buffers for where in buffer.param_index_map.values())


@pytest.fixture(scope="module")
def three_layer_hf_dir(tmp_path_factory) -> str:
    """Three layers: the middle of the gradient buffer, where DP2 splits it, falls inside a parameter."""
    from skyrl_megatron.testing import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3_3"), seed=5, num_hidden_layers=3))


@pytest.mark.parametrize("layout", [TP2_SP, WORLD1], ids=["tp2_one_rank_per_dp_group", "dp2"])
def test_the_distributed_optimizer_is_saved_without_a_gather(hf_dir, three_layer_hf_dir, tmp_path, layout):
    """The optimizer's state described where it is (whole on one rank, or a parameter cut by the data-
    parallel ranges joined from its pieces) is the checkpoint Megatron's gather writes, key by key and bit
    by bit, also when written in the background while the next step runs."""
    root = tmp_path / "saves"
    model = three_layer_hf_dir if layout is WORLD1 else hf_dir
    cut = run_on_ranks(_distributed_optimizer_saves, 2, model, str(root), layout, timeout=300)
    assert (sum(cut) > 0) == (layout is WORLD1)  # DP2 cuts a parameter here; TP2 (one rank per group) none
    gathered = global_tensors(root / "gathered", tmp_path / "g.pt")
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in gathered)
    for name in ("direct", "background"):
        written = global_tensors(root / name, tmp_path / f"{name}.pt")
        assert written.keys() == gathered.keys(), name
        for key, tensor in gathered.items():
            assert torch.equal(written[key], tensor), (name, key)


def _state_tensors(owners) -> list[torch.Tensor]:
    return [t.detach().clone() for t in owners]


def _lent_to_a_colocated_offload(rank, world, hf_dir, root, training=None):
    """A colocated trainer's order on one rank (Megatron's distributed optimizer): step 1; a background save
    lending its host copies; the offload right after it; backload; step 2. Then a second save whose copies
    go stale: a step runs before the offload. A reference run without saves or offloads takes the same steps.
    `training`: `setup_training`'s keywords (bf16 with compact masters and compact adam, say)."""
    import gc

    from skyrl_megatron.checkpoint import AsyncCheckpointSaver, save_checkpoint
    from skyrl_megatron.checkpoint.async_save import _live_storages, _storage_of
    from skyrl_megatron.workers.offload import ModelOffloader

    root = Path(root)
    built, optimizer, scheduler, batches = setup_training(hf_dir, WORLD1, distributed_optimizer=True,
                                                          **(training or {}))
    chunks = built.chunks
    train_step(chunks, optimizer, scheduler, batches)
    save_checkpoint(root / "sync1", chunks, optimizer, scheduler, step=1)
    offloader, saver = ModelOffloader(chunks), AsyncCheckpointSaver()
    owners = offloader.storage_owners(optimizer)
    saver.save(root / "async1", chunks, optimizer, scheduler, step=1, storage_owners=owners)
    # Megatron's writer holds the host copies now, not the model's or the optimizer's tensors
    gc.collect()
    held = [t for _, _, (_, tensors) in saver._pending.request.async_fn_args[1] for _, t in tensors]
    live = _live_storages(chunks, optimizer)
    writer_holds_live = sum(_storage_of(t) in live for t in held)
    copies = dict(saver.storage_copies)
    offloader.lend(copies)
    before = _state_tensors(owners)
    lent_offload = offloader.offload(model=True, optimizer=True, optimizer_obj=optimizer, pin_memory=False)
    parked_in_copies = sorted(
        p.host.data_ptr() for part in offloader._parked.values() for p in part if p.host.data_ptr() in
        {c.data_ptr() for c in copies.values()}
    )
    offloader.backload(model=True, optimizer=True, optimizer_obj=optimizer)
    back_equal = all(torch.equal(a, b) for a, b in zip(_state_tensors(offloader.storage_owners(optimizer)), before))
    losses = [train_step(chunks, optimizer, scheduler, batches)[0]]
    # stale: the copies of the second save are lent, then a step changes the state before the offload
    saver.save(root / "async2", chunks, optimizer, scheduler, step=2, storage_owners=offloader.storage_owners(optimizer))
    offloader.lend(saver.storage_copies)
    losses.append(train_step(chunks, optimizer, scheduler, batches)[0])
    after_step = _state_tensors(offloader.storage_owners(optimizer))
    stale_offload = offloader.offload(model=True, optimizer=True, optimizer_obj=optimizer, pin_memory=False)
    offloader.backload(model=True, optimizer=True, optimizer_obj=optimizer)
    stale_equal = all(torch.equal(a, b) for a, b in zip(_state_tensors(offloader.storage_owners(optimizer)), after_step))
    losses.append(train_step(chunks, optimizer, scheduler, batches)[0])
    saver.finalize()
    return {
        "writer_holds": (len(held), writer_holds_live),
        "copies": len(copies),
        "copies_bytes": sum(c.nbytes for c in copies.values()),
        "lent": (lent_offload.bytes_lent, lent_offload.bytes_moved, len(parked_in_copies)),
        "stale_lent": stale_offload.bytes_lent,
        "back_equal": back_equal,
        "stale_equal": stale_equal,
        "losses": losses,
        "params": local_params(chunks),
    }


def _steps_without_saves(rank, world, hf_dir, training=None):
    built, optimizer, scheduler, batches = setup_training(hf_dir, WORLD1, distributed_optimizer=True,
                                                          **(training or {}))
    losses = [train_step(built.chunks, optimizer, scheduler, batches)[0] for _ in range(4)][1:]
    return {"losses": losses, "params": local_params(built.chunks)}


@pytest.mark.parametrize("training", [None, {"dtype": "bf16"}, {"dtype": "bf16", "compact_adam": True}], ids=["fp32", "bf16", "compact_adam"])
def test_a_colocated_offload_parks_the_state_in_the_saves_host_copies(hf_dir, tmp_path, training):
    """The save's host copies of whole storages serve the offload that follows it (nothing copied again), the
    state comes back bitwise, training matches a run without saves or offloads bitwise, the checkpoint equals a
    synchronous save of the same step; copies made stale by a step are not used. Megatron's writer holds only
    the host copies while it writes. Also in bf16 with the compact masters, and with compact adam, whose moments
    are views of one buffer per run of them."""
    root = tmp_path / "saves"
    (result,) = run_on_ranks(_lent_to_a_colocated_offload, 1, hf_dir, str(root), training, timeout=300)
    (reference,) = run_on_ranks(_steps_without_saves, 1, hf_dir, training, timeout=300)
    held, writer_holds_live = result["writer_holds"]
    assert held > 0 and writer_holds_live == 0
    lent, moved, parked_in_copies = result["lent"]
    if training and training.get("compact_adam"):
        # on the CPU runtime Megatron's writer clones every tensor that is a view of a larger storage, as compact
        # adam's moments are of their run's buffer: the save holds no copy of a live storage, the offload copies
        # (on GPUs the save copies whole storages itself, views included)
        assert result["copies"] == 0 and lent == 0 < moved
    else:
        # every storage the save copied whole was parked in its copy; what the save does not hold (the gradient
        # buffer) was copied by the offload
        assert parked_in_copies == result["copies"] > 0
        assert lent == result["copies_bytes"] and 0 < lent < moved
    assert result["stale_lent"] == 0
    assert result["back_equal"] and result["stale_equal"]
    assert result["losses"] == reference["losses"]
    for name, param in reference["params"].items():
        assert torch.equal(result["params"][name], param), name
    # the same files: each tensor written as its own bytes, not as the storage copy it lies in
    sizes = {name: sum(f.stat().st_size for f in (root / name).rglob("*") if f.is_file()) for name in ("async1", "sync1")}
    assert abs(sizes["async1"] - sizes["sync1"]) < 0.02 * sizes["sync1"], sizes
    written, expected = global_tensors(root / "async1", tmp_path / "a.pt"), global_tensors(root / "sync1", tmp_path / "s.pt")
    assert written.keys() == expected.keys() and any(".exp_avg" in key for key in written)
    for key, tensor in expected.items():
        assert torch.equal(written[key], tensor), key


def test_a_tensor_in_a_storage_copied_whole_is_written_as_its_own_bytes():
    """Tensors that share a storage copied whole (a DDP parameter buffer on a GPU) come back as tensors over that
    copy whose storages are their own bytes: the file writer serialises a tensor's whole storage, so a plain view
    would write the whole buffer once per parameter."""
    import io

    from skyrl_megatron.checkpoint import AsyncCheckpointSaver

    saver = AsyncCheckpointSaver()
    owner = torch.randn(100_000).to(torch.bfloat16)
    first, second = owner[10:110].view(10, 10), owner[500:600]
    (a, copied_a), (b, copied_b) = (saver._view_in_storage_copy(t, owner) for t in (first, second))
    assert (copied_a, copied_b) == (owner.nbytes, 0) and len(saver.storage_copies) == 1
    (copy,) = saver.storage_copies.values()
    assert a.data_ptr() == copy.data_ptr() + 20 and b.data_ptr() == copy.data_ptr() + 1000  # in the copy
    assert torch.equal(a, first) and torch.equal(b, second) and a.untyped_storage().nbytes() == first.nbytes
    written = io.BytesIO()
    torch.save(a, written)
    assert len(written.getvalue()) < first.nbytes + 2048 < owner.nbytes
    assert saver._view_in_storage_copy(owner.view(200, 500)[:, :10], owner) == (None, 0)  # not contiguous: own copy


def _a_series_of_saves(rank, world, hf_dir, root):
    """A trainer's series (Megatron's distributed optimizer): four steps, each followed by a background save and a
    synchronous save of the same state; then a background save of the model alone (another structure). Returns,
    per background save, whether Megatron validated its sharding and whether its strategy found the plan unchanged
    (from then on it plans no more)."""
    import megatron.core.dist_checkpointing.state_dict_utils as state_dict_utils

    from skyrl_megatron.checkpoint import AsyncCheckpointSaver, save_checkpoint

    root = Path(root)
    validations = []
    validate = state_dict_utils.validate_sharding_integrity
    state_dict_utils.validate_sharding_integrity = lambda *a, **k: validations.append(1) or validate(*a, **k)
    built, optimizer, scheduler, batches = setup_training(hf_dir, WORLD1, distributed_optimizer=True)
    saver, saves = AsyncCheckpointSaver(), []
    for step in range(1, 5):
        train_step(built.chunks, optimizer, scheduler, batches)
        before = len(validations)
        saver.save(root / f"async{step}", built.chunks, optimizer, scheduler, step=step)
        validated = len(validations) > before
        saver.finalize()
        saves.append((validated, _torch_strategy(saver).validated_cache_reuse))
        save_checkpoint(root / f"sync{step}", built.chunks, optimizer, scheduler, step=step)
    before = len(validations)
    saver.save(root / "model_only", built.chunks, step=5)
    saves.append((len(validations) > before, _torch_strategy(saver).validated_cache_reuse))
    saver.finalize()
    return saves


def _torch_strategy(saver):
    """The saver's Megatron torch_dist strategy (inside the replicas' wrapper at DP > 1)."""
    return getattr(saver._strategy, "base_strategy", saver._strategy)


@pytest.mark.parametrize("world", [1, 2], ids=["world1", "dp2"])
def test_a_series_of_background_saves_plans_and_validates_once_and_writes_what_a_synchronous_save_writes(
        hf_dir, tmp_path, world):
    """One save strategy serves a saver's series: Megatron validates the sharding at the first save and again only
    when the structure changes (here: the model saved without its optimizer); from the second save on the plan is
    found unchanged and reused (at DP2 with the replicas' share of the shards kept too). Every checkpoint of the
    series holds what a synchronous save of the same state holds, bit for bit, also the ones written from the
    reused plan."""
    root = tmp_path / "saves"
    series = run_on_ranks(_a_series_of_saves, world, hf_dir, str(root), timeout=300)
    assert all(saves == series[0] for saves in series)
    saves = series[0]
    assert [validated for validated, _ in saves] == [True, False, False, False, True]
    assert [reused for _, reused in saves[:4]] == [False, True, True, True]
    for step in range(1, 5):
        written = global_tensors(root / f"async{step}", tmp_path / f"a{step}.pt")
        expected = global_tensors(root / f"sync{step}", tmp_path / f"s{step}.pt")
        assert written.keys() == expected.keys() and any(".exp_avg" in key for key in written)
        for key, tensor in expected.items():
            assert torch.equal(written[key], tensor), (step, key)
    model_only = global_tensors(root / "model_only", tmp_path / "m.pt")
    assert model_only and not any(key.startswith("optimizer.") for key in model_only)
    assert all(torch.equal(model_only[key], tensor) for key, tensor in expected.items() if key in model_only)


def test_the_state_is_copied_ahead_whole_and_handed_to_the_writer_as_its_own_bytes(monkeypatch):
    """Before the write is planned, each storage the state's shards lie in is copied to host memory once and whole
    (an owner's storage as the owner stands, lent to the offload; any other over all its bytes, not lent); the
    plan's tensors are then their own bytes of those copies, which later changes of the state do not reach."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import skyrl_megatron.checkpoint.async_save as async_save

    monkeypatch.setattr(async_save, "_copied_ahead", lambda tensor: True)  # as for an accelerator's storages
    owned, other = torch.randn(1000), torch.randn(500).to(torch.bfloat16)
    tensors = [owned[:100], owned[300:400].view(10, 10), other[64:128], owned[100:200]]
    sharded = {"a": ShardedTensor.from_rank_offsets("a", tensors[0]),
               "nested": [ShardedTensor.from_rank_offsets("b", tensors[1]), ShardedTensor.from_rank_offsets("c", tensors[2])]}
    saver = async_save.AsyncCheckpointSaver()
    copied = saver._copy_ahead(sharded, {async_save._storage_of(owned): owned})
    assert copied == owned.nbytes + other.nbytes
    assert list(saver.storage_copies) == [async_save._storage_of(owned)]  # the owner's copy alone is lent
    # the copies keep none of the state's storages alive (on a GPU: the compact masters' buffer made for the save)
    state = {async_save._storage_of(t) for t in (owned, other)}
    held = [value for copy in saver._copies.values() for field in dataclasses.fields(copy)
            if isinstance(value := getattr(copy, field.name), torch.Tensor)]
    assert held and not any(async_save._storage_of(t) in state for t in held)
    before = [t.clone() for t in tensors]
    # the plan's tensors (one not in the sharded state, as Megatron's factories make them): nothing copied again
    handed = [saver._view_in_storage_copy(t, None) for t in tensors]
    assert [n for _, n in handed] == [0, 0, 0, 0]
    owned.add_(1)
    other.add_(1)  # the next step
    for (host, _), tensor, value in zip(handed, tensors, before, strict=True):
        assert torch.equal(host, value) and host.untyped_storage().nbytes() == tensor.nbytes
    assert saver._view_in_storage_copy(owned.view(50, 20)[:, :5], None) == (None, 0)  # not contiguous: its own copy


def _finished_before_the_next_save(rank, world, hf_dir, root):
    """A trainer's order: the save in flight is finished (`finalize`) before the next save is called; once while its
    write still runs (held half a second longer), once after it is written."""
    import threading

    from skyrl_megatron.checkpoint import AsyncCheckpointSaver

    root = Path(root)
    built, optimizer, scheduler, batches = setup_training(hf_dir, WORLD1, distributed_optimizer=False)
    train_step(built.chunks, optimizer, scheduler, batches)
    release = threading.Event()
    _hold_writer(release)
    saver = AsyncCheckpointSaver()
    saver.save(root / "a", built.chunks, optimizer, scheduler, step=1)
    threading.Timer(0.5, release.set).start()
    started = time.perf_counter()
    saver.finalize()  # the trainer's, before it saves again: waits for the held write
    finalize_s = time.perf_counter() - started
    saver.save(root / "b", built.chunks, optimizer, scheduler, step=1)
    after_a_wait = saver.last_timings
    while not saver.write_done():
        time.sleep(0.01)
    saver.finalize()  # published once written (the trainer checks as a step's training starts)
    saver.save(root / "c", built.chunks, optimizer, scheduler, step=1)
    after_publishing = saver.last_timings
    saver.finalize()
    return {"finalize_s": finalize_s, "after_a_wait": dataclasses.asdict(after_a_wait),
            "after_publishing": dataclasses.asdict(after_publishing)}


def test_a_wait_for_the_previous_write_before_a_save_is_that_saves_to_account(hf_dir, tmp_path):
    """The trainer finishes the save in flight before it calls the next save: when that had to wait for the write,
    the next save's `finish_previous_s` is the wait (a save step's extra seconds are the capture and this wait);
    when the write was done and the save published, nothing."""
    (result,) = run_on_ranks(_finished_before_the_next_save, 1, hf_dir, str(tmp_path), timeout=300)
    waited = result["after_a_wait"]["finish_previous_s"]
    assert 0.3 < waited <= result["finalize_s"]
    assert result["after_a_wait"]["previous_write_s"] > 0.3  # the write, held until the wait ended
    assert result["after_publishing"]["finish_previous_s"] == 0.0
    assert result["after_publishing"]["previous_write_s"] > 0
