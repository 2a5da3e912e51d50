"""The GPU check for scoring passes as CUDA graphs (bench/gpu_scoring_graph_check.py): its padding into a fixed
bucket, and its CPU smoke mode, which checks the script before device time is spent on it and asserts what the
graphs rely on: a micro-batch padded into the bucket (dummy segments, then empty ones) gives its real tokens the
hidden states of the unpadded forward."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_scoring_graph_check.py"


def test_padding_fills_the_bucket_with_short_segments_then_empty_ones():
    pad_to_bucket = runpy.run_path(str(SCRIPT))["pad_to_bucket"]
    ids = torch.arange(1, 11).unsqueeze(0)  # two sequences: 6 and 4 tokens
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    padded_ids, padded_positions, padded_cu = pad_to_bucket(ids, positions, cu, 21, 6, pad_segment=4, pad_token_id=0)
    assert padded_ids.tolist() == [list(range(1, 11)) + [0] * 11]
    assert padded_cu.dtype == torch.int32
    # 11 padded tokens as dummy segments of 4, 4 and 3, then one empty segment repeating the end
    assert padded_cu.tolist() == [0, 6, 10, 14, 18, 21, 21]
    assert padded_positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]]
    same_ids, _, same_cu = pad_to_bucket(ids, positions, cu, 10, 3, pad_segment=4)  # a full bucket: no dummy
    assert torch.equal(same_ids, ids) and same_cu.tolist() == [0, 6, 10, 10]
    with pytest.raises(ValueError, match="do not fit a bucket of 8"):
        pad_to_bucket(ids, positions, cu, 8, 6, pad_segment=4)
    with pytest.raises(ValueError, match="5 segments do not fit 4 boundary slots"):
        pad_to_bucket(ids, positions, cu, 21, 4, pad_segment=4)


@pytest.mark.slow
def test_smoke_mode_pads_without_changing_the_real_tokens(tmp_path, bench_smoke):
    out = tmp_path / "graph.json"
    run = bench_smoke(SCRIPT, out, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["device"] == "cpu" and "capture" not in result  # no graphs on CPU
    rows = result["micro_batches"]
    assert len(rows) >= 2 and all(0 < row["real_tokens"] <= result["bucket_tokens"] for row in rows)
    assert all(row["padded_vs_eager_max_abs"] <= 1e-5 for row in rows), rows
