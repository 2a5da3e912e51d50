"""Megatron DDP's gradient buffers exist only while the model trains (`compute/gradient_buffers.py`).

The buffers hold fp32 gradients, 4 bytes per trained parameter, that nothing reads between one
step's optimizer update and the next step's backward; the workers release them after training and
before scoring. Checked on a real DDP model (CPU, world 1): scoring gives the same logprobs with the
buffers' storage gone, training brings the storage back under the same tensors (every `main_grad`
view still points into it), and whatever the returned memory holds never reaches the gradients.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_tiny_hf_model, run_on_ranks


def _release_and_train(rank, world_size, hf_dir: str) -> dict:
    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.parallel import ParallelConfig, init_distributed
    from skyrl_megatron.testing.policy_steps import policy_gradient_objective, train_one_mini_batch
    from skyrl_megatron.testing.rl_batches import make_rl_batch

    init_distributed("cpu")
    batch = make_rl_batch(6, 6, 6, seed=5)
    ddp_config = {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True}
    built, first = train_one_mini_batch(hf_dir, batch, transformer_overrides={}, ddp_config=ddp_config)
    chunk = built.chunks[0]
    grad_buffers = [buffer.grad_data for buffer in chunk.buffers]
    first_grads = {name: p.main_grad.clone() for name, p in chunk.named_parameters()}
    runner = ModelRunner(built.chunks, ParallelConfig())
    micro = MicroBatching(micro_batch_size=2)

    def score():
        return runner.response_logprobs(batch["sequences"], batch["attention_mask"], 6, micro)

    expected = score()
    sizes = [g.untyped_storage().nbytes() for g in grad_buffers]
    freed = runner.gradients.release()
    assert runner.gradients.release() == 0  # idempotent
    during = [g.untyped_storage().nbytes() for g in grad_buffers]
    released_logprobs = score()
    runner.gradients.restore()  # what train_mini_batch does first; a second restore is a no-op
    after = [g.untyped_storage().nbytes() for g in grad_buffers]
    views_inside = all(
        p.main_grad.untyped_storage().data_ptr() == grad_buffers[0].untyped_storage().data_ptr()
        for p in chunk.parameters()
    )
    for g in grad_buffers:  # what freshly returned memory may hold
        g.fill_(float("nan"))
    second = runner.train_mini_batch(
        batch["sequences"],
        batch["attention_mask"],
        {"loss_mask": batch["loss_mask"], "advantages": batch["advantages"]},
        policy_gradient_objective,
        micro,
    )
    return {
        "sizes": sizes,
        "freed": freed,
        "during": during,
        "after": after,
        "views_inside": views_inside,
        "logprobs": (expected, released_logprobs),
        "losses": (first["loss"], second["loss"]),
        "grads": (first_grads, {name: p.main_grad.clone() for name, p in chunk.named_parameters()}),
    }


@pytest.mark.slow
def test_scoring_runs_without_gradient_storage_and_training_brings_it_back_clean(tmp_path):
    make_tiny_hf_model("qwen3", tmp_path, seed=3)
    (result,) = run_on_ranks(_release_and_train, 1, str(tmp_path), timeout=600)
    assert len(result["sizes"]) == 1 and result["sizes"][0] > 0
    assert result["freed"] == result["sizes"][0]
    assert result["during"] == [0]
    assert result["after"] == result["sizes"]
    assert result["views_inside"]
    expected, released = result["logprobs"]
    assert torch.equal(expected, released)
    # the parameters did not move (no optimizer step), so the second backward must equal the first
    assert result["losses"][0] == result["losses"][1]
    first, second = result["grads"]
    for name, grad in first.items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(second[name], grad), name
