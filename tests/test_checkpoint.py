"""Distributed checkpoints: exact resume, resume under another layout, atomic saves, bad input, HF export.

Every run trains a tiny Qwen3 (fp32, Megatron DDP) on a fixed next-token batch. A checkpoint taken
after step 2 and loaded by a fresh process group must continue with step 3 as if never interrupted.
Tests that need no training use an even smaller GPT, built without Hugging Face weights.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from skyrl_megatron.testing import run_on_ranks
from skyrl_megatron.testing.checkpoint_steps import (
    SEQ,
    TP2_SP,
    WORLD1,
    global_tensors,
    local_params,
    micro_batches,
    setup_training,
    train_step,
)

pytestmark = pytest.mark.slow

CROSS_LAYOUT_ATOL = 1e-6


# ----------------------------------------------------------------------------------------------
# Code that runs on the ranks
# ----------------------------------------------------------------------------------------------


def _tiny_gpt() -> torch.nn.Module:
    """A one-layer GPT, data-parallel over the ranks: quick to build where no HF weights are needed."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    runtime = init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(), seed=0)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        **runtime.transformer_config_overrides(),
    )
    return GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64, max_sequence_length=16
    )


def _hf_weights(built, rank: int) -> dict[str, torch.Tensor] | None:
    """Full weights under HF names on rank 0 (collective: every rank takes part in the gather)."""
    exported = {name: tensor.clone() for name, tensor in built.bridge.export_hf_weights(built.chunks, cpu=True)}
    return exported if rank == 0 else None


