"""Tests for skyrl_megatron.testing: the rank launcher, tiny checkpoints and the tiny tokenizer."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Spawned ranks re-import this file to find the rank functions, so its import must stay cheap:
# the package loads `transformers` (seconds per rank) only when a model/tokenizer name is first
# used, and nothing below touches one at import time.
import skyrl_megatron.testing as toolkit

BIG_RESULT_NUMEL = 1 << 20  # 4 MiB of float32, far beyond a pipe buffer


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize `family` at collection time, which (unlike a decorator) spawned ranks never run."""
    if "family" in metafunc.fixturenames:
        metafunc.parametrize("family", toolkit.FAMILIES)


# ---- rank functions (top level so that spawn can pickle them) ------------------------------------


def _all_reduce_rank(rank: int, world_size: int, offset: float, *, scale: float) -> dict:
    value = torch.tensor([scale * (rank + offset)])
    dist.all_reduce(value)
    return {
        "rank": rank,
        "world_size": world_size,
        "sum": value,
        "env_marker": os.environ["TOOLKIT_TEST_MARKER"],
        "threads": torch.get_num_threads(),
        "big": torch.full((BIG_RESULT_NUMEL,), float(rank)),
    }


def _environment_variable(rank: int, world_size: int, name: str) -> str | None:
    return os.environ.get(name)


