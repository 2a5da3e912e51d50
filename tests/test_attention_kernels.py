"""`megatron_config.attention_kernel`: which segment kernel our core attention runs, and the checks.

The decision table of `model/layers/attention.select_segment_kernel` is checked with the GPU's compute
capability and flash-attn-4's presence faked (monkeypatch); no kernel runs here, so nothing here says
flash-attn-4 computes the right thing: `bench/gpu_fa4_check.py` checks that on a GPU.
"""

from __future__ import annotations

import types

import pytest
import torch

from skyrl_megatron.attention_kernels import ATTENTION_KERNELS, SegmentKernel, flash4_installed
from skyrl_megatron.config import ConfigError
from skyrl_megatron.model.layers import attention
from skyrl_megatron.runtime import Device, Runtime
from skyrl_megatron.validation import validate_config

CPU, GPU = Runtime(Device.CPU), Runtime(Device.CUDA)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FLASH4, VARLEN, SDPA = SegmentKernel.FLASH4, SegmentKernel.VARLEN, SegmentKernel.MASKED_SDPA
KEY = "megatron_config.attention_kernel"
MC = "trainer.policy.megatron_config"


@pytest.fixture
def device_facts(monkeypatch):
    """Factory: fake the GPU's compute capability and whether flash-attn-4 is installed."""

    def fake(capability: tuple[int, int] | None, installed: bool) -> None:
        def compute_capability(index: int) -> tuple[int, int]:
            assert capability is not None, "the CPU runtime must not ask for a GPU's capability"
            return capability

        monkeypatch.setattr(attention, "_compute_capability", compute_capability)
        monkeypatch.setattr(attention, "flash4_installed", lambda: installed)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "a fake GPU")

    return fake


H100, B200, A100, RTX5090 = (9, 0), (10, 0), (8, 0), (12, 0)

# (setting, runtime, dtype, capability, flash-attn-4 installed) -> kernel
CHOSEN = {
    "auto, Hopper, installed, bf16": ("auto", GPU, BF16, H100, True, FLASH4),
    "auto, Blackwell, installed, fp16": ("auto", GPU, FP16, B200, True, FLASH4),
    "auto, Hopper, not installed": ("auto", GPU, BF16, H100, False, VARLEN),
    "auto, Ampere, installed": ("auto", GPU, BF16, A100, True, VARLEN),
    "auto, sm120, installed": ("auto", GPU, BF16, RTX5090, True, VARLEN),
    "auto, Hopper, installed, fp32": ("auto", GPU, FP32, H100, True, SDPA),
    "auto, CPU, bf16": ("auto", CPU, BF16, None, True, SDPA),
    "auto, CPU, fp32": ("auto", CPU, FP32, None, True, SDPA),
    "flash4, Hopper": ("flash4", GPU, BF16, H100, True, FLASH4),
    "flash4, Blackwell": ("flash4", GPU, BF16, B200, True, FLASH4),
    "varlen, Hopper, installed": ("varlen", GPU, BF16, H100, True, VARLEN),
    "varlen, Ampere": ("varlen", GPU, FP16, A100, False, VARLEN),
    "sdpa, Hopper, installed": ("sdpa", GPU, BF16, H100, True, SDPA),
    "sdpa, CPU": ("sdpa", CPU, FP32, None, False, SDPA),
}


@pytest.mark.parametrize("setting,runtime,dtype,capability,installed,expected", CHOSEN.values(), ids=CHOSEN.keys())
def test_the_kernel_chosen_for_each_setting_device_and_dtype(device_facts, setting, runtime, dtype,
                                                              capability, installed, expected):
    device_facts(capability, installed)
    device = torch.device("cpu") if runtime.is_cpu else torch.device("cuda", 0)
    assert attention.select_segment_kernel(runtime, dtype, setting, device) is expected


# (setting, runtime, dtype, capability, installed) -> what the error says besides the key
REFUSED = {
    "flash4, Ampere": ("flash4", GPU, BF16, A100, True, ["Hopper (sm90) and Blackwell (sm100)", "sm80 (a fake GPU)",
                                                         "attention_kernel=auto"]),
    "flash4, sm120": ("flash4", GPU, BF16, RTX5090, True, ["sm120", "attention_kernel=auto"]),
    "flash4, not installed": ("flash4", GPU, BF16, H100, False, ["not installed", "pip install flash-attn-4",
                                                                 "attention_kernel=auto"]),
    "flash4, fp32": ("flash4", GPU, FP32, H100, True, ["bf16/fp16", "torch.float32"]),
    "flash4, CPU": ("flash4", CPU, BF16, None, True, ["CPU runtime", "attention_kernel=auto"]),
    "varlen, CPU": ("varlen", CPU, BF16, None, True, ["CPU runtime", "attention_kernel=auto"]),
    "varlen, fp32": ("varlen", GPU, FP32, H100, True, ["torch.float32", "attention_kernel=auto"]),
    "unknown": ("flash3", GPU, BF16, H100, True, ["unknown kernel 'flash3'", "auto, flash4, varlen, sdpa"]),
}


