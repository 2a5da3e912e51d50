"""The optimizer's state brought back on its own CUDA stream (`workers/offload.py`, `skyrl_megatron.arrivals`), one GPU.

A colocated run parks the optimizer's state in pinned host memory while the engine samples and brings it back
before training; on a GPU its copies run on a stream of their own beside the first forward and backward, and the
optimizer step waits for them. This check runs the same sequence twice on fresh state, once with that overlapped
backload and once with a synchronous one: offload the state of a fused AdamW over `--gib` GiB of parameters,
back-load it, run a stand-in for the first micro-batches on the current stream (matmuls that allocate and free
memory while the copies are in flight), then the optimizer step. Asserted: parameters and Adam state bitwise equal
between the two; reported: the back-load call's own seconds and the whole sequence's, overlapped and not.

    python bench/gpu_offload_overlap_check.py --out $OUT     # torch only: no Megatron, Ray or host needed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def offload_module():
    """`skyrl_megatron.workers.offload` without its package's imports (Ray, the host, Megatron): torch only."""
    sys.path.insert(0, str(ROOT))
    package = types.ModuleType("skyrl_megatron.workers")
    package.__path__ = [str(ROOT / "skyrl_megatron" / "workers")]
    sys.modules.setdefault("skyrl_megatron.workers", package)
    from skyrl_megatron.workers import offload

    return offload


def optimizer_with_state(gib: float, tensors: int):
    """A fused AdamW over `tensors` fp32 parameters of `gib` GiB in all, one step taken (its moments exist)."""
    numel = int(gib * 2**30 / 4 / tensors)
    generator = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, device="cuda", generator=generator)) for _ in range(tensors)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    for p in params:
        p.grad = torch.randn(numel, device="cuda", generator=generator)
    optimizer.step()
    for p in params:  # the next step's gradients (they are not parked: the model's side keeps its own)
        p.grad = torch.randn(numel, device="cuda", generator=generator)
    return params, optimizer


def first_micro_batches(iterations: int) -> torch.Tensor:
    """Work on the current stream that allocates and frees memory while the state is arriving."""
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(iterations):
        a = torch.tanh(a @ a.T / 8192)
    return a.sum()


def run(offload, overlapped: bool, gib: float, iterations: int) -> dict:
    from skyrl_megatron.optim import torch_optimizers

    params, optimizer = optimizer_with_state(gib, tensors=4)
    offloader = offload.ModelOffloader([], overlap_optimizer=overlapped)
    offloader.offload(model=False, optimizer=True, optimizer_obj=optimizer, pin_memory=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    report = offloader.backload(model=False, optimizer=True, optimizer_obj=optimizer)
    issued = time.perf_counter() - started
    work = first_micro_batches(iterations)
    for inner in torch_optimizers(optimizer):  # the optimizer step's lookup: waits for the arriving state
        inner.step()
    torch.cuda.synchronize()
    total = time.perf_counter() - started
    state = [optimizer.state[p][key].clone() for p in params for key in ("exp_avg", "exp_avg_sq")]
    return {"params": [p.detach().clone() for p in params], "state": state, "work": work.item(),
            "backload_call_s": issued, "sequence_s": total, "gib_moved": report.bytes_moved / 2**30}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="parameters' GiB (the state moved is 3x: params, moments)")
    parser.add_argument("--iterations", type=int, default=40, help="matmuls of the stand-in for the first micro-batches")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    offload = offload_module()
    first_micro_batches(2)  # kernels loaded before anything is timed
    synchronous = run(offload, False, args.gib, args.iterations)
    overlapped = run(offload, True, args.gib, args.iterations)
    equal = all(torch.equal(a, b) for key in ("params", "state") for a, b in zip(synchronous[key], overlapped[key], strict=True))
    record = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "gib_moved": overlapped["gib_moved"],
        "bitwise_equal": equal and synchronous["work"] == overlapped["work"],
        **{f"{name}_{key}": run_[key] for name, run_ in (("synchronous", synchronous), ("overlapped", overlapped))
           for key in ("backload_call_s", "sequence_s")},
    }
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offload_overlap.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0 if record["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
