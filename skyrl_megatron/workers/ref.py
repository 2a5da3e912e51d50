"""The reference worker on Megatron-Core: a frozen model that scores response logprobs."""

from skyrl_megatron import host_api
from skyrl_megatron.workers.base import MegatronWorkerMixin

_, RefWorkerBase, _ = host_api.worker_bases()


class MegatronRefWorker(MegatronWorkerMixin, RefWorkerBase):
    role = "ref"

    def init_model(self, model_path: str, *args, **kwargs):
        self._build(model_path)
        for chunk in self.built.chunks:
            chunk.requires_grad_(False)
