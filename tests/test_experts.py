"""Grouped-GEMM experts (model/moe/experts.py): the grouped linear against per-expert matmuls, the
DDP gradient-accumulation contract, and a built MoE model with grouped experts against the same
checkpoint built with Megatron's SequentialMLP, loaded from the conversion-cache entry the
sequential build wrote. The layouts test (`test_model_layouts.py`) runs the grouped experts under
EP2 and TP2 x EP2 against Hugging Face's logits."""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.model.moe import experts as experts_module
from skyrl_megatron.model.moe.experts import back_to_back_runs, grouped_linear, stacked_weights
from skyrl_megatron.testing import run_on_ranks

TOKENS_PER_EXPERT = [3, 0, 5, 2]  # an expert with no tokens included


def _problem(dtype=torch.float32, din=16, dout=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(TOKENS_PER_EXPERT), din, generator=g, dtype=dtype).requires_grad_()
    weights = [torch.randn(dout, din, generator=g, dtype=dtype).requires_grad_() for _ in TOKENS_PER_EXPERT]
    grad_out = torch.randn(sum(TOKENS_PER_EXPERT), dout, generator=g, dtype=dtype)
    return x, weights, grad_out


def _per_expert(x, weights):
    return torch.cat([rows @ w.t() for rows, w in zip(x.split(TOKENS_PER_EXPERT), weights)])


