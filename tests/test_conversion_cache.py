"""The HF -> Megatron conversion cache: keys, digests, entry checks, locks, and real starts on CPU ranks.

The multi-rank tests start "jobs" (run_on_ranks calls) on one tiny Qwen3 checkpoint and watch the
bridge's weight loader in each child, so "did not convert" is observed, not inferred from a report.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from skyrl_megatron.model.conversion.cache import (
    CACHE_ROOT_ENV,
    CHECKPOINT_DIRNAME,
    DIGEST_MEMO_NAME,
    HASH_BLOCK_BYTES,
    CacheEntry,
    EntryLock,
    FileDigests,
    entry_problem,
    library_versions,
    local_checkpoint_dir,
    locate_entry,
    resolve_cache_root,
    write_manifest,
)
from skyrl_megatron.testing import run_on_ranks

BATCH, SEQ = 2, 12
SLOW_CONVERSION_S = 5.0  # stretches the converting job so that a concurrent one must wait on the lock
TENSOR_PARALLEL_ATOL = 1e-5  # logits under another layout: same weights, different reduction order


# ---- the cache root ------------------------------------------------------------------------------


def test_cache_root_prefers_config_then_env_then_hf_home_then_home(tmp_path):
    env = {CACHE_ROOT_ENV: str(tmp_path / "env"), "HF_HOME": str(tmp_path / "hf")}
    assert resolve_cache_root(str(tmp_path / "cfg"), env) == tmp_path / "cfg"
    assert resolve_cache_root(None, env) == tmp_path / "env"
    assert resolve_cache_root(None, {"HF_HOME": str(tmp_path / "hf")}) == tmp_path / "hf" / "skyrl_megatron"
    assert resolve_cache_root(None, {}) == Path.home() / ".cache" / "huggingface" / "skyrl_megatron"
    assert resolve_cache_root(None, {CACHE_ROOT_ENV: "", "HF_HOME": ""}) == resolve_cache_root(None, {})


def test_only_checkpoints_on_this_machine_can_be_keyed(tmp_path):
    assert local_checkpoint_dir(str(tmp_path)) == tmp_path.resolve()
    assert local_checkpoint_dir("skyrl-megatron-tests/never-downloaded") is None


# ---- keys and digests (fake checkpoints: only bytes matter here) ---------------------------------


def _reference_digest(data: bytes) -> str:
    """The documented digest, written out again: sha256 over the size and each block's sha256."""
    blocks = [hashlib.sha256(data[i:i + HASH_BLOCK_BYTES]).digest() for i in range(0, len(data), HASH_BLOCK_BYTES)]
    return hashlib.sha256(len(data).to_bytes(8, "little") + b"".join(blocks)).hexdigest()


def test_a_large_file_hashes_block_by_block_in_parallel_and_any_changed_block_shows(tmp_path):
    """One file of several blocks (the first start reads a multi-GB HF shard and the entry it writes): its
    digest is the documented one whatever the thread count, and a byte changed in any block, or a byte
    appended, changes it."""
    data = bytearray(os.urandom(2 * HASH_BLOCK_BYTES + 12345))
    path = tmp_path / "model-00001-of-00001.safetensors"
    path.write_bytes(data)
    expected = _reference_digest(bytes(data))
    for threads in (1, 4):
        assert FileDigests(tmp_path / f"memo{threads}.json", max_threads=threads).of([path])[path] == expected
    seen = {expected}
    for offset in (0, HASH_BLOCK_BYTES + 7, len(data) - 1):
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        path.write_bytes(changed)
        seen.add(FileDigests(tmp_path / "memo_changed.json").of([path])[path])
    path.write_bytes(bytes(data) + b"\0")
    seen.add(FileDigests(tmp_path / "memo_longer.json").of([path])[path])
    assert len(seen) == 5
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    assert FileDigests(tmp_path / "memo_empty.json").of([empty])[empty] == _reference_digest(b"")


def _fake_checkpoint(directory: Path, weights: bytes = b"w" * 4096) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    (directory / "model.safetensors").write_bytes(weights)
    (directory / "tokenizer.json").write_text('{"vocab": 1}')
    return directory


