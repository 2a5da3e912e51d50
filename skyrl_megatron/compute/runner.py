"""The compute core of a worker, free of Ray and of the host's worker classes.

A :class:`ModelRunner` owns the model chunks of one rank and runs the two things RL asks of them:

* :meth:`ModelRunner.response_logprobs`: logprobs (and entropy) of the response tokens, [B, A];
* :meth:`ModelRunner.train_mini_batch`: forward + backward of one mini-batch with the policy
  objective, leaving finalised gradients for the optimizer step;
* for a critic (a model built with a value head): :meth:`ModelRunner.response_values` and
  :meth:`ModelRunner.train_value_mini_batch` with the host's value loss, through the same
  micro-batching, packing, CP gather and pipeline schedules.

Both split the rank's rows into micro-batches (:mod:`skyrl_megatron.compute.batching`), run them
through Megatron's pipeline schedule, and compute logprobs from the last hidden state with the
chunked vocab-parallel kernel (:mod:`skyrl_megatron.compute.logprobs`), so no [tokens, vocab]
tensor exists. The host-facing workers (policy, ref, critic) wrap a runner.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from skyrl_megatron.compute.batching import (
    IGNORE_LABEL,
    ModelInputs,
    PackingSettings,
    RowSpans,
    build_model_inputs,
    model_shape,
    pad_plan,
    plan_micro_batches,
)
from skyrl_megatron.compute.gradient_buffers import GradientBuffers
from skyrl_megatron.compute.logprobs import DEFAULT_LOGITS_CHUNK_BYTES, LogprobOutputProcessor, LogprobTargets
from skyrl_megatron.compute.losses import MiniBatchTotals, PolicyObjective, ValueObjective
from skyrl_megatron.compute.packing import ContextParallelSplit
from skyrl_megatron.compute.route_replay import NO_ROUTE, RouteReplay, RouteStore, RouteTargets, route_dtype
from skyrl_megatron.compute.router_metrics import RouterMetrics, real_token_mask
from skyrl_megatron.compute.schedule import forward_backward, forward_only
from skyrl_megatron.model.moe import dispatch_needs_equal_token_counts
from skyrl_megatron.model.value_head import ValueOutputProcessor
from skyrl_megatron.parallel import ParallelConfig
from skyrl_megatron.runtime import current_runtime

# Named ranges for `torch.profiler` (and tools that read its trace): where a step's time goes.
_mark = torch.profiler.record_function

# keys of the host's training batch that the policy objective reads, all [B, A]
RESPONSE_KEYS = ("loss_mask", "action_log_probs", "base_action_log_probs", "advantages", "rollout_logprobs")
# ... and that the critic's value loss reads
VALUE_KEYS = ("loss_mask", "values", "returns")


@dataclass(frozen=True)
class MicroBatching:
    """How a rank's rows are split: by row count, or by a token budget (then packed)."""

    micro_batch_size: int = 1
    max_tokens: int | None = None
    packed: bool = False


@dataclass
class _MicroBatch:
    inputs: ModelInputs  # global (all CP ranks' tokens), for mapping outputs back
    model_input_ids: torch.Tensor  # this CP rank's share of the tokens, on the device
    model_position_ids: torch.Tensor
    targets: LogprobTargets  # this CP rank's share, on the device
    rows: torch.Tensor  # indices into the rank's batch
    response: dict[str, torch.Tensor]  # [rows, A] slices of the response tensors
    cp_split: ContextParallelSplit | None = None
    real_tokens: torch.Tensor | None = None  # this CP rank's [b, s] real-token mask, for router metrics
    routes: RouteTargets | None = None  # MoE routes to replay or record, in the routers' token order
    recorded: dict[int, torch.Tensor] | None = None  # routes recorded by this rank's routers {layer: [tokens, k]}


