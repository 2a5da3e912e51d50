"""`bench/gpu_master_weights_check.py` (the GPU timing of compact master weights' release and rebuild):
its smoke mode runs on CPU, and its exactness check fails when a rebuild is wrong."""

from __future__ import annotations

import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_master_weights_check.py"


def test_smoke_mode_times_and_checks_the_eager_kernels(tmp_path, bench_smoke):
    out = tmp_path / "mw.json"
    run = bench_smoke(SCRIPT, out)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["tensors"] == 19 and [r["kernels"] for r in report["runs"]] == ["eager"] * 3
    assert [r["copy_back"] for r in report["runs"]] == [None, "copy", "write"]  # the step's copy back both ways
    assert all(r["exact"] and r["freed_gib"] > 0 for r in report["runs"])


def test_a_wrong_model_weight_written_by_the_release_fails_the_check(tmp_path, bench_smoke):
    out = tmp_path / "mw.json"
    # the release's write of the model weights off by one bit in each tensor's first weight
    patch = ("real = script.master_weights._split_on_device; script.master_weights._split_on_device = "
             "lambda master, model, write_model=False: (lambda result: (write_model and "
             "model.view(script.torch.int16)[:1].__ixor__(1), result)[1])(real(master, model, write_model))")
    run = bench_smoke(SCRIPT, out, patch)
    assert run.returncode == 1
    assert [r["exact"] for r in json.loads(out.read_text())["runs"]] == [True, True, False]


def test_a_wrong_rebuild_fails_the_check(tmp_path, bench_smoke):
    out = tmp_path / "mw.json"
    patch = ("import dataclasses; real = script.master_weights._EAGER; script.master_weights._EAGER = dataclasses.replace("
             "real, join=lambda upper, remainder: real.join(upper, remainder) ^ 1)")
    run = bench_smoke(SCRIPT, out, patch)
    assert run.returncode == 1 and not json.loads(out.read_text())["runs"][0]["exact"]


def _script():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("gpu_master_weights_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_moe_shapes_hold_each_experts_weights_as_tensors_of_their_own():
    config = json.loads((SCRIPT.parents[1] / "examples/megatron/model_configs/Qwen3-30B-A3B.json").read_text())
    config["num_hidden_layers"] = 2
    sizes = _script().parameter_sizes(config)
    hidden, experts, ffn = 2048, 128, 768
    # embedding and head, the final norm; per layer 6 attention tensors, the router, 2 per expert
    assert len(sizes) == 3 + 2 * (6 + 1 + 2 * experts)
    assert sizes.count(hidden * 2 * ffn) == sizes.count(ffn * hidden) == 2 * experts
    assert sum(sizes) == 2 * 151936 * hidden + hidden + 2 * (
        2 * hidden + hidden * (32 + 2 * 4) * 128 + 2 * 128 + 32 * 128 * hidden + experts * hidden + experts * 3 * ffn * hidden)


def test_the_profiled_round_reports_the_marked_release_and_rebuild(tmp_path):
    import torch

    script = _script()
    sizes = script.parameter_sizes({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000})
    pairs = script.make_pairs(sizes, torch.device("cpu"))
    expected = [master.detach().view(torch.int32).clone() for master, _ in pairs]
    summary = script.profile_round(pairs, torch.device("cpu"), tmp_path / "profile.txt")
    report = (tmp_path / "profile.txt").read_text()
    assert summary["host_ops"] > 0 and "skyrl_megatron.masters_release" in report
    assert "skyrl_megatron.masters_rebuild" in report
    assert all(torch.equal(master.detach().view(torch.int32), want) for (master, _), want in zip(pairs, expected))
