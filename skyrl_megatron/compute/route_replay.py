"""MoE routing replay: the experts chosen while scoring are the experts trained through.

An MoE router picks each token's top-k experts from its logits. Two forward passes over the same
tokens with the same weights can still pick differently when logits are near-tied: a different
micro-batch composition, kernel or dtype moves a logit by an ulp and a token goes to another
expert. The policy's first training step then sees log-probs that differ from the old log-probs it
scored, and its importance ratio is not 1 even though no weight changed. Replay removes that:

* **R2** (``moe_config.routing_replay: r2``): the policy's scoring pass (``forward``, the old
  log-probs) *records* the top-k expert indices of every token in every MoE layer; every training
  micro-batch of that step *replays* them instead of choosing again.
* **R3** (``r3``): the routes come from the inference engine that sampled the tokens; scoring
  replays them (:func:`engine_routes` maps an engine's per-row routes onto a rank's layers) and
  records every token's routes as R2 does, and training replays what scoring recorded. An engine
  routes the tokens it forwards: the prompt and every sampled token but the last (never fed back).
  Tokens without an engine route (that last one, a token the host appended) are routed by scoring
  as usual, and training replays scoring's choice for them too: such a token's own output predicts
  nothing that is trained, so only the two passes agreeing matters (the expert token counts set GEMM
  shapes, and with them the last bits of every token). skyrl 0.4 carries the routes from engine to
  trainer (``rollout_expert_indices``); skyrl-train 0.3.1 has no way to (its vLLM/SGLang engines
  return none, its generator keeps only tokens and logprobs), so the config refuses ``r3`` there.

It builds on Megatron-Core's hook for this: ``topk_routing_with_score_function`` asks the router's
``router_replay`` object for the top-k (``get_replay_topk``), handing it the default selection.
:class:`RouteReplay` puts one :class:`_LayerReplay` on every router of this rank's model chunks
(per model, not Megatron's process-wide registry, so a policy and a reference model in one process
stay apart). Replayed probabilities are the router's own scores gathered at the recorded indices,
in the recorded order: with the same routes, the same arithmetic as the recorded pass.

Recording is replay with nothing to replay: every real token chooses as usual, and each router
keeps what it used. Padding (alignment, or equal shapes across ranks) takes a fixed route in every
pass: it reaches no real token, but the experts' token counts set the GEMM shapes, and with them the
last bits of the real tokens' results.

Routes are data that travel with the batch. Recorded routes are mapped back to the host's [B, S]
columns (through the same CP gather and packing maps as the log-probs) and kept per row, keyed by
the row's real tokens (:class:`RouteStore`), since the training micro-batch plan, packing and CP
shards need not be the scoring ones; the trainer looks them up for its rows and they go through the
same row slicing, packing and CP/SP split as the tokens (``compute/microbatch/``).

Activation recompute runs a router again in the backward pass; micro-batches are recomputed in the
order they ran forward (per model chunk), so each router keeps the routes it replayed in a queue
and a call from inside the backward pass takes the oldest.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from skyrl_megatron.host_copies import to_device
from skyrl_megatron.model.moe.settings import routers

NO_ROUTE = -1  # a real token without a route: routed as usual


def _in_backward_pass() -> bool:
    """Whether the autograd engine is running a backward pass (activation recompute calls in it)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class RouteTargets:
    """What one forward's routers follow, in the order they see tokens."""

    routes: torch.Tensor | None  # [tokens, k] (one layer's) or [tokens, L, k]; None: choose for every real token
    padding: torch.Tensor  # [tokens] bool
    some_to_choose: bool  # a real token without a route (NO_ROUTE), or routes None
    some_padding: bool

    @classmethod
    def of(cls, routes: torch.Tensor | None, padding: torch.Tensor, device) -> "RouteTargets":
        """From host-side tensors (the flags are read there, before the copy to `device`, which does not wait for it)."""
        real = ~padding
        if routes is None:
            some_to_choose = bool(real.any())
        else:
            some_to_choose = bool(((routes[..., 0] == NO_ROUTE).any(dim=1) & real).any())
        return cls(
            routes=None if routes is None else to_device(routes, device),
            padding=to_device(padding, device),
            some_to_choose=some_to_choose,
            some_padding=bool(padding.any()),
        )

    def layer(self, index: int) -> "RouteTargets":
        return RouteTargets(
            None if self.routes is None else self.routes[:, index], self.padding, self.some_to_choose, self.some_padding
        )