def _key(hf_dir: Path, root: Path, dtype: str = "torch.float32", versions=None) -> CacheEntry:
    return locate_entry(hf_dir, root, {"dtype": dtype}, FileDigests(root / DIGEST_MEMO_NAME), versions)


def test_key_follows_weights_config_versions_and_dtype_but_not_the_tokenizer(tmp_path):
    hf_dir, root = _fake_checkpoint(tmp_path / "hf"), tmp_path / "root"
    base = _key(hf_dir, root)
    assert base.name.startswith("qwen3-") and base.key.startswith(base.name.split("-", 1)[1])
    assert _key(hf_dir, root).key == base.key
    assert _key(hf_dir, root, versions=library_versions()).key == base.key

    (hf_dir / "tokenizer.json").write_text('{"vocab": 2}')
    assert _key(hf_dir, root).key == base.key

    assert _key(hf_dir, root, dtype="torch.bfloat16").key != base.key
    newer_core = {**library_versions(), "megatron-core": "99.0.0"}
    assert _key(hf_dir, root, versions=newer_core).key != base.key
    newer_bridge = {**library_versions(), "megatron-bridge": "99.0.0"}
    assert _key(hf_dir, root, versions=newer_bridge).key != base.key

    (hf_dir / "model.safetensors").write_bytes(b"v" + b"w" * 4095)  # same size, one byte differs
    after_weights = _key(hf_dir, root)
    assert after_weights.key != base.key
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 32}))
    assert _key(hf_dir, root).key not in (base.key, after_weights.key)


def test_digests_are_memoized_across_starts_and_refreshed_when_a_file_changes(tmp_path):
    hf_dir = _fake_checkpoint(tmp_path / "hf", weights=os.urandom(1 << 20))
    files = sorted(p for p in hf_dir.iterdir())
    memo = tmp_path / "root" / DIGEST_MEMO_NAME

    first = FileDigests(memo)
    digests = first.of(files)
    assert first.files_read == len(files)
    assert all(digests[p] == _reference_digest(p.read_bytes()) for p in files)

    later_start = FileDigests(memo)  # a new process: only the sidecar carries the memo over
    assert later_start.of(files) == digests
    assert later_start.files_read == 0 and later_start.bytes_read == 0

    weights = hf_dir / "model.safetensors"
    new_bytes = os.urandom(1 << 20)
    weights.write_bytes(new_bytes)  # same size: only mtime/ctime reveal the change
    again = FileDigests(memo)
    current = again.of(files)
    assert current[weights] == _reference_digest(new_bytes)
    assert again.files_read == 1
    # the sidecar keeps only records that still describe a file
    assert len(json.loads(memo.read_text())["digests"]) == len(files)

    moved = hf_dir.rename(tmp_path / "moved")  # what committing an entry does to its freshly hashed files
    moved_files = [moved / p.name for p in files]
    after_move = FileDigests(memo)
    assert {p.name: d for p, d in after_move.of(moved_files).items()} == {p.name: d for p, d in current.items()}
    assert after_move.files_read == 0
    recorded_paths = {rec["path"] for rec in json.loads(memo.read_text())["digests"].values()}
    assert recorded_paths == {str(p) for p in moved_files}


# ---- entry verification (a fake checkpoint directory under a real manifest) -----------------------


@pytest.fixture
def intact_entry(tmp_path) -> tuple[CacheEntry, FileDigests]:
    root = tmp_path / "root"
    entry = _key(_fake_checkpoint(tmp_path / "hf"), root)
    digests = FileDigests(root / DIGEST_MEMO_NAME)
    staging = root / f"{entry.name}.tmp-test"
    (staging / CHECKPOINT_DIRNAME / "sub").mkdir(parents=True)
    (staging / CHECKPOINT_DIRNAME / "__0_0.distcp").write_bytes(os.urandom(64 << 10))
    (staging / CHECKPOINT_DIRNAME / "sub" / "metadata.json").write_text("{}")
    write_manifest(entry, staging, digests, {"conversion_seconds": 1.5})
    os.replace(staging, entry.dir)
    assert entry_problem(entry, digests) is None
    return entry, digests


def test_truncated_file_is_detected_by_size(intact_entry):
    entry, digests = intact_entry
    shard = entry.checkpoint_dir / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(1000)
    assert "__0_0.distcp has 1000 bytes" in entry_problem(entry, digests)


