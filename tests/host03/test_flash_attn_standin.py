"""The flash_attn stand-in (bench/flash_attn_standin): what a CPU can check.

Its kernels (PyTorch's FlashAttention-2) need CUDA; bench/gpu_flash_attn_standin_check.py checks
them on the GPU. Here: the assembled package is flash-attn 2.8.3 to transformers (its
flash_attention_2 integration loads the stand-in's functions), transformers' three dispatch branches
(packed position ids, padded batch, one unpadded sequence) give per-sequence causal attention with
GQA, forward and backward, when the kernel is a reference; the host's imports resolve, and its own
sample-packing path through the stand-in gives the logprobs of its padded path; flash-attn's
own padding helpers round-trip; unsupported arguments are refused clearly.

On skyrl-train 0.3.1: the stand-in serves the benchmark's FSDP2 baseline on that host (the GPU machines'
environment, bench/fetch_wheels.sh), and the probe drives 0.3.1's own sample-packing path.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "bench" / "flash_attn_standin"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


interface = _load("standin_flash_attn_interface", STANDIN / "flash_attn" / "flash_attn_interface.py")
reference = _load("standin_reference", STANDIN / "reference.py")
assemble = _load("standin_assemble", STANDIN / "assemble.py")


# What runs in a fresh interpreter with the assembled stand-in first on sys.path (transformers reads
# the installed distributions once, at import). CUDA availability is reported true to transformers
# only, so that it offers flash_attention_2; the kernel is the CPU reference.
PROBE = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import torch
import torch.nn.functional as F
import transformers.utils.import_utils as import_utils
import transformers.modeling_flash_attention_utils as mfa

result = {"package_available": import_utils._is_package_available("flash_attn", return_version=True),
          "fa2_package_check": mfa.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["pkg_availability_check"]()}
import_utils.is_torch_cuda_available = lambda: True
result["fa2_available"] = import_utils.is_flash_attn_2_available()

import flash_attn
import flash_attn.flash_attn_interface as interface
import reference
interface.varlen_kernel = reference.varlen_attention
(fn, varlen_fn, kvcache_fn, pad_fn, unpad_fn), process = mfa.lazy_import_flash_attention("flash_attention_2")
result["module"] = flash_attn.__file__
result["version"] = flash_attn.__version__
result["loaded"] = [f.__module__ + "." + f.__name__ for f in (fn, varlen_fn, kvcache_fn, pad_fn, unpad_fn)]
result["supports"] = process.keywords["supports_mapping"]

# the host's imports on its sample-packing path
from flash_attn.bert_padding import pad_input, unpad_input
from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
import skyrl_train.model_wrapper as model_wrapper
import skyrl_train.utils.torch_utils as torch_utils
result["host_imports"] = [pad_input.__module__, cross_entropy_loss.__module__,
                          model_wrapper.unpad_input is unpad_input, torch_utils.cross_entropy_loss is cross_entropy_loss]

torch.manual_seed(0)
heads, kv_heads, dim = 4, 2, 16
lengths = [5, 9, 3]

def sdpa(q, k, v):  # one sequence, (L, heads, dim): causal attention in float32 math
    out = F.scaled_dot_product_attention(*(t.float().transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                         is_causal=True, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)

def qkv(tokens):
    return [torch.randn(1, tokens, h, dim, dtype=torch.bfloat16, requires_grad=True) for h in (heads, kv_heads, kv_heads)]

def call(q, k, v, **kwargs):
    return mfa._flash_attention_forward(q, k, v, query_length=q.shape[1], is_causal=True,
                                        attn_implementation="flash_attention_2", **kwargs)

def grads(out, expected, tensors, grad):
    g1 = torch.autograd.grad(out.float(), tensors, grad, retain_graph=True)
    g2 = torch.autograd.grad(expected, tensors, grad)
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(g1, g2))

diffs = {}
# packed: one row, position ids restarting per sequence (the host's sample packing)
q, k, v = qkv(sum(lengths))
positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
out = call(q, k, v, attention_mask=None, position_ids=positions)
bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
expected = torch.cat([sdpa(q[0, a:b], k[0, a:b], v[0, a:b]) for a, b in zip(bounds, bounds[1:])]).unsqueeze(0)
grad = torch.randn_like(expected)
diffs["packed"] = [float((out.float() - expected).abs().max()), grads(out, expected, (q, k, v), grad)]

# padded: rows of different lengths, right-padded, with an attention mask
width = max(lengths)
q, k, v = (torch.randn(len(lengths), width, h, dim, dtype=torch.bfloat16) for h in (heads, kv_heads, kv_heads))
mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
out = call(q, k, v, attention_mask=mask)
diffs["padded"] = max(float((out[r, :n].float() - sdpa(q[r, :n], k[r, :n], v[r, :n])).abs().max())
                      for r, n in enumerate(lengths))

# one sequence, no padding, plain positions: transformers calls flash_attn_func
q, k, v = qkv(7)
out = call(q, k, v, attention_mask=None, position_ids=torch.arange(7).unsqueeze(0))
expected = sdpa(q[0], k[0], v[0]).unsqueeze(0)
diffs["single"] = [float((out.float() - expected).abs().max()), grads(out, expected, (q, k, v), torch.randn_like(expected))]
result["diffs"] = diffs

# flash-attn's padding helpers: unpad then pad restores the unmasked entries, zeros elsewhere
x = torch.randn(3, 6, 5)
mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
packed, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask)
result["padding"] = {"roundtrip": bool(torch.equal(pad_input(packed, indices, 3, 6), x * mask.unsqueeze(-1))),
                     "cu_seqlens": cu_seqlens.tolist(), "max_seqlen": int(max_seqlen), "tokens": packed.shape[0]}
# the host's own sample-packing path (HFModelWrapper: unpad, position ids, flash_attention_2, pad
# back) against its padded path, same weights, bf16; logprobs by torch (Triton needs a GPU)
from skyrl_megatron.activation import activate
from skyrl_megatron.testing import make_tiny_hf_model
activate()
mfa.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["supported_devices"] = ((lambda: True, "cuda"),)  # CPU weights allowed
torch_utils.FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = False
model_dir = make_tiny_hf_model("qwen3", sys.argv[3], seed=0)
prompt, response = 6, 8
mask = torch.zeros(3, prompt + response, dtype=torch.long)
for row, (p, r) in enumerate([(6, 8), (3, 5), (4, 1)]):
    mask[row, prompt - p : prompt + r] = 1
sequences = torch.randint(1, 200, mask.shape).masked_fill(mask == 0, 0)
logprobs = {}
for packed in (True, False):
    wrapper = model_wrapper.HFModelWrapper(str(model_dir), use_flash_attention_2=packed, bf16=True,
                                           use_sample_packing=packed)
    with torch.no_grad():
        logprobs[packed] = wrapper(sequences, response, attention_mask=mask).float()
    result.setdefault("host_attention", []).append(wrapper.model.config._attn_implementation)
valid = mask[:, prompt:].bool()
result["host_packed_vs_padded"] = float((logprobs[True] - logprobs[False])[valid].abs().max())
result["host_logprob_scale"] = float(logprobs[False][valid].abs().max())
print("RESULT " + json.dumps(result))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    site = assemble.assemble(tmp_path_factory.mktemp("standin"))
    model_dir = tmp_path_factory.mktemp("tiny_qwen3")
    run = subprocess.run([sys.executable, "-c", PROBE, str(site), str(STANDIN), str(model_dir)], capture_output=True,
                         text=True, timeout=300, cwd=site)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-2000:] + run.stderr[-4000:]
    return site, json.loads(lines[0][len("RESULT "):])


def test_assembled_package_is_flash_attn_2_8_3_with_the_librarys_own_helpers(probe):
    site, result = probe
    assert result["package_available"] == [True, "2.8.3"] and result["version"] == "2.8.3"
    assert result["fa2_package_check"] and result["fa2_available"]
    assert result["module"] == str(site / "flash_attn" / "__init__.py")
    library = assemble.installed_library()
    for name in assemble.LIBRARY_FILES:  # carried unchanged
        assert (site / "flash_attn" / name).read_bytes() == (library / name).read_bytes()
    # the host's model wrapper unpads with them, and its logprobs take the Triton cross entropy
    assert result["host_imports"] == ["flash_attn.bert_padding", "flash_attn.ops.triton.cross_entropy", True, True]


def test_transformers_flash_attention_2_loads_the_standins_functions(probe):
    _, result = probe
    assert result["loaded"] == [
        "flash_attn.flash_attn_interface.flash_attn_func",
        "flash_attn.flash_attn_interface.flash_attn_varlen_func",
        "flash_attn.flash_attn_interface.flash_attn_with_kvcache",
        "flash_attn.bert_padding.pad_input",
        "flash_attn.bert_padding.unpad_input",
    ]
    supports = result["supports"]  # transformers passes what the signature offers
    assert all(supports[name] for name in ("dropout_p", "softmax_scale", "window_size", "max_seqlen_q", "max_seqlen_k"))


def test_every_transformers_dispatch_branch_is_per_sequence_causal_gqa_attention(probe):
    _, result = probe
    diffs = result["diffs"]
    # bf16 outputs against float32 SDPA: within one bf16 rounding of O(1) values
    assert diffs["packed"][0] < 2e-2 and diffs["packed"][1] < 5e-2
    assert diffs["padded"] < 2e-2
    assert diffs["single"][0] < 2e-2 and diffs["single"][1] < 5e-2


def test_the_hosts_sample_packing_path_through_the_standin_equals_its_padded_path(probe):
    _, result = probe
    assert result["host_attention"] == ["flash_attention_2", "eager"]
    # bf16 logprobs (up to ~6 in size) of a tiny model: 0.03 apart, where a causal mask dropped or
    # sequences attending across the packed boundary put them 0.25-0.3 apart
    assert result["host_packed_vs_padded"] < 0.1


def test_flash_attns_padding_helpers_round_trip(probe):
    _, result = probe
    assert result["padding"] == {"roundtrip": True, "cu_seqlens": [0, 4, 7, 13], "max_seqlen": 6, "tokens": 13}


@pytest.fixture
def reference_kernel(monkeypatch):
    monkeypatch.setattr(interface, "varlen_kernel", reference.varlen_attention)


def test_flash_attn_func_keeps_flash_attns_bottom_right_causal_window_and_lse_layout(reference_kernel):
    torch.manual_seed(1)
    q = torch.randn(2, 3, 4, 8, dtype=torch.bfloat16)
    k, v = torch.randn(2, 6, 2, 8, dtype=torch.bfloat16), torch.randn(2, 6, 2, 8, dtype=torch.bfloat16)
    out, lse, probs = interface.flash_attn_func(q, k, v, causal=True, window_size=(2, 5), softmax_scale=0.3,
                                                return_attn_probs=True)
    assert out.shape == (2, 3, 4, 8) and lse.shape == (2, 4, 3) and probs is None
    for b in range(2):
        # causal clips the right window to 0; the last query sees the last key (bottom-right)
        want_out, want_lse = reference.segment_attention(q[b], k[b], v[b], 0.3, (2, 0))
        assert torch.equal(out[b], want_out) and torch.equal(lse[b], want_lse)
    # equal lengths, full causal: SDPA's own causal attention (an independent reference)
    q, k, v = (torch.randn(2, 5, h, 8, dtype=torch.bfloat16) for h in (4, 1, 1))
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True).transpose(1, 2)
    assert (interface.flash_attn_func(q, k, v, causal=True).float() - expected).abs().max() < 2e-2


def test_window_translation_to_torchs_entry():
    assert interface._window(True, (-1, -1)) == (-1, 0)  # exactly the tuple torch treats as causal
    assert interface._window(True, [7, 7]) == (7, 0)
    assert interface._window(False, (3, 2)) == (3, 2)
    assert interface._as_int(torch.tensor(12)) == 12


@pytest.mark.parametrize("kwargs, message", [
    ({"dropout_p": 0.1}, "dropout_p=0.1"),
    ({"softcap": 30.0}, "softcap=30.0"),
    ({"alibi_slopes": torch.ones(4)}, "alibi_slopes"),
    ({"deterministic": True}, "deterministic=True"),
])
def test_unsupported_arguments_are_refused_naming_them(kwargs, message, reference_kernel):
    q = torch.randn(1, 4, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(interface.UnsupportedByStandIn, match=f"does not support: {message}"):
        interface.flash_attn_func(q, q, q, causal=True, **kwargs)


def test_float32_kv_cache_and_cpu_tensors_are_refused_clearly(monkeypatch):
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(interface.UnsupportedByStandIn, match="float16 and bfloat16 only"):
        interface.flash_attn_func(q, q, q)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache is not provided"):
        interface.flash_attn_with_kvcache(q, q, q)
    monkeypatch.setattr(interface, "varlen_kernel", None)
    q = q.bfloat16()
    with pytest.raises(RuntimeError, match="run on CUDA only"):
        interface.flash_attn_func(q, q, q)


def _fake_flash4(calls: list):
    """flash_attn.cute's varlen entry as a CPU reference (keywords as flash-attn-4 takes them), returning
    (out, lse) as some of its releases do."""

    def flash4_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        calls.append({"causal": causal, "max": (max_seqlen_q, max_seqlen_k), "dtype": cu_seqlens_q.dtype})
        from torch.nn.attention.varlen import AuxRequest

        return reference.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          return_aux=AuxRequest(lse=True), scale=softmax_scale, window_size=(-1, 0))

    return flash4_varlen


@pytest.fixture
def flash4_route(monkeypatch, reference_kernel):
    import types

    calls = []
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = _fake_flash4(calls)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setenv(interface.KERNEL_VARIABLE, "flash4")
    return calls


def test_the_flash4_route_gives_the_fa2_routes_packed_causal_attention(flash4_route, monkeypatch):
    torch.manual_seed(2)
    q, k, v = (torch.randn(11, h, 8, dtype=torch.bfloat16) for h in (4, 2, 2))
    bounds = torch.tensor([0, 3, 11], dtype=torch.int64)  # int64, as transformers may pass them
    args = (q, k, v, bounds, bounds, torch.tensor(8), 8)
    got = interface.flash_attn_varlen_func(*args, softmax_scale=0.4, causal=True)
    assert flash4_route == [{"causal": True, "max": (8, 8), "dtype": torch.int32}]
    monkeypatch.delenv(interface.KERNEL_VARIABLE)
    assert torch.equal(got, interface.flash_attn_varlen_func(*args, softmax_scale=0.4, causal=True))
    # the padded entry goes the same way, without asking for the log-sum-exp
    monkeypatch.setenv(interface.KERNEL_VARIABLE, "flash4")
    padded = interface.flash_attn_func(q[None, :8], k[None, :8], v[None, :8], causal=True)
    assert padded.shape == (1, 8, 4, 8) and len(flash4_route) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"causal": False}, "causal full-context attention only"),
    ({"causal": True, "window_size": (4, 0)}, "causal full-context attention only"),
    ({"causal": True, "return_attn_probs": True}, "no log-sum-exp on this route"),
])
def test_the_flash4_route_refuses_what_it_does_not_run(flash4_route, kwargs, message):
    q = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    bounds = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(interface.UnsupportedByStandIn, match=f"{interface.KERNEL_VARIABLE}=flash4 does not support: .*{message}"):
        interface.flash_attn_varlen_func(q, q, q, bounds, bounds, 4, 4, **kwargs)
    assert flash4_route == []


def test_assembly_carries_flash_attn_4_where_the_library_holds_it(tmp_path):
    library = tmp_path / "library"
    shutil.copytree(assemble.installed_library(), library, ignore=lambda d, names: [n for n in names if n == "cute"])
    without = assemble.assemble(tmp_path / "without", library)
    assert not (without / "flash_attn" / "cute").exists()
    (library / "cute").mkdir()
    (library / "cute" / "__init__.py").write_text("flash4 = True\n")
    with_flash4 = assemble.assemble(tmp_path / "with", library)
    assert (with_flash4 / "flash_attn" / "cute" / "__init__.py").read_text() == "flash4 = True\n"