class _LayerReplay:
    """One router's replay state; Megatron calls :meth:`get_replay_topk` through `router.router_replay`.

    While active, every forward gets a target per token: a route to replay, NO_ROUTE (choose as
    usual, e.g. a token that was never routed before) or padding. Padding (alignment and
    equal-shape padding of the model layout) takes a fixed route, the same in every pass: it
    reaches no real token, but how many tokens each expert gets decides the expert GEMMs' shapes,
    and with them the last bits of the real tokens' results.
    """

    def __init__(self, layer: int):
        self.layer = layer  # index into this rank's route layers
        self.active = False
        self.training = False  # training forwards may be recomputed in the backward pass
        self.recorded: torch.Tensor | None = None  # [tokens, k] the last forward used
        self.target: RouteTargets | None = None  # for the next forward
        self.for_recompute: deque[RouteTargets] = deque()  # each training forward's, oldest first

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if not self.active:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if _in_backward_pass():
            if not self.for_recompute:
                raise RuntimeError(f"routing replay: MoE layer {self.layer} was recomputed without a replayed forward")
            targets = self.for_recompute.popleft()
        else:
            if self.target is None:
                raise RuntimeError(f"routing replay: no routes set for MoE layer {self.layer}")
            targets = self.target
            self.target = None  # one forward per target: a stale one must never be replayed
            if self.training:  # (recomputed forwards first run under no_grad: not a test of training)
                self.for_recompute.append(targets)
        routes, padding = targets.routes, targets.padding
        tokens, device = scores.shape[0], scores.device
        if padding.shape != (tokens,) or (routes is not None and routes.shape != (tokens, topk)):
            raise RuntimeError(
                f"routing replay: MoE layer {self.layer} routes {tokens} tokens to {topk} experts, but the "
                f"replayed routes are {None if routes is None else tuple(routes.shape)} for {padding.shape[0]} tokens"
            )
        padding = padding.to(device)
        if routes is None:
            routes = torch.full((tokens, topk), NO_ROUTE, dtype=torch.long, device=device)
        routes = routes.to(device=device, dtype=torch.long)
        # the flags come from the host side: no device sync per layer
        if targets.some_to_choose:
            choose = (routes[:, 0] == NO_ROUTE) & ~padding
            _, chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            routes = torch.where(choose.unsqueeze(1), chosen, routes)
        if targets.some_padding:
            # k distinct experts per padding token, spread over all experts
            spread = torch.arange(tokens, device=device).unsqueeze(1) + torch.arange(topk, device=device)
            spread = spread % scores.shape[1]
            routes = torch.where(padding.unsqueeze(1), spread, routes)
        if not _in_backward_pass():
            self.recorded = routes.detach()
        return scores.gather(1, routes), routes


class RouteReplay:
    """Record and replay switches for every router of this rank's model chunks.

    Route layers are this rank's MoE routers in chunk order (under PP a stage holds its own layers,
    and its routes concern only those).
    """

    def __init__(self, chunks: list[torch.nn.Module]):
        from megatron.core.utils import get_model_config

        self.chunks = chunks
        self.config = get_model_config(chunks[0])
        self._chunk_index = {id(chunk): index for index, chunk in enumerate(chunks)}
        self.layers: list[_LayerReplay] = []
        self._chunk_layers: list[list[_LayerReplay]] = [[] for _ in chunks]
        moe_layers = _moe_layer_numbers(self.config)
        self.moe_layer_count = len(moe_layers)
        self.rollout_columns: list[int | None] = []  # each route layer's place among the model's MoE layers
        self.decoder_columns: list[int | None] = []  # ... and among all its decoder layers (0-based)
        for index, router in routers(chunks):
            self.rollout_columns.append(None if router.is_mtp_layer else moe_layers.index(router.layer_number))
            self.decoder_columns.append(None if router.is_mtp_layer else router.layer_number - 1)
            layer = _LayerReplay(len(self.layers))
            router.router_replay = layer
            self.layers.append(layer)
            self._chunk_layers[index].append(layer)
        self.topk = int(self.config.moe_router_topk or 0)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def activate(self, active: bool, training: bool = False) -> None:
        """Routers follow the targets of each forward (True) or choose as usual (False); in
        `training` they keep each forward's targets for activation recompute."""
        for layer in self.layers:
            layer.active = active
            layer.training = active and training
            layer.recorded = layer.target = None
            layer.for_recompute.clear()

    # -- per forward ------------------------------------------------------------------------------

    def set_targets(self, chunk: torch.nn.Module, targets: RouteTargets) -> None:
        """What the next forward of `chunk` follows (routes [tokens, L, k] of this rank's route layers)."""
        for layer in self._chunk_layers[self._chunk_index[id(chunk)]]:
            layer.target = targets.layer(layer.layer)

    def take_recorded(self, chunk: torch.nn.Module) -> dict[int, torch.Tensor]:
        """{route layer: [tokens, k]} recorded by the last forward of `chunk`."""
        taken = {}
        for layer in self._chunk_layers[self._chunk_index[id(chunk)]]:
            if layer.recorded is None:
                raise RuntimeError(f"routing replay: MoE layer {layer.layer} recorded nothing in its forward")
            taken[layer.layer] = layer.recorded
            layer.recorded = None
        return taken


