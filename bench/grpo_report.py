"""Per-step table of a demo run's metrics.jsonl (the last record of each step wins, so a resumed run
reads as one): reward, the engine's logprob gap, bitwise sync, seconds per phase, and (colocated runs)
the host's offload/backload traffic of the policy and ref since the previous step's scoring, the memory
each still held on the GPU after its last offload, and the GPU memory then free for the engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (
    ("reward", ("reward/avg_raw_reward",), "{:.3f}"),
    ("lp gap", ("sync/rollout_logprob_max_diff",), "{:.1e}"),
    ("sync bitwise", ("sync/bitwise_equal",), "{:.0f}"),
    ("generate s", ("timing/generate",), "{:.2f}"),
    ("score s", ("timing/fwd_logprobs_values_reward",), "{:.2f}"),
    ("train s", ("timing/train_critic_and_policy", "timing/policy_train"), "{:.2f}"),
    ("sync s", ("timing/sync_weights",), "{:.2f}"),
    ("step s", ("timing/step",), "{:.2f}"),
    ("policy off GiB / s", ("offload/policy_offload_gib",), "{:.2f}", ("offload/policy_offload_s",)),
    ("policy back GiB / s", ("offload/policy_backload_gib",), "{:.2f}", ("offload/policy_backload_s",)),
    ("ref off GiB / s", ("offload/ref_offload_gib",), "{:.2f}", ("offload/ref_offload_s",)),
    ("policy held GiB", ("offload/policy_allocated_gib_after_offload",), "{:.2f}"),
    ("ref held GiB", ("offload/ref_allocated_gib_after_offload",), "{:.2f}"),
    ("GPU free GiB", ("offload/policy_device_free_gib_after_offload",), "{:.1f}"),
)


def _first(record: dict, keys: tuple[str, ...]) -> float | None:
    return next((record[k] for k in keys if isinstance(record.get(k), (int, float))), None)


def main(path: str) -> None:
    by_step = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if "trainer/global_step" in record:
            by_step[record["step"]] = record
    print("| step | " + " | ".join(column[0] for column in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for step in sorted(by_step):
        record = by_step[step]
        cells = []
        for _, keys, fmt, *seconds in COLUMNS:
            value = _first(record, keys)
            cell = "-" if value is None else fmt.format(value)
            if seconds and value is not None:
                cell += f" / {_first(record, seconds[0]) or 0.0:.2f}"
            cells.append(cell)
        print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
