"""``moe_config.overlap_all_to_all``: MoE layers at EP > 1 that run their tokens in two halves, one half's
all-to-all in flight while the other half's experts compute (model/moe/split_overlap.py), on CPU over gloo.

A tiny Qwen3-MoE built with the key on, under EP2 (DP4, packed micro-batches), TP2 x EP2 (sequence
parallel, expert TP 2, the MoE module recomputed) and PP2 x EP2 (full layers recomputed), scores and
trains one mini-batch through the real runner with the halves, then again with them switched off on
the same model (Megatron's own forward): the response logprobs, the loss and every parameter's
gradient must agree. Not bitwise: the expert GEMMs run on half the rows (for a single row the CPU
takes a matrix-vector kernel, which rounds differently) and each expert weight gradient is the sum
of two halves' GEMMs; in fp32 every tensor must agree to 1e-5 of its largest magnitude (seen: at
most 1.1e-6, the roundings of 4 layers). One MoE layer alone with 1, 3, 5 and 7 tokens on the four
ranks (one token leaves the second half empty) gives the same output and input gradient, and each
half's experts run while an exchange is in flight, forward and backward. Then the build's backstop
and the config checks.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.testing import make_rl_batch, make_tiny_hf_model, run_on_ranks

WORLD = 4
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
MOE_RECOMPUTE = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
LAYOUTS = {  # name: (ParallelConfig fields, micro-batching, transformer_config_kwargs)
    "ep2": ({"expert": 2}, {"max_tokens": 24}, {}),  # packed micro-batches
    # the halves inside the MoE module's own recompute, and inside whole layers recomputed (skyrl 0.4's default)
    "tp2_ep2": ({"tensor": 2, "expert": 2, "sequence_parallel": True}, {"micro_batch_size": 2}, MOE_RECOMPUTE),
    "pp2_ep2": ({"pipeline": 2, "expert": 2}, {"micro_batch_size": 1}, FULL_RECOMPUTE),
}
ROWS, PROMPT, RESPONSE, SEED = 8, 6, 6, 5
# |halves - Megatron's| <= REL x max |Megatron's| for every tensor compared (see the module docstring)
REL = 1e-5


def _gradients(chunks) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.main_grad.detach().clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def _score_and_train(runner, chunks, batch, batching) -> dict:
    from skyrl_megatron.testing.policy_steps import policy_gradient_objective

    runner.gradients.release()  # as the worker scores: without gradient storage
    logprobs = runner.response_logprobs(batch["sequences"], batch["attention_mask"], RESPONSE, batching)
    response = {k: batch[k] for k in ("loss_mask", "advantages")}
    metrics = runner.train_mini_batch(batch["sequences"], batch["attention_mask"], response,
                                      policy_gradient_objective, batching)
    return {"logprobs": logprobs, "loss": metrics["loss"], "grads": _gradients(chunks)}


def _layout(rank, hf_dir: str, layout: dict, batching: dict, recompute: dict) -> tuple[dict, list]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.config import MoeSettings
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.moe.layer import set_split_overlap
    from skyrl_megatron.parallel import ParallelConfig, initialize_model_parallel

    parallel = ParallelConfig(**layout)
    initialize_model_parallel(parallel, seed=SEED)
    spec = ModelSpec(hf_dir, parallel=parallel, dtype="fp32", wrap_with_ddp=True,
                     ddp_config={"grad_reduce_in_fp32": True, "average_in_collective": True},
                     moe=MoeSettings(overlap_all_to_all=True), transformer_overrides=recompute)
    chunks = build_model(spec).chunks
    get_model_config(chunks[0]).finalize_model_grads_func = finalize_model_grads
    runner = ModelRunner(chunks, parallel)
    full = make_rl_batch(ROWS, PROMPT, RESPONSE, seed=SEED)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch = {k: v[dp_rank * ROWS // dp:(dp_rank + 1) * ROWS // dp] for k, v in full.items()}
    micro = MicroBatching(**batching)
    out = {"halved_layers": set_split_overlap(chunks, True), "on": _score_and_train(runner, chunks, batch, micro)}
    set_split_overlap(chunks, False)
    out["off"] = _score_and_train(runner, chunks, batch, micro)
    return out, chunks


def _overlap_probe(layer) -> list[tuple[str, int]]:
    """(expert pass, exchanges in flight as it starts) for every forward and backward of `layer`'s experts;
    the exchanges counted are `model/moe/async_all_to_all.py`'s, from launch to wait."""
    from skyrl_megatron.model.moe import async_all_to_all

    seen, in_flight = [], [0]
    launch = async_all_to_all._launch

    class CountedWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            in_flight[0] -= 1
            return self.work.wait()

    def counted_launch(*args, **kwargs):
        out, work = launch(*args, **kwargs)
        in_flight[0] += 1
        return out, CountedWork(work)

    async_all_to_all._launch = counted_launch
    layer.experts.register_forward_pre_hook(lambda module, args: seen.append(("forward", in_flight[0])))
    layer.experts.register_full_backward_pre_hook(lambda module, grad: seen.append(("backward", in_flight[0])))
    return seen


