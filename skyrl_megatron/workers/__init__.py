"""Megatron-Core workers for the host trainer.

This module is also what the host imports as ``skyrl_train.workers.megatron.megatron_worker`` once
:func:`skyrl_megatron.activate` has run, so it exports the three names the host expects, as Ray
actor classes (the host's trainer creates actors from them with ``.options(...).remote(...)``).
"""

import ray

from skyrl_megatron.workers.critic import MegatronCriticWorker
from skyrl_megatron.workers.policy import MegatronPolicyWorker
from skyrl_megatron.workers.ref import MegatronRefWorker

PolicyWorker = ray.remote(num_gpus=1)(MegatronPolicyWorker)
RefWorker = ray.remote(num_gpus=1)(MegatronRefWorker)
CriticWorker = ray.remote(num_gpus=1)(MegatronCriticWorker)

__all__ = [
    "PolicyWorker",
    "RefWorker",
    "CriticWorker",
    "MegatronPolicyWorker",
    "MegatronRefWorker",
    "MegatronCriticWorker",
]
