"""The compute core of a worker, free of Ray and of the host's worker classes.

A :class:`ModelRunner` owns the model chunks of one rank and runs the two things RL asks of them:

* :meth:`ModelRunner.response_logprobs`: logprobs (and entropy) of the response tokens, [B, A];
* :meth:`ModelRunner.train_mini_batch`: forward + backward of one mini-batch with the policy
  objective, leaving finalised gradients for the optimizer step;
* for a critic (a model built with a value head): :meth:`ModelRunner.response_values` and
  :meth:`ModelRunner.train_value_mini_batch` with the host's value loss, through the same
  micro-batching, packing, CP gather and pipeline schedules.

Both prepare the rank's rows as micro-batches (:mod:`skyrl_megatron.compute.microbatch`), run them
through Megatron's pipeline schedule, and compute logprobs from the last hidden state with the
chunked vocab-parallel kernel (:mod:`skyrl_megatron.compute.logprobs`), so no [tokens, vocab]
tensor exists. The host-facing workers (policy, ref, critic) wrap a runner.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping, NamedTuple

import torch

from skyrl_megatron.compute.gradient_buffers import GradientBuffers
from skyrl_megatron.compute.logprobs import DEFAULT_LOGITS_CHUNK_BYTES, LogprobOutputProcessor
from skyrl_megatron.compute.losses import MiniBatchTotals, PolicyObjective, ValueObjective, mini_batch_metrics
from skyrl_megatron.compute.microbatch.micro_batch import MicroBatch
from skyrl_megatron.compute.microbatch.pipeline import MicroBatches, prepare_micro_batches
from skyrl_megatron.compute.microbatch.plan import MicroBatching
from skyrl_megatron.compute.microbatch.results import collect, recorded_host_routes, response_columns
from skyrl_megatron.compute.pending_metrics import PendingMetrics
from skyrl_megatron.compute.route_replay import RouteReplay, RouteStore
from skyrl_megatron.compute.router_metrics import RouterMetrics
from skyrl_megatron.compute.schedule import forward_backward, forward_only
from skyrl_megatron.model.adapters.value_head import ValueOutputProcessor
from skyrl_megatron.model.moe.settings import dispatch_needs_equal_token_counts
from skyrl_megatron.parallel import ParallelConfig
from skyrl_megatron.runtime import current_runtime

# Named ranges for `torch.profiler` (and tools that read its trace): where a step's time goes.
_mark = torch.profiler.record_function

# keys of the host's training batch that the policy objective reads, all [B, A]
RESPONSE_KEYS = ("loss_mask", "action_log_probs", "base_action_log_probs", "advantages", "rollout_logprobs")
# ... and that the critic's value loss reads
VALUE_KEYS = ("loss_mask", "values", "returns")


class MiniBatchRows(NamedTuple):
    """Rows of the host's training batch as `ModelRunner.train_mini_batch` takes them."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response: dict[str, torch.Tensor]  # the response columns the batch carries, [B, A] each
    routes: torch.Tensor | None  # the rows' replayed MoE routes, [B, S, L, k], or None


def mini_batch_rows(batch: Mapping[str, torch.Tensor], rows: slice, routes: torch.Tensor | None = None,
                    keys: tuple[str, ...] = RESPONSE_KEYS) -> MiniBatchRows:
    """Rows `rows` of the host's training `batch` (and of its replayed `routes`), with the response
    columns among `keys`."""
    response = {k: batch[k][rows] for k in keys if batch.get(k) is not None}
    return MiniBatchRows(batch["sequences"][rows], batch["attention_mask"][rows], response,
                         None if routes is None else routes[rows])


