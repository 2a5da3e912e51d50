"""The CPU runtime: Megatron-Core's CUDA assumptions redirected, real multi-rank runs over gloo."""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import run_on_ranks

VOCAB, SEQ, BATCH = 256, 16, 2


def _build_gpt(runtime):
    """A small GPT (RMSNorm, SwiGLU, RoPE, GQA) with Megatron's local (TE-free) layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    import torch.nn.functional as F

    from megatron.core import parallel_state as ps

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        **runtime.transformer_config_overrides(),
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
    )


def _tokens():
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)


def _forward_full_logits(model):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tokens, positions = _tokens()
    with torch.no_grad():
        logits = model(tokens, positions, None)  # [b, s, vocab / tp]
        return gather_from_tensor_model_parallel_region(logits)


def _save_world1_reference(rank, world_size, ckpt_dir):
    from megatron.core import dist_checkpointing

    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    runtime = init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(), seed=0)
    model = _build_gpt(runtime)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    return _forward_full_logits(model)


def _load_and_forward(rank, world_size, ckpt_dir, tensor):
    from megatron.core import dist_checkpointing

    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    runtime = init_distributed("cpu")
    coords = initialize_model_parallel(ParallelConfig(tensor=tensor), seed=123)  # other init on purpose
    model = _build_gpt(runtime)
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state)
    local_shape = tuple(model.output_layer.weight.shape)
    return _forward_full_logits(model), local_shape, coords.tp


@pytest.mark.slow
def test_tp2_forward_equals_world1_from_same_weights(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    (reference,) = run_on_ranks(_save_world1_reference, 1, ckpt, timeout=300)
    results = run_on_ranks(_load_and_forward, 2, ckpt, 2, timeout=300)
    for rank, (logits, local_shape, tp_rank) in enumerate(results):
        assert tp_rank == rank
        assert local_shape == (VOCAB // 2, 64)  # the output layer really is split over TP
        assert logits.shape == reference.shape == (BATCH, SEQ, VOCAB)
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    # and the reference is not trivially equal to a differently initialised model
    (fresh, _, _) = run_on_ranks(_fresh_forward, 1, timeout=300)[0]
    assert (fresh - reference).abs().max() > 1e-3


def _fresh_forward(rank, world_size):
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    runtime = init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(), seed=99)
    torch.manual_seed(99)
    model = _build_gpt(runtime)
    return _forward_full_logits(model), None, None


def _train_steps(rank, world_size, steps):
    """Megatron DDP + distributed optimizer on CPU: the CUDA-only code paths must all be redirected."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    runtime = init_distributed("cpu")
    initialize_model_parallel(ParallelConfig(), seed=0)
    model = _build_gpt(runtime)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0), [ddp]
    )
    tokens, positions = _tokens()
    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm > 0
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_dp2_training_with_distributed_optimizer_on_cpu():
    losses = run_on_ranks(_train_steps, 2, 4, timeout=300)
    assert losses[0] == losses[1]  # DP ranks see the same batch here, so the same loss
    assert losses[0][-1] < losses[0][0]  # and the optimizer actually steps


def test_cuda_placements_are_redirected_in_cpu_mode():
    code = (
        "import torch\n"
        "from skyrl_megatron.runtime import activate_runtime\n"
        "rt = activate_runtime('cpu')\n"
        "x = torch.empty(3, device='cuda'); y = torch.zeros(2, device=torch.cuda.current_device())\n"
        "z = torch.ones(2).cuda(); s = torch.cuda.Stream(); e = torch.cuda.Event(); e.record()\n"
        "with torch.cuda.stream(s): w = torch.ones(1, device='cuda:0')\n"
        "torch.cuda.synchronize()\n"
        "assert isinstance(s, torch.cuda.Stream) and isinstance(e, torch.cuda.Event)\n"
        "assert {t.device.type for t in (x, y, z, w)} == {'cpu'}\n"
        "assert torch.ones(1).type() == 'torch.cuda.FloatTensor'\n"
        "assert rt.backend == 'gloo' and rt.is_cpu\n"
        "print('ok')\n"
    )
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_unknown_runtime_is_a_clear_error(monkeypatch):
    from skyrl_megatron.runtime import resolve_device

    monkeypatch.delenv("SKYRL_MEGATRON_RUNTIME", raising=False)
    with pytest.raises(ValueError, match="not one of 'auto', 'cuda', 'cpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="sees no GPU"):
            resolve_device("cuda")


def test_gpu_workers_use_the_threads_they_were_given():
    from skyrl_megatron.runtime import gpu_worker_host_threads

    assert gpu_worker_host_threads({}) == 1
    assert gpu_worker_host_threads({"OMP_NUM_THREADS": "4"}) == 4
    assert gpu_worker_host_threads({"OMP_NUM_THREADS": "0"}) == 1
    assert gpu_worker_host_threads({"OMP_NUM_THREADS": "many"}) == 1
