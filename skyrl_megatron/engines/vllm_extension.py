"""A vLLM worker extension for skyrl 0.4's servers: the host's own plus a read-back of the engine's weights.

vLLM's ``/collective_rpc`` route calls worker methods by name only (it takes no callables), so the check that
an engine holds exactly the policy's weights after a sync needs a method on the worker: this class is the
host's extension (``host_api.vllm_worker_extension_class``) with ``skyrl_megatron_weight_digests`` added,
named by ``HostAdapter.vllm_engine_overrides`` as ``worker_extension_cls``. vLLM mixes it into its worker
class, so ``self`` is the worker.
"""

from __future__ import annotations

from collections.abc import Collection

from skyrl_megatron import host_api
from skyrl_megatron.engines.vllm_weights import engine_weight_digests

READ_BACK_METHOD = "skyrl_megatron_weight_digests"


class WeightReadBack(host_api.vllm_worker_extension_class()):
    def skyrl_megatron_weight_digests(self, names: Collection[str] | None = None) -> dict[str, str]:
        """SHA-256 of each HF-named tensor this worker's model holds (see `engine_weight_digests`)."""
        return engine_weight_digests(self, names)
