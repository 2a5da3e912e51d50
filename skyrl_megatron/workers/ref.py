"""The ref worker on Megatron-Core."""

from skyrl_train.workers.worker import RefWorkerBase

from skyrl_megatron.workers.base import MegatronWorkerMixin


class MegatronRefWorker(MegatronWorkerMixin, RefWorkerBase):
    role = "ref"
