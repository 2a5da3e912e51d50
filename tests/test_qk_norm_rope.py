"""`fused_kernels: [qk_norm_rope]`: the query/key RMSNorm inside the rotation (model/layers/qk_norm_rope.py).

The kernel against PyTorch's RMSNorm followed by Megatron's rotation (values and the gradients of input
and weight); the GPU's Triton kernels, run by Triton's interpreter on CPU, against those functions on the
views the attention passes; and a tiny Qwen3 built with it against
the same checkpoint built without, on packed and padded micro-batches (padded ones take Megatron's own
path), with the same parameter names and the same gradients, at world 1, TP2+SP and CP2 (and Qwen3-MoE), the
kernels reading query and key inside the QKV projection's output; and at world 1 once more with the GPU's Triton
kernels (this one and the dense MLP's SwiGLU) under the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.model.layers import qk_norm_rope
from skyrl_megatron.testing import padded_token_rows, run_on_ranks


def _reference(x, weight, cos, sin, eps):
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = normed.unsqueeze(1)
    return ((normed * cos.unsqueeze(1)) + (_rotate_half(normed, False) * sin.unsqueeze(1))).squeeze(1)


def _inputs(tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, heads, dim, generator=generator) * 3).to(dtype)
    weight = (torch.rand(dim, generator=generator) + 0.5).to(dtype)
    angles = torch.rand(tokens, 1, dim // 2, generator=generator) * 10
    angles = torch.cat([angles, angles], dim=-1)  # rotate-half tables repeat their frequencies
    return x, weight, torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_matches_torch_norm_then_megatrons_rotation(dtype):
    tolerance = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for tokens, heads in [(11, 4), (6, 2)]:  # query and key heads, two micro-batch sizes
        x, weight, cos, sin = _inputs(tokens, heads, 16, dtype)
        x_ref, x_fused = x.clone().requires_grad_(), x.clone().requires_grad_()
        w_ref, w_fused = weight.clone().requires_grad_(), weight.clone().requires_grad_()
        out_ref = _reference(x_ref, w_ref, cos, sin, 1e-6)
        out_fused = qk_norm_rope.norm_rope(x_fused, w_fused, cos, sin, 1e-6)
        assert out_fused.dtype == dtype and out_fused.shape == x.shape
        torch.testing.assert_close(out_fused, out_ref, **tolerance)
        grad = torch.randn_like(out_ref)
        out_ref.backward(grad)
        out_fused.backward(grad)
        torch.testing.assert_close(x_fused.grad, x_ref.grad, **tolerance)
        assert w_fused.grad.dtype == dtype
        # the weight's gradient sums over every token and head: compared relative to its size
        torch.testing.assert_close(w_fused.grad.float(), w_ref.grad.float(), atol=tolerance["atol"] * tokens * heads,
                                   rtol=tolerance["rtol"])


def test_the_reference_sums_the_weight_terms_over_the_heads():
    x, weight, cos, sin = _inputs(7, 2, 8, torch.float32)
    out, inverse_rms = qk_norm_rope.norm_rope_forward(x, weight, cos, sin, 1e-6)
    _, weight_terms = qk_norm_rope.norm_rope_backward(out, x, weight, cos, sin, inverse_rms)
    assert weight_terms.shape == (7, 8) and weight_terms.dtype == torch.float32


# Run under Triton's interpreter (TRITON_INTERPRET=1, read when triton is imported: a fresh process): the GPU
# kernels' own code on CPU tensors, against the reference functions, on the inputs the attention passes.
_TRITON_CHECK = """
import torch
from skyrl_megatron.model.layers import norm_rope_kernels as triton_kernels, qk_norm_rope as reference

