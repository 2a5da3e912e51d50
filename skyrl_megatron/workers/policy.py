"""The policy worker on Megatron-Core."""

from skyrl_train.workers.worker import PolicyWorkerBase

from skyrl_megatron.workers.base import MegatronWorkerMixin


class MegatronPolicyWorker(MegatronWorkerMixin, PolicyWorkerBase):
    role = "policy"