def _moe_layer_numbers(config) -> list[int]:
    """The 1-based numbers of the decoder's MoE layers (Megatron's `moe_layer_freq`: every n-th, or a 0/1 list)."""
    freq = config.moe_layer_freq
    pattern = [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe]


def engine_columns(replay: RouteReplay, engine_layers: int) -> torch.Tensor:
    """Which of an engine's route layers each of this rank's route layers reads.

    An engine reports either one column per MoE layer (our HF engine: its routers') or one per
    decoder layer (vLLM, dense layers included, whose columns no router reads); the two agree when
    every layer is MoE.
    """
    if any(column is None for column in replay.rollout_columns):
        raise ValueError("routing replay r3: multi-token-prediction layers have no engine routes")
    if engine_layers == replay.moe_layer_count:
        return torch.tensor(replay.rollout_columns, dtype=torch.long)
    if engine_layers == int(replay.config.num_layers):
        return torch.tensor(replay.decoder_columns, dtype=torch.long)
    raise ValueError(
        f"routing replay r3: the engine's routes have {engine_layers} layers, but the model has "
        f"{replay.moe_layer_count} MoE layers of {replay.config.num_layers} (is the engine serving this model?)"
    )


def engine_routes(
    segments: Sequence, captured: Sequence[torch.Tensor], attention_mask: torch.Tensor, replay: RouteReplay
) -> list[torch.Tensor]:
    """R3: an inference engine's routes -> this rank's route layers per row, [real tokens, L, k].

    Per row, `segments[i]` holds routes [n, engine layers, k] for the row's first n real tokens
    (n at most the row's real tokens) and `captured[i]` [real tokens] bool says which real tokens
    the engine routed (a prefix: skyrl 0.4's `router_padding_mask`, negated, at the real columns).
    A token the engine did not route gets NO_ROUTE: the replaying pass routes it as usual.
    """
    rows = []
    mask = attention_mask.bool().cpu()
    columns = None
    for i, (row, routed) in enumerate(zip(segments, captured)):
        given = torch.as_tensor(row).long()
        routed = torch.as_tensor(routed).bool().cpu()
        real = int(mask[i].sum())
        if given.dim() != 3 or given.shape[0] > real or given.shape[2] != replay.topk or routed.shape != (real,):
            raise ValueError(
                f"routing replay r3: row {i} has engine routes of shape {tuple(given.shape)} and a routed-token mask "
                f"of shape {tuple(routed.shape)} for {real} real tokens (expected [at most {real}, layers, "
                f"{replay.topk}] and [{real}])"
            )
        if columns is None:
            columns = engine_columns(replay, given.shape[1])
        out = torch.full((real, len(columns), replay.topk), NO_ROUTE, dtype=torch.int32)
        n = int(routed.sum())
        if n > given.shape[0]:
            raise ValueError(f"routing replay r3: row {i} has {n} routed tokens but engine routes for {given.shape[0]}")
        if not bool(routed[:n].all()):
            raise ValueError(f"routing replay r3: row {i}'s routed tokens are not the first {n} of its real tokens")
        out[:n] = given[:n, columns].to(torch.int32)
        rows.append(out)
    return rows


def rollout_routes(routes: Sequence, attention_mask: torch.Tensor, replay: RouteReplay) -> list[torch.Tensor]:
    """R3 from bare per-row engine routes ([n, layers, k] for each row's first n real tokens, as an
    engine returns them): :func:`engine_routes` with the first n real tokens routed."""
    mask = attention_mask.bool().cpu()
    captured = [torch.arange(int(m.sum())) < len(row) for row, m in zip(routes, mask)]
    return engine_routes(routes, captured, attention_mask, replay)


# -- routes per row, in the host's columns ----------------------------------------------------------


