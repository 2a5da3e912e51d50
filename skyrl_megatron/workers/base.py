"""What every Megatron worker role shares: runtime, process groups, the host's MeshRank."""

from __future__ import annotations

from skyrl_megatron.config import MegatronWorkerConfig
from skyrl_megatron.parallel import MeshCoordinates, init_distributed, initialize_model_parallel


class MegatronWorkerMixin:
    """Mixed into the host's worker bases; `role` selects the config section (policy/ref/critic)."""

    role: str

    def _init_parallel(self) -> MeshCoordinates:
        from skyrl_train.distributed.dispatch import MeshRank

        self.megatron_cfg = MegatronWorkerConfig.from_host_config(self.cfg, self.role)
        self.runtime = init_distributed(self.megatron_cfg.runtime)
        coords = initialize_model_parallel(self.megatron_cfg.parallel(), seed=self.cfg.trainer.seed)
        # The host's dispatch collects from sp == 0: a Megatron rank puts its CP rank in that slot.
        self.mesh_rank = MeshRank(
            dp=coords.dp,
            sp=coords.cp,
            tp=coords.tp,
            pp=coords.pp,
            world_size=coords.world_size,
            dp_size=coords.dp_size,
            pp_size=coords.pp_size,
        )
        return coords

    def get_mesh_rank(self):
        return self.mesh_rank

    def init_model(self, model_path: str, *args, **kwargs):
        raise NotImplementedError(
            f"skyrl-megatron {self.role} worker: model building is not implemented yet in this release"
        )