def _logits(built) -> torch.Tensor:
    """Full-vocabulary logits of the first micro-batch's tokens (no pipeline parallelism)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens, _ = micro_batches(0, 1)[0]
    (model,) = built.chunks
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ).unsqueeze(0), None)
    return gather_from_tensor_model_parallel_region(logits)[..., : built.provider.vocab_size]


def _train_and_save(
    rank, world, hf_dir, layout, distributed_optimizer, ckpt_dir, steps_after_save, export_dir=None
):
    """Train 2 steps, save (and export to HF), then (optionally) go on uninterrupted: the reference
    for a resume."""
    from transformers import AutoTokenizer

    from skyrl_megatron.checkpoint import save_checkpoint, save_hf_model

    built, optimizer, scheduler, micro_batches = setup_training(hf_dir, layout, distributed_optimizer)
    history = [train_step(built.chunks, optimizer, scheduler, micro_batches) for _ in range(2)]
    save_checkpoint(ckpt_dir, built.chunks, optimizer, scheduler, step=2, extra={"consumed": 8, "tag": "a"})
    rng_draw = torch.rand(3)
    logits = None
    if export_dir is not None:
        # small shards: the ~0.7 MB model is written as several safetensors files plus an index
        save_hf_model(export_dir, built, AutoTokenizer.from_pretrained(hf_dir), max_shard_bytes=200_000)
        logits = _logits(built)
    history += [train_step(built.chunks, optimizer, scheduler, micro_batches) for _ in range(steps_after_save)]
    return {
        "history": history,
        "rng_draw": rng_draw,
        "logits": logits,
        "params": local_params(built.chunks),
        "hf": _hf_weights(built, rank),
    }


def _load_and_step(rank, world, hf_dir, layout, distributed_optimizer, ckpt_dir, resave_dir=None):
    """Load, optionally save again right away (what was loaded, in this layout), then step 3."""
    from skyrl_megatron.checkpoint import load_checkpoint, save_checkpoint

    built, optimizer, scheduler, micro_batches = setup_training(hf_dir, layout, distributed_optimizer)
    state = load_checkpoint(ckpt_dir, built.chunks, optimizer, scheduler)
    if resave_dir is not None:
        save_checkpoint(resave_dir, built.chunks, optimizer, scheduler, step=state.step, extra=state.extra)
    rng_draw = torch.rand(3)
    loss, result = train_step(built.chunks, optimizer, scheduler, micro_batches)
    return {
        "state": state,
        "rng_draw": rng_draw,
        "loss": loss,
        "result": result,
        "params": local_params(built.chunks),
        "hf": _hf_weights(built, rank),
    }


# ----------------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from skyrl_megatron.testing import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"), seed=5))


@pytest.fixture(scope="module")
def reference(hf_dir, tmp_path_factory):
    """World-1, distributed optimizer: 3 uninterrupted steps, with a checkpoint after step 2."""
    ckpt = tmp_path_factory.mktemp("reference") / "step2"
    (result,) = run_on_ranks(_train_and_save, 1, hf_dir, WORLD1, True, str(ckpt), 1, timeout=300)
    return ckpt, result


@pytest.fixture(scope="module")
def tp2_run(hf_dir, tmp_path_factory):
    """TP=2 with sequence parallelism: 2 steps, a checkpoint, and an HF export of the trained model."""
    work = tmp_path_factory.mktemp("tp2")
    ckpt, export_dir = work / "step2", work / "hf_export"
    results = run_on_ranks(_train_and_save, 2, hf_dir, TP2_SP, True, str(ckpt), 0, str(export_dir), timeout=300)
    return ckpt, export_dir, results


def _last_stage_loss(results) -> float:
    (loss,) = {r["loss"] for r in results if r["loss"] is not None}
    return loss


def _tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


# ----------------------------------------------------------------------------------------------
# Resume
# ----------------------------------------------------------------------------------------------


def _assert_exact_resume(uninterrupted, resumed):
    (loss3, step3) = uninterrupted["history"][2]
    assert resumed["loss"] == loss3
    assert resumed["result"].lr == step3.lr
    assert resumed["result"].grad_norm == step3.grad_norm
    assert resumed["params"].keys() == uninterrupted["params"].keys()
    for name, param in resumed["params"].items():
        assert torch.equal(param, uninterrupted["params"][name]), name
    assert torch.equal(resumed["rng_draw"], uninterrupted["rng_draw"])  # RNG restored too
    assert resumed["state"].rng_restored
    assert resumed["state"].step == 2 and resumed["state"].extra == {"consumed": 8, "tag": "a"}


def test_world1_distributed_optimizer_resumes_exactly(hf_dir, reference):
    ckpt, uninterrupted = reference
    (resumed,) = run_on_ranks(_load_and_step, 1, hf_dir, WORLD1, True, str(ckpt), timeout=300)
    _assert_exact_resume(uninterrupted, resumed)
    # the run really trained, and the cosine schedule with one warmup step was followed
    losses = [loss for loss, _ in uninterrupted["history"]]
    assert losses[2] < losses[0]
    assert [r.lr for _, r in uninterrupted["history"]] == pytest.approx([0.0, 1e-2, 0.75e-2], abs=1e-12)


def test_world1_plain_optimizer_resumes_exactly(hf_dir, tmp_path):
    ckpt = tmp_path / "plain"
    (uninterrupted,) = run_on_ranks(_train_and_save, 1, hf_dir, WORLD1, False, str(ckpt), 1, timeout=300)
    (resumed,) = run_on_ranks(_load_and_step, 1, hf_dir, WORLD1, False, str(ckpt), timeout=300)
    _assert_exact_resume(uninterrupted, resumed)


def test_dp2_distributed_optimizer_resumes_exactly(hf_dir, tmp_path):
    ckpt = tmp_path / "dp2"
    uninterrupted = run_on_ranks(_train_and_save, 2, hf_dir, WORLD1, True, str(ckpt), 1, timeout=300)
    resumed = run_on_ranks(_load_and_step, 2, hf_dir, WORLD1, True, str(ckpt), timeout=300)
    for before, after in zip(uninterrupted, resumed):
        _assert_exact_resume(before, after)


def test_tp2_checkpoint_resumes_under_pp2_with_virtual_stages(hf_dir, reference, tp2_run, tmp_path):
    """Model and distributed-optimizer state reshard from TP=2 (+SP) to PP=2 x VPP=2 exactly; the
    resumed step matches the uninterrupted world-1 run; per-rank RNG states are left alone."""
    _, world1 = reference
    tp2_ckpt, _, _ = tp2_run
    pp2_ckpt = tmp_path / "pp2"
    pp2 = run_on_ranks(
        _load_and_step, 2, hf_dir, {"pipeline": 2, "virtual_pipeline": 2}, True, str(tp2_ckpt), str(pp2_ckpt),
        timeout=300,
    )
    # saved under TP=2, loaded under PP=2 x VPP=2, saved again: the same global tensors, bit for bit
    saved, resaved = global_tensors(tp2_ckpt, tmp_path / "a.pt"), global_tensors(pp2_ckpt, tmp_path / "b.pt")
    assert saved.keys() == resaved.keys()
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in saved)
    for key, tensor in saved.items():
        assert torch.equal(tensor, resaved[key]), key

    assert not any(r["state"].rng_restored for r in pp2)
    assert pp2[0]["state"].saved_layout.tensor == 2 and pp2[0]["state"].step == 2
    assert _last_stage_loss(pp2) == pytest.approx(world1["history"][2][0], abs=CROSS_LAYOUT_ATOL)
    assert pp2[0]["result"].lr == world1["history"][2][1].lr
    exported, expected = pp2[0]["hf"], world1["hf"]
    assert exported.keys() == expected.keys()
    worst = max((exported[name] - expected[name]).abs().max().item() for name in expected)
    assert worst <= CROSS_LAYOUT_ATOL


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def test_missing_or_incomplete_checkpoint_dir_is_a_clear_error(tmp_path):
    from skyrl_megatron.checkpoint import (
        METADATA_FILE,
        CheckpointNotFoundError,
        CorruptCheckpointError,
        load_checkpoint,
    )

    missing = tmp_path / "nowhere" / "global_step_7"
    # raised before any rank, model or optimizer is touched
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at .*global_step_7.*expected a directory") as err:
        load_checkpoint(missing, chunks=[])
    assert isinstance(err.value, FileNotFoundError)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CorruptCheckpointError, match=f"{METADATA_FILE} is missing"):
        load_checkpoint(empty, chunks=[])

    (empty / METADATA_FILE).write_text('{"step": 3')
    with pytest.raises(CorruptCheckpointError, match="cannot parse"):
        load_checkpoint(empty, chunks=[])


def test_saving_refuses_to_replace_other_directories_and_non_json_extra(tmp_path):
    from skyrl_megatron.checkpoint import CheckpointError, save_checkpoint, save_hf_model

    precious = tmp_path / "my_data"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    # refused before any collective, so no process group is needed
    with pytest.raises(CheckpointError, match=r"refusing to replace .*my_data: it is not empty and not a skyrl"):
        save_checkpoint(precious, chunks=[], step=1)
    with pytest.raises(CheckpointError, match="not a Hugging Face checkpoint"):
        save_hf_model(precious, built_model=None)
    with pytest.raises(CheckpointError, match="`extra` must be JSON-serialisable"):
        save_checkpoint(tmp_path / "new", chunks=[], step=1, extra={"when": object()})
    assert (precious / "notes.txt").read_text() == "keep me"


def _try_loads(rank, world, cases):
    """Load each (hf_dir, ckpt_dir) case; report the error and whether the model weights, the
    optimizer's fp32 main params or the schedule changed."""
    from skyrl_megatron.checkpoint import load_checkpoint

    def values(built, optimizer):
        groups = [group for part in optimizer.chained_optimizers for group in part.optimizer.param_groups]
        main_params = [param.detach().clone() for group in groups for param in group["params"]]
        return list(local_params(built.chunks).values()) + main_params

    models = {}
    outcomes = []
    for hf_dir, ckpt_dir in cases:
        if hf_dir not in models:
            models[hf_dir] = setup_training(hf_dir, WORLD1, True)[:3]
        built, optimizer, scheduler = models[hf_dir]
        before = values(built, optimizer)
        try:
            load_checkpoint(ckpt_dir, built.chunks, optimizer, scheduler)
            error = None
        except Exception as exc:  # noqa: BLE001 - the error is what the test inspects
            error = (type(exc).__name__, str(exc))
        after = values(built, optimizer)
        untouched = all(torch.equal(a, b) for a, b in zip(before, after)) and scheduler.num_steps == 0
        outcomes.append({"error": error, "untouched": untouched})
    return outcomes


