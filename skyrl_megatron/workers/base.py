"""What every Megatron worker role shares: process groups, the host's MeshRank, the model, forward.

The host calls its workers through a fixed contract (skyrl_train.workers.worker): `init_model`,
`forward`, `offload_to_cpu` / `backload_to_gpu`, `empty_cache`, `get_mesh_rank`. This mixin
implements it on top of a :class:`~skyrl_megatron.compute.runner.ModelRunner`; the role classes
add training (policy) or nothing (ref).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any

import torch

from skyrl_megatron import host_api
from skyrl_megatron.config import SCORING_BUDGET_FACTOR, MegatronWorkerConfig, gpu_sharing
from skyrl_megatron.failures import register_current_worker
from skyrl_megatron.model.adapters.lora import LoraSpec
from skyrl_megatron.model.build import BuiltModel, ModelSpec, build_model
from skyrl_megatron.model.conversion.cache import ConversionCacheSettings
from skyrl_megatron.parallel import (
    LONG_COLLECTIVE_TIMEOUT_S,
    MeshCoordinates,
    collective_timeout,
    init_distributed,
    initialize_model_parallel,
    set_collective_timeout,
)
from skyrl_megatron.watchdog import CollectiveWatchdog
from skyrl_megatron.workers.memory_peaks import PhasePeaks
from skyrl_megatron.workers.offload import ModelOffloader, TransferLog
from skyrl_megatron.workers.out_of_memory import StepKnobs, explains_out_of_memory
from skyrl_megatron.workers.python_gc import ManualGc
from skyrl_megatron.compute.runner import MicroBatching, ModelRunner

logger = logging.getLogger(__name__)


class MegatronWorkerMixin:
    """Mixed into the host's worker bases; `role` selects the config section (policy/ref/critic)."""

    role: str
    trains: bool = False

    # -- set-up -----------------------------------------------------------------------------------

    @property
    def host_cfg(self):
        """The host's config for this worker in the shape we read (``trainer.*``, ``generator.*``), whatever
        the host release handed the worker (``self.cfg``)."""
        view = self.__dict__.get("_host_cfg")
        if view is None:
            view = self.__dict__["_host_cfg"] = host_api.worker_view(self.cfg)
        return view

    def _init_parallel(self) -> MeshCoordinates:
        started = time.perf_counter()
        self.megatron_cfg = MegatronWorkerConfig.from_host_config(self.host_cfg, self.role)
        configured = time.perf_counter()
        self.runtime = init_distributed(self.megatron_cfg.runtime)
        joined = time.perf_counter()
        self.parallel_config = self.megatron_cfg.parallel()
        coords = initialize_model_parallel(self.parallel_config, seed=self.host_cfg.trainer.seed)
        # where a start's process-group stage goes (policy_bench reports it): the default group waits for every
        # rank's actor; Megatron's groups include importing megatron.core, the first use of it in the worker
        grouped = time.perf_counter()
        self.init_parallel_seconds = {"config": configured - started, "torch_distributed": joined - configured,
                                      "megatron_groups": grouped - joined}
        self.mesh_rank = host_api.make_mesh_rank(
            dp=coords.dp,
            cp=coords.cp,
            tp=coords.tp,
            pp=coords.pp,
            world_size=coords.world_size,
            dp_size=coords.dp_size,
            pp_size=coords.pp_size,
        )
        coordinates = f"dp {coords.dp}, cp {coords.cp}, tp {coords.tp}, pp {coords.pp}"
        rank = torch.distributed.get_rank()
        self.worker_name = f"{self.role} worker rank {rank}/{coords.world_size} ({coordinates})"
        register_current_worker(self.role, rank, coords.world_size, coordinates)
        self.watchdog = CollectiveWatchdog(f"{self.role} workers", self.megatron_cfg.collective_timeout_s,
                                           timeout_key=f"trainer.{self.role}.megatron_config.collective_timeout_s")
        self.init_parallel_seconds["mesh_and_registry"] = time.perf_counter() - grouped
        logger.info("skyrl-megatron %s: process groups in %s", self.worker_name,
                    ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.init_parallel_seconds.items()))
        return coords

    def init_worker_process_group(self) -> None:
        """Replaces the host's NCCL + device-mesh set-up (DistributedTorchRayActor).

        The host's actor group calls this right after creating the actors and then reads
        `get_mesh_rank()` once to plan every later dispatch, so the Megatron groups, and with them
        the real (dp, cp, tp, pp) coordinates, must exist before `init_model`.
        """
        self._init_parallel()

    def get_mesh_rank(self):
        return self.mesh_rank

    def _model_spec(self, model_path: str) -> ModelSpec:
        m = self.megatron_cfg
        return ModelSpec(
            hf_path=model_path,
            parallel=self.parallel_config,
            dtype="bf16" if self.host_cfg.trainer.bf16 else "fp32",
            transformer_overrides=m.transformer_overrides(),
            wrap_with_ddp=self.trains,
            ddp_config=dict(m.ddp_config),
            cache=ConversionCacheSettings(root=m.checkpoint_cache_dir, force_reconvert=m.force_reconvert),
            moe=m.moe_config,
            fused_kernels=tuple(m.fused_kernels),
            attention_kernel=m.attention_kernel,
            # only a trained role gets adapters; the reference model is the frozen base
            lora=LoraSpec.from_host_config(self.host_cfg, self.role) if self.trains else None,
        )

    def _build(self, model_path: str) -> BuiltModel:
        if getattr(self, "parallel_config", None) is None:  # not started through the host's actor group
            self._init_parallel()
        started = time.perf_counter()
        self.built = build_model(self._model_spec(model_path))
        logger.info("skyrl-megatron %s: model ready in %.1f s", self.role, time.perf_counter() - started)
        self.runner = ModelRunner(
            self.built.chunks,
            self.parallel_config,
            pad_token_id=getattr(self, "_pad_token_id", 0) or 0,
            fused_logprobs=self.built.fused_logprobs,
            logprobs_in_gemm=self.built.logprobs_in_gemm,
            logits_chunk_bytes=self.megatron_cfg.logits_chunk_mib * 2**20,
            logits_kept_bytes=self.megatron_cfg.logits_kept_mib * 2**20,
        )
        # start-up is over: a steady-state collective waits `collective_timeout_s` (plus the watchdog's grace)
        set_collective_timeout(self.watchdog.group_timeout())
        self.offloader = ModelOffloader(self.built.chunks, overlap_optimizer=self.megatron_cfg.overlap_optimizer_backload)
        self.transfer_log = TransferLog()  # the host's offload/backload calls, not our `model_resident` moves
        self.phase_peaks = PhasePeaks()
        self.manual_gc = ManualGc() if self.megatron_cfg.manual_gc else None
        return self.built

    def _set_pad_token_id(self, pad_token_id: int) -> None:
        self._pad_token_id = pad_token_id
        if getattr(self, "runner", None) is not None:
            self.runner.pad_token_id = pad_token_id

    # -- forward ----------------------------------------------------------------------------------

    def _token_budget(self, phase: str) -> tuple[str, int | None]:
        """(key, value) of the phase's token budget: scoring passes keep no activations for backward, so
        they take a larger one (`forward_max_tokens_per_microbatch`, by default SCORING_BUDGET_FACTOR x the
        training budget; the key an out-of-memory names)."""
        m = self.megatron_cfg
        if phase == "scoring" and m.forward_max_tokens_per_microbatch is not None:
            return "forward_max_tokens_per_microbatch", m.forward_max_tokens_per_microbatch
        if phase == "scoring" and m.max_tokens_per_microbatch is not None:
            return "forward_max_tokens_per_microbatch", SCORING_BUDGET_FACTOR * m.max_tokens_per_microbatch
        return "max_tokens_per_microbatch", m.max_tokens_per_microbatch

    def _batching(self, micro_batch_size: int, phase: str) -> MicroBatching:
        """Rows per micro-batch from the host's config; the phase's token budget, when set, wins (and packs)."""
        return MicroBatching(
            micro_batch_size=int(micro_batch_size),
            max_tokens=self._token_budget(phase)[1],
            packed=bool(self.host_cfg.trainer.use_sample_packing),
        )

    @contextlib.contextmanager
    def _watched(self, phase: str, *, long_waits: bool = False):
        """The block is one call of `phase` under the collective watchdog (`watchdog.py`): a collective that
        a rank does not join fails it with an error naming that rank. `long_waits`: calls where one rank may
        keep the others waiting for long (checkpoints: one rank writes or reads) get start-up's timeout."""
        watchdog = getattr(self, "watchdog", None)
        if watchdog is None:  # process groups not made by us (a test's bare worker)
            yield
            return
        if not long_waits:
            with watchdog.watch(phase):
                yield
            return
        with collective_timeout(watchdog.group_timeout(LONG_COLLECTIVE_TIMEOUT_S)), \
                watchdog.watch(phase, timeout_s=LONG_COLLECTIVE_TIMEOUT_S):
            yield

    @contextlib.contextmanager
    def _step_guard(self, phase: str):
        """Scoring or training under this: an out-of-memory names this worker and the knobs that size
        its micro-batches (`workers/out_of_memory.py`), the phase's memory peak is kept, and Python's
        cyclic collector waits for the pass to end (`workers/python_gc.py`, `megatron_config.manual_gc`)."""
        gc_paused = self.manual_gc.paused() if self.manual_gc is not None else contextlib.nullcontext()
        with self._explains_out_of_memory(phase), self.phase_peaks.measure(phase), gc_paused:
            yield

    def _explains_out_of_memory(self, phase: str):
        trainer = self.host_cfg.trainer
        micro_key = "micro_train_batch_size_per_gpu" if phase == "training" else "micro_forward_batch_size_per_gpu"
        budget_key, budget = self._token_budget(phase)
        knobs = StepKnobs(
            role=self.role,
            token_budget_key=budget_key,
            token_budget=budget,
            micro_batch_key=f"trainer.{micro_key}",
            micro_batch_size=int(getattr(trainer, micro_key)),
            recompute_granularity=self.megatron_cfg.transformer_config_kwargs.get("recompute_granularity"),
        )
        return explains_out_of_memory(self.worker_name, phase, knobs)

    def forward(self, data, loss_fn: str | None = None, loss_fn_config=None, **kwargs: Any):
        """Logprobs of the response tokens at the sampling temperature, [B, A], in the host's output type."""
        if loss_fn is not None:
            raise NotImplementedError(
                f"forward(loss_fn={loss_fn!r}): skyrl-megatron scores logprobs only; a loss in forward "
                "(the Tinker API's forward with a loss) is not implemented"
            )
        response_length = int(data.metadata["response_length"])
        self.runner.gradients.release()  # scoring needs no gradients (the first score follows the build)
        with self._watched("scoring"), self._step_guard("scoring"):
            logprobs = self.runner.response_logprobs(
                data["sequences"],
                data["attention_mask"],
                response_length,
                self._batching(self.host_cfg.trainer.micro_forward_batch_size_per_gpu, "scoring"),
                temperature=float(self.host_cfg.generator.sampling_params.temperature),
                routes=self._scoring_routes(data),
                record_routes=self._scoring_route_store(),
            )
        if logprobs is None:  # not the last pipeline stage: the host does not collect from here
            logprobs = torch.zeros(data["sequences"].shape[0], response_length)
        return host_api.scoring_output("logprobs", logprobs.cpu(), dict(data.metadata))

    def _scoring_route_store(self):
        """Where `forward` records MoE routes (the policy under routing replay); None: nowhere."""
        return None

    def _scoring_routes(self, data):
        """MoE routes `forward` replays, [B, S, L, k] in the host's columns (the policy under R3); None: none."""
        return None

    # -- memory -----------------------------------------------------------------------------------

    def empty_cache(self) -> None:
        """The host asks after each scoring and training call (and our weight sync after its buckets). The
        allocator's pool goes back only where the placement shares this worker's GPUs with another model or the
        engines, the next user of that memory. On GPUs the worker has to itself nothing else can take it, and
        emptying only made the next pass call cudaMalloc again (449 times per Qwen3-4B training call)."""
        if self._shares_gpus:
            self._give_cuda_cache_back()

    @functools.cached_property
    def _shares_gpus(self) -> bool:
        return gpu_sharing(self.host_cfg, self.role) is not None

    def _give_cuda_cache_back(self) -> None:
        if not self.runtime.is_cpu and self.megatron_cfg.empty_cuda_cache:
            torch.cuda.empty_cache()

    def offload_to_cpu(self, pin_memory: bool = True, non_blocking: bool = True, **kwargs: Any):
        report = self.offloader.offload(
            model=kwargs.get("offload_model", True),
            optimizer=kwargs.get("offload_optimizer", True),
            optimizer_obj=getattr(self, "optimizer", None),
            pin_memory=pin_memory and not self.runtime.is_cpu,
        )
        self._give_cuda_cache_back()  # what an offload is for, wherever the GPUs are
        self.transfer_log.add(report)
        return report.as_dict()

    @contextlib.contextmanager
    def model_resident(self, optimizer: bool = False):
        """The model's weights (and with `optimizer`, the optimizer's state) on the device for the block,
        parked again after it if they were parked (a colocated run keeps them in host memory while the
        engine samples)."""
        parked = self.offloader.offloaded & ({"model", "optimizer"} if optimizer else {"model"})
        optimizer_obj = getattr(self, "optimizer", None)
        if parked:
            self.offloader.backload(model="model" in parked, optimizer="optimizer" in parked, optimizer_obj=optimizer_obj)
        try:
            yield
        finally:
            if parked:
                self.offloader.offload(model="model" in parked, optimizer="optimizer" in parked,
                                       optimizer_obj=optimizer_obj, pin_memory=not self.runtime.is_cpu)

    def backload_to_gpu(self, non_blocking: bool = True, **kwargs: Any):
        report = self.offloader.backload(
            model=kwargs.get("backload_model", True),
            optimizer=kwargs.get("backload_optimizer", True),
            optimizer_obj=getattr(self, "optimizer", None),
        )
        self.transfer_log.add(report)
        return report.as_dict()

    def transfer_summary(self) -> dict[str, float]:
        """Bytes and seconds the host's offloads/backloads moved since the last call, and the memory
        left after the last offload (see `TransferLog`)."""
        return self.transfer_log.drain()

    def memory_peaks(self) -> dict[str, float]:
        """The device memory peak of each scoring/training phase since the last call ({} on CPU)."""
        return self.phase_peaks.drain()
