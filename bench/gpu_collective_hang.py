"""A collective that one rank skips, over NCCL: the watchdog's named error within the timeout (watchdog.py).

Two ranks (one GPU each), `collective_timeout_s` = --timeout. Rank 1 leaves a watched "training" call
without joining the all-reduce that rank 0 waits in (rank 0 then blocks on the result, as a training
step does when it reads its loss). Expected: rank 0's watchdog names the call and rank 1 after about
--timeout seconds (the message is written to $OUT/hang_report.txt, as the driver's registry would get
it), and rank 0 ends soon after: NCCL's own timeout (--timeout + the watchdog's grace) aborts it, or the
watchdog ends the process. Prints one line per rank (how it ended, after how long) and the report.

    python bench/gpu_collective_hang.py --out $OUT            # on 2 GPUs (nvidia-h200-x2)
    python bench/gpu_collective_hang.py --out /tmp/h --smoke  # gloo on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from skyrl_megatron.testing import DistributedTestError, run_on_ranks

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off on the lent machines


def skip_a_collective(rank, world, timeout_s: float, report_file: str, smoke: bool):
    import torch
    import torch.distributed as dist

    from skyrl_megatron.failures import CollectiveHang
    from skyrl_megatron.parallel import set_collective_timeout
    from skyrl_megatron.watchdog import CollectiveWatchdog

    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if not smoke:
        torch.cuda.set_device(device)
    watchdog = CollectiveWatchdog("policy workers", timeout_s, report=lambda message: Path(report_file).write_text(message))
    set_collective_timeout(watchdog.group_timeout())
    with watchdog.watch("scoring"):  # a call every rank completes
        dist.all_reduce(torch.ones(1, device=device))
        torch.ones(1, device=device).item()
    started = time.monotonic()
    try:
        with watchdog.watch("training"):
            if rank == 0:
                value = torch.ones(1, device=device)
                dist.all_reduce(value)
                value.item()  # waits for the all-reduce, as reading a loss does
        outcome = "returned"
    except CollectiveHang as hang:
        outcome = f"CollectiveHang: {hang}"
    except Exception as error:  # noqa: BLE001 - reported, it is what the run measures
        outcome = f"{type(error).__name__}: {error}"
    if rank == 1:
        time.sleep(timeout_s + watchdog.grace_s + 40)  # stays up (and keeps rank 0's peers) until rank 0 ends
    return {"outcome": outcome, "seconds": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=20.0, help="collective_timeout_s (seconds)")
    parser.add_argument("--smoke", action="store_true", help="gloo on CPU")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    report_file = args.out / "hang_report.txt"
    report_file.unlink(missing_ok=True)
    started = time.monotonic()
    try:
        results = run_on_ranks(skip_a_collective, 2, args.timeout, str(report_file), args.smoke,
                               backend="gloo" if args.smoke else "nccl", timeout=args.timeout * 4 + 120)
        ended = [f"rank {rank}: {r['outcome'][:300]} after {r['seconds']:.1f} s" for rank, r in enumerate(results)]
    except DistributedTestError as error:  # a rank ended by NCCL or by the watchdog: how is in the text
        ended = [str(error)[-2000:]]
    summary = {
        "timeout_s": args.timeout,
        "wall_s": time.monotonic() - started,
        "report": report_file.read_text() if report_file.exists() else None,
        "ranks": ended,
    }
    (args.out / "collective_hang.json").write_text(json.dumps(summary, indent=2))
    print("\n".join(ended))
    print(f"watchdog report: {summary['report']}")
    print(f"wall {summary['wall_s']:.1f} s (collective_timeout_s {args.timeout:g})")
    sys.exit(0 if summary["report"] else 1)


if __name__ == "__main__":
    main()