def test_damaged_or_foreign_checkpoint_fails_before_touching_anything(hf_dir, reference, tmp_path):
    from skyrl_megatron.checkpoint import DIST_SUBDIR
    from skyrl_megatron.testing import make_tiny_hf_model

    ckpt, _ = reference
    truncated = tmp_path / "truncated"
    shutil.copytree(ckpt, truncated)
    shard = max((truncated / DIST_SUBDIR).glob("*.distcp"), key=lambda path: path.stat().st_size)  # a writer thread's file
    shard.write_bytes(shard.read_bytes()[:1000])
    garbled = tmp_path / "garbled"
    shutil.copytree(ckpt, garbled)
    index = garbled / DIST_SUBDIR / ".metadata"  # torch.distributed.checkpoint's index, same size
    index.write_bytes(b"\0" * index.stat().st_size)
    llama_dir = str(make_tiny_hf_model("llama", tmp_path / "llama", seed=5))
    digests = {path: _tree_digest(path) for path in (ckpt, truncated, garbled)}

    foreign, cut, unreadable = run_on_ranks(
        _try_loads, 1, [(llama_dir, str(ckpt)), (hf_dir, str(truncated)), (hf_dir, str(garbled))], timeout=300
    )[0]

    kind, message = foreign["error"]
    assert kind == "CheckpointMismatchError"
    assert "another model" in message and "qk_layernorm=True" in message and "qk_layernorm=False" in message
    kind, message = cut["error"]
    assert kind == "CorruptCheckpointError"
    assert f"{shard.name} has 1000 bytes" in message and str(truncated) in message
    kind, message = unreadable["error"]
    assert kind == "CorruptCheckpointError" and f"cannot read checkpoint {garbled}" in message
    assert foreign["untouched"] and cut["untouched"] and unreadable["untouched"]
    assert digests == {path: _tree_digest(path) for path in digests}  # nothing was written