def test_same_size_corruption_is_detected_by_checksum(intact_entry):
    entry, digests = intact_entry
    shard = entry.checkpoint_dir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert entry_problem(entry, digests) == "checksum mismatch: __0_0.distcp"


def test_partial_or_tampered_entries_are_detected(intact_entry):
    entry, digests = intact_entry
    (entry.checkpoint_dir / "stray.distcp").write_bytes(b"x")
    assert entry_problem(entry, digests) == "files not in the manifest: stray.distcp"
    (entry.checkpoint_dir / "stray.distcp").unlink()
    (entry.checkpoint_dir / "sub" / "metadata.json").unlink()
    assert entry_problem(entry, digests) == "missing files: sub/metadata.json"
    entry.manifest_path.unlink()
    assert entry_problem(entry, digests).startswith("no manifest")
    entry.manifest_path.write_text("{not json")
    assert entry_problem(entry, digests).startswith("unreadable manifest")


def test_exclusive_lock_holds_off_readers_until_released(tmp_path):
    lock = EntryLock(tmp_path / "locks" / "e.lock")
    held, waited = threading.Event(), []

    def writer():
        with lock.hold(exclusive=True):
            held.set()
            time.sleep(0.5)

    thread = threading.Thread(target=writer)
    thread.start()
    held.wait()
    started = time.perf_counter()
    with lock.hold(exclusive=False):
        waited.append(time.perf_counter() - started)
    thread.join()
    assert waited[0] >= 0.4
    with lock.hold(exclusive=False), EntryLock(lock.path).hold(exclusive=False):
        pass  # readers share


# ---- real starts on spawned CPU ranks ------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _wait_for_peers(rendezvous: str, jobs: int) -> None:
    """File-system barrier between independent jobs, so that they really reach the cache together."""
    Path(rendezvous, str(os.getpid())).touch()
    deadline = time.monotonic() + 180
    while len(os.listdir(rendezvous)) < jobs:
        if time.monotonic() > deadline:
            raise TimeoutError("the other job never arrived")
        time.sleep(0.05)