@pytest.mark.parametrize("setting,runtime,dtype,capability,installed,words", REFUSED.values(), ids=REFUSED.keys())
def test_a_kernel_that_cannot_run_is_refused_by_key_and_fix(device_facts, setting, runtime, dtype, capability,
                                                            installed, words):
    device_facts(capability, installed)
    device = torch.device("cpu") if runtime.is_cpu else torch.device("cuda", 0)
    with pytest.raises(attention.AttentionKernelError) as err:
        attention.select_segment_kernel(runtime, dtype, setting, device)
    message = str(err.value)
    assert message.startswith(KEY) and "Fix:" in message
    for word in words:
        assert word in message


def test_every_setting_is_a_kernel_or_auto():
    assert ATTENTION_KERNELS == ("auto", "flash4", "varlen", "sdpa")


def test_flash_attn_4_is_found_by_its_distribution_without_importing_it(tmp_path, monkeypatch):
    """flash-attn 2.8.3 ships an early `flash_attn/cute` of its own: a `cute` folder alone is not
    flash-attn-4. Looking imports nothing (this `flash_attn/__init__` would raise)."""
    import sys

    package = tmp_path / "flash_attn"
    (package / "cute").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "cute" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    for name in [name for name in sys.modules if name == "flash_attn" or name.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    # this folder first, and no installed package (a flash-attn-4 installed here would answer)
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if "site-packages" not in p])
    assert flash4_installed() is False
    info = tmp_path / "flash_attn_4-4.0.0b36.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn-4\nVersion: 4.0.0b36\n")
    assert flash4_installed() is True
    assert "flash_attn" not in sys.modules


# ---- the module and the layer spec on the CPU runtime ----------------------------------------------------


def _core_attention(monkeypatch, runtime: Runtime, setting: str, dtype=torch.float32):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setattr(attention, "current_runtime", lambda: runtime)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                               attention_dropout=0.0, params_dtype=dtype, use_cpu_initialization=True)
    no_context_parallel = types.SimpleNamespace(cp=None)
    return attention.CoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=no_context_parallel,
                                   attention_kernel=setting)


def test_auto_on_the_cpu_runtime_keeps_masked_sdpa(monkeypatch):
    module = _core_attention(monkeypatch, CPU, "auto")
    assert module.segment_kernel is SDPA
    assert module._kernel(torch.zeros(4, 4, 8, dtype=torch.bfloat16)) is SDPA  # whatever the dtype of a call


