"""HF -> Megatron conversion cache: convert a checkpoint once, load the Megatron copy on later starts.

An entry is a Megatron distributed checkpoint (torch_dist) of the model chunks, stored under
``<root>/<model_type>-<key prefix>``. The key hashes the contents of the HF files that decide the
weights (config, weights, index, generation config; not the tokenizer), the megatron-core and
megatron-bridge versions and the conversion settings (dtype). Megatron's sharded state dict names
every tensor by a global key and shape (layers stacked on a leading axis, TP/PP/VPP shards as
offsets), so an entry written under one parallel layout loads under any other.

Write protocol: every rank saves its shards into ``<entry>.tmp-*``; global rank 0 then hashes the
files, writes ``manifest.json`` last and renames the directory into place. An entry without a
manifest, or whose files differ from it, is never loaded: it is named in a warning, deleted and
rebuilt.

Concurrency: jobs that share a root (policy and ref workers, parallel experiments) serialise on one
fcntl lock per entry, held by their global rank 0: shared while loading, exclusive while replacing
a bad entry, converting and committing. One job converts; the others wait, then load. Within a job
only rank 0 inspects the file system; its verdicts are broadcast so that every rank takes the same
branch into the collective save or load. The root must therefore be visible to every rank.

File digests are memoized in ``<root>/file_digests.json`` by file identity (device, inode, size,
mtime, ctime), so a later start stats a 60 GB checkpoint instead of reading it. A file's digest is a
hash of its blocks' hashes (`file_digest`), so that one large file is read by every core at once: the
first start reads the HF checkpoint for the key and the written entry for its manifest.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from skyrl_megatron.disk_room import bytes_to_write, free_bytes, node_shortfall

logger = logging.getLogger(__name__)

CACHE_ROOT_ENV = "SKYRL_MEGATRON_CHECKPOINT_DIR"
# Bump when the entry layout or the key material changes: old entries then simply stop matching.
# 2: file digests over blocks (HASH_NAME), not over whole files.
CACHE_FORMAT = 2
MANIFEST_NAME = "manifest.json"
CHECKPOINT_DIRNAME = "checkpoint"
DIGEST_MEMO_NAME = "file_digests.json"
# sha256 runs on the CPU's SHA extensions through OpenSSL: about twice blake2b's speed here. A file's
# digest is the sha256 of its size and of the sha256 of each HASH_BLOCK_BYTES block, in order
# (`file_digest`): blocks hash in parallel threads (hashlib and os.pread release the GIL).
HASH_NAME = "sha256-of-64MiB-blocks"
HASH_BLOCK_BYTES = 64 * 2**20
# The HF files that decide the converted weights. The tokenizer does not, so editing it keeps the entry.
HF_CONTENT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model*.bin.index.json",
)
_HASH_THREADS = min(32, os.cpu_count() or 8)
_READ_BYTES = 8 * 2**20  # one read of a block (bounded memory per thread)
_T = TypeVar("_T")


class ConversionCacheError(RuntimeError):
    """The cache could not be used as asked (raised on every rank of the job)."""


@dataclass(frozen=True)
class ConversionCacheSettings:
    root: str | None = None  # None: $SKYRL_MEGATRON_CHECKPOINT_DIR, else $HF_HOME/skyrl_megatron, else ~/.cache/...
    force_reconvert: bool = False  # convert even if a valid entry exists, and replace it


def resolve_cache_root(configured: str | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The cache root: the configured directory, else $SKYRL_MEGATRON_CHECKPOINT_DIR, else
    $HF_HOME/skyrl_megatron, else ~/.cache/huggingface/skyrl_megatron."""
    env = os.environ if env is None else env
    if configured:
        return Path(configured).expanduser().absolute()
    if env.get(CACHE_ROOT_ENV):
        return Path(env[CACHE_ROOT_ENV]).expanduser().absolute()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser().absolute() / "skyrl_megatron"
    return Path("~/.cache/huggingface/skyrl_megatron").expanduser()