def _start(rank, world_size, hf_dir, root, layout, force=False, ddp=False, rendezvous=None, slow_conversion_s=0.0,
           free_bytes=None):
    """One job's start: build the model through the cache, run a forward pass, export the weights.
    `free_bytes`: what the disk reports free (a nearly full disk)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from skyrl_megatron.compute.schedule import forward_only
    from skyrl_megatron.model.build import ModelSpec, build_model, load_bridge
    from skyrl_megatron.model.conversion.bridge_import import import_bridge
    from skyrl_megatron.model.conversion.cache import ConversionCacheSettings
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    import_bridge()
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    conversions = []
    convert = MegatronModelBridge.load_weights_hf_to_megatron

    def watched_convert(self, *args, **kwargs):  # the bridge's HF -> Megatron weight loading
        conversions.append(1)
        time.sleep(slow_conversion_s)
        return convert(self, *args, **kwargs)

    MegatronModelBridge.load_weights_hf_to_megatron = watched_convert
    records = _Records()
    logging.getLogger("skyrl_megatron.model.conversion.cache").addHandler(records)
    logging.getLogger("skyrl_megatron.model.conversion.cache").setLevel(logging.INFO)

    if free_bytes is not None:
        real_usage = shutil.disk_usage
        shutil.disk_usage = lambda path: real_usage(path)._replace(free=free_bytes)
    init_distributed("cpu")
    parallel = ParallelConfig(**layout)
    initialize_model_parallel(parallel)
    if rendezvous is not None:
        load_bridge(hf_dir)  # pay the bridge's first-use cost (imports) before the race, not inside it
        _wait_for_peers(rendezvous, jobs=2)
    cache = ConversionCacheSettings(root=root, force_reconvert=force)
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32", cache=cache, wrap_with_ddp=ddp))

    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(SEQ).unsqueeze(0)
    outputs = forward_only(
        built.chunks,
        [tokens[i : i + 1] for i in range(BATCH)],
        lambda model, micro_batch: model(micro_batch, positions, None),
        lambda output, micro_batch: gather_from_tensor_model_parallel_region(output),
        seq_length=SEQ,
        micro_batch_size=1,
    )
    exported = {name: t.clone() for name, t in built.bridge.export_hf_weights(built.chunks, cpu=True)}
    return {
        "report": built.load_report,
        "conversions": len(conversions),
        "logits": torch.cat(outputs) if outputs else None,
        "export": exported if rank == 0 else None,
        "log": records.lines,
    }


def _run_job(hf_dir, root, world_size=1, layout=None, **kwargs) -> list[dict]:
    return run_on_ranks(_start, world_size, str(hf_dir), str(root), layout or {}, timeout=600, **kwargs)


def _copy_root(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def _entry_dir(report) -> Path:
    return Path(report.entry)


def _assert_exports_hf_weights(result: dict, hf_weights: dict[str, torch.Tensor]) -> None:
    exported = result["export"]
    assert sorted(exported) == sorted(hf_weights)
    for name, tensor in hf_weights.items():
        assert torch.equal(exported[name], tensor), name


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.torch import load_file

    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir = make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"), seed=11)
    weights = {}
    for path in hf_dir.glob("*.safetensors"):
        weights.update(load_file(path))
    return hf_dir, weights


@pytest.fixture(scope="module")
def concurrent_first_starts(checkpoint, tmp_path_factory):
    """Two world-1 jobs start together on an empty cache; whichever converts takes SLOW_CONVERSION_S."""
    hf_dir, _ = checkpoint
    root = tmp_path_factory.mktemp("cache")
    rendezvous = tmp_path_factory.mktemp("rendezvous")
    results: dict[int, list[dict] | BaseException] = {}

    def job(index: int):
        try:
            results[index] = _run_job(
                hf_dir, root, rendezvous=str(rendezvous), slow_conversion_s=SLOW_CONVERSION_S
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            results[index] = exc

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for outcome in results.values():
        if isinstance(outcome, BaseException):
            raise outcome
    (first,), (second,) = sorted((results[0], results[1]), key=lambda r: r[0]["report"].hit)
    return root, first, second


@pytest.mark.slow
def test_one_of_two_concurrent_starts_converts_and_the_other_loads_without_converting(
    concurrent_first_starts, checkpoint
):
    root, converted, loaded = concurrent_first_starts
    _, hf_weights = checkpoint

    assert converted["report"].hit is False and converted["report"].reason == "no cache entry"
    assert converted["conversions"] == 1
    assert converted["report"].conversion_seconds >= SLOW_CONVERSION_S
    entry = _entry_dir(converted["report"])
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["writer_world_size"] == 1 and manifest["conversion_seconds"] >= SLOW_CONVERSION_S
    assert {"metadata.json", ".metadata"} <= set(manifest["files"])
    assert sorted(os.listdir(root)) == sorted([entry.name, "locks", DIGEST_MEMO_NAME])  # no staging left

    assert loaded["report"].hit is True and loaded["report"].entry == str(entry)
    assert loaded["conversions"] == 0, "the cache hit still ran the bridge's HF weight loading"
    assert any(level == "INFO" and line.startswith("waiting for") for level, line in loaded["log"])
    assert loaded["report"].lookup_seconds >= SLOW_CONVERSION_S / 2  # it waited for the converting job
    assert loaded["report"].entry_conversion_seconds == manifest["conversion_seconds"]

    assert torch.equal(loaded["logits"], converted["logits"])
    _assert_exports_hf_weights(loaded, hf_weights)


@pytest.fixture(scope="module")
def forced_at_tp2_dp2(concurrent_first_starts, checkpoint, tmp_path_factory):
    """force_reconvert on a copy of the cache, written by two data-parallel replicas of a TP2 model."""
    root = _copy_root(concurrent_first_starts[0], tmp_path_factory.mktemp("forced") / "cache")
    before = json.loads((root / Path(concurrent_first_starts[1]["report"].entry).name / "manifest.json").read_text())
    layout = {"tensor": 2, "sequence_parallel": True}
    results = _run_job(checkpoint[0], root, world_size=4, layout=layout, force=True)
    return root, before, results


@pytest.mark.slow
def test_force_reconvert_converts_and_replaces_the_entry(forced_at_tp2_dp2, concurrent_first_starts):
    _, before, results = forced_at_tp2_dp2
    reference = concurrent_first_starts[1]["logits"]
    entry = _entry_dir(results[0]["report"])
    after = json.loads((entry / "manifest.json").read_text())
    assert after["key"] == before["key"] and after["created"] >= before["created"]
    assert (before["writer_world_size"], after["writer_world_size"], after["writer_layout"]["tensor"]) == (1, 4, 2)
    # every rank wrote a share: the save is spread over the data-parallel replicas, not left to the first
    # (files are named __<rank>_<writer thread>.distcp)
    writers = {int(name[2:].split("_")[0]) for name in after["files"] if name.endswith(".distcp")}
    assert writers == {0, 1, 2, 3}
    for result in results:
        assert result["report"].hit is False and result["report"].reason == "force_reconvert"
        assert result["conversions"] == 1
        assert (result["logits"] - reference).abs().max().item() <= TENSOR_PARALLEL_ATOL


@pytest.mark.slow
def test_entry_written_at_tp2_dp2_loads_at_pp2_vpp2_into_ddp_buffers(
    forced_at_tp2_dp2, concurrent_first_starts, checkpoint
):
    root, _, _ = forced_at_tp2_dp2
    layout = {"pipeline": 2, "virtual_pipeline": 2}
    results = _run_job(checkpoint[0], root, world_size=2, layout=layout, ddp=True)
    for result in results:
        assert result["report"].hit is True and result["conversions"] == 0
    (last_stage,) = [r["logits"] for r in results if r["logits"] is not None]
    # the pipeline split reorders no reduction, so the world-1 conversion's logits come back exactly
    assert torch.equal(last_stage, concurrent_first_starts[1]["logits"])
    _assert_exports_hf_weights(results[0], checkpoint[1])


@pytest.mark.slow
def test_truncated_cache_file_is_reported_and_rebuilt(concurrent_first_starts, checkpoint, tmp_path):
    root = _copy_root(concurrent_first_starts[0], tmp_path / "cache")
    entry = root / Path(concurrent_first_starts[1]["report"].entry).name
    shard = max((entry / CHECKPOINT_DIRNAME).glob("*.distcp"), key=lambda path: path.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)

    (result,) = _run_job(checkpoint[0], root)
    assert result["report"].hit is False and result["conversions"] == 1
    assert f"has {size // 2} bytes" in result["report"].reason
    warnings = [line for level, line in result["log"] if level == "WARNING"]
    assert len(warnings) == 1 and str(entry) in warnings[0] and "truncated" in warnings[0]
    assert torch.equal(result["logits"], concurrent_first_starts[1]["logits"])
    assert shard.stat().st_size == size  # rebuilt in place, and intact again
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["files"][shard.name]["size"] == size


@pytest.mark.slow
def test_an_entry_that_does_not_fit_is_not_stored_and_the_start_goes_on(checkpoint, tmp_path):
    """A cache disk without room for the entry: nothing is written, every rank says why with the fix, and the
    start runs on the converted weights (the same logits and exported weights as one that stored its entry)."""
    hf_dir, hf_weights = checkpoint
    layout = {"tensor": 2}
    full = _run_job(hf_dir, tmp_path / "full", world_size=2, layout=layout, free_bytes=10_000)
    stored = _run_job(hf_dir, tmp_path / "roomy", world_size=2, layout=layout)
    for rank, result in enumerate(full):
        report = result["report"]
        assert report.hit is False and result["conversions"] == 1
        assert "GiB to write" in report.not_stored and "GiB free under" in report.not_stored
        assert "not stored as" in report.summary()
        warnings = [line for level, line in result["log"] if level == "WARNING" and "not stored" in line]
        assert warnings and "megatron_config.checkpoint_cache_dir" in warnings[0]
        assert torch.equal(result["logits"], stored[rank]["logits"])
    _assert_exports_hf_weights(full[0], hf_weights)
    # nothing of the entry on the disk: no entry, no staging directory
    entry = _entry_dir(full[0]["report"])
    assert not entry.parent.exists() or not any(p.name.startswith(entry.name) for p in entry.parent.iterdir())
    assert stored[0]["report"].not_stored == "" and _entry_dir(stored[0]["report"]).is_dir()
