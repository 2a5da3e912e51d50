"""What the rank server imports once, before `run_on_ranks` forks ranks from it (`testing/distributed.py`).

A rank that builds a model imports torch, Megatron-Core, Megatron-Bridge and transformers: about 8 s
of CPU per process, more than a tiny model's whole test on a 2-core CI machine. Imported here once,
every rank forked afterwards starts with them. Only imports: nothing runs a tensor operation (a
forked OpenMP thread pool would hang the ranks), and a library that is missing or fails to import is
left to the ranks, which then import it themselves as they would without this module.
"""

from __future__ import annotations

import importlib
import warnings

_HEAVY = ("torch", "torch.distributed", "transformers", "megatron.core", "megatron.core.models.gpt",
          "megatron.core.pipeline_parallel", "megatron.core.optimizer", "megatron.core.dist_checkpointing")


def _preload() -> None:
    for name in _HEAVY:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the rank imports it itself, and reports its error there
            return
    try:
        from skyrl_megatron.model.conversion.bridge_import import import_bridge

        import_bridge()
    except Exception:  # noqa: BLE001 - as above
        pass


with warnings.catch_warnings():  # Megatron-Core's import-time notices; a rank importing it prints them itself
    warnings.simplefilter("ignore")
    _preload()