def _one_layer(rank, chunks) -> dict:
    """The first MoE layer of an EP2 model alone with 1 + 2 x rank tokens, halves on and off: output,
    input gradient, and the exchanges in flight at each expert pass."""
    from skyrl_megatron.model.moe.layer import grouped_moe_layer_class, set_split_overlap

    layer = next(m for m in chunks[0].modules() if isinstance(m, grouped_moe_layer_class()))
    seen = _overlap_probe(layer)
    g = torch.Generator().manual_seed(11 + rank)
    hidden = torch.randn(1 + 2 * rank, 1, layer.config.hidden_size, generator=g)
    grad = torch.randn(hidden.shape, generator=g)
    runs = {}
    for on in (True, False):
        set_split_overlap(chunks, on)
        x = hidden.clone().requires_grad_()
        output, _ = layer(x)
        output.backward(grad)
        runs[on] = (output.detach().clone(), x.grad.clone(), list(seen))
        seen.clear()
    return runs


def _refused_with_a_capacity_factor(chunks) -> str | None:
    """The build's backstop (`use_split_overlap`) on layers whose config drops tokens by capacity."""
    from megatron.core.utils import get_model_config

    from skyrl_megatron.config import ConfigError
    from skyrl_megatron.model.moe.layer import use_split_overlap

    config = get_model_config(chunks[0])
    config.moe_expert_capacity_factor = 1.0
    try:
        use_split_overlap(chunks)
    except ConfigError as error:
        return str(error)
    finally:
        config.moe_expert_capacity_factor = None
    return None


def _all(rank, world_size, hf_dir: str) -> dict:
    from skyrl_megatron.parallel import init_distributed

    init_distributed("cpu")
    out = {}
    for name, (layout, batching, recompute) in LAYOUTS.items():
        out[name], chunks = _layout(rank, hf_dir, layout, batching, recompute)
        if name == "ep2":  # its model once more: one layer alone, then the build's refusal
            out["one_layer"] = _one_layer(rank, chunks)
            out["refused"] = _refused_with_a_capacity_factor(chunks)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hf_dir = tmp_path_factory.mktemp("moe") / "hf"
    make_tiny_hf_model("qwen3_moe", hf_dir, seed=3)
    return run_on_ranks(_all, WORLD, str(hf_dir), timeout=600)


