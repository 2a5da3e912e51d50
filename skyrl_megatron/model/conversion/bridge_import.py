"""Import Megatron-Bridge where Transformer Engine is not installed.

Megatron-Bridge 0.6.2 imports `transformer_engine.pytorch` unconditionally in one module,
`megatron.bridge.peft.lora_layers`, for its TE-fused LoRA path and for `isinstance` checks against
TE linear layers. Without TE the whole bridge fails to import. We serve that one module a stand-in
for `transformer_engine.pytorch` *while it executes* and remove the stand-in right after, so
Megatron-Core and the rest of the bridge still see TE as absent: the `isinstance` checks are false
(no layer is a TE layer) and the fused TE LoRA path raises a clear error if anything reaches it.
With TE installed this module does nothing.
"""

from __future__ import annotations

import importlib
import logging
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_TE_USER = "megatron.bridge.peft.lora_layers"
_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch")


def _te_stand_in() -> dict[str, types.ModuleType]:
    def unavailable(name: str) -> type:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"transformer_engine.pytorch.{name} is not installed; this code path needs TE")

        return type(name, (), {"__init__": __init__, "__module__": "transformer_engine.pytorch"})

    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.__doc__ = "stand-in for Megatron-Bridge's lora_layers import (skyrl_megatron.model.conversion.bridge_import)"
    for name in ("Linear", "LayerNormLinear"):
        setattr(pytorch, name, unavailable(name))
    ops = types.SimpleNamespace()
    for name in ("Sequential", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput", "Linear", "Dropout",
                 "ConstantScale", "AddExtraInput"):
        setattr(ops, name, unavailable(f"ops.{name}"))
    pytorch.ops = ops
    package = types.ModuleType("transformer_engine")
    package.__path__ = []  # a package, so `import transformer_engine.pytorch` resolves
    package.pytorch = pytorch
    return {"transformer_engine": package, "transformer_engine.pytorch": pytorch}


class _ScopedLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        stand_in = _te_stand_in()
        sys.modules.update(stand_in)
        try:
            self.real.exec_module(module)
        finally:
            for name in _TE_NAMES:
                if sys.modules.get(name) is stand_in[name]:
                    del sys.modules[name]


class _ScopedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TE_USER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _ScopedLoader(spec.loader)
                return spec
        return None


def have_transformer_engine() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine.pytorch") is not None
    except (ImportError, ValueError):
        return False


def import_bridge():
    """`megatron.bridge`, importable with or without Transformer Engine."""
    if "megatron.bridge" not in sys.modules and not have_transformer_engine():
        if not any(isinstance(f, _ScopedFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _ScopedFinder())
    from skyrl_megatron.runtime import quiet_megatron_import

    # Without TE the bridge logs a full traceback at INFO for every optional TE symbol it probes.
    logging.getLogger("megatron.bridge.utils.import_utils").setLevel(logging.WARNING)
    with quiet_megatron_import():
        bridge = importlib.import_module("megatron.bridge")
    if not have_transformer_engine():
        _route_peft_to_local_layers()
    return bridge


def _route_peft_to_local_layers() -> None:
    """Let the bridge's PEFT adapt Megatron's local (non-TE) linear layers.

    `megatron.bridge.peft.utils` decides TE is present because Megatron-Core still defines its TE
    wrapper classes without TE, but two of them (the grouped linears) are None there, so its
    `isinstance` checks raise before they reach the local ColumnParallelLinear/RowParallelLinear
    branches. No layer of a TE-less model is a TE layer: the flag's true value is False.
    """
    peft_utils = importlib.import_module("megatron.bridge.peft.utils")
    peft_utils.HAVE_TE = False