class ModelRunner:
    def __init__(
        self,
        chunks: list[torch.nn.Module],
        parallel: ParallelConfig,
        *,
        pad_token_id: int = 0,
        logits_chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES,
        logits_kept_bytes: int = 0,
        fused_logprobs: bool = False,
        logprobs_in_gemm: bool = False,
    ):
        self.chunks = chunks
        self.parallel = parallel
        self.pad_token_id = pad_token_id
        self.logits_chunk_bytes = logits_chunk_bytes
        self.logits_kept_bytes = logits_kept_bytes
        self.fused_logprobs = fused_logprobs  # the head's Triton kernels (`BuiltModel.fused_logprobs`)
        self.logprobs_in_gemm = logprobs_in_gemm  # its statistics in the GEMM's epilogue (`BuiltModel.logprobs_in_gemm`)
        self.optimizer = None
        self.router_metrics: RouterMetrics | None = None
        self.route_replay: RouteReplay | None = None
        self.device = current_runtime().torch_device
        self.equal_token_counts = dispatch_needs_equal_token_counts(chunks)
        # DDP's gradient storage: the worker releases it outside training, training brings it back
        self.gradients = GradientBuffers(chunks)

    def attach_optimizer(self, optimizer) -> None:
        """Wire the optimizer and Megatron's gradient hooks into the model config, as the schedules
        expect: gradients are finalised (DP reduce, TP/SP norm and embedding all-reduces) by
        `finalize_model_grads` after the last micro-batch, and the overlapped reduce/gather of the
        DDP buffers is driven by the schedule when the DDP config asks for it."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.utils import get_model_config

        self.optimizer = optimizer
        config = get_model_config(self.chunks[0])
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = optimizer.scale_loss
        ddp_config = getattr(self.chunks[0], "ddp_config", None)
        if ddp_config is not None and ddp_config.overlap_grad_reduce:
            no_sync = [chunk.no_sync for chunk in self.chunks]
            config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
            if ddp_config.align_param_gather:
                sync = [chunk.start_grad_sync for chunk in self.chunks]
                config.grad_sync_func = sync[0] if len(sync) == 1 else sync
        if ddp_config is not None and ddp_config.overlap_param_gather and ddp_config.align_param_gather:
            sync = [chunk.start_param_sync for chunk in self.chunks]
            config.param_sync_func = sync[0] if len(sync) == 1 else sync

    def attach_router_metrics(self, metrics: RouterMetrics) -> None:
        """Tell `metrics` which tokens of each micro-batch are real (MoE router statistics exclude padding)."""
        self.router_metrics = metrics

    def attach_route_replay(self, replay: RouteReplay) -> None:
        """Let scoring record MoE routes and training (or scoring) replay them (compute/route_replay.py)."""
        self.route_replay = replay

    # -- micro-batches -----------------------------------------------------------------------------

    def _micro_batches(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        batching: MicroBatching,
        response: Mapping[str, torch.Tensor] | None = None,
        routes: torch.Tensor | None = None,
        route_tokens: bool = False,
    ) -> MicroBatches:
        """The rows as micro-batches (compute/microbatch/). `routes` [B, S, L, k] (host columns) go with
        the rows into each micro-batch, in the order the routers see its tokens; `route_tokens`
        (implied by `routes`) marks the padding there."""
        if routes is not None and self.route_replay is None:
            raise RuntimeError("routes to replay, but no RouteReplay is attached to the runner")
        with_routes = routes is not None or route_tokens
        return prepare_micro_batches(
            sequences,
            attention_mask,
            batching,
            self.parallel,
            device=self.device,
            pad_token_id=self.pad_token_id,
            equal_token_counts=self.equal_token_counts,
            response=response,
            routes=routes,
            with_routes=with_routes,
            with_real_tokens=self.router_metrics is not None,
        )

    # -- model call -------------------------------------------------------------------------------

    def _forward_fn(self, temperature: float, with_entropy: bool, record_routes: bool = False) -> Callable:
        processor = LogprobOutputProcessor(
            temperature=temperature,
            with_entropy=with_entropy,
            logits_chunk_bytes=self.logits_chunk_bytes,
            logits_kept_bytes=self.logits_kept_bytes,
            fused=self.fused_logprobs,
            lse_gemm=self.logprobs_in_gemm,
        )

        def per_token(out) -> torch.Tensor:
            # the schedules pass one tensor to the loss function: stack logprobs and entropy
            parts = [out.logprobs] + ([out.entropy] if out.entropy is not None else [])
            return torch.stack(parts, dim=-1)

        return self._model_call(processor, per_token, record_routes)

    def _value_forward_fn(self) -> Callable:
        """The critic's model call: per-token values [b, s] from the value head (model/adapters/value_head.py)."""
        return self._model_call(ValueOutputProcessor(), lambda out: out.values)

    def _model_call(self, processor, per_token: Callable, record_routes: bool = False) -> Callable:
        """forward(model_chunk, micro_batch) for the schedules: hidden states on inner pipeline
        stages, `per_token(processor's result)` on the last one; `record_routes`: keep the MoE routes
        each micro-batch chose (routing replay)."""

        def forward(model, mb: MicroBatch):
            if self.router_metrics is not None:
                self.router_metrics.start_forward(model, mb.real_tokens)
            if mb.routes is not None:
                self.route_replay.set_targets(model, mb.routes)
            out = model(
                mb.model_input_ids,
                mb.model_position_ids,
                None,
                packed_seq_params=mb.inputs.packed_seq_params,
                output_processor=processor,
                output_processor_context=mb.targets,
            )
            if record_routes:
                mb.recorded = {**(mb.recorded or {}), **self.route_replay.take_recorded(model)}
            if isinstance(out, torch.Tensor):  # an inner pipeline stage: hidden states for the next one
                return out
            return per_token(out)

        return forward

    # -- public -----------------------------------------------------------------------------------

    def response_logprobs(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        batching: MicroBatching,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        routes: torch.Tensor | None = None,
        record_routes: RouteStore | None = None,
    ) -> torch.Tensor | None:
        """Logprobs [B, A] (with entropy: [B, A, 2]) on the last pipeline stage; None elsewhere.

        MoE routing replay (an attached `route_replay`): `routes` [B, S, L, k] (host columns, this
        rank's route layers) are replayed; `record_routes` receives the routes this pass chose, on
        every rank (each for its own layers).
        """
        record = record_routes is not None and self.replays_routes
        result = self._score(
            sequences, attention_mask, response_length, batching,
            self._forward_fn(temperature, with_entropy, record_routes=record), width=2 if with_entropy else 1,
            routes=routes, record_routes=record_routes if record else None,
        )
        if result is None:
            return None
        return result if with_entropy else result.squeeze(-1)

    def response_values(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        batching: MicroBatching,
    ) -> torch.Tensor | None:
        """The critic's values [B, A] of the states before each response token (0 past a response's
        end), on the last pipeline stage; None elsewhere. Needs a model built with a value head."""
        result = self._score(sequences, attention_mask, response_length, batching, self._value_forward_fn(), width=1)
        return None if result is None else result.squeeze(-1)

    def _score(self, sequences, attention_mask, response_length, batching, forward_fn, *, width: int,
               routes: torch.Tensor | None = None, record_routes: RouteStore | None = None):
        for chunk in self.chunks:
            chunk.eval()
        record = record_routes is not None
        with _mark("skyrl_megatron.prepare_micro_batches"):
            prepared = self._micro_batches(sequences, attention_mask, batching, routes=routes, route_tokens=record)
        micro_batches, shape = prepared.micro_batches, prepared.shape
        with _mark("skyrl_megatron.schedule"), self._routing(routes is not None or record):
            outputs = forward_only(
                self.chunks,
                micro_batches,
                forward_fn,
                lambda output, mb: (mb.rows, response_columns(output.float(), mb, response_length)),
                seq_length=shape[1],
                micro_batch_size=shape[0],
            )
        if record:
            with _mark("skyrl_megatron.record_routes"):
                routes_chosen = recorded_host_routes(self.route_replay, micro_batches, sequences.shape)
                record_routes.put(sequences, attention_mask, routes_chosen)
        if not outputs:
            return None
        with _mark("skyrl_megatron.collect"):
            return collect(outputs, sequences.shape[0], response_length, width)

    def train_mini_batch(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response: Mapping[str, torch.Tensor],
        objective: PolicyObjective,
        batching: MicroBatching,
        *,
        temperature: float = 1.0,
        dp_group=None,
        routes: torch.Tensor | None = None,
        defer_metrics: bool = False,
    ) -> dict[str, float] | PendingMetrics:
        """Forward + backward of one mini-batch with the policy objective; returns its metrics summed
        over micro-batches and DP ranks (each micro-batch's metrics are already its share of the
        mini-batch). `routes` [B, S, L, k] (host columns): MoE routes every micro-batch replays (an
        attached `route_replay`). With attached router metrics, the mini-batch's MoE load joins the
        metrics (collective: every rank). `defer_metrics`: return them unread (`PendingMetrics`), for a
        caller that queues the optimizer step first."""

        def loss(values: torch.Tensor, mb: MicroBatch, totals: MiniBatchTotals):
            return objective(values[..., 0], values[..., 1], mb.response, totals)

        if self.router_metrics is not None:
            self.router_metrics.reset()  # this mini-batch's load alone, not the scoring before it
        # the host always reports policy_entropy
        forward_fn = self._forward_fn(temperature, with_entropy=True)
        metrics = self._train(sequences, attention_mask, response, batching, forward_fn, loss, dp_group, routes)
        if self.router_metrics is not None:
            metrics = metrics.joined(self.router_metrics.pending_summary())
        return metrics if defer_metrics else metrics.read()

    def train_value_mini_batch(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response: Mapping[str, torch.Tensor],
        objective: ValueObjective,
        batching: MicroBatching,
        *,
        dp_group=None,
        defer_metrics: bool = False,
    ) -> dict[str, float] | PendingMetrics:
        """Forward + backward of one critic mini-batch with the host's value loss (`response` holds
        `loss_mask`, old `values` and `returns`, [B, A]); metrics as for `train_mini_batch`."""

        def loss(values: torch.Tensor, mb: MicroBatch, totals: MiniBatchTotals):
            return objective(values[..., 0], mb.response, totals)

        metrics = self._train(sequences, attention_mask, response, batching, self._value_forward_fn(), loss, dp_group)
        return metrics if defer_metrics else metrics.read()

    def _train(self, sequences, attention_mask, response, batching, forward_fn, micro_batch_loss, dp_group,
               routes: torch.Tensor | None = None) -> PendingMetrics:
        from megatron.core import parallel_state as ps

        self.gradients.restore()
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        response_length = response["loss_mask"].shape[1]
        totals = MiniBatchTotals.of(response["loss_mask"], dp_group, device=self.device)
        with _mark("skyrl_megatron.prepare_micro_batches"):
            prepared = self._micro_batches(sequences, attention_mask, batching, response, routes)
        micro_batches, shape = prepared.micro_batches, prepared.shape
        # Megatron divides each micro-batch loss by their number and averages gradients over DP;
        # our losses are already shares of the whole mini-batch, so undo both.
        dp_size = ps.get_data_parallel_world_size()
        scale = len(micro_batches) * dp_size

        def loss_fn(output, mb: MicroBatch):
            with _mark("skyrl_megatron.loss"):
                values = response_columns(output.float(), mb, response_length)
                if mb.rows.numel() == 0:
                    # an empty micro-batch (padding the count across ranks) contributes nothing
                    zero = output.sum() * 0.0
                    return zero, {}
                loss, metrics = micro_batch_loss(values, mb, totals)
                return loss * scale, metrics

        with _mark("skyrl_megatron.schedule"), self._routing(routes is not None, training=True):
            per_micro_batch = forward_backward(
                self.chunks,
                micro_batches,
                forward_fn,
                loss_fn,
                seq_length=shape[1],
                micro_batch_size=shape[0],
            )
        with _mark("skyrl_megatron.metrics"):  # queued: the values are read when the caller reads them
            return mini_batch_metrics(per_micro_batch, dp_group, self.device)

    # -- routing replay ---------------------------------------------------------------------------

    @property
    def replays_routes(self) -> bool:
        """Whether routes can be recorded and replayed here (a RouteReplay with routers on this rank)."""
        return self.route_replay is not None and self.route_replay.num_layers > 0

    @contextlib.contextmanager
    def _routing(self, active: bool, training: bool = False):
        """Routers follow each micro-batch's routes inside the block (when `active`); as usual after it."""
        if not active or not self.replays_routes:
            yield
            return
        self.route_replay.activate(True, training)
        try:
            yield
        finally:
            self.route_replay.activate(False)
