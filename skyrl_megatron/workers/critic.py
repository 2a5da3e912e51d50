"""The critic worker on Megatron-Core."""

from skyrl_train.workers.worker import CriticWorkerBase

from skyrl_megatron.workers.base import MegatronWorkerMixin


class MegatronCriticWorker(MegatronWorkerMixin, CriticWorkerBase):
    role = "critic"