cases = 0
for dtype in (torch.float32, torch.bfloat16):
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-6, rtol=2e-6)
    # (tokens, groups, query heads per group, head dim): Qwen3's 128-wide heads; rows that do not fill the last
    # program (32 rows each at dim 128); half rows that are not a power of two (dim 20); an empty micro-batch
    for tokens, groups, per_group, dim in [(9, 2, 2, 128), (37, 3, 5, 8), (13, 2, 3, 20), (0, 2, 2, 16)]:
        generator = torch.Generator().manual_seed(tokens)
        mixed = (torch.randn(tokens, groups, (per_group + 2) * dim, generator=generator) * 3).to(dtype)
        query, key, _ = torch.split(mixed, [per_group * dim, dim, dim], dim=-1)
        weight = (torch.rand(dim, generator=generator) + 0.5).to(dtype)
        angles = (torch.rand(tokens, 1, dim // 2, generator=generator) * 10).repeat(1, 1, 2)
        # the views the attention passes: grouped query [tokens, groups, heads, dim], key [tokens, groups, dim],
        # both inside the projection's output; and a plain contiguous [tokens, heads, dim]
        plain = query.reshape(tokens, groups * per_group, dim).contiguous()
        for x in (query.unflatten(-1, (per_group, dim)), key, plain):
            tables = [t.reshape(tokens, *([1] * (x.dim() - 2)), dim).to(dtype) for t in (angles.cos(), angles.sin())]
            out, inverse_rms = triton_kernels.norm_rope_forward(x, weight, *tables, 1e-6)
            want, want_inverse_rms = reference.norm_rope_forward(x, weight, *tables, 1e-6)
            assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
            torch.testing.assert_close(out, want, **tolerance)
            torch.testing.assert_close(inverse_rms, want_inverse_rms.squeeze(-1), atol=1e-6, rtol=1e-6)
            grad = torch.randn(out.shape, generator=generator).to(dtype)
            grad_x, weight_sums = triton_kernels.norm_rope_backward(grad, x, weight, *tables, inverse_rms)
            want_grad_x, weight_terms = reference.norm_rope_backward(grad, x, weight, *tables, want_inverse_rms)
            assert grad_x.shape == x.shape and grad_x.dtype == dtype
            torch.testing.assert_close(grad_x, want_grad_x, **tolerance)
            # one partial sum per program (32 rows at dim 128), not per token: what torch sums afterwards is small
            rows = x[..., 0].numel()
            assert weight_sums.dtype == torch.float32 and weight_sums.shape[1] == dim
            rows_per_program = max(1, 2048 // triton_kernels.triton.next_power_of_2(dim // 2))
            assert weight_sums.shape[0] == max(1, -(-rows // rows_per_program))
            torch.testing.assert_close(weight_sums.sum(0), weight_terms.sum(0), atol=1e-4 * max(rows, 1), rtol=1e-4)
            cases += 1
print("checked", cases)
"""


def test_the_triton_kernels_equal_the_reference_on_the_views_the_attention_passes():
    """The GPU kernels, run by Triton's interpreter on CPU: values, 1/rms, the input's gradient and the weight's
    partial sums against the reference functions, reading query and key inside the QKV projection's output."""
    from skyrl_megatron.testing import last_word_under_triton_interpreter

    assert last_word_under_triton_interpreter(_TRITON_CHECK, timeout=300) == str(2 * 4 * 3)


def test_the_attention_runs_the_triton_kernels_on_gpu_and_the_reference_on_cpu():
    from skyrl_megatron.model.layers import norm_rope_kernels

    assert qk_norm_rope._kernels(torch.device("cuda")) == (norm_rope_kernels.norm_rope_forward,
                                                          norm_rope_kernels.norm_rope_backward)
    assert qk_norm_rope._kernels(torch.device("cpu")) == (qk_norm_rope.norm_rope_forward,
                                                         qk_norm_rope.norm_rope_backward)


SEQ_LENGTHS = (7, 12, 3, 9)


def _logits_and_grads(rank, world_size, hf_dir: str, layout: dict, fused: tuple[str, ...] = ("qk_norm_rope",)):
    """One tiny model built with the fused query/key norm and rotation (and any other `fused` kernels) and one
    without (same checkpoint, fp32, same layout): this rank's logits on a packed and a padded micro-batch, and
    every parameter's gradient of the packed one."""
    from skyrl_megatron.compute.microbatch.pack import pack_padded_batch
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.model.layers.context_parallel_layout import ContextParallelSplit
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel

    init_distributed("cpu")
    parallel = ParallelConfig(**layout)
    coords = initialize_model_parallel(parallel)
    # the fused kernels are a GPU setting; here the spec takes it on CPU too (eager kernels)
    ModelSpec.fused = lambda self, kernel, runtime: kernel in self.fused_kernels
    calls = []
    real_norm_rope = qk_norm_rope.norm_rope
    # each call's input storage: query and key read in place share the QKV projection's output
    qk_norm_rope.norm_rope = lambda *args: calls.append(args[0].untyped_storage().data_ptr()) or real_norm_rope(*args)

    tokens, mask = padded_token_rows(SEQ_LENGTHS, seed=5)
    packed = pack_padded_batch(tokens, mask, parallel)
    # under CP each rank holds its share of every sequence (identity without CP)
    split = ContextParallelSplit.for_packed(packed.packed_seq_params, coords.cp, parallel.context)
    out = {}
    for name, kernels in (("fused", fused), ("reference", ())):
        built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32", fused_kernels=kernels))
        model = built.chunks[0]
        calls.clear()
        logits = model(split.local(packed.tokens), split.local(packed.position_ids), None,
                       packed_seq_params=packed.packed_seq_params)
        packed_calls = len(calls)
        read_in_place = all(query == key for query, key in zip(calls[0::2], calls[1::2]))
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        padded = None
        if parallel.context == 1:  # a padded batch under CP would need its own split
            with torch.no_grad():
                padded = model(tokens, torch.arange(tokens.shape[1]).expand(*tokens.shape), None)
        out[name] = {
            "kernels": built.fused_kernels,
            "attention": type(model.decoder.layers[0].self_attention).__name__,
            "norm_rope_calls": packed_calls,
            "read_in_place": read_in_place,
            "padded_calls": len(calls) - packed_calls,
            "packed": logits.detach(),
            "padded": padded,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "layers": len(model.decoder.layers),
        }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family, world, layout", [
    ("qwen3", 1, {}), ("qwen3", 2, {"tensor": 2, "sequence_parallel": True}), ("qwen3", 2, {"context": 2}),
    ("qwen3_moe", 1, {}),
], ids=["world1", "tp2-sp", "cp2", "moe-world1"])
def test_a_model_with_it_equals_the_model_without(tmp_path, family, world, layout):
    """Under TP each rank normalises and rotates its own heads; the norm weights' gradients are partial
    per rank as without the fusion (Megatron reduces them over the TP group). Under CP each rank rotates
    its two chunks of every sequence by their global positions."""
    from skyrl_megatron.testing import make_tiny_hf_model

    make_tiny_hf_model(family, tmp_path, seed=4)
    for result in run_on_ranks(_logits_and_grads, world, str(tmp_path), layout, timeout=300):
        _assert_equal_models(result["fused"], result["reference"])


# The GPU's Triton kernels in the whole model: query/key norm + rotation and the dense MLP's SwiGLU, run on CPU by
# Triton's interpreter (a fresh process: TRITON_INTERPRET is read when triton is imported, and the rank server of
# `run_on_ranks` has imported it already), routed as on a GPU.
_TRITON_MODEL = """
import os, sys
import torch
sys.path.insert(0, {tests!r})
import test_qk_norm_rope as here
from skyrl_megatron import runtime
from skyrl_megatron.model.layers import norm_rope_kernels, qk_norm_rope, swiglu

cpu_overrides = runtime.Runtime.transformer_config_overrides  # these turn Megatron's CUDA-only fusions off on CPU
runtime.Runtime.transformer_config_overrides = lambda self: {{
    key: value for key, value in cpu_overrides(self).items() if key != "bias_activation_fusion"}}
qk_norm_rope._kernels = lambda device: (norm_rope_kernels.norm_rope_forward, norm_rope_kernels.norm_rope_backward)
swiglu._on_gpu = lambda t: True
calls = []
real_swiglu = swiglu._SwiGLU.apply
swiglu._SwiGLU.apply = lambda *args: calls.append(1) or real_swiglu(*args)
result = here._logits_and_grads(0, 1, {hf_dir!r}, {{}}, fused=("qk_norm_rope", "swiglu"))
here._assert_equal_models(result["fused"], result["reference"])
# every layer's MLP in the packed and the padded forward (SwiGLU has no packed/padded split)
assert "swiglu" in result["fused"]["kernels"] and len(calls) == 2 * result["fused"]["layers"], calls
print("equal")
"""


@pytest.mark.slow
def test_a_model_with_the_triton_kernels_equals_the_model_without(tmp_path):
    """World 1, Qwen3: the kernels' code as a GPU runs it, values and every parameter's gradient."""
    from pathlib import Path

    from skyrl_megatron.testing import last_word_under_triton_interpreter, make_tiny_hf_model
    from skyrl_megatron.testing.distributed import free_port

    make_tiny_hf_model("qwen3", tmp_path, seed=4)
    script = _TRITON_MODEL.format(tests=str(Path(__file__).parent), hf_dir=str(tmp_path))
    rank = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    assert last_word_under_triton_interpreter(script, timeout=600, env=rank) == "equal"


def _assert_equal_models(fused: dict, reference: dict) -> None:
    assert "qk_norm_rope" in fused["kernels"] and "qk_norm_rope" not in reference["kernels"]
    assert fused["attention"] == "QKNormRopeSelfAttention" and reference["attention"] == "SelfAttention"
    assert fused["norm_rope_calls"] == 2 * fused["layers"]  # query and key of every layer: the joined path ran
    assert fused["read_in_place"]  # no copies of query or key out of the projection's output
    assert fused["padded_calls"] == 0  # unpacked micro-batches take Megatron's own path
    torch.testing.assert_close(fused["packed"], reference["packed"], atol=1e-5, rtol=1e-5)
    if reference["padded"] is not None:
        torch.testing.assert_close(fused["padded"], reference["padded"], atol=1e-5, rtol=1e-5)
    assert fused["grads"].keys() == reference["grads"].keys()
    assert any("q_layernorm" in name for name in fused["grads"])
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(fused["grads"][name], grad, atol=1e-4, rtol=1e-4, msg=name)
