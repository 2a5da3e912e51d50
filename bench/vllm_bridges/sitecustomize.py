"""Bench harness bridge: skyrl-train 0.3.1's vLLM engine module on vLLM 0.24 (not product code).

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
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types

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
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name not in _MOVED:
            return None
        if importlib.util.find_spec(_MOVED[name][0]) is None:  # an older vLLM that still has the old name
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        for source in _MOVED[spec.name]:
            public = importlib.import_module(source)
            module.__dict__.update({k: v for k, v in vars(public).items() if not k.startswith("__")})
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _MovedModules())
