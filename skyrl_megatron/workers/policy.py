"""The policy worker on Megatron-Core: logprobs, PPO/GRPO training, checkpoints, HF export."""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from skyrl_megatron import host_api
from skyrl_megatron.checkpoint import save_hf_model
from skyrl_megatron.compute.losses import ObjectiveSettings, PolicyObjective
from skyrl_megatron.compute.route_replay import (
    RouteReplay,
    RouteStore,
    engine_routes,
    host_columns,
    training_routes,
)
from skyrl_megatron.compute.router_metrics import RouterMetrics
from skyrl_megatron.compute.runner import mini_batch_rows
from skyrl_megatron.engines.weight_updates import torch_dtype
from skyrl_megatron.model.adapters.lora import measure_footprint
from skyrl_megatron.digests import tensor_sha256
from skyrl_megatron.weights import iter_hf_weights, iter_weight_buckets
from skyrl_megatron.workers.engine_sync import BUCKET_BYTES as ENGINE_SYNC_BUCKET_BYTES
from skyrl_megatron.workers.engine_sync import EngineBroadcastSender, is_engine_client
from skyrl_megatron.workers.training import TrainedRoleMixin

logger = logging.getLogger(__name__)

PolicyWorkerBase, _, _ = host_api.worker_bases()


class MegatronPolicyWorker(TrainedRoleMixin, PolicyWorkerBase):
    role = "policy"

    def init_model(self, model_path: str, num_training_steps: int | None = None):
        built = self._build(model_path)
        trainer = self.host_cfg.trainer
        self._init_optimizer(trainer.policy.optimizer_config, num_training_steps)
        self.router_metrics = RouterMetrics.attach(built.chunks)  # per-layer MoE load; nothing for dense
        self.runner.attach_router_metrics(self.router_metrics)
        # routing replay: `forward` (old logprobs) records each row's routes, training replays them;
        # under R3 `forward` itself replays the routes the inference engine returned
        self.routing_replay = self.megatron_cfg.moe_config.routing_replay if self.router_metrics.is_moe else None
        self.route_replay: RouteReplay | None = None
        self.route_store: RouteStore | None = None
        if self.routing_replay is not None:
            self.route_replay = RouteReplay(built.chunks)
            self.runner.attach_route_replay(self.route_replay)
            self.route_store = RouteStore()
        self._trained_since_scoring = False  # the next `forward` starts a new step's routes
        self.objective = PolicyObjective(ObjectiveSettings.from_algorithm_config(host_api.algorithm_config(self.cfg)))
        self.lora_metrics: dict[str, float] = {}
        if built.lora is not None:
            footprint = measure_footprint(
                built.chunks,
                bf16=bool(trainer.bf16),
                distributed_optimizer=bool(self.megatron_cfg.ddp_config.get("use_distributed_optimizer")),
            )
            self.lora_metrics = footprint.as_metrics()
            if torch.distributed.get_rank() == 0:
                logger.info("LoRA: %s", self.lora_metrics)

    # -- training: one mini-batch, then one optimizer step ----------------------------------------

    def _mini_batch_settings(self) -> dict:
        """How each training mini-batch runs (`ModelRunner.train_mini_batch`'s settings) on this worker."""
        from megatron.core import parallel_state as ps

        return dict(
            objective=self.objective,
            batching=self._batching(self.host_cfg.trainer.micro_train_batch_size_per_gpu, "training"),
            temperature=float(self.host_cfg.generator.sampling_params.temperature),
            dp_group=ps.get_data_parallel_group(),
        )

    def ppo_train(self, train_data):
        """skyrl-train 0.3.1's contract: epochs x mini-batches of the rank's rows, one optimizer step each."""
        trainer = self.host_cfg.trainer
        rows = train_data["sequences"].shape[0]
        mini = int(trainer.policy_mini_batch_size) * int(self.host_cfg.generator.n_samples_per_prompt) // self.mesh_rank.dp_size
        if mini < 1 or rows % mini:
            raise ValueError(
                f"policy worker got {rows} rows per DP rank, not a multiple of the per-rank mini-batch {mini} "
                "(trainer.policy_mini_batch_size x generator.n_samples_per_prompt / DP size); adjust "
                "trainer.train_batch_size or trainer.policy_mini_batch_size"
            )
        settings = self._mini_batch_settings()
        # every row's routes from this step's scoring, matched by its tokens (rows may come reordered)
        routes = self._training_routes(train_data)
        self._trained_since_scoring = True
        history: dict[str, list[float]] = defaultdict(list)
        steps = 0
        with self._watched("training"):
            for _ in range(int(trainer.update_epochs_per_batch)):
                for start in range(0, rows, mini):
                    batch = mini_batch_rows(train_data, slice(start, start + mini), routes)
                    with self._step_guard("training"):
                        pending = self.runner.train_mini_batch(
                            batch.sequences, batch.attention_mask, batch.response, **settings, routes=batch.routes,
                            defer_metrics=True,
                        )
                    step = self._optimizer_step()  # queued before the metrics are read: no wait for the backward
                    metrics = {**pending.read(), **step}
                    steps += 1
                    for name, value in metrics.items():
                        history[name].append(value)
        # the step is applied: until the next ppo_train the gradients are dead weight (4 B/param)
        self.runner.gradients.release()
        if self.route_store is not None:
            self.route_store.clear()
        status = {name: sum(values) / len(values) for name, values in history.items()}
        status["policy_update_steps"] = steps
        status["policy_skipped_steps"] = self.skipped_steps
        status.update(self.lora_metrics)
        return host_api.training_output(metadata={"train_status": status})

    def forward_backward(self, data, loss_fn: str | None = None, loss_fn_config=None, **kwargs):
        """skyrl 0.4's contract: one mini-batch (this rank's rows of it); ``optim_step`` follows."""
        if loss_fn is not None or loss_fn_config:
            raise NotImplementedError(
                "forward_backward with a loss_fn/loss_fn_config override (the Tinker API) is not implemented "
                "by skyrl-megatron; the policy trains with trainer.algorithm.policy_loss_type"
            )
        settings = self._mini_batch_settings()
        routes = self._training_routes(data)
        self._trained_since_scoring = True
        batch = mini_batch_rows(data, slice(None), routes)
        with self._watched("training"), self._step_guard("training"):
            metrics = self.runner.train_mini_batch(
                batch.sequences, batch.attention_mask, batch.response, **settings, routes=batch.routes
            )
        metrics["policy_lr"] = self.get_lr()  # the rate the coming optim_step applies
        metrics.update(self.lora_metrics)
        return host_api.training_status(metrics)

    def _scoring_route_store(self) -> RouteStore | None:
        """One step's scoring at a time: skyrl 0.4 scores a step mini-batch by mini-batch (its
        ``recompute_old_logprobs_per_minibatch``) before training any, so the routes of every scoring
        call since the last training call are kept, and the first scoring after training starts anew."""
        if self.route_store is None:
            return None
        if self._trained_since_scoring:
            self.route_store.clear()
            self._trained_since_scoring = False
        return self.route_store

    def _scoring_routes(self, data) -> torch.Tensor | None:
        """R3: the engine's routes of `data`'s rows, [B, S, L, k] in the host's columns; NO_ROUTE where the
        engine gave none (the last sampled token, which it never forwarded): scoring routes those as
        usual, and training replays scoring's choice for them as for every other token."""
        rows = self._engine_routes(data)
        return None if rows is None else host_columns(rows, data["attention_mask"])

    def _engine_routes(self, data) -> list[torch.Tensor] | None:
        if self.routing_replay != "r3" or not self.runner.replays_routes:
            return None  # (a pipeline stage without MoE layers has no routes)
        given = host_api.engine_routes(data)
        if given is None:
            raise RuntimeError(
                "megatron_config.moe_config.routing_replay=r3, but the batch carries no rollout_expert_indices: "
                "the generator must return the engines' routes (generator.inference_engine.enable_return_routed_experts)"
            )
        return engine_routes(*given, data["attention_mask"], self.route_replay)

    def _training_routes(self, train_data) -> torch.Tensor | None:
        """The routes training replays for `train_data`'s rows (`route_replay.training_routes`), or None
        without routing replay."""
        if self.route_store is None or not self.runner.replays_routes:
            return None  # (a pipeline stage without MoE layers has no routes)
        engine_rows = self._engine_routes(train_data) if self.routing_replay == "r3" else None
        return training_routes(self.route_store, train_data["sequences"], train_data["attention_mask"], engine_rows)

    def recorded_routes(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """The routes this step's scoring recorded for these rows, [B, S, L, k] in the host's columns
        (NO_ROUTE at padding) for this rank's route layers; None without routing replay. For checks."""
        if self.route_store is None or not self.runner.replays_routes:
            return None
        return host_columns(self.route_store.lookup(sequences, attention_mask), attention_mask)

    # -- weight sync ------------------------------------------------------------------------------

    _engine_sender: EngineBroadcastSender | None = None  # our own sync, to our HF engines

    async def init_weight_sync_state(self, inference_engine_client, *host_args, **host_kwargs):
        """Our HF engines (skyrl 0.4's ``generator.engine=cpu``) get our broadcast sender; any other
        client gets the host's own sender set-up (skyrl-train 0.3.1: its transfer strategies)."""
        with self._watched("weight sync set-up", long_waits=True):
            if is_engine_client(inference_engine_client):
                self._engine_sender = await EngineBroadcastSender.connect(
                    inference_engine_client, on_gpu=self.runtime.torch_device.type == "cuda",
                    timeout_s=self.watchdog.group_timeout(),
                )
                return
            return await super().init_weight_sync_state(inference_engine_client, *host_args, **host_kwargs)

    async def broadcast_to_inference_engines(self, inference_engine_client, inference_engine_cfg=None, model_id=None):
        """Send the current weights, HF-named full tensors, through the sender ``init_weight_sync_state`` made.

        Every rank runs the export (its gathers are collectives); the sender decides who transmits:
        rank 0 over a broadcast group, or each rank's CUDA IPC handles (the host's strategies, chosen
        from ``generator.weight_sync_backend`` and the placement). skyrl 0.4 passes the client once, at
        ``init_weight_sync_state``, and None here.
        """
        with self._watched("weight sync"):
            return await self._broadcast_to_inference_engines(inference_engine_client, inference_engine_cfg)

    async def _broadcast_to_inference_engines(self, inference_engine_client, inference_engine_cfg):
        if self._engine_sender is not None:
            inference_engine_client = self._engine_sender.client
        elif inference_engine_client is None:
            inference_engine_client = self._weight_sync_inference_client  # skyrl 0.4 kept it at init
        if self._host_sync_engine() is not None and not self._syncs_adapters():
            # skyrl 0.4 with its own servers (vLLM): its transfer engine pulls from our weight source
            await self._sync_weights_to_inference_engines(inference_engine_client, inference_engine_cfg)
            return {"host_transfer": True}
        reset_prefix_cache = None
        if self.host_cfg.generator.enable_prefix_caching and torch.distributed.get_rank() == 0:
            reset_prefix_cache = inference_engine_client.reset_prefix_cache()
        if self._syncs_adapters():
            await self._send_adapters(inference_engine_client)
            sent = {"adapters": True}
        else:
            sent = await self._send_full_weights()
        if reset_prefix_cache is not None:
            await reset_prefix_cache
        return sent

    def _syncs_adapters(self) -> bool:
        return self.built.lora is not None and self.built.lora.weight_sync == "adapters"

    def _host_sync_engine(self):
        """skyrl 0.4's trainer-side transfer engine, made by its ``init_weight_sync_state`` (else None)."""
        return getattr(self, "_weight_sync_engine", None)

    _weight_source_dtype: torch.dtype | None = None

    def _build_weight_source(self, dtype: torch.dtype, backend: str):
        """skyrl 0.4's hook for its transfer engine: a vLLM weight source over our HF export. (Its workers see
        no generator config: the dtype is kept for `weight_digests`.)"""
        from skyrl_megatron.workers.vllm_source import exported_weight_source

        self._weight_source_dtype = dtype
        return exported_weight_source(self.built, dtype, backend, self.runtime.torch_device)

    async def _send_full_weights(self) -> dict:
        if self._engine_sender is not None:
            bucket_bytes = ENGINE_SYNC_BUCKET_BYTES
        else:
            bucket_bytes = host_api.weight_sync_bucket_bytes(self.cfg, self._transfer_strategy_cls)
        buckets = iter_weight_buckets(self.built, bucket_bytes, dtype=self._engine_dtype(), device=self.runtime.torch_device)
        if self._engine_sender is not None:
            await self._engine_sender.send(buckets)
        else:
            await self._weight_transfer_sender.send_chunks(host_api.weight_chunk(bucket) for bucket in buckets)
        self.empty_cache()
        torch.distributed.barrier()
        report = buckets.report
        if torch.distributed.get_rank() == 0:
            logger.info(
                "weight sync: %d tensors, %.1f MiB in %d chunks, export %.2f s",
                report.tensors, report.bytes / 2**20, report.buckets, report.seconds,
            )
        return {"tensors": report.tensors, "bytes": report.bytes, "chunks": report.buckets,
                "export_seconds": report.seconds}

    async def _send_adapters(self, inference_engine_client) -> None:
        """LoRA with ``weight_sync: adapters``: a PEFT adapter directory the engines load from disk.

        The engines must have loaded the base weights (they start from the same checkpoint) and, for
        vLLM, run with LoRA enabled.
        """
        path = self.host_cfg.trainer.policy.model.lora.lora_sync_path
        save_hf_model(path, self.built, adapters_only=True)  # collective; rank 0 writes, atomically
        if torch.distributed.get_rank() == 0:
            if callable(getattr(inference_engine_client, "load_lora_adapter", None)):  # skyrl 0.4's clients
                await inference_engine_client.load_lora_adapter(self.role, str(path))
            else:
                await inference_engine_client.update_named_weights(host_api.lora_load_request_class()(lora_path=str(path)))
        torch.distributed.barrier()

    def _engine_dtype(self) -> torch.dtype:
        """The dtype the inference engines hold their weights in (what a sync sends)."""
        if self._engine_sender is not None:
            return torch_dtype(self._engine_sender.client.model_dtype)
        if self._weight_source_dtype is not None:  # skyrl 0.4's servers: the dtype its transfer engine asked for
            return self._weight_source_dtype
        return host_api.generator_dtype(self.cfg)

    def weight_digests(self) -> dict[str, str]:
        """SHA-256 of every exported tensor in the engines' dtype (rank 0; {} elsewhere). Collective.

        What a weight sync sends, fingerprinted: equal digests on the engine side mean the engine
        holds exactly the trainer's weights.
        """
        digests = {}
        with self.model_resident():
            for name, tensor in iter_hf_weights(self.built, dtype=self._engine_dtype(), device="cpu"):
                if torch.distributed.get_rank() == 0:
                    digests[name] = tensor_sha256(tensor)
        return digests

    # -- HF export --------------------------------------------------------------------------------

    def save_hf_model(self, export_dir: str, tokenizer=None):
        """The HF checkpoint of the current weights (offloaded ones brought back for the export)."""
        with self._watched("HF export", long_waits=True), self.model_resident():
            save_hf_model(export_dir, self.built, tokenizer)
