"""The critic worker on Megatron-Core (not available yet: value-head models need their own bridge)."""

from skyrl_megatron import host_api
from skyrl_megatron.workers.base import MegatronWorkerMixin

_, _, CriticWorkerBase = host_api.worker_bases()


class MegatronCriticWorker(MegatronWorkerMixin, CriticWorkerBase):
    role = "critic"

    def init_model(self, model_path: str, *args, **kwargs):
        raise NotImplementedError(
            "skyrl-megatron has no critic worker yet: use a critic-free estimator "
            "(trainer.algorithm.advantage_estimator=grpo, rloo or reinforce++) or trainer.strategy=fsdp2"
        )