@pytest.mark.parametrize("din,dout", [(16, 24), (6, 10)])  # 16-byte aligned rows, and rows that are not
def test_grouped_linear_equals_per_expert_matmuls(din, dout):
    x, weights, grad_out = _problem(din=din, dout=dout)
    out = grouped_linear(x, TOKENS_PER_EXPERT, weights)
    expected = _per_expert(x, weights)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    got = torch.autograd.grad(out, [x, *weights], grad_out)
    want = torch.autograd.grad(expected, [x, *weights], grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert torch.count_nonzero(got[2]) == 0  # the expert without tokens gets a zero gradient


def test_fused_weight_gradients_accumulate_into_main_grad():
    """Megatron DDP's contract: add into `main_grad`, mark `grad_added_to_main_grad`, return a placeholder."""
    x, weights, grad_out = _problem()
    want = torch.autograd.grad(_per_expert(x, weights), weights, grad_out)
    for w in weights:
        w.main_grad = torch.ones_like(w)
        w.grad_added_to_main_grad = False
    grouped_linear(x, TOKENS_PER_EXPERT, weights, fuse_wgrad=True).backward(grad_out)
    for w, expected in zip(weights, want):
        torch.testing.assert_close(w.main_grad, 1 + expected, rtol=0, atol=1e-5)
        assert w.grad_added_to_main_grad


def test_fused_weight_gradients_add_into_back_to_back_main_grads_per_run():
    x, weights, grad_out = _problem()
    want = torch.autograd.grad(_per_expert(x, weights), weights, grad_out)
    buffer = torch.zeros(len(weights) * weights[0].numel() + 7)
    for i, w in enumerate(weights):  # experts 0-1 back to back, a gap, then 2-3
        start = i * w.numel() + (7 if i >= 2 else 0)
        w.main_grad = buffer[start : start + w.numel()].view(w.shape)
    assert back_to_back_runs([w.main_grad for w in weights]) == [(0, 2), (2, 4)]
    grouped_linear(x, TOKENS_PER_EXPERT, weights, fuse_wgrad=True).backward(grad_out)
    for w, expected in zip(weights, want):
        torch.testing.assert_close(w.main_grad, expected, rtol=0, atol=1e-5)
    assert torch.count_nonzero(buffer[2 * weights[0].numel() : 2 * weights[0].numel() + 7]) == 0


def test_stacked_weights_is_a_view_when_the_experts_lie_back_to_back():
    buffer = torch.arange(4 * 6, dtype=torch.float32)
    back_to_back = [buffer[i * 6 : (i + 1) * 6].view(2, 3) for i in range(4)]
    view = stacked_weights(back_to_back)
    assert view.data_ptr() == buffer.data_ptr() and view.shape == (4, 2, 3)
    torch.testing.assert_close(view, buffer.view(4, 2, 3))
    scattered = [buffer[i * 6 : i * 6 + 6].view(2, 3) for i in (0, 2, 1, 3)]  # out of order: copied
    copy = stacked_weights(scattered)
    assert copy.data_ptr() != buffer.data_ptr()
    torch.testing.assert_close(copy, torch.stack(scattered))


def test_layout_memo_recomputes_when_the_tensors_move():
    from skyrl_megatron.model.moe.experts import _LayoutMemo

    buffer = torch.zeros(4 * 6)
    back_to_back = [buffer[i * 6 : (i + 1) * 6].view(2, 3) for i in range(4)]
    memo = _LayoutMemo()
    assert memo.runs(back_to_back) == [(0, 4)]
    assert memo.runs(back_to_back) is memo.runs(back_to_back)  # remembered
    moved = [t.clone() for t in back_to_back]  # as after an offload and reload: separate storages
    assert memo.runs(moved) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def _moe_logits_and_grads(rank, world_size, hf_dir: str, grouped: bool, cache_root: str, overlap_grad_reduce=False):
    """World-1 fp32 logits, one backward's expert gradients and the experts' module types, and how many
    times autograd accumulated a gradient into an expert weight (DDP's hooks run then)."""
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.conversion.cache import ConversionCacheSettings
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig()
    initialize_model_parallel(parallel)
    spec = ModelSpec(
        hf_dir,
        parallel=parallel,
        dtype="fp32",
        wrap_with_ddp=True,
        # as the policy runs by default: DDP then holds the parameters in its buffers too
        ddp_config={"use_distributed_optimizer": True, "grad_reduce_in_fp32": True,
                    "overlap_grad_reduce": overlap_grad_reduce},
        transformer_overrides={"moe_grouped_gemm": grouped},
        cache=ConversionCacheSettings(root=cache_root),
    )
    built = build_model(spec)
    model = built.chunks[0]
    from skyrl_megatron.model.moe.experts import ColumnGroupedLinear, RowGroupedLinear

    grouped_linears = [m for m in model.modules() if isinstance(m, (ColumnGroupedLinear, RowGroupedLinear))]
    # DDP's param and grad buffers hold each layer's experts back to back in expert order: the
    # grouped GEMMs read the weights and accumulate the gradients without a copy
    runs = {tuple(back_to_back_runs([w.main_grad for w in m.expert_weights()])) for m in grouped_linears}
    runs |= {tuple(back_to_back_runs(m.expert_weights())) for m in grouped_linears}
    bypass = {m.grads_bypass_autograd for m in grouped_linears}
    accumulations = []
    for name, param in model.named_parameters():
        if ".experts." in name:
            param.register_post_accumulate_grad_hook(lambda p: accumulations.append(p))
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    logits = model(tokens, torch.arange(12).unsqueeze(0).expand(2, -1), None)
    logits.float().square().mean().backward()
    with torch.no_grad():  # the scoring path (no autograd) gives the same logits
        assert torch.equal(model(tokens, torch.arange(12).unsqueeze(0).expand(2, -1), None), logits)
    grads = {}
    for name, param in model.named_parameters():
        if ".experts." in name:
            grad = param.main_grad if hasattr(param, "main_grad") else param.grad
            grads[_expert_key(name)] = grad.detach().clone()
    kinds = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")})
    from megatron.core.transformer.moe import token_dispatcher

    from skyrl_megatron.model.moe import token_sort

    assert token_dispatcher.sort_chunks_by_idxs is token_sort.sort_chunks_by_idxs  # installed by the build
    exported = {k: v.clone() for k, v in built.bridge.export_hf_weights(built.chunks, cpu=True)}
    return {"logits": logits.detach(), "grads": grads, "kinds": kinds, "export": exported, "runs": runs,
            "cache_hit": built.load_report.hit, "bypass": bypass, "accumulations": len(accumulations),
            "expert_gemms": built.expert_gemms}


def _expert_key(name: str) -> str:
    """(layer, fc, expert) from either naming: `...experts.local_experts.3.linear_fc1.weight` or `...experts.linear_fc1.weight3`."""
    layer = name.split("layers.")[1].split(".")[0]
    fc = "fc1" if "linear_fc1" in name else "fc2"
    expert = name.split("local_experts.")[1].split(".")[0] if "local_experts" in name else name.rsplit("weight", 1)[1]
    return f"{layer}.{fc}.{expert}"


@pytest.mark.slow
def test_grouped_experts_equal_sequential_experts(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model

    hf_dir, cache_root = tmp_path / "hf", str(tmp_path / "cache")
    make_tiny_hf_model("qwen3_moe", hf_dir, seed=11)
    # the sequential build converts and writes the cache entry; the grouped build loads that entry:
    # the two layouts' distributed checkpoints are interchangeable
    sequential = run_on_ranks(_moe_logits_and_grads, 1, str(hf_dir), False, cache_root)[0]
    grouped = run_on_ranks(_moe_logits_and_grads, 1, str(hf_dir), True, cache_root)[0]
    # with DDP overlapping the gradient reduce, every expert weight's hook must run: the weights stay
    # autograd inputs (the placeholder path), with the same gradients
    overlapped = run_on_ranks(_moe_logits_and_grads, 1, str(hf_dir), True, cache_root, True)[0]
    assert (sequential["cache_hit"], grouped["cache_hit"]) == (False, True)
    assert grouped["kinds"] == ["GroupedExperts"] and sequential["kinds"] == ["SequentialMLP"]
    # `expert_gemms: auto` on the CPU runtime: torch's grouped GEMM; per-expert linears have no grouped GEMMs
    assert (grouped["expert_gemms"], sequential["expert_gemms"]) == ("torch", None)
    num_experts, moe_layers = 8, 4
    assert grouped["runs"] == {((0, num_experts),)} and sequential["runs"] == set()
    assert (grouped["bypass"], overlapped["bypass"]) == ({True}, {False})
    # the grouped weights' gradients reached main_grad without autograd accumulating any of them
    assert grouped["accumulations"] == 0
    assert overlapped["accumulations"] == sequential["accumulations"] == num_experts * 2 * moe_layers
    for run in (grouped, overlapped):
        torch.testing.assert_close(run["logits"], sequential["logits"], rtol=0, atol=1e-5)
        assert run["grads"].keys() == sequential["grads"].keys() and run["grads"]
        for key, grad in sequential["grads"].items():
            torch.testing.assert_close(run["grads"][key], grad, rtol=0, atol=1e-6, msg=key)
    assert grouped["export"].keys() == sequential["export"].keys()
    for name, tensor in sequential["export"].items():
        assert torch.equal(grouped["export"][name], tensor), name


@pytest.mark.parametrize("ep_times_tp,local_experts", [(1, 4), (2, 3), (4, 2)])
def test_token_sort_equals_megatrons_split_and_concatenate(ep_times_tp, local_experts):
    """The dispatcher's two regroupings (by local expert, and back) against Megatron's own."""
    from megatron.core.transformer.moe import moe_utils

    from skyrl_megatron.model.moe.token_sort import sort_chunks_by_idxs

    chunks = torch.arange(ep_times_tp * local_experts)
    by_expert = chunks.reshape(-1, local_experts).T.ravel()  # as the alltoall dispatcher builds them
    restore = chunks.reshape(local_experts, -1).T.ravel()
    sizes = torch.randint(0, 5, (ep_times_tp * local_experts,), generator=torch.Generator().manual_seed(ep_times_tp))
    tokens = torch.randn(int(sizes.sum()), 6)
    probs = torch.rand(int(sizes.sum()))
    for order, split in ((by_expert, sizes), (restore, sizes.reshape(-1, local_experts).T.ravel())):
        ours, theirs = (tokens.clone().requires_grad_(), probs.clone().requires_grad_()), \
            (tokens.clone().requires_grad_(), probs.clone().requires_grad_())
        got, got_probs = sort_chunks_by_idxs(*ours[:1], split, order, probs=ours[1])
        want, want_probs = moe_utils.sort_chunks_by_idxs(*theirs[:1], split, order, probs=theirs[1])
        assert torch.equal(got, want) and torch.equal(got_probs, want_probs)
        # backward: a gather by the inverse order, bitwise Megatron's split-and-concatenate gradient
        upstream = torch.randn_like(got), torch.randn_like(got_probs)
        torch.autograd.backward((got, got_probs), upstream)
        torch.autograd.backward((want, want_probs), upstream)
        assert torch.equal(ours[0].grad, theirs[0].grad) and torch.equal(ours[1].grad, theirs[1].grad)
    if ep_times_tp == 1:  # one rank: the order is the identity and nothing is copied
        assert sort_chunks_by_idxs(tokens, sizes, by_expert)[0] is tokens


def _expert_wgrad_problem():
    """The experts' operands, the weight gradients autograd gives, and a layer stand-in whose experts' main grads
    (2.0 to start) lie back to back in one buffer, with `wgrad_in_gemm` set."""
    from types import SimpleNamespace

    from skyrl_megatron.model.moe.experts import _LayoutMemo

    x, weights, grad_out = _problem()
    want = torch.autograd.grad(_per_expert(x, weights), weights, grad_out)
    buffer = torch.full((len(weights) * weights[0].numel(),), 2.0)
    for i, w in enumerate(weights):
        w.main_grad = buffer[i * w.numel() : (i + 1) * w.numel()].view(w.shape)
    layer = SimpleNamespace(expert_weights=lambda: weights, _main_grad_layout=_LayoutMemo(), wgrad_in_gemm=True)
    return x.detach(), weights, grad_out, want, buffer, layer


def test_expert_wgrad_falls_back_to_the_grouped_gemm_where_quacks_kernel_does_not_take_the_operands():
    """quack's weight-gradient GEMM (`moe_config.expert_gemms`) on tensors it cannot take (CPU here, as fp32 or misaligned ones on a
    GPU): the layer's weight gradients still land in `main_grad`, from the grouped GEMM and the fp32 add."""
    from skyrl_megatron.model.moe import expert_wgrad
    from skyrl_megatron.model.moe.experts import _GroupedLinear, expert_offsets

    x, weights, grad_out, want, buffer, layer = _expert_wgrad_problem()
    assert not expert_wgrad.takes(buffer.view(len(weights), *weights[0].shape), grad_out, x)
    offsets = expert_offsets(TOKENS_PER_EXPERT, x.device)
    _GroupedLinear.add_weight_gradients(layer, grad_out, x, offsets)
    for w, expected in zip(weights, want):
        torch.testing.assert_close(w.main_grad, 2 + expected, rtol=0, atol=1e-5)


def test_expert_gemms_quack_that_cannot_run_fails_the_build_naming_the_key_and_the_fix(monkeypatch, tmp_path):
    """`moe_config.expert_gemms: quack` on a GPU quack cannot run on (no quack-kernels, or older than Hopper): one
    message before any weights load; `auto` and `torch` never fail there, and on the CPU runtime nothing fails."""
    from skyrl_megatron.config import MoeSettings
    from skyrl_megatron.model import build
    from skyrl_megatron.model import quack_support
    from skyrl_megatron.runtime import Device, Runtime

    def spec(choice):
        return build.ModelSpec(str(tmp_path / "no-checkpoint-needed"), moe=MoeSettings(expert_gemms=choice))

    build._check_kernels_can_run(spec("quack"), Runtime(Device.CPU))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(quack_support, "missing_reason", lambda device: "it needs quack-kernels")
    with pytest.raises(ValueError) as error:
        build._check_kernels_can_run(spec("quack"), Runtime(Device.CUDA))
    assert str(error.value) == (
        "megatron_config.moe_config.expert_gemms: quack cannot run here: it needs quack-kernels; set auto (quack where "
        "it runs, else torch._grouped_mm) or torch")
    for choice in ("auto", "torch"):
        build._check_kernels_can_run(spec(choice), Runtime(Device.CUDA))
    monkeypatch.setattr(quack_support, "missing_reason", lambda device: None)
    build._check_kernels_can_run(spec("quack"), Runtime(Device.CUDA))


class _StandInLinear(experts_module._GroupedLinear):
    """The attributes the build's hooks read and set, without Megatron's config."""

    def __init__(self, main_grad_dtype=torch.float32):
        torch.nn.Module.__init__(self)
        self.grads_bypass_autograd, self.wgrad_in_gemm, self.gemm_on_quack = False, False, False
        weight = torch.nn.Parameter(torch.zeros(8, 8))
        weight.main_grad = torch.zeros(8, 8, dtype=main_grad_dtype)
        self._weights = [weight]

    def expert_weights(self):
        return self._weights


@pytest.mark.parametrize("choice,quack_runs,runtime,expected", [
    ("auto", True, "cuda", "quack"),
    ("quack", True, "cuda", "quack"),
    ("auto", False, "cuda", "torch"),  # quack missing or an older GPU: torch's grouped GEMM, no error
    ("torch", True, "cuda", "torch"),
    ("auto", True, "cpu", "torch"),
    ("quack", True, "cpu", "torch"),  # the CPU runtime runs no GPU kernel, whatever was asked
])
def test_expert_gemms_choose_quack_where_it_runs_and_torchs_grouped_gemm_elsewhere(
        monkeypatch, tmp_path, caplog, choice, quack_runs, runtime, expected):
    """`moe_config.expert_gemms` on built chunks: quack's forward and input-gradient GEMMs on every grouped linear, its
    weight-gradient GEMM where the weights bypass autograd into fp32 main grads, and the log line says which and why."""
    import logging

    from skyrl_megatron.config import MoeSettings
    from skyrl_megatron.model import build
    from skyrl_megatron.model import quack_support
    from skyrl_megatron.runtime import Device, Runtime

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(quack_support, "missing_reason", lambda device: None if quack_runs else "it needs quack-kernels")
    fp32, bf16 = _StandInLinear(torch.float32), _StandInLinear(torch.bfloat16)
    chunks = [torch.nn.ModuleList([fp32, bf16])]
    experts_module.keep_expert_weights_out_of_autograd(chunks)
    spec = build.ModelSpec(str(tmp_path / "no-checkpoint-needed"), moe=MoeSettings(expert_gemms=choice))
    with caplog.at_level(logging.INFO, logger=build.logger.name):
        build._choose_expert_gemms(spec, Runtime(Device.CUDA if runtime == "cuda" else Device.CPU), chunks)
    on_quack = expected == "quack"
    assert (fp32.gemm_on_quack, bf16.gemm_on_quack) == (on_quack, on_quack)
    assert (fp32.wgrad_in_gemm, bf16.wgrad_in_gemm) == (on_quack, False)  # a bf16 main_grad keeps the two kernels
    reason = {("auto", False): "quack cannot run here: it needs quack-kernels", ("torch", True): "moe_config.expert_gemms=torch"}
    expected_log = (f"MoE experts' GEMMs: quack-kernels (moe_config.expert_gemms={choice}), weight gradients into main_grad by quack"
                    if on_quack else
                    f"MoE experts' GEMMs: torch._grouped_mm ({reason.get((choice, quack_runs), 'the CPU runtime')})")
    assert [r.getMessage() for r in caplog.records] == [expected_log]


def test_expert_gemms_leave_a_dense_model_alone(monkeypatch, tmp_path, caplog):
    """No grouped experts: quack is not even probed, and nothing is logged."""
    from skyrl_megatron.model import build
    from skyrl_megatron.model import quack_support
    from skyrl_megatron.runtime import Device, Runtime

    monkeypatch.setattr(quack_support, "missing_reason", lambda device: pytest.fail("probed quack for a dense model"))
    with caplog.at_level("INFO", logger=build.logger.name):
        build._choose_expert_gemms(build.ModelSpec(str(tmp_path)), Runtime(Device.CUDA), [torch.nn.Linear(2, 2)])
    assert caplog.records == []


def test_expert_wgrad_takes_only_aligned_half_precision_operands_and_an_fp32_target():
    """quack's GEMM is compiled for 16-byte aligned addresses and strides: an expert width that is not a multiple of
    8 half-precision elements, an operand that starts off 16 bytes, or a target that is not fp32 goes to the
    two-kernel path."""
    from skyrl_megatron.model.moe import expert_wgrad

    class OnGpu(torch.Tensor):  # reports CUDA without a GPU, for the predicate alone
        @property
        def is_cuda(self):
            return True

    def operands(out_features, in_features, rows=5, dtype=torch.bfloat16):
        target = torch.zeros(2, out_features, in_features).as_subclass(OnGpu)
        return target, torch.zeros(rows, out_features, dtype=dtype), torch.zeros(rows, in_features, dtype=dtype)

    assert expert_wgrad.takes(*operands(8, 16))
    assert expert_wgrad.takes(*operands(16, 8, dtype=torch.float16))
    assert not expert_wgrad.takes(*operands(8, 12))  # x's rows 24 bytes apart
    assert not expert_wgrad.takes(*operands(6, 16))  # dY^T's columns 12 bytes apart
    assert not expert_wgrad.takes(*operands(8, 16, dtype=torch.float32))  # fp32 operands
    target, grad_output, x = operands(8, 16)
    assert not expert_wgrad.takes(target.to(torch.bfloat16), grad_output, x)  # a bf16 main_grad
    assert not expert_wgrad.takes(target, grad_output, torch.zeros(5 * 16 + 2, dtype=torch.bfloat16)[2:].view(5, 16))
    assert not expert_wgrad.takes(torch.zeros(2, 8, 16), grad_output, x)  # on the CPU


def test_expert_wgrad_hands_the_kernel_the_back_to_back_main_grads_and_each_experts_rows(monkeypatch):
    """Where quack's GEMM takes the operands, the layer calls it once with the [E, out, in] view over the experts'
    back-to-back main grads, dY, X and the experts' row offsets. A stand-in for the GPU kernel (its definition:
    main_grads[e] += dY_e^T X_e) runs here; an expert without rows keeps its gradient."""
    from skyrl_megatron.model.moe import expert_wgrad
    from skyrl_megatron.model.moe.experts import _GroupedLinear, _LayoutMemo, expert_offsets

    calls = []

    def stand_in(main_grads, grad_output, x, offsets):  # quack's varlen-K GEMM, by its definition
        calls.append((main_grads.shape, main_grads.data_ptr()))
        starts = [0, *offsets.tolist()[:-1]]
        for e, (lo, hi) in enumerate(zip(starts, offsets.tolist())):
            main_grads[e] += grad_output[lo:hi].t() @ x[lo:hi]

    monkeypatch.setattr(expert_wgrad, "takes", lambda *operands: True)
    monkeypatch.setattr(expert_wgrad, "add_", stand_in)
    x, weights, grad_out, want, buffer, layer = _expert_wgrad_problem()
    offsets = expert_offsets(TOKENS_PER_EXPERT, x.device)
    _GroupedLinear.add_weight_gradients(layer, grad_out, x, offsets)
    assert calls == [((len(weights), *weights[0].shape), buffer.data_ptr())]
    for w, expected in zip(weights, want):
        torch.testing.assert_close(w.main_grad, 2 + expected, rtol=0, atol=1e-5)
    assert torch.equal(weights[1].main_grad, torch.full_like(weights[1].main_grad, 2.0))  # no rows: unchanged

    calls.clear()  # main grads that do not lie back to back: the two-kernel path, never the kernel
    for w in weights:
        w.main_grad = torch.full(w.shape, 2.0)
    layer._main_grad_layout = _LayoutMemo()
    _GroupedLinear.add_weight_gradients(layer, grad_out, x, offsets)
    assert calls == []
    for w, expected in zip(weights, want):
        torch.testing.assert_close(w.main_grad, 2 + expected, rtol=0, atol=1e-5)


def test_expert_wgrad_is_set_only_on_linears_that_bypass_autograd_with_fp32_main_grads():
    """`build.py` asks for the kernel after DDP wraps: a grouped linear whose weights still go through autograd
    (`overlap_grad_reduce`) or whose main grads are bf16 (`grad_reduce_in_fp32: false`) keeps the two-kernel path, and
    the count returned says how many were set."""
    fp32, bf16 = _StandInLinear(torch.float32), _StandInLinear(torch.bfloat16)
    chunks = [torch.nn.ModuleList([fp32, bf16])]
    assert experts_module.add_weight_gradients_in_gemm(chunks) == 0  # weights still in autograd: none
    assert experts_module.keep_expert_weights_out_of_autograd(chunks) == 2
    assert experts_module.add_weight_gradients_in_gemm(chunks) == 1
    assert fp32.wgrad_in_gemm and not bf16.wgrad_in_gemm


def _varlen_m_stand_in(calls: list):
    """quack's varlen-M GEMM by its definition (out[rows of e] = a[rows of e] @ b[e]), recording its operands."""

    def matmul(a, b, offsets):
        calls.append((a.data_ptr(), tuple(b.shape), b.stride()))
        starts = [0, *offsets.tolist()[:-1]]
        return torch.cat([a[lo:hi] @ b[e] for e, (lo, hi) in enumerate(zip(starts, offsets.tolist()))])

    return matmul


def test_expert_gemm_runs_the_forward_and_input_gradient_gemms_on_quack_in_every_path(monkeypatch):
    """With `gemm_on_quack` (`moe_config.expert_gemms` picking quack) the experts' forward hands quack's varlen-M GEMM the
    rows and the stacked weight transposed ([E, in, out], a view), and the backward the output gradient and the
    stacked weight ([E, out, in]): in the autograd path, the path with the weights outside autograd, and a pass
    without autograd. The GPU kernel cannot run here: a stand-in by its definition does; results equal per-expert
    matmuls, an expert without tokens included."""
    from types import SimpleNamespace

    from skyrl_megatron.model.moe import expert_gemm
    from skyrl_megatron.model.moe.experts import (
        _GroupedLinear,
        _GroupedLinearIntoMainGrad,
        _LayoutMemo,
        expert_offsets,
        stacked_weights,
    )

    calls = []
    monkeypatch.setattr(expert_gemm, "takes", lambda a, b: True)
    monkeypatch.setattr(expert_gemm, "matmul", _varlen_m_stand_in(calls))
    x, weights, grad_out = _problem()
    dout, din = weights[0].shape
    expected = _per_expert(x, weights)
    want = torch.autograd.grad(expected, [x, *weights], grad_out)
    forward_call = (x.data_ptr(), (len(weights), din, dout))

    out = grouped_linear(x, TOKENS_PER_EXPERT, weights, on_quack=True)  # weights in autograd
    got = torch.autograd.grad(out, [x, *weights], grad_out)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert [call[:2] for call in calls] == [forward_call, (grad_out.data_ptr(), (len(weights), dout, din))]
    assert calls[0][2][1] == 1  # the forward's B is the weight's transposed view, not a copy

    calls.clear()  # weights outside autograd: the layer adds their gradients itself
    stacked = stacked_weights([w.detach() for w in weights])
    layer = SimpleNamespace(gemm_on_quack=True, add_weight_gradients=lambda *operands: None)
    rows = x.detach().clone().requires_grad_()
    out = _GroupedLinearIntoMainGrad.apply(rows, expert_offsets(TOKENS_PER_EXPERT, x.device), stacked, layer)
    out.backward(grad_out)
    torch.testing.assert_close(out, expected.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(rows.grad, want[0], rtol=0, atol=1e-5)
    assert len(calls) == 2

    calls.clear()  # a pass without autograd (scoring)
    layer = SimpleNamespace(expert_weights=lambda: weights, _weight_layout=_LayoutMemo(), gemm_on_quack=True)
    with torch.no_grad():
        out, _ = _GroupedLinear.forward(layer, x, torch.tensor(TOKENS_PER_EXPERT))
    torch.testing.assert_close(out, expected.detach(), rtol=0, atol=1e-6)
    assert len(calls) == 1

    calls.clear()  # without the key: torch's grouped GEMM, never quack's
    grouped_linear(x, TOKENS_PER_EXPERT, weights).backward(grad_out)
    assert calls == []


def test_expert_gemm_falls_back_to_torchs_grouped_gemm_where_quack_does_not_take_the_operands():
    """On tensors quack's GEMM cannot take (CPU here; fp32, misaligned or empty ones on a GPU) the key changes
    nothing: the results are torch's grouped GEMM's."""
    from skyrl_megatron.model.moe import expert_gemm

    x, weights, grad_out = _problem()
    assert not expert_gemm.takes(x, stacked_weights(weights))
    out = grouped_linear(x, TOKENS_PER_EXPERT, weights, on_quack=True)
    torch.testing.assert_close(out, _per_expert(x, weights), rtol=0, atol=1e-6)
    got = torch.autograd.grad(out, [x, *weights], grad_out)
    want = torch.autograd.grad(_per_expert(x, weights), [x, *weights], grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_expert_gemm_takes_only_aligned_half_precision_rows_and_a_unit_stride_weight():
    """quack's GEMM is compiled for 16-byte aligned addresses and strides (the output's rows included) and
    half-precision operands; it needs rows to multiply, a matching inner width and a weight with a unit stride in one
    of its last two dimensions."""
    from skyrl_megatron.model.moe import expert_gemm

    class OnGpu(torch.Tensor):  # reports CUDA without a GPU, for the predicate alone
        @property
        def is_cuda(self):
            return True

    def forward_operands(din, dout, rows=5, dtype=torch.bfloat16):  # rows [rows, in], the weight [E, out, in]^T
        weight = torch.zeros(3, dout, din, dtype=dtype)
        return torch.zeros(rows, din, dtype=dtype).as_subclass(OnGpu), weight.transpose(1, 2)

    rows, weight_t = forward_operands(16, 8)
    assert expert_gemm.takes(rows, weight_t)  # the forward: the weight transposed, a view
    grad_output = torch.zeros(5, 8, dtype=torch.bfloat16).as_subclass(OnGpu)
    assert expert_gemm.takes(grad_output, weight_t.transpose(1, 2))  # the input gradient: the weight as it lies
    assert expert_gemm.takes(*forward_operands(16, 8, dtype=torch.float16))
    assert not expert_gemm.takes(rows, weight_t.transpose(1, 2))  # inner widths differ: 16 against 8
    assert not expert_gemm.takes(*forward_operands(12, 8))  # rows 24 bytes apart
    assert not expert_gemm.takes(*forward_operands(16, 12))  # output rows 24 bytes apart
    assert not expert_gemm.takes(*forward_operands(16, 8, dtype=torch.float32))  # fp32
    assert not expert_gemm.takes(*forward_operands(16, 8, rows=0))  # no rows on this rank
    no_unit_stride = torch.zeros(3, 16, 32, dtype=torch.bfloat16)[:, :, ::2]
    assert not expert_gemm.takes(rows, no_unit_stride)
    unaligned = torch.zeros(5 * 16 + 2, dtype=torch.bfloat16)[2:].view(5, 16).as_subclass(OnGpu)
    assert not expert_gemm.takes(unaligned, weight_t)  # rows starting 4 bytes off
    assert not expert_gemm.takes(torch.zeros(5, 16, dtype=torch.bfloat16), weight_t)  # on the CPU


def test_expert_gemm_hands_quack_the_experts_row_ends_with_a_leading_zero_at_its_default_configuration(monkeypatch):
    """`expert_gemm.matmul` calls quack's `gemm` with the rows, the [E, K, N] weight, int32 `cu_seqlens_m` (the
    grouped GEMM's cumulative row ends with a leading zero) and `tuned=False`. quack's GEMM cannot run on CPU: a
    module standing in for `quack.gemm_interface` records the call."""
    import sys
    import types

    from skyrl_megatron.model.moe import expert_gemm
    from skyrl_megatron.model.moe.experts import expert_offsets

    calls = []
    interface = types.ModuleType("quack.gemm_interface")
    interface.gemm = lambda a, b, **kwargs: calls.append((a, b, kwargs)) or "out"
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", interface)
    a, b = torch.zeros(10, 4), torch.zeros(4, 4, 2)
    assert expert_gemm.matmul(a, b, expert_offsets(TOKENS_PER_EXPERT, a.device)) == "out"
    [(got_a, got_b, kwargs)] = calls
    assert got_a is a and got_b is b and set(kwargs) == {"cu_seqlens_m", "tuned"} and kwargs["tuned"] is False
    assert kwargs["cu_seqlens_m"].dtype == torch.int32
    assert kwargs["cu_seqlens_m"].tolist() == [0, 3, 3, 8, 10]


def test_run_gemms_on_quack_sets_every_grouped_linear_and_counts_them():
    linears = [_StandInLinear(), _StandInLinear()]
    assert experts_module.run_gemms_on_quack([torch.nn.ModuleList(linears)]) == 2
    assert all(linear.gemm_on_quack for linear in linears)
    assert experts_module.run_gemms_on_quack([torch.nn.Linear(2, 2)]) == 0  # a dense model