def test_a_kernel_that_cannot_run_fails_when_the_model_is_built(monkeypatch, device_facts):
    device_facts(A100, True)
    monkeypatch.setattr(Runtime, "torch_device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(attention.AttentionKernelError, match=r"attention_kernel=flash4: .*sm80"):
        _core_attention(monkeypatch, GPU, "flash4", dtype=torch.bfloat16)


def test_a_broken_flash_attn_4_install_is_named_at_model_build(monkeypatch):
    """`auto` takes flash4 where its distribution is found; if its import then fails, the model build
    says so and names the kernel that needs no flash-attn-4."""
    import sys

    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # `import flash_attn.cute` raises ImportError
    attention._flash4_varlen.cache_clear()
    with pytest.raises(attention.AttentionKernelError, match=r"failed .*reinstall it .*attention_kernel=varlen"):
        attention._flash4_varlen()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    from skyrl_megatron.testing import make_tiny_hf_model

    return str(make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3")))


def test_the_setting_reaches_the_layer_spec_and_is_checked_there(qwen3_dir, monkeypatch, device_facts):
    """A GPU provider as a worker builds it (no CUDA call: capability and installation faked): the
    local spec's core attention carries the setting, and flash4 on an Ampere GPU stops the build."""
    from megatron.core.transformer import transformer_block

    from skyrl_megatron.model.build import ModelSpec, load_bridge, make_provider

    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: config.num_layers)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bridge = load_bridge(qwen3_dir)
    device_facts(H100, True)
    provider = make_provider(ModelSpec(qwen3_dir, attention_kernel="varlen"), bridge, GPU)
    core_attention = provider.transformer_layer_spec(provider).layer_specs[0].submodules.self_attention.submodules.core_attention
    assert core_attention.func is attention.CoreAttention and core_attention.keywords == {"attention_kernel": "varlen"}

    device_facts(A100, True)
    with pytest.raises(attention.AttentionKernelError, match=r"attention_kernel=flash4: .*sm80"):
        make_provider(ModelSpec(qwen3_dir, attention_kernel="flash4"), bridge, GPU)


def test_the_log_line_names_the_kernel_used(device_facts):
    device_facts(None, False)
    line = attention.describe_core_attention(CPU, torch.bfloat16)
    assert "masked SDPA (packed)" in line and "flash-attn-4" not in line


def test_an_installed_flash_attn_4_that_auto_passes_over_is_explained(device_facts, monkeypatch):
    """`auto` falls back without an error; where flash-attn-4 is installed, the log line (and the bench's path
    report) say why it was not taken, and nothing where it was taken or `varlen` was asked for by name."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    device_facts(A100, True)
    line = attention.describe_core_attention(GPU, BF16)
    assert "varlen_attn" in line and "flash-attn-4 installed, not taken: " in line and "sm80" in line
    assert attention.flash4_passed_over(GPU, BF16) is not None
    assert "flash-attn-4 installed, not taken: " in attention.describe_core_attention(GPU, FP32)
    assert "not taken" not in attention.describe_core_attention(GPU, BF16, "varlen")
    device_facts(H100, True)
    assert attention.flash4_passed_over(GPU, BF16) is None
    assert "not taken" not in attention.describe_core_attention(GPU, BF16)
    device_facts(H100, False)
    assert attention.flash4_passed_over(GPU, BF16) is None  # nothing installed: nothing to explain


# ---- the up-front check ------------------------------------------------------------------------------------


def _problems(compose, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(compose(*overrides), run_host_checks=False)
    return str(err.value)


def test_an_unknown_kernel_is_named_with_the_known_ones(compose):
    message = _problems(compose, f"{MC}.attention_kernel=flash3")
    assert (f"{MC}.attention_kernel: unknown kernel 'flash3'. Fix: use one of auto, flash4, varlen, sdpa "
            "(did you mean 'flash4'?).") in message


def test_flash4_without_flash_attn_4_is_refused_before_anything_starts(compose, monkeypatch):
    from skyrl_megatron import config

    monkeypatch.setattr(config, "flash4_installed", lambda: False)
    message = _problems(compose, f"{MC}.attention_kernel=flash4")
    assert f"{MC}.attention_kernel: flash4 needs flash-attn-4 (the module flash_attn.cute), which is not installed" in message
    assert "Fix: pip install flash-attn-4" in message and "or set attention_kernel=auto" in message

    monkeypatch.setattr(config, "flash4_installed", lambda: True)
    validate_config(compose(f"{MC}.attention_kernel=flash4"), run_host_checks=False)  # the GPU is checked at build


@pytest.mark.parametrize("kernel", ["flash4", "varlen"])
def test_a_gpu_kernel_on_the_cpu_runtime_is_refused(compose, monkeypatch, kernel):
    from skyrl_megatron import config

    monkeypatch.setattr(config, "flash4_installed", lambda: True)
    message = _problems(compose, f"{MC}.attention_kernel={kernel}", f"{MC}.runtime=cpu")
    assert f"{MC}.attention_kernel: {kernel} runs on GPUs, and runtime is cpu" in message


@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
def test_kernels_that_run_anywhere_pass(compose, kernel):
    validate_config(compose(f"{MC}.attention_kernel={kernel}", f"{MC}.runtime=cpu"), run_host_checks=False)


def test_the_key_reaches_the_workers_config_on_this_host(compose):
    """Through the installed host's config (skyrl-train 0.3.1's Hydra group, skyrl 0.4's typed
    extension), as the workers read it; `auto` by default for every role."""
    from skyrl_megatron.config import MegatronWorkerConfig
    from skyrl_megatron.hosts import current

    view = current().our_view(compose())
    for role in ("policy", "ref", "critic"):
        assert MegatronWorkerConfig.from_host_config(view, role).attention_kernel == "auto"
    view = current().our_view(compose(f"{MC}.attention_kernel=varlen"))
    assert MegatronWorkerConfig.from_host_config(view, "policy").attention_kernel == "varlen"


def test_flash_attn_4_gets_the_value_contiguous_and_its_gradient_reaches_the_fused_projection(monkeypatch):
    """The value is a view into the fused QKV projection's output; flash-attn-4's backward reads such a view
    more slowly than a copy costs, so the kernel is handed a contiguous value, and the gradient it returns for
    it lands in the projection's output rows (a stand-in kernel: no flash-attn-4 on CPU)."""
    seen = {}

    def stand_in(query, key, value, **kwargs):
        seen["value_contiguous"] = value.is_contiguous()
        return (query * value.sum(dim=1, keepdim=True),)

    monkeypatch.setattr(attention, "_flash4_varlen", lambda: stand_in)
    tokens, groups, per_group, dim = 5, 2, 2, 4
    fused = torch.randn(tokens, groups, per_group + 2, dim, requires_grad=True)
    query = fused[:, :, :per_group].reshape(tokens, groups * per_group, dim)
    key, value = fused[:, :, per_group], fused[:, :, per_group + 1]
    assert not value.is_contiguous()
    segments = attention.CausalSegments(torch.tensor([0, tokens], dtype=torch.int32),
                                        torch.tensor([0, tokens], dtype=torch.int32), tokens, tokens)
    out = attention._flash4_segments(query, key, value, segments, scale=1.0)
    assert seen["value_contiguous"]
    out.sum().backward()
    reference = fused.detach().clone().requires_grad_(True)
    q = reference[:, :, :per_group].reshape(tokens, groups * per_group, dim)
    v = reference[:, :, per_group + 1]
    stand_in(q, reference[:, :, per_group], v.contiguous())[0].sum().backward()
    assert torch.equal(fused.grad, reference.grad)
    assert fused.grad[:, :, per_group + 1].abs().sum() > 0  # the value's rows got their gradient