def _load_with_rank1_failing(rank, world, ckpt_dir):
    """Save, then load twice with rank 1 failing alone: in dist_checkpointing's checks, then in its read.
    Report each error and whether the weights stayed as they were."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    from skyrl_megatron.checkpoint import load_checkpoint, save_checkpoint

    model = _tiny_gpt()
    save_checkpoint(ckpt_dir, [model], step=1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # differs from the checkpoint: a load that went through would show
    before = local_params([model])

    def fail(*args, **kwargs):
        raise OSError("simulated failure on rank 1")

    outcomes = []
    for module, name in ((serialization, "validate_integrity_and_strict_load"), (TorchDistLoadShardedStrategy, "load")):
        original = getattr(module, name)
        if rank == 1:
            setattr(module, name, fail)
        try:
            load_checkpoint(ckpt_dir, [model])
            error = None
        except Exception as exc:  # noqa: BLE001 - the error is what the test inspects
            error = (type(exc).__name__, str(exc))
        finally:
            setattr(module, name, original)
        after = local_params([model])
        outcomes.append({"error": error, "untouched": all(torch.equal(after[k], v) for k, v in before.items())})
    return outcomes


def test_a_read_failing_on_one_data_parallel_rank_fails_the_load_on_all(tmp_path):
    """The data-parallel load exchanges what each replica read: a rank that failed before or in its
    read must not leave the other waiting in that exchange."""
    results = run_on_ranks(_load_with_rank1_failing, 2, str(tmp_path / "ckpt"), timeout=90)
    for outcomes in results:
        for outcome in outcomes:
            kind, message = outcome["error"]
            assert kind == "CorruptCheckpointError"
            assert message == f"cannot read checkpoint {tmp_path / 'ckpt'}: rank 1: OSError: simulated failure on rank 1"
            assert outcome["untouched"]


# ----------------------------------------------------------------------------------------------
# Atomic saves
# ----------------------------------------------------------------------------------------------


def _save_crashing_then_succeeding(rank, world, hf_dir, ckpt_dir):
    """Overwrite an existing checkpoint, crashing after the shards are written; then for real."""
    import skyrl_megatron.checkpoint as checkpoint
    from skyrl_megatron.checkpoint import training

    built, optimizer, scheduler, micro_batches = setup_training(hf_dir, WORLD1, True)
    train_step(built.chunks, optimizer, scheduler, micro_batches)

    def crash(partial, final):
        assert (partial / checkpoint.METADATA_FILE).is_file()  # everything was written
        raise RuntimeError("simulated crash before publishing")

    publish = training.commit
    training.commit = crash
    try:
        checkpoint.save_checkpoint(ckpt_dir, built.chunks, optimizer, scheduler, step=3)
        crashed = False
    except RuntimeError:
        crashed = True
    finally:
        training.commit = publish
    after_crash = checkpoint.read_checkpoint_metadata(ckpt_dir).step
    loaded = checkpoint.load_checkpoint(ckpt_dir, built.chunks, optimizer, scheduler).step
    checkpoint.save_checkpoint(ckpt_dir, built.chunks, optimizer, scheduler, step=30)
    return {"crashed": crashed, "after_crash": after_crash, "loaded": loaded}


def test_crash_mid_save_leaves_the_previous_checkpoint_loadable(hf_dir, reference, tmp_path):
    from skyrl_megatron.checkpoint import read_checkpoint_metadata

    ckpt = tmp_path / "global_step_2"
    shutil.copytree(reference[0], ckpt)
    before = _tree_digest(ckpt)
    (result,) = run_on_ranks(_save_crashing_then_succeeding, 1, hf_dir, str(ckpt), timeout=300)
    assert result == {"crashed": True, "after_crash": 2, "loaded": 2}
    # the successful save replaced it, and nothing is left beside it
    assert read_checkpoint_metadata(ckpt).step == 30
    assert _tree_digest(ckpt) != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2"]


def test_hf_export_of_the_trained_tp2_model_reproduces_its_logits(hf_dir, tp2_run):
    """save_hf_model gathers the TP shards into a checkpoint transformers loads, with the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, export_dir, (rank0, _) = tp2_run
    tokens, _ = micro_batches(0, 1)[0]

    def hf_logits(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            return model(tokens).logits

    assert len(list(export_dir.glob("model-*-of-*.safetensors"))) > 1
    exported = hf_logits(export_dir)
    assert (exported - rank0["logits"]).abs().max().item() <= 1e-4
    assert (exported - hf_logits(hf_dir)).abs().max().item() > 1e-3  # the trained weights, not the initial ones
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    assert tokenizer.decode(tokenizer("12+7=19")["input_ids"], skip_special_tokens=True) == "12+7=19"
    assert not list(export_dir.parent.glob(".*"))  # no partial or replaced directory left behind