class _GatherContextParallel(torch.autograd.Function):
    """All-gather per-token values over CP into global token order.

    Every CP rank then computes the same loss on the whole sequences, so the gradient of a rank's
    own tokens is just its slice of the incoming gradient (no sum over ranks); Megatron's schedule
    multiplies the loss by the CP size and DDP averages over DP x CP, which together restore the
    full gradient.
    """

    @staticmethod
    def forward(ctx, local, split, group):
        ctx.split = split
        return split.gather(local, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return ctx.split.local(grad, dim=1), None, None


class ModelRunner:
    def __init__(
        self,
        chunks: list[torch.nn.Module],
        parallel: ParallelConfig,
        *,
        pad_token_id: int = 0,
        logits_chunk_bytes: int = DEFAULT_LOGITS_CHUNK_BYTES,
        fused_logprobs: bool = False,
    ):
        self.chunks = chunks
        self.parallel = parallel
        self.pad_token_id = pad_token_id
        self.logits_chunk_bytes = logits_chunk_bytes
        self.fused_logprobs = fused_logprobs  # the head's generated kernels (`BuiltModel.fused_logprobs`)
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

    # -- batching ---------------------------------------------------------------------------------

    def _packing(self, packed: bool) -> PackingSettings:
        p = self.parallel
        return PackingSettings(packed=packed, tensor=p.tensor, sequence_parallel=p.sequence_parallel, context=p.context)

    def _micro_batches(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        batching: MicroBatching,
        response: Mapping[str, torch.Tensor] | None = None,
        routes: torch.Tensor | None = None,
        route_tokens: bool = False,
    ) -> tuple[list[_MicroBatch], tuple[int, int]]:
        """`routes` [B, S, L, k] (host columns) go with the rows into each micro-batch, in the order
        the routers see its tokens; `route_tokens` (implied by `routes`) marks the padding there."""
        if routes is not None and self.route_replay is None:
            raise RuntimeError("routes to replay, but no RouteReplay is attached to the runner")
        spans = RowSpans.from_attention_mask(attention_mask)
        packed = batching.packed or batching.max_tokens is not None
        plan = plan_micro_batches(
            spans.length, micro_batch_size=batching.micro_batch_size, max_tokens=batching.max_tokens
        )
        settings = self._packing(packed)
        shape = model_shape([spans.length[rows].tolist() for rows in plan.groups], settings)
        if not packed:
            shape = (max(shape[0], batching.micro_batch_size), shape[1])
        # Pipeline stages exchange fixed-shape activations, and the allgather MoE dispatcher needs as
        # many tokens on every expert-parallel rank: only there do micro-batches share one shape.
        # Elsewhere each keeps its own, so no compute goes to padding up to the largest one (on
        # long-tailed RL batches that was 18% of the positions at a 16k-token budget).
        fixed_shape = self.parallel.pipeline > 1 or self.equal_token_counts
        # every rank runs the same number of micro-batches: expert-parallel all-to-alls and the
        # pipeline pair up forward passes across data-parallel ranks; the allgather MoE dispatcher
        # also needs as many tokens on every expert-parallel rank, hence one shape for all ranks
        agreed = [len(plan), *(shape if self.equal_token_counts else ())]
        agreed = torch.tensor(agreed, dtype=torch.long, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        count = int(agreed[0])
        if self.equal_token_counts:
            shape = (int(agreed[1]), int(agreed[2]))
        if self.parallel.virtual_pipeline:
            # the interleaved schedule walks micro-batches in groups of PP size
            count = -(-count // self.parallel.pipeline) * self.parallel.pipeline
        plan = pad_plan(plan, count)
        micro_batches = []
        for rows in plan.groups:
            own_shape = None if packed or rows.numel() else (1, settings.row_align)  # an empty one: one pad row
            model_in = build_model_inputs(
                sequences[rows], attention_mask[rows], settings, pad_token_id=self.pad_token_id,
                padded_shape=shape if fixed_shape else own_shape,
            )
            split = self._context_split(model_in)
            local = (lambda t: split.local(t, dim=1)) if split is not None else (lambda t: t)
            labels = local(model_in.labels)
            targets = LogprobTargets(
                labels=labels.clamp(min=0).to(self.device), mask=(labels != IGNORE_LABEL).to(self.device)
            )
            sliced = {k: v[rows].to(self.device) for k, v in (response or {}).items() if v is not None}
            if model_in.packed_seq_params is not None:
                model_in.packed_seq_params = _params_on(model_in.packed_seq_params, self.device)
            real_tokens = None
            if self.router_metrics is not None:
                real_tokens = local(real_token_mask(model_in)).to(self.device)
            mb_routes = None
            if routes is not None or route_tokens:
                # [B, S, L, k] host columns -> this rank's tokens, in the order its routers see them
                order = self.route_replay.router_order
                own = None if routes is None else order(local(model_in.from_host_layout(routes[rows], NO_ROUTE)))
                mb_routes = RouteTargets.of(own, order(local(~real_token_mask(model_in))), self.device)
            micro_batches.append(
                _MicroBatch(
                    inputs=model_in,
                    model_input_ids=local(model_in.input_ids).to(self.device),
                    model_position_ids=local(model_in.position_ids).to(self.device),
                    targets=targets,
                    rows=rows,
                    response=sliced,
                    cp_split=split,
                    real_tokens=real_tokens,
                    routes=mb_routes,
                )
            )
        return micro_batches, shape

    def _context_split(self, model_in: ModelInputs) -> ContextParallelSplit | None:
        from megatron.core import parallel_state as ps

        cp = self.parallel.context
        if cp == 1:
            return None
        rank = ps.get_context_parallel_rank()
        if model_in.packed_seq_params is None:
            return ContextParallelSplit.for_padded(model_in.input_ids.shape[1], rank, cp)
        cu = model_in.packed_seq_params.cu_seqlens_q_padded.tolist()
        return ContextParallelSplit(tuple(b - a for a, b in zip(cu[:-1], cu[1:])), rank, cp)

    # -- model call -------------------------------------------------------------------------------

    def _forward_fn(self, temperature: float, with_entropy: bool, record_routes: bool = False) -> Callable:
        processor = LogprobOutputProcessor(
            temperature=temperature,
            with_entropy=with_entropy,
            logits_chunk_bytes=self.logits_chunk_bytes,
            fused=self.fused_logprobs,
        )

        def per_token(out) -> torch.Tensor:
            # the schedules pass one tensor to the loss function: stack logprobs and entropy
            parts = [out.logprobs] + ([out.entropy] if out.entropy is not None else [])
            return torch.stack(parts, dim=-1)

        return self._model_call(processor, per_token, record_routes)

    def _value_forward_fn(self) -> Callable:
        """The critic's model call: per-token values [b, s] from the value head (model/value_head.py)."""
        return self._model_call(ValueOutputProcessor(), lambda out: out.values)

    def _model_call(self, processor, per_token: Callable, record_routes: bool = False) -> Callable:
        """forward(model_chunk, micro_batch) for the schedules: hidden states on inner pipeline
        stages, `per_token(processor's result)` on the last one; `record_routes`: keep the MoE routes
        each micro-batch chose (routing replay)."""

        def forward(model, mb: _MicroBatch):
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

    @staticmethod
    def _response_values(output: torch.Tensor, mb: _MicroBatch, response_length: int) -> torch.Tensor:
        """[b, s(, k)] per-token outputs -> [rows, A(, k)]: the columns predicting the last A tokens."""
        if mb.cp_split is not None:
            from megatron.core import parallel_state as ps

            output = _GatherContextParallel.apply(output, mb.cp_split, ps.get_context_parallel_group())
        if output.dim() == 2:
            output = output.unsqueeze(-1)
        columns = [mb.inputs.to_host_columns(output[..., i]) for i in range(output.shape[-1])]
        per_column = torch.stack(columns, dim=-1)  # [rows, S, k]
        total = per_column.shape[1]
        return per_column[:, total - response_length - 1 : total - 1]

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
            micro_batches, shape = self._micro_batches(
                sequences, attention_mask, batching, routes=routes, route_tokens=record
            )
        with _mark("skyrl_megatron.schedule"), self._routing(routes is not None or record):
            outputs = forward_only(
                self.chunks,
                micro_batches,
                forward_fn,
                lambda output, mb: (mb.rows, self._response_values(output.float(), mb, response_length)),
                seq_length=shape[1],
                micro_batch_size=shape[0],
            )
        if record:
            with _mark("skyrl_megatron.record_routes"):
                record_routes.put(sequences, attention_mask, self._recorded_host_routes(micro_batches, sequences.shape))
        if not outputs:
            return None
        with _mark("skyrl_megatron.collect"):
            result = torch.zeros(sequences.shape[0], response_length, width, dtype=torch.float32)
            for rows, values in outputs:
                result[rows] = values.cpu()
        return result

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
    ) -> dict[str, float]:
        """Forward + backward of one mini-batch with the policy objective; returns its metrics summed
        over micro-batches and DP ranks (each micro-batch's metrics are already its share of the
        mini-batch). `routes` [B, S, L, k] (host columns): MoE routes every micro-batch replays (an
        attached `route_replay`)."""

        def loss(values: torch.Tensor, mb: _MicroBatch, totals: MiniBatchTotals):
            return objective(values[..., 0], values[..., 1], mb.response, totals)

        # the host always reports policy_entropy
        forward_fn = self._forward_fn(temperature, with_entropy=True)
        return self._train(sequences, attention_mask, response, batching, forward_fn, loss, dp_group, routes)

    def train_value_mini_batch(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response: Mapping[str, torch.Tensor],
        objective: ValueObjective,
        batching: MicroBatching,
        *,
        dp_group=None,
    ) -> dict[str, float]:
        """Forward + backward of one critic mini-batch with the host's value loss (`response` holds
        `loss_mask`, old `values` and `returns`, [B, A]); metrics as for `train_mini_batch`."""

        def loss(values: torch.Tensor, mb: _MicroBatch, totals: MiniBatchTotals):
            return objective(values[..., 0], mb.response, totals)

        return self._train(sequences, attention_mask, response, batching, self._value_forward_fn(), loss, dp_group)

    def _train(self, sequences, attention_mask, response, batching, forward_fn, micro_batch_loss, dp_group,
               routes: torch.Tensor | None = None):
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
            micro_batches, shape = self._micro_batches(sequences, attention_mask, batching, response, routes)
        # Megatron divides each micro-batch loss by their number and averages gradients over DP;
        # our losses are already shares of the whole mini-batch, so undo both.
        dp_size = ps.get_data_parallel_world_size()
        scale = len(micro_batches) * dp_size

        def loss_fn(output, mb: _MicroBatch):
            with _mark("skyrl_megatron.loss"):
                values = self._response_values(output.float(), mb, response_length)
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
        with _mark("skyrl_megatron.metrics"):
            return _sum_metrics(per_micro_batch, dp_group, self.device)

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

    def _recorded_host_routes(self, micro_batches: list[_MicroBatch], batch_shape) -> torch.Tensor:
        """The routes recorded per micro-batch -> [B, S, L, k] in the host's columns (this rank's
        route layers; gathered over SP and CP, so every rank of a stage holds whole rows)."""
        from megatron.core import parallel_state as ps

        replay = self.route_replay
        dtype = route_dtype(int(replay.config.num_moe_experts) - 1)
        out = torch.full((*batch_shape, replay.num_layers, replay.topk), NO_ROUTE, dtype=dtype)
        for mb in micro_batches:  # the same order on every rank: the gathers below pair up
            local_shape = mb.model_input_ids.shape
            routes = replay.model_order(mb.recorded, (local_shape[0], local_shape[1]))
            if mb.cp_split is not None:
                routes = mb.cp_split.gather(routes, ps.get_context_parallel_group(), dim=1)
            if mb.rows.numel():
                out[mb.rows] = mb.inputs.to_host_layout(routes.cpu(), NO_ROUTE).to(dtype)
            mb.recorded = None
        return out


def _params_on(params, device):
    """PackedSeqParams with its index tensors on `device` (attention kernels read them there)."""
    import dataclasses

    moved = {
        f.name: getattr(params, f.name).to(device)
        for f in dataclasses.fields(params)
        if isinstance(getattr(params, f.name), torch.Tensor)
    }
    return dataclasses.replace(params, **moved)


def _sum_metrics(per_micro_batch: list[dict], dp_group, device) -> dict[str, float]:
    """Sum micro-batch metrics, then over DP ranks; broadcast from the last pipeline stage."""
    from megatron.core import parallel_state as ps

    names = sorted({k for m in per_micro_batch for k in m})
    # every rank must agree on the metric names for the collectives below: take them from the
    # last stage, where the loss function ran
    names_list = [names]
    last = ps.get_pipeline_model_parallel_last_rank()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(names_list, src=last, group=ps.get_pipeline_model_parallel_group())
    names = names_list[0]
    totals = torch.zeros(len(names), dtype=torch.float64, device=device)
    for m in per_micro_batch:
        for i, name in enumerate(names):
            if name in m:
                totals[i] += m[name].to(torch.float64)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(totals, src=last, group=ps.get_pipeline_model_parallel_group())
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(totals, group=dp_group)
    return {name: float(value) for name, value in zip(names, totals)}
