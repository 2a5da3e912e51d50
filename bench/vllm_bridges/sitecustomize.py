"""Bench harness bridges onto vLLM 0.24 (not product code): skyrl-train 0.3.1's vLLM engine module, and
skyrl 0.4's vLLM servers and weight sync (`skyrl04_on_vllm024.py`, whose hooks are registered here).

skyrl-train 0.3.1 was written for vLLM 0.11; the GPU machines run vLLM 0.24.0, the release built for
their torch (2.11). 0.24 moved the OpenAI serving modules that the host's ``vllm_engine.py`` imports at
its top (its synchronous engine never uses them). This file, first on PYTHONPATH of every process of a
bench run (Python imports ``sitecustomize`` at start-up, Ray workers too), answers the old module names
with the new modules, only when something imports them:

  vllm.entrypoints.openai.serving_chat        -> vllm.entrypoints.openai.chat_completion.serving
  vllm.entrypoints.openai.serving_completion  -> vllm.entrypoints.openai.completion.serving
  vllm.entrypoints.openai.serving_models      -> vllm.entrypoints.openai.models.serving
  vllm.entrypoints.openai.protocol            -> the names of engine/, chat_completion/, completion/ and
                                                 models/protocol.py in one module
  vllm.entrypoints.launchers.cli_args         -> vllm.entrypoints.openai.cli_args (skyrl 0.4, written for
                                                 vLLM 0.30; `vllm.entrypoints.launchers` an empty package)
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types

import skyrl04_on_vllm024  # beside this file, first on PYTHONPATH
from skyrl04_on_vllm024 import spec_elsewhere

_MOVED = {
    "vllm.entrypoints.openai.serving_chat": ("vllm.entrypoints.openai.chat_completion.serving",),
    "vllm.entrypoints.openai.serving_completion": ("vllm.entrypoints.openai.completion.serving",),
    "vllm.entrypoints.openai.serving_models": ("vllm.entrypoints.openai.models.serving",),
    "vllm.entrypoints.openai.protocol": (
        "vllm.entrypoints.openai.engine.protocol",
        "vllm.entrypoints.openai.chat_completion.protocol",
        "vllm.entrypoints.openai.completion.protocol",
        "vllm.entrypoints.openai.models.protocol",
    ),
    "vllm.entrypoints.launchers.cli_args": ("vllm.entrypoints.openai.cli_args",),
}
_EMPTY_PACKAGES = {"vllm.entrypoints.launchers": "vllm.entrypoints.openai.cli_args"}  # package: what it stands for


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in _EMPTY_PACKAGES:
            if spec_elsewhere(self, name, path) is not None or importlib.util.find_spec(_EMPTY_PACKAGES[name]) is None:
                return None
            return importlib.util.spec_from_loader(name, self, is_package=True)
        if name not in _MOVED or spec_elsewhere(self, name, path) is not None:  # a vLLM that has the name
            return None
        if importlib.util.find_spec(_MOVED[name][0]) is None:  # an older vLLM that still has the old name
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        if spec.name in _EMPTY_PACKAGES:
            module.__path__ = []
            return module
        for source in _MOVED[spec.name]:
            public = importlib.import_module(source)
            module.__dict__.update({k: v for k, v in vars(public).items() if not k.startswith("__")})
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _MovedModules())
skyrl04_on_vllm024.install()