def local_checkpoint_dir(hf_path: str) -> Path | None:
    """The local directory of an HF checkpoint: the path itself, or a hub id's cached snapshot.

    None when the files are not on this machine (a hub id that was never downloaded): there is
    nothing to hash, so the cache cannot key such a checkpoint.
    """
    path = Path(hf_path).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(hf_path, local_files_only=True)).resolve()
    except Exception:  # noqa: BLE001 - any failure means "not available locally"
        return None


# ----------------------------------------------------------------------------------------------
# File digests, memoized by file identity
# ----------------------------------------------------------------------------------------------


def _identity(path: Path) -> str:
    # ctime cannot be set from user space, so a same-size rewrite that restores mtime still shows.
    # The path is left out on purpose: the entry directory is renamed after its files are hashed.
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _block_hash(path: Path, offset: int, length: int) -> bytes:
    block = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        end = offset + length
        while offset < end:
            data = os.pread(fd, min(_READ_BYTES, end - offset), offset)
            if not data:
                raise OSError(f"{path} ended at byte {offset} while hashing (it shrank)")
            block.update(data)
            offset += len(data)
    finally:
        os.close(fd)
    return block.digest()


def file_digest(block_hashes: Sequence[bytes], size: int) -> str:
    """The digest of a file of `size` bytes whose HASH_BLOCK_BYTES blocks hash to `block_hashes`."""
    top = hashlib.sha256(size.to_bytes(8, "little"))
    for block in block_hashes:
        top.update(block)
    return top.hexdigest()


def _hash_files(paths: Sequence[Path], max_threads: int) -> dict[Path, str]:
    """Digests of `paths`, their blocks spread over one pool of threads (a single large file uses them all)."""
    sizes = {path: path.stat().st_size for path in paths}
    blocks = [(path, offset, min(HASH_BLOCK_BYTES, sizes[path] - offset))
              for path in paths for offset in range(0, sizes[path], HASH_BLOCK_BYTES)]
    with ThreadPoolExecutor(max_workers=max(1, min(max_threads, len(blocks)))) as pool:
        hashes = list(pool.map(lambda block: _block_hash(*block), blocks))
    per_file: dict[Path, list[bytes]] = {path: [] for path in paths}
    for (path, _, _), block_hash in zip(blocks, hashes):
        per_file[path].append(block_hash)
    return {path: file_digest(per_file[path], sizes[path]) for path in paths}


class FileDigests:
    """Content digests of files, memoized in a JSON sidecar so that unchanged files are not re-read.

    Blocks of files are hashed in threads (`_hash_files`). `files_read` and `bytes_read` count the
    actual reads, for logs and tests.
    """

    def __init__(self, memo_path: Path, max_threads: int = _HASH_THREADS):
        self.memo_path = memo_path
        self.max_threads = max_threads
        self.files_read = 0
        self.bytes_read = 0

    def of(self, paths: Sequence[Path]) -> dict[Path, str]:
        memo = self._read_memo()
        identities = {path: _identity(path) for path in paths}
        unknown = [path for path, identity in identities.items() if identity not in memo]
        digests = {path: memo[identities[path]]["digest"] for path in paths if path not in unknown}
        # Known files seen under a new name (the entry directory is renamed after hashing): record
        # the name, which the memo's pruning checks.
        learned = {
            identities[path]: {"path": str(path), "digest": digest}
            for path, digest in digests.items()
            if memo[identities[path]]["path"] != str(path)
        }
        if unknown:
            fresh = _hash_files(unknown, self.max_threads)
            self.files_read += len(unknown)
            self.bytes_read += sum(path.stat().st_size for path in unknown)
            digests.update(fresh)
            # A file that changed while it was read is hashed again next time rather than memoized wrongly.
            learned.update(
                {
                    identities[path]: {"path": str(path), "digest": digest}
                    for path, digest in fresh.items()
                    if _identity(path) == identities[path]
                }
            )
        if learned:
            self._merge_into_memo(learned)
        return {path: digests[path] for path in paths}

    def _read_memo(self) -> dict[str, dict[str, str]]:
        try:
            data = json.loads(self.memo_path.read_text())
        except (OSError, ValueError):
            return {}
        return data.get("digests", {}) if data.get("hash") == HASH_NAME else {}

    def _merge_into_memo(self, learned: dict[str, dict[str, str]]) -> None:
        # Re-read first so that concurrent jobs lose few records; a lost record only costs a re-read.
        records = {**self._read_memo(), **learned}
        live = {identity: rec for identity, rec in records.items() if _still_identifies(rec["path"], identity)}
        _write_json_atomically(self.memo_path, {"hash": HASH_NAME, "digests": live})