def _raise_on_one_exit_on_two(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from the second rank")
    if rank == 2:
        os._exit(7)  # dies without running any Python cleanup, so it never reports
    return rank


def _hang_on_rank_one(rank: int, world_size: int) -> int:
    # Both ranks finish joining the group first: a rank 0 that returned and exited at once could
    # close its gloo connection while a slow-starting rank 1 was still connecting to it.
    dist.barrier()
    if rank == 1:
        time.sleep(3600)
    return rank


# ---- run_on_ranks ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_on_ranks_returns_all_reduce_results_in_rank_order():
    results = toolkit.run_on_ranks(_all_reduce_rank, 2, 1.0, scale=2.0, env={"TOOLKIT_TEST_MARKER": "set"})

    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert result["world_size"] == 2
        assert result["sum"].item() == 2.0 * (1 + 2)  # scale * ((0 + 1) + (1 + 1))
        assert result["env_marker"] == "set"
        assert result["threads"] == 1
    assert torch.equal(results[1]["big"], torch.ones(BIG_RESULT_NUMEL))


@pytest.mark.slow
def test_ranks_see_the_callers_environment_as_it_is_at_the_call(monkeypatch):
    """Ranks fork from a server started earlier, with the environment of that time: each call's own counts."""
    monkeypatch.setenv("TOOLKIT_TEST_CALLER_VAR", "first")
    assert toolkit.run_on_ranks(_environment_variable, 2, "TOOLKIT_TEST_CALLER_VAR") == ["first", "first"]
    monkeypatch.setenv("TOOLKIT_TEST_CALLER_VAR", "second")
    assert toolkit.run_on_ranks(_environment_variable, 1, "TOOLKIT_TEST_CALLER_VAR") == ["second"]
    monkeypatch.delenv("TOOLKIT_TEST_CALLER_VAR")
    assert toolkit.run_on_ranks(_environment_variable, 1, "TOOLKIT_TEST_CALLER_VAR") == [None]


@pytest.mark.slow
def test_run_on_ranks_reports_every_failed_rank():
    with pytest.raises(toolkit.DistributedTestError) as excinfo:
        toolkit.run_on_ranks(_raise_on_one_exit_on_two, 3, timeout=60)

    message = str(excinfo.value)
    assert message.startswith("2 of 3 rank(s) failed")
    raised, died = message.split("rank 1:\n", 1)[1].split("rank 2:", 1)
    assert "Traceback (most recent call last)" in raised
    assert "_raise_on_one_exit_on_two" in raised
    assert "ValueError: boom from the second rank" in raised
    assert died.strip() == "exited without reporting a result (exit code 7)"
    assert "rank 0" not in message  # rank 0 succeeded and must not be blamed


@pytest.mark.slow
def test_run_on_ranks_kills_hung_rank_at_timeout():
    start = time.monotonic()
    with pytest.raises(toolkit.DistributedTestError) as excinfo:
        toolkit.run_on_ranks(_hang_on_rank_one, 2, timeout=5)
    elapsed = time.monotonic() - start

    message = str(excinfo.value)
    # Rank 0 is not checked: on a slow machine it may still be starting up when the deadline hits.
    assert "rank 1: hung" in message
    assert 5 <= elapsed < 15
    assert mp.active_children() == []  # the hung child was killed and reaped


def test_run_on_ranks_rejects_empty_world():
    with pytest.raises(ValueError, match="world_size"):
        toolkit.run_on_ranks(_raise_on_one_exit_on_two, 0)


# ---- tiny models -----------------------------------------------------------------------------------


def _load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.slow
def test_tiny_model_loads_offline_and_gives_finite_logits(family: str, tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = toolkit.make_tiny_hf_model(family, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+7="}], add_generation_prompt=True, return_dict=False
    )
    with torch.no_grad():
        logits = model(torch.tensor([input_ids])).logits
    assert logits.shape == (1, len(input_ids), 256)
    assert torch.isfinite(logits).all()
    assert model.config.vocab_size == len(tokenizer) == 256
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


@pytest.mark.slow
def test_tiny_model_norms_and_biases_are_perturbed(family: str, tmp_path: Path):
    state = _load_state_dict(toolkit.make_tiny_hf_model(family, tmp_path))

    norms = {name: t for name, t in state.items() if "norm" in name}
    biases = {name: t for name, t in state.items() if name.endswith(".bias")}
    assert norms and all(not torch.allclose(t, torch.ones_like(t)) for t in norms.values())
    assert all(t.abs().min() > 0 for t in biases.values())
    assert bool(biases) == (family == "qwen2")
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in norms


@pytest.mark.slow
def test_tiny_model_same_seed_is_bitwise_identical(family: str, tmp_path: Path):
    first = _load_state_dict(toolkit.make_tiny_hf_model(family, tmp_path / "a", seed=3))
    second = _load_state_dict(toolkit.make_tiny_hf_model(family, tmp_path / "b", seed=3))
    other_seed = _load_state_dict(toolkit.make_tiny_hf_model(family, tmp_path / "c", seed=4))

    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other_seed["model.embed_tokens.weight"])


@pytest.mark.slow
def test_tiny_model_shapes_overrides_and_dtype(tmp_path: Path):
    from transformers import AutoConfig

    model_dir = toolkit.make_tiny_hf_model(
        "qwen3_moe", tmp_path, dtype=torch.bfloat16, num_hidden_layers=2, tie_word_embeddings=True
    )
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    state = _load_state_dict(model_dir)

    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    assert config.norm_topk_prob and config.mlp_only_layers == []
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert "lm_head.weight" not in state  # tied to the embedding
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_tiny_model_rejects_unknown_family_and_misspelled_override(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown model family"):
        toolkit.make_tiny_hf_model("gpt2", tmp_path)
    with pytest.raises(TypeError, match="num_layers"):
        toolkit.make_tiny_hf_model("llama", tmp_path, num_layers=2)


# ---- tiny tokenizer --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["12+7=19", "2+3=", "  a . b\n\tc ", "(99 - 100) * 3 = -3"])
def test_tokenizer_round_trips_text_exactly(text: str):
    tokenizer = toolkit.make_tiny_tokenizer()
    ids = tokenizer.encode(text)

    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("vocab_size", [128, 256, 1024])
def test_tokenizer_vocab_size_is_exact(vocab_size: int):
    tokenizer = toolkit.make_tiny_tokenizer(vocab_size)

    assert len(tokenizer) == tokenizer.vocab_size == vocab_size
    assert max(tokenizer.get_vocab().values()) == vocab_size - 1


def test_filler_tokens_decode_to_nothing_and_stay_out_of_the_added_token_table():
    """Sampled fillers vanish from decoded text (with or without skip_special_tokens), and a published-size
    vocabulary keeps only the real special tokens as added tokens: 151,839 added fillers made the
    tokenizer take half a minute to load and to pickle."""
    from skyrl_megatron.testing.tokenizer import SPECIAL_TOKENS

    tokenizer = toolkit.make_tiny_tokenizer(151936)
    filler = tokenizer.convert_tokens_to_ids("<|unused_151000|>")
    ids = [*tokenizer.encode("2+"), filler, *tokenizer.encode("3")]
    assert filler > 151000 and tokenizer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True) == "2+3"
    assert {t.content for t in tokenizer.added_tokens_decoder.values()} == set(SPECIAL_TOKENS)


def test_tokenizer_rejects_too_small_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        toolkit.make_tiny_tokenizer(64)


def test_tokenizer_chat_template_and_special_tokens(tmp_path: Path):
    from transformers import AutoTokenizer

    toolkit.save_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    messages = [{"role": "user", "content": "2+3="}]

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    assert text == "<|bos|><|user|>2+3=<|eos|><|assistant|>"
    assert ids == tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id in ids
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    assert tokenizer.decode(ids, skip_special_tokens=True) == "2+3="
