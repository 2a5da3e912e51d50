"""Per-step table of a demo run's metrics.jsonl (the last record of each step wins, so a resumed run
reads as one): reward, the engine's logprob gap, bitwise sync, and seconds per phase."""

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
)


def main(path: str) -> None:
    by_step = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if "trainer/global_step" in record:
            by_step[record["step"]] = record
    print("| step | " + " | ".join(name for name, _, _ in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for step in sorted(by_step):
        record = by_step[step]
        cells = []
        for _, keys, fmt in COLUMNS:
            value = next((record[k] for k in keys if isinstance(record.get(k), (int, float))), None)
            cells.append("-" if value is None else fmt.format(value))
        print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