def route_dtype(largest_expert: int) -> torch.dtype:
    """The smallest signed type for routes (NO_ROUTE included): [tokens, L, k] adds up over many layers."""
    return torch.int16 if largest_expert < 2**15 else torch.int32


def row_keys(sequences: torch.Tensor, attention_mask: torch.Tensor) -> list[bytes]:
    """A key per row from its real tokens (the same row under any padding has the same key)."""
    mask = attention_mask.bool()
    return [
        hashlib.blake2b(row[m].to(torch.int64).numpy().tobytes(), digest_size=16).digest()
        for row, m in zip(sequences.cpu(), mask.cpu())
    ]


@dataclass
class RouteStore:
    """Routes of scored rows, by the rows' real tokens: [real tokens, L, k] each (int16 or int32).

    Identical rows are kept in the order they were scored and matched in the order they are
    looked up, so a batch whose rows keep their relative order gets back exactly its own routes.
    """

    rows: dict[bytes, list[torch.Tensor]] = field(default_factory=dict)

    def clear(self) -> None:
        self.rows.clear()

    def __len__(self) -> int:
        return sum(len(v) for v in self.rows.values())

    def put(self, sequences: torch.Tensor, attention_mask: torch.Tensor, routes: torch.Tensor) -> None:
        """`routes` [B, S, L, k] in the host's columns; the real tokens' routes are kept."""
        dtype = route_dtype(int(routes.max()) if routes.numel() else 0)
        mask = attention_mask.bool().cpu()
        for key, row_routes, m in zip(row_keys(sequences, attention_mask), routes.cpu(), mask):
            self.rows.setdefault(key, []).append(row_routes[m].to(dtype))

    def lookup(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """Each row's routes [real tokens, L, k]; KeyError naming the first row never scored."""
        seen: dict[bytes, int] = {}
        found = []
        for i, key in enumerate(row_keys(sequences, attention_mask)):
            stored = self.rows.get(key)
            if not stored:
                raise KeyError(
                    f"routing replay: row {i} of the training batch was not scored by this worker's forward "
                    "(the routes recorded while scoring old log-probs are keyed by each row's tokens)"
                )
            occurrence = seen.get(key, 0)
            seen[key] = occurrence + 1
            found.append(stored[min(occurrence, len(stored) - 1)])
        return found


def host_columns(routes: Sequence[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-row routes [real tokens, L, k] -> [B, S, L, k] at the rows' real columns, NO_ROUTE elsewhere."""
    mask = attention_mask.bool().cpu()
    if not routes:
        return torch.full((*mask.shape, 0, 0), NO_ROUTE, dtype=torch.int16)
    layers, k = routes[0].shape[1:]
    largest = max(int(r.max()) if r.numel() else 0 for r in routes)
    out = torch.full((*mask.shape, layers, k), NO_ROUTE, dtype=route_dtype(largest))
    for i, row_routes in enumerate(routes):
        real = int(mask[i].sum())
        if real != row_routes.shape[0]:
            raise ValueError(f"routing replay: row {i} has {real} real tokens but {row_routes.shape[0]} routes")
        out[i, mask[i]] = row_routes.to(out.dtype)
    return out


def training_routes(store: RouteStore, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    engine_rows: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The routes training replays for a batch's rows, [B, S, L, k] in the host's columns, resolved once
    for all its rows (the mini-batches slice it).

    R2 (`engine_rows` None): what this step's scoring recorded for each row (`store`, by the row's tokens;
    a row never scored is an error). R3: the engine's routes of each row (`engine_routes`: each row its
    own, also for rows with the same tokens), and where the engine gave none, the route scoring chose.
    Scoring replayed exactly the engine's routes, so training replays exactly what scoring used. Where
    nothing was scored (a loss on rollout logprobs alone) the engine's routes stand and the tokens it
    did not route are routed as usual."""
    if engine_rows is None:
        try:
            rows = store.lookup(sequences, attention_mask)
        except KeyError as missing:
            raise RuntimeError(
                f"{missing.args[0]}; with megatron_config.moe_config.routing_replay=r2 the policy's forward must "
                "score the rows of a step before training on them"
            ) from None
        return host_columns(rows, attention_mask)
    try:
        scored = store.lookup(sequences, attention_mask)
    except KeyError:
        scored = None
    for given, chosen in zip(engine_rows, scored or ()):
        unrouted = given[:, :, 0] == NO_ROUTE
        given[unrouted] = chosen.to(given.dtype)[unrouted]
    return host_columns(engine_rows, attention_mask)