def _still_identifies(path: str, identity: str) -> bool:
    try:
        return _identity(Path(path)) == identity
    except OSError:
        return False


def _write_json_atomically(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(scratch, path)


# ----------------------------------------------------------------------------------------------
# Entries: key, manifest, verification
# ----------------------------------------------------------------------------------------------


def hf_content_files(hf_dir: Path) -> list[Path]:
    """The files of an HF checkpoint that decide the converted model, sorted by name."""
    found = {path for pattern in HF_CONTENT_PATTERNS for path in hf_dir.glob(pattern) if path.is_file()}
    if not any(path.name == "config.json" for path in found):
        raise ConversionCacheError(f"{hf_dir} has no config.json: not an HF checkpoint directory")
    return sorted(found)


def library_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in ("megatron-core", "megatron-bridge")}


@dataclass(frozen=True)
class CacheEntry:
    root: Path
    name: str
    key: str  # full hex digest of `key_material`
    key_material: dict[str, Any]

    @property
    def dir(self) -> Path:
        return self.root / self.name

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / CHECKPOINT_DIRNAME

    @property
    def manifest_path(self) -> Path:
        return self.dir / MANIFEST_NAME

    @property
    def lock_path(self) -> Path:
        return self.root / "locks" / f"{self.name}.lock"


