"""Megatron-Core workers for the host trainer.

This module is also what the host imports as ``skyrl_train.workers.megatron.megatron_worker`` once
:func:`skyrl_megatron.activate` has run, so it exports the three names the host expects, as Ray
actor classes (the host's trainer creates actors from them with ``.options(...).remote(...)``).
"""

import logging

import ray

from skyrl_megatron.runtime import quiet_megatron_import

# Megatron-Core's notices that TE/Apex are absent (our TE-free path is chosen on purpose), and torch's
# "no CUDA runtime" notice on CPU boxes, come from the imports below, in the driver and every worker.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
with quiet_megatron_import():
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
