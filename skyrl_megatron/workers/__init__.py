"""Megatron-Core workers for the host trainer.

This module is also what the host imports as ``skyrl_train.workers.megatron.megatron_worker`` once
:func:`skyrl_megatron.activate` has run, so it exports the three names the host expects.
"""

from skyrl_megatron.workers.critic import CriticWorker
from skyrl_megatron.workers.policy import PolicyWorker
from skyrl_megatron.workers.ref import RefWorker

__all__ = ["PolicyWorker", "RefWorker", "CriticWorker"]