def locate_entry(
    hf_dir: Path,
    root: Path,
    conversion_settings: Mapping[str, Any],
    digests: FileDigests,
    versions: Mapping[str, str] | None = None,
) -> CacheEntry:
    """The entry for this checkpoint, these library versions and these conversion settings."""
    files = hf_content_files(hf_dir)
    material = {
        "format": CACHE_FORMAT,
        "hf_files": {path.relative_to(hf_dir).as_posix(): digest for path, digest in digests.of(files).items()},
        "versions": dict(library_versions() if versions is None else versions),
        "conversion": dict(conversion_settings),
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type") or "model"
    name = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', model_type)}-{key[:20]}"
    return CacheEntry(root=root, name=name, key=key, key_material=material)


def _files_under(directory: Path) -> dict[str, Path]:
    return {path.relative_to(directory).as_posix(): path for path in directory.rglob("*") if path.is_file()}


def write_manifest(
    entry: CacheEntry, staging_dir: Path, digests: FileDigests, details: Mapping[str, Any]
) -> dict[str, Any]:
    """Hash the staged checkpoint's files and write the manifest (the entry's completion mark)."""
    files = _files_under(staging_dir / CHECKPOINT_DIRNAME)
    sums = digests.of(list(files.values()))
    manifest = {
        "format": CACHE_FORMAT,
        "key": entry.key,
        "key_material": entry.key_material,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **details,
        "files": {rel: {"size": path.stat().st_size, HASH_NAME: sums[path]} for rel, path in sorted(files.items())},
    }
    _write_json_atomically(staging_dir / MANIFEST_NAME, manifest)
    return manifest


def read_manifest(entry: CacheEntry) -> dict[str, Any]:
    return json.loads(entry.manifest_path.read_text())


def entry_problem(entry: CacheEntry, digests: FileDigests) -> str | None:
    """Why the existing entry directory must not be loaded; None when it is complete and intact."""
    try:
        manifest = read_manifest(entry)
    except FileNotFoundError:
        return "no manifest (an interrupted write, or not written by this cache)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    if manifest.get("format") != CACHE_FORMAT or manifest.get("key") != entry.key:
        return "the manifest belongs to another cache format or key"
    recorded: dict[str, dict[str, Any]] = manifest.get("files") or {}
    present = _files_under(entry.checkpoint_dir) if entry.checkpoint_dir.is_dir() else {}
    if missing := sorted(set(recorded) - set(present)):
        return f"missing files: {', '.join(missing)}"
    if unexpected := sorted(set(present) - set(recorded)):
        return f"files not in the manifest: {', '.join(unexpected)}"
    for rel, info in sorted(recorded.items()):
        size = present[rel].stat().st_size
        if size != info["size"]:
            return f"{rel} has {size} bytes, the manifest says {info['size']} (truncated or overwritten)"
    sums = digests.of([present[rel] for rel in sorted(recorded)])
    if mismatched := [rel for rel in sorted(recorded) if sums[present[rel]] != recorded[rel][HASH_NAME]]:
        return f"checksum mismatch: {', '.join(mismatched)}"
    return None


def _remove_tree(path: Path) -> None:
    # Rename first: the entry name is free at once, and an interrupted delete leaves only a stray name.
    doomed = path.with_name(f"{path.name}.deleting-{socket.gethostname()}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def _leftovers(entry: CacheEntry) -> list[Path]:
    """Staging and half-deleted directories of this entry, left by processes that died mid-way."""
    patterns = (f"{entry.name}.tmp-*", f"{entry.name}.deleting-*")
    return [path for pattern in patterns for path in entry.root.glob(pattern) if path.is_dir()]


# ----------------------------------------------------------------------------------------------
# Cross-job lock and in-job coordination
# ----------------------------------------------------------------------------------------------


class EntryLock:
    """An fcntl lock on a file beside the entries; the kernel drops it if the holding process dies."""

    def __init__(self, path: Path):
        self.path = path

    @contextlib.contextmanager
    def hold(self, exclusive: bool) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        with open(self.path, "a") as handle:
            try:
                fcntl.flock(handle, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                kind = "exclusive" if exclusive else "shared"
                logger.info("waiting for the %s lock %s: another job is using this cache entry", kind, self.path)
                started = time.perf_counter()
                fcntl.flock(handle, mode)
                logger.info("got the %s lock %s after %.1f s", kind, self.path, time.perf_counter() - started)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _decided_on_rank0(fn: Callable[[], _T]) -> _T:
    """Run `fn` on global rank 0 and return its result on every rank; its error is raised everywhere,
    so no rank is left waiting in a collective that the others skipped."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    payload: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            payload = [(True, fn())]
        except Exception as exc:  # noqa: BLE001 - shipped to the other ranks, then re-raised
            error = exc
            payload = [(False, f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(payload, src=0)
    ok, value = payload[0]
    if error is not None:
        raise error
    if not ok:
        raise ConversionCacheError(f"conversion cache step failed on rank 0: {value}")
    return value


@contextlib.contextmanager
def _held_on_rank0(lock: EntryLock, exclusive: bool) -> Iterator[None]:
    if _is_rank0():
        with lock.hold(exclusive):
            yield
    else:
        yield


# ----------------------------------------------------------------------------------------------
# Saving and loading model chunks
# ----------------------------------------------------------------------------------------------


def _sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    from megatron.core.utils import unwrap_model

    # The per-chunk nesting only shapes the returned dict; tensors are stored under their global
    # keys, so the entry does not depend on how many chunks the writer had.
    return {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(unwrap_model(list(chunks)))}


def save_chunks(chunks: Sequence[torch.nn.Module], checkpoint_dir: Path, sharded_state: dict | None = None) -> None:
    """Collective: write the chunks' weights (`sharded_state`, theirs when None) as a Megatron distributed checkpoint."""
    from megatron.core import dist_checkpointing

    from skyrl_megatron.dist_io import fast_shard_bookkeeping, save_strategy, writer_results_in_process

    # Data-parallel replicas hold the same shards; by default only the first replica writes them.
    # Spreading the writes over the replicas divides the one-time save by the DP size.
    with writer_results_in_process(), fast_shard_bookkeeping():  # no helper process left by a killed rank
        state = sharded_state if sharded_state is not None else _sharded_state_dict(chunks)
        dist_checkpointing.save(state, str(checkpoint_dir), sharded_strategy=save_strategy())


def load_chunks(chunks: Sequence[torch.nn.Module], checkpoint_dir: Path) -> None:
    """Collective: read this rank's shards of a distributed checkpoint into the chunks (strictly)."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    from skyrl_megatron.dist_io import fast_shard_bookkeeping

    with fast_shard_bookkeeping():
        loaded = dist_checkpointing.load(_sharded_state_dict(chunks), str(checkpoint_dir))
    for i, chunk in enumerate(unwrap_model(list(chunks))):
        chunk.load_state_dict(loaded[f"chunk{i}"], strict=True)


# ----------------------------------------------------------------------------------------------
# The claim: one start's decision (load or convert) and its report
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadReport:
    """How this start got its weights, with timings (seconds)."""

    hit: bool | None  # None: built without the cache
    entry: str | None  # the entry directory
    reason: str  # why this start converted; "" on a hit
    lookup_seconds: float = 0.0  # hashing, lock waits and entry checks
    conversion_seconds: float = 0.0  # building the model through the bridge (HF weights included when loaded)
    save_seconds: float = 0.0  # writing and committing the entry
    load_seconds: float = 0.0  # building the model and reading the entry
    entry_conversion_seconds: float | None = None  # on a hit: what converting took when the entry was written
    not_stored: str = ""  # on a miss: why the converted weights were not stored (a disk without room)

    def summary(self) -> str:
        if self.hit is None:
            return (
                f"built through Megatron-Bridge in {self.conversion_seconds:.2f} s, "
                f"no conversion cache ({self.reason})"
            )
        if self.hit:
            saved = (
                f" (converting it took {self.entry_conversion_seconds:.2f} s)"
                if self.entry_conversion_seconds is not None
                else ""
            )
            return f"loaded {self.entry} in {self.load_seconds:.2f} s{saved}; lookup {self.lookup_seconds:.2f} s"
        if self.not_stored:
            return (
                f"converted through Megatron-Bridge in {self.conversion_seconds:.2f} s ({self.reason}); not stored "
                f"as {self.entry}: {self.not_stored}; lookup {self.lookup_seconds:.2f} s"
            )
        return (
            f"converted through Megatron-Bridge in {self.conversion_seconds:.2f} s ({self.reason}) and saved "
            f"{self.entry} in {self.save_seconds:.2f} s; lookup {self.lookup_seconds:.2f} s"
        )


@dataclass(frozen=True)
class _Verdict:
    usable: bool
    reason: str  # why the entry is not usable
    corrupt: bool  # the directory exists but must not be loaded
    entry_conversion_seconds: float | None = None


class EntryClaim:
    """This job's hold on one entry: either load it (`hit`) or convert and `store` into it."""

    def __init__(self, entry: CacheEntry, verdict: _Verdict, lookup_seconds: float, digests: FileDigests | None):
        self.entry = entry
        self.hit = verdict.usable
        self.reason = verdict.reason
        self.lookup_seconds = lookup_seconds
        self._entry_conversion_seconds = verdict.entry_conversion_seconds
        self._digests = digests  # rank 0 only
        self._not_stored = ""

    def load(self, chunks: Sequence[torch.nn.Module]) -> float:
        """Collective: read the entry into freshly built chunks; returns the seconds spent."""
        if not self.hit:
            raise ConversionCacheError(f"{self.entry.dir} is not a usable entry: {self.reason}")
        started = time.perf_counter()
        load_chunks(chunks, self.entry.checkpoint_dir)
        return time.perf_counter() - started

    def store(self, chunks: Sequence[torch.nn.Module], details: Mapping[str, Any]) -> float:
        """Collective: save converted chunks and commit them as the entry; returns the seconds spent.

        `details` (conversion time, writer layout, HF source, ...) go into the manifest.
        """
        if self.hit:
            raise ConversionCacheError(f"{self.entry.dir} is already a valid entry; nothing to store")
        started = time.perf_counter()
        state = _sharded_state_dict(chunks)
        # the entry is an optimisation: where it does not fit, this start goes on with the converted weights
        short = node_shortfall(bytes_to_write(state), free_bytes(self.entry.root))
        if short is not None:
            self._not_stored = short.describe(self.entry.root)
            logger.warning(
                "conversion cache: %s not stored (%s); this start goes on with the converted weights and the next "
                "one converts again. Fix: free space there, or point megatron_config.checkpoint_cache_dir (of "
                "trainer.policy, trainer.ref, trainer.critic) or $%s at a larger disk", self.entry.dir, self._not_stored, CACHE_ROOT_ENV)
            return time.perf_counter() - started
        staging = _decided_on_rank0(self._make_staging_dir)
        save_chunks(chunks, staging / CHECKPOINT_DIRNAME, state)
        _decided_on_rank0(lambda: self._commit(staging, details))
        return time.perf_counter() - started

    def report(self, **timings: float) -> LoadReport:
        return LoadReport(
            hit=self.hit,
            entry=str(self.entry.dir),
            reason=self.reason,
            lookup_seconds=self.lookup_seconds,
            entry_conversion_seconds=self._entry_conversion_seconds if self.hit else None,
            not_stored=self._not_stored,
            **timings,
        )

    def _make_staging_dir(self) -> Path:
        # This job holds the exclusive lock, so any other directory of this entry belongs to a dead process.
        for stale in _leftovers(self.entry):
            logger.warning("removing %s, left by an interrupted conversion", stale)
            shutil.rmtree(stale)
        staging = self.entry.root / f"{self.entry.name}.tmp-{socket.gethostname()}-{os.getpid()}"
        (staging / CHECKPOINT_DIRNAME).mkdir(parents=True)
        return staging

    def _commit(self, staging: Path, details: Mapping[str, Any]) -> None:
        assert self._digests is not None
        write_manifest(self.entry, staging, self._digests, details)
        if self.entry.dir.exists():
            # force_reconvert: the old entry goes only now that its replacement is complete
            _remove_tree(self.entry.dir)
        os.replace(staging, self.entry.dir)


def _judge(entry: CacheEntry, digests: FileDigests) -> _Verdict:
    if not entry.dir.exists():
        return _Verdict(usable=False, reason="no cache entry", corrupt=False)
    problem = entry_problem(entry, digests)
    if problem is not None:
        return _Verdict(usable=False, reason=f"bad entry: {problem}", corrupt=True)
    return _Verdict(
        usable=True, reason="", corrupt=False, entry_conversion_seconds=read_manifest(entry).get("conversion_seconds")
    )


def _judge_for_writing(entry: CacheEntry, digests: FileDigests, force: bool) -> _Verdict:
    """The verdict under the exclusive lock; a bad entry is reported and deleted here."""
    verdict = _judge(entry, digests)
    if verdict.corrupt:
        logger.warning(
            "conversion cache entry %s is unusable (%s); deleting it and converting again", entry.dir, verdict.reason
        )
        _remove_tree(entry.dir)
    if force:
        return _Verdict(usable=False, reason="force_reconvert", corrupt=verdict.corrupt)
    return verdict


@contextlib.contextmanager
def claim_entry(
    hf_dir: Path, settings: ConversionCacheSettings, conversion_settings: Mapping[str, Any]
) -> Iterator[EntryClaim]:
    """Collective: find the entry for this checkpoint and hold it for the duration of the block.

    Yields a claim that is either a hit (call `load`) or a miss (convert, then call `store`).
    A bad entry is named in a warning and deleted before the block runs.
    """
    started = time.perf_counter()
    root = resolve_cache_root(settings.root)
    digests = FileDigests(root / DIGEST_MEMO_NAME) if _is_rank0() else None
    entry = _decided_on_rank0(lambda: locate_entry(hf_dir, root, conversion_settings, digests))
    lock = EntryLock(entry.lock_path)

    if not settings.force_reconvert:
        with _held_on_rank0(lock, exclusive=False):
            verdict = _decided_on_rank0(lambda: _judge(entry, digests))
            if verdict.usable:
                yield EntryClaim(entry, verdict, time.perf_counter() - started, digests)
                return

    with _held_on_rank0(lock, exclusive=True):
        # Judged again: another job may have converted while this one waited for the exclusive lock.
        verdict = _decided_on_rank0(lambda: _judge_for_writing(entry, digests, settings.force_reconvert))
        yield EntryClaim(entry, verdict, time.perf_counter() - started, digests)
