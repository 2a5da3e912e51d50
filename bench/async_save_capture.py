"""The capture of a background checkpoint save (`AsyncCheckpointSaver.save`): one process, no Ray, no host.

A bf16 Qwen3 with the demo's Qwen3-0.6B shape (28 layers; `--tiny` keeps the depth and the tensor count but shrinks
the widths, for the CPU) trains one step with DDP, the distributed optimizer and compact master weights, as the
demo's policy does; then `--saves` background saves are taken, each after a training step, with the state's
storages named as a colocated worker names them (the offloader's `storage_owners`). Printed per save: the capture
(what a training step waits for), the device copies' completion after it (`--gpu`: the time until the staged copies
are on the host, which the work after the save waits for at its next synchronisation), when the background write
was done and published, and the staged GiB. `--phases` adds where a capture's time goes (its parts, timed by wrapping them; the compact masters' rebuild
and release count the training step's too), `--profile` a cProfile of one more capture.

    python bench/async_save_capture.py --gpu             # one GPU: the 0.6B demo shape
    python bench/async_save_capture.py --tiny --profile  # CPU runtime (gloo): the host work per tensor
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import tempfile
import time
from pathlib import Path

DEMO_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
TINY_WIDTHS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="the demo shape's depth with tiny widths")
    parser.add_argument("--layers", type=int, default=DEMO_SHAPE["num_hidden_layers"])
    parser.add_argument("--saves", type=int, default=4, help="background saves (the first allocates its buffers)")
    parser.add_argument("--profile", action="store_true", help="a cProfile of one more capture")
    parser.add_argument("--phases", action="store_true",
                        help="the seconds of the capture's parts (and of the training step's master-weight work)")
    parser.add_argument("--out", type=Path, help="where the checkpoints go (default: a temporary directory)")
    args = parser.parse_args()

    import torch
    from megatron.core.distributed import finalize_model_grads

    from skyrl_megatron.checkpoint import AsyncCheckpointSaver
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.optim import OptimizerSettings, optimizer_step
    from skyrl_megatron.testing import init_single_rank, make_tiny_hf_model
    from skyrl_megatron.workers.offload import ModelOffloader

    init_single_rank("cuda" if args.gpu else "cpu", port=29563)
    root = args.out or Path(tempfile.mkdtemp(prefix="async_save_capture_"))
    shape = {**DEMO_SHAPE, **(TINY_WIDTHS if args.tiny else {}), "num_hidden_layers": args.layers}
    hf_dir = make_tiny_hf_model("qwen3", root / "hf", **shape)
    built = build_model(ModelSpec(str(hf_dir), dtype="bf16", transformer_overrides={"cross_entropy_loss_fusion": False},
                                  wrap_with_ddp=True, ddp_config={"use_distributed_optimizer": True,
                                                                  "grad_reduce_in_fp32": True}))
    (model,) = built.chunks
    host = {"lr": 1e-5, "adam_betas": [0.9, 0.999], "weight_decay": 0.01, "max_grad_norm": 1.0,
            "num_warmup_steps": 0, "scheduler": "constant"}
    settings = OptimizerSettings.from_host_config(host, {}, num_training_steps=args.saves + 4, dtype="bf16")
    optimizer = settings.build_optimizer(built.chunks, compact_master_weights=True)
    scheduler = settings.build_scheduler(optimizer)
    owners = ModelOffloader(built.chunks).storage_owners
    device = torch.device("cuda") if args.gpu else torch.device("cpu")
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(64, device=device).unsqueeze(0)

    def train_step() -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
        finalize_model_grads([model])
        assert not optimizer_step(optimizer, scheduler).skipped

    def sync() -> None:
        if args.gpu:
            torch.cuda.synchronize()

    # as a worker with `megatron_config.manual_gc` (the default): the long-lived objects out of the collector's walks
    gc.collect()
    gc.freeze()
    phases = time_phases() if args.phases else None
    saver = AsyncCheckpointSaver()
    rows = []

    def timed_save(index: int, profiler: cProfile.Profile | None = None) -> None:
        train_step()
        saver.finalize()  # the previous save written and published: this capture waits for nothing
        sync()
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        # one path: each save replaces the last (one checkpoint on the disk, and one being written)
        saver.save(root / "ckpt", built.chunks, optimizer, scheduler, step=index,
                   storage_owners=owners(optimizer))
        if profiler is not None:
            profiler.disable()
        captured = time.perf_counter()
        sync()
        copied = time.perf_counter()
        saver.finalize()  # the write's rest and the publishing
        rows.append((captured - started, copied - captured, time.perf_counter() - captured, saver.last_timings.staged_gib))

    for index in range(args.saves):
        timed_save(index)
    tensors = sum(1 for _ in model.parameters())
    for index, (capture, copies, write, gib) in enumerate(rows):
        print(f"save {index}: capture {capture * 1e3:.1f} ms, device copies done {copies * 1e3:.1f} ms after it, "
              f"written and published {write:.2f} s after it, {gib:.2f} GiB staged")
    later = rows[1:] or rows
    if phases is not None:
        print("per save and training step (ms): " + ", ".join(f"{name} {seconds / len(rows) * 1e3:.1f}"
                                                               for name, seconds in phases.items()))
    print(f"{tensors} parameter tensors, {'GPU' if args.gpu else 'CPU runtime'}: capture median "
          f"{statistics.median(r[0] for r in later) * 1e3:.1f} ms, copies done after it "
          f"{statistics.median(r[1] for r in later) * 1e3:.1f} ms (saves after the first)")
    if args.profile:
        profiler = cProfile.Profile()
        timed_save(args.saves, profiler)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


def time_phases() -> dict[str, float]:
    """Wrap the capture's parts in timers; their summed seconds, by part, filled as they run."""
    import collections
    import functools

    import megatron.core.dist_checkpointing.serialization as serialization
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async
    import megatron.core.dist_checkpointing.strategies.state_dict_saver as state_dict_saver
    import megatron.core.dist_checkpointing.strategies.torch as torch_strategy

    import skyrl_megatron.checkpoint.async_save as async_save
    import skyrl_megatron.checkpoint.training as training
    import skyrl_megatron.master_weights as master_weights

    seconds: dict[str, float] = collections.defaultdict(float)
    parts = [
        (async_save, "begin_save"), (training, "model_state_of"), (training, "sharded_training_state"),
        (async_save, "on_any_rank"), (training, "ensure_room"), (async_save, "write_shards"),
        (serialization, "save_preprocess"), (torch_strategy, "mcore_to_pyt_state_dict"),
        (state_dict_saver, "save_state_dict_async_plan"), (filesystem_async.FileSystemWriterAsync, "prepare_write_data"),
        (async_save.AsyncCheckpointSaver, "_copy_ahead"), (async_save.AsyncCheckpointSaver, "_stage"),
        (master_weights.CompactMasterWeights, "rebuild"), (master_weights.CompactMasterWeights, "release"),
    ]
    for owner, name in parts:
        function = getattr(owner, name, None)
        if function is None:  # a part another version of the code does not have
            continue

        @functools.wraps(function)
        def timed(*args, _function=function, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - started

        setattr(owner, name, timed)
    return seconds


if __name__ == "__main__":
    main()