def _largest(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    gap, scale = _largest(got - want), _largest(want)
    assert gap <= REL * scale, f"{what}: off by {gap:.3g}, more than {REL:g} of its largest magnitude {scale:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_halves_score_and_train_as_megatrons_forward(results, layout):
    scored = 0
    for rank, r in enumerate(results):
        run = r[layout]
        assert run["halved_layers"] == (2 if layout == "pp2_ep2" else 4), f"rank {rank}: MoE layers in halves"
        on, off = run["on"], run["off"]
        if off["logprobs"] is not None:  # the last pipeline stage
            _close(on["logprobs"], off["logprobs"], f"{layout} rank {rank} logprobs")
            scored += 1
        assert on["loss"] == pytest.approx(off["loss"], rel=REL), f"{layout} rank {rank} loss"
        assert on["grads"].keys() == off["grads"].keys()
        for name, grad in off["grads"].items():
            _close(on["grads"][name], grad, f"{layout} rank {rank} {name}")
        experts = [n for n, g in off["grads"].items() if ".experts." in n and torch.count_nonzero(g)]
        assert experts, f"{layout} rank {rank}: the experts got no gradient"
    assert scored >= 2


@pytest.mark.slow
def test_one_layer_with_an_empty_half_and_uneven_ranks(results):
    for rank, r in enumerate(results):
        (out, grad, _), (want_out, want_grad, _) = r["one_layer"][True], r["one_layer"][False]
        assert out.shape[0] == 1 + 2 * rank
        _close(out, want_out, f"rank {rank} layer output")
        _close(grad, want_grad, f"rank {rank} input gradient")


@pytest.mark.slow
def test_each_half_computes_while_an_exchange_is_in_flight(results):
    for rank, r in enumerate(results):
        halves, megatron = r["one_layer"][True][2], r["one_layer"][False][2]
        # Megatron's forward: one expert pass each way, every exchange waited for before it
        assert megatron == [("forward", 0), ("backward", 0)], f"rank {rank}: {megatron}"
        # halves: A's experts under B's dispatch (tokens and probabilities), B's under A's return; in
        # the backward B's under A's return gradient, A's under B's dispatch gradients
        assert halves == [("forward", 2), ("forward", 1), ("backward", 1), ("backward", 2)], f"rank {rank}: {halves}"


@pytest.mark.slow
def test_the_build_refuses_the_key_for_moe_layers_it_cannot_serve(results):
    for r in results:
        assert r["refused"] and "megatron_config.moe_config.overlap_all_to_all" in r["refused"], r["refused"]
        assert "dropless routing" in r["refused"] and "overlap_all_to_all=false" in r["refused"]


# ----- the config checks --------------------------------------------------------------------------


def _problems(overrides: dict) -> list:
    from omegaconf import OmegaConf

    from skyrl_megatron.config import check_megatron_role

    megatron = {"expert_model_parallel_size": 2, "moe_config": {"overlap_all_to_all": True}}
    cfg = OmegaConf.create({
        "trainer": {"policy": {"model": {"lora": {"rank": 0}}, "megatron_config": megatron},
                    "placement": {"policy_num_nodes": 1, "policy_num_gpus_per_node": 2}},
        "generator": {},
    })
    cfg = OmegaConf.merge(cfg, OmegaConf.create(overrides))
    return [p for p in check_megatron_role(cfg, "policy", None) if "overlap_all_to_all" in p.key]


def test_the_key_is_off_by_default_and_accepted_with_tensor_and_expert_tensor_parallelism():
    from skyrl_megatron.config import MoeSettings

    assert MoeSettings().overlap_all_to_all is False
    assert _problems({}) == []
    tp_etp = {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 2, "sequence_parallel": True}
    assert _problems({"trainer": {"policy": {"megatron_config": tp_etp}}}) == []


def _megatron(values: dict) -> dict:
    return {"trainer": {"policy": {"megatron_config": values}}}


@pytest.mark.parametrize("overrides,words", [
    (_megatron({"moe_config": {"token_dispatcher": "allgather"}}), "token_dispatcher=alltoall"),
    (_megatron({"moe_config": {"device_all_to_all": True}}), "set device_all_to_all=false"),
    (_megatron({"transformer_config_kwargs": {"moe_expert_capacity_factor": 1.0}}), "drop moe_expert_capacity_factor"),
    (_megatron({"transformer_config_kwargs": {"moe_shared_expert_overlap": True}}), "drop moe_shared_expert_overlap"),
    (_megatron({"transformer_config_kwargs": {"overlap_moe_expert_parallel_comm": True}}),
     "drop overlap_moe_expert_parallel_comm"),
    (_megatron({"transformer_config_kwargs": {"moe_grouped_gemm": False}}), "drop moe_grouped_gemm"),
    ({"trainer": {"policy": {"model": {"lora": {"rank": 8}}}}}, "with LoRA"),
    (_megatron({"moe_config": {"overlap_all_to_all": "yes"}}), "true or false"),
], ids=["dispatcher", "device_all_to_all", "dropping", "shared_expert_overlap", "megatron_overlap", "not_grouped",
        "lora", "not_bool"])
def test_the_key_is_refused_where_it_cannot_apply_naming_the_key_and_fix(overrides, words):
    problems = _problems(overrides)
    assert problems, "expected a problem"
    assert all(p.key.endswith("moe_config.overlap_all_to_all") for p in problems)
    assert any(words in str(p) for p in problems), [str(p) for p in problems]
