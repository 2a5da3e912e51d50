"""Our hand-written Triton kernels compile for the H200 (sm_90), on a machine without a GPU.

Triton's interpreter (the CPU tests of each kernel's results) runs a kernel's Python body as it is, so it
accepts code that the compiler refuses: a module-level global that is not a `tl.constexpr`, for one, which
only the code generator rejects. Here each kernel goes through Triton's whole pipeline for an sm_90 target
(source -> TTIR -> TTGIR -> LLVM -> PTX -> cubin, with the ptxas Triton ships), with the argument types and
constexpr values its launches use.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)


def _logprob_cases():
    from skyrl_megatron.compute import logprob_kernels as k

    for logits in ("*bf16", "*fp32"):
        for tempered in (False, True):
            for with_entropy in (False, True):
                flags = {"TEMPERED": tempered, "WITH_ENTROPY": with_entropy}
                yield (f"statistics {logits} {flags}", k._statistics_kernel, {
                    "logits_ptr": logits, "row_stride": "i32", "vocab": "i32", "target_ptr": "*i64",
                    "owned_ptr": "*i1", "temperature": "fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32",
                    "target_logit_ptr": "*fp32", "weighted_ptr": "*fp32",
                }, {**flags, "BLOCK": k._STATISTICS_BLOCK})
                yield (f"logit grads {logits} {flags}", k._logit_grad_kernel, {
                    "logits_ptr": logits, "row_stride": "i32", "vocab": "i32", "log_partition_ptr": "*fp32",
                    "g_logprob_ptr": "*fp32", "target_ptr": "*i64", "owned_ptr": "*i1", "entropy_ptr": "*fp32",
                    "g_entropy_ptr": "*fp32", "temperature": "fp32",
                }, {**flags, "BLOCK": k._GRAD_BLOCK})


def _other_cases():
    from skyrl_megatron import compact_adam_kernels, master_weights_kernels
    from skyrl_megatron.model.layers import rms_norm_kernels, swiglu_kernels
    from skyrl_megatron.model.moe import grad_accumulate_kernels, row_sum_kernels

    yield ("compact masters' split", master_weights_kernels._split_kernel,
           {"bits_ptr": "*i32", "upper_ptr": "*i16", "remainder_ptr": "*i16", "partial_ptr": "*i32", "numel": "i64"},
           {"BLOCK": master_weights_kernels._BLOCK})
    yield ("compact masters' split writing the model weights", master_weights_kernels._round_split_kernel,
           {"bits_ptr": "*i32", "upper_ptr": "*i16", "remainder_ptr": "*i16", "partial_ptr": "*i32", "numel": "i64"},
           {"BLOCK": master_weights_kernels._BLOCK})
    yield ("compact masters' tie indices", master_weights_kernels._tie_index_kernel,
           {"bits_ptr": "*i32", "upper_ptr": "*i16", "partial_ptr": "*i32", "first_ptr": "*i64", "out_ptr": "*i64",
            "numel": "i64"}, {"BLOCK": master_weights_kernels._BLOCK})
    yield ("compact masters' join", master_weights_kernels._join_kernel,
           {"upper_ptr": "*i16", "remainder_ptr": "*i16", "bits_ptr": "*i32", "numel": "i64"},
           {"BLOCK": master_weights_kernels._BLOCK})
    yield ("compact masters' ties raised", master_weights_kernels._raise_ties_kernel,
           {"bits_ptr": "*i32", "index_ptr": "*i64", "count": "i64"}, {"BLOCK": master_weights_kernels._TIE_BLOCK})
    for scaled in (False, True):
        for aligned in (False, True):
            yield (f"AdamW over compact masters, scaled {scaled}, aligned {aligned}",
                   compact_adam_kernels._adam_round_split_kernel,
                   {"upper_ptr": "*i16", "remainder_ptr": "*i16", "grad_ptr": "*fp32", "exp_avg_ptr": "*fp32",
                    "exp_avg_sq_ptr": "*fp32", "start_ptr": "*i64", "count_ptr": "*i32", "group_ptr": "*i32",
                    "hyper_ptr": "*fp32", "skip_ptr": "*fp32", "scale_ptr": "*fp32", "partial_ptr": "*i32",
                    "tie_bits_ptr": "*i32"},
                   {"HAS_SCALE": scaled, "ALIGNED": aligned, "BLOCK": compact_adam_kernels.BLOCK})
    yield ("AdamW over compact masters' tie indices", compact_adam_kernels._tie_index_kernel,
           {"start_ptr": "*i64", "partial_ptr": "*i32", "tie_bits_ptr": "*i32", "first_ptr": "*i64", "out_ptr": "*i64"},
           {"BLOCK": compact_adam_kernels.BLOCK})

    for rows in ("*bf16", "*fp32"):
        for hidden in (128, 2048, 2560, 4096):
            block, warps = rms_norm_kernels._launch(hidden)
            yield (f"rms norm forward {rows} {hidden}", rms_norm_kernels._forward_kernel,
                   {"x_ptr": rows, "weight_ptr": rows, "out_ptr": rows, "inverse_rms_ptr": "*fp32", "hidden": "i32",
                    "eps": "fp32"}, {"BLOCK": block})
            yield (f"rms norm backward {rows} {hidden}", rms_norm_kernels._backward_kernel,
                   {"grad_ptr": rows, "x_ptr": rows, "weight_ptr": rows, "inverse_rms_ptr": "*fp32",
                    "grad_x_ptr": rows, "grad_weight_partial_ptr": "*fp32", "num_rows": "i32", "hidden": "i32"},
                   {"ROWS": rms_norm_kernels._ROWS, "BLOCK": block})
    for half in ("*bf16", "*fp16"):
        yield (f"grad accumulate {half}", grad_accumulate_kernels._accumulate_kernel,
               {"target_ptr": "*fp32", "addend_ptr": half, "numel": "i64"}, {"BLOCK": grad_accumulate_kernels._BLOCK})
        yield (f"swiglu forward {half}", swiglu_kernels._swiglu_forward_kernel,
               {"y_ptr": half, "out_ptr": half, "width": "i32"}, {"BLOCK": swiglu_kernels._BLOCK})
        yield (f"swiglu backward {half}", swiglu_kernels._swiglu_backward_kernel,
               {"grad_ptr": half, "y_ptr": half, "grad_y_ptr": half, "width": "i32"}, {"BLOCK": swiglu_kernels._BLOCK})
    for rows in ("*bf16", "*fp16", "*fp32"):
        for k in (2, 8):
            yield (f"row sums {rows} k={k}", row_sum_kernels._sum_rows_kernel,
                   {"x_ptr": rows, "rows_ptr": "*i64", "out_ptr": rows, "hidden": "i32"},
                   {"K": k, "BLOCK": row_sum_kernels._BLOCK})


CASES = [*_logprob_cases(), *_other_cases()]


@pytest.mark.parametrize("name,kernel,signature,constexprs", CASES, ids=[case[0] for case in CASES])
def test_the_kernel_compiles_for_sm90(name, kernel, signature, constexprs):
    source = ASTSource(fn=kernel, signature={**signature, **{key: "constexpr" for key in constexprs}},
                       constexprs=constexprs)
    compiled = triton.compile(source, target=H200)
    assert compiled.asm["cubin"], name


def test_compact_adams_pass_reads_and_writes_16_bytes_at_a_time_where_its_blocks_are_aligned():
    """With its pointers 16-byte aligned (as Triton specializes them at launch) and `ALIGNED` set, the pass's loads
    and stores are 16-byte vector accesses; without it, one element at a time (the hint is what makes the
    difference: the blocks' starts and lengths are read from memory)."""
    import re

    from skyrl_megatron import compact_adam_kernels

    signature = {"upper_ptr": "*i16", "remainder_ptr": "*i16", "grad_ptr": "*fp32", "exp_avg_ptr": "*fp32",
                 "exp_avg_sq_ptr": "*fp32", "start_ptr": "*i64", "count_ptr": "*i32", "group_ptr": "*i32",
                 "hyper_ptr": "*fp32", "skip_ptr": "*fp32", "scale_ptr": "*fp32", "partial_ptr": "*i32",
                 "tie_bits_ptr": "*i32", "HAS_SCALE": "constexpr", "ALIGNED": "constexpr", "BLOCK": "constexpr"}
    aligned_pointers = {(index,): [["tt.divisibility", 16]] for index, kind in enumerate(signature.values())
                        if kind.startswith("*")}
    vector_accesses = {}
    for aligned in (False, True):
        source = ASTSource(fn=compact_adam_kernels._adam_round_split_kernel, signature=signature,
                           constexprs={"HAS_SCALE": True, "ALIGNED": aligned, "BLOCK": compact_adam_kernels.BLOCK},
                           attrs=aligned_pointers)
        ptx = triton.compile(source, target=H200, options={"enable_fp_fusion": False, "num_warps": 8}).asm["ptx"]
        vector_accesses[aligned] = len(re.findall(r"(?:ld|st)\.global\.v4\.b32", ptx))
        assert "fma.rn.f32" not in ptx  # no contracted multiply-adds: bitwise the eager definition
    assert vector_accesses[False] == 0 and vector_accesses[True] >= 20, vector_accesses
