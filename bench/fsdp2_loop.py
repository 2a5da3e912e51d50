"""A plain FSDP2 training loop written for speed: the third side of bench/policy_bench.py (`fsdp2_loop`).

What a user would write by hand with the same kernels as the host's FSDP2 workers at their best, without
a framework around it: an HF transformers model, `fully_shard` per decoder layer and at the root (fp32
master weights, bf16 compute, fp32 gradient reduction), the RL batch's rows packed first-fit-decreasing
into micro-batches of a token budget (our planner's `plan_micro_batches`; each micro-batch one sequence,
positions restarting per row), varlen attention registered in transformers' attention interface
(on GPU flash-attn-4's `flash_attn.cute.flash_attn_varlen_func` where the bench runs ours on it, else
flash-attn's `flash_attn_varlen_func`, the stand-in where flash-attn has no CUDA build; on CPU, SDPA row by
row, for the smoke test), the output layer only at the positions that predict response tokens,
logprobs through flash-attn's Triton cross entropy where it imports (else a chunked log_softmax gather),
the PPO clipped loss averaged over the batch's response tokens, fused AdamW, no activation recompute.
Scoring packs 4x the training budget (no activations are kept for backward).

`measure` is one rank's whole run (launched by `skyrl_megatron.testing.run_on_ranks`, world 1 or DP):
`warmup + steps` steps of one scoring pass and one training step, each phase timed between device
synchronisations, with its peak allocated memory.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ATTENTION = "plain_loop_varlen"  # our name in transformers' AttentionInterface
SCORING_BUDGET_FACTOR = 4
CLIP_EPS = 0.2
LOGPROB_CHUNK = 4096  # tokens per log_softmax chunk of the torch fallback


@dataclass(frozen=True)
class LoopSettings:
    model_dir: str
    token_budget: int  # training micro-batches: at most this many tokens (scoring: 4x)
    prompt_tokens: int  # the batch's response columns start here (the host's layout)
    steps: int = 1
    warmup: int = 0
    lr: float = 1e-6
    max_grad_norm: float = 1.0
    flash_attn_site: str | None = None  # put first on sys.path (the stand-in) before flash_attn imports
    attention_kernel: str = "flash2"  # on GPU: "flash4" (flash-attn-4's varlen kernels) or "flash2"
    profile_phase: str | None = None  # one more step profiled: "step" (scoring + training), "forward" or "train"
    profile_heading: str = ""  # the report's first line
    profile_file: str | None = None  # rank 0 writes the report there


@dataclass
class Row:
    tokens: torch.Tensor  # the row's real tokens
    response_start: int  # index in `tokens` of the first response token
    advantages: torch.Tensor  # one per response token


@dataclass
class MicroBatch:
    """Rows packed into one sequence; `predict` are the positions whose next token is a response token."""

    rows: list[int]
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting per row
    cu_seqlens: torch.Tensor  # [rows + 1] int32
    max_length: int
    predict: torch.Tensor  # [N] positions in the packed sequence
    labels: torch.Tensor  # [N] the response tokens
    advantages: torch.Tensor  # [N]
    row_sizes: list[int]  # response tokens per row, to split [N] back per row


@dataclass
class Measurement:
    seconds: dict[str, list[float]] = field(default_factory=lambda: {"forward": [], "train": []})
    peak_gib: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "train": 0.0})
    losses: list[float] = field(default_factory=list)
    path: dict = field(default_factory=dict)
    profile: dict | None = None  # the profiled step's summary (gpu_idle.write_profile_report)


# ----------------------------------------------------------------------------------------------
# The batch: host rows -> this rank's rows -> packed micro-batches
# ----------------------------------------------------------------------------------------------


def host_rows(batch: dict[str, torch.Tensor], prompt_tokens: int) -> list[Row]:
    """Each row's real tokens out of the host's left-padded prompt / right-padded response columns."""
    rows = []
    for sequence, mask, advantages, loss_mask in zip(batch["sequences"], batch["attention_mask"],
                                                     batch["advantages"], batch["loss_mask"]):
        prompt = int(mask[:prompt_tokens].sum())
        response = int(loss_mask.sum())
        rows.append(Row(sequence[mask.bool()], prompt, advantages[:response].float()))
    return rows


def rank_rows(lengths: list[int], world: int, rank: int) -> list[int]:
    """This rank's row indices: longest first onto the least-loaded rank, so ranks hold similar token counts."""
    load, owner = [0] * world, {}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + lengths[i]
    return [i for i in range(len(lengths)) if owner[i] == rank]


def pack(rows: list[Row], indices: list[int], device: torch.device) -> MicroBatch:
    tokens = [rows[i].tokens for i in indices]
    lengths = [len(t) for t in tokens]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    predict = torch.cat([torch.arange(offsets[k] + rows[i].response_start - 1, offsets[k + 1] - 1)
                         for k, i in enumerate(indices)])
    input_ids = torch.cat(tokens)
    return MicroBatch(
        rows=list(indices),
        input_ids=input_ids[None].to(device),
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None].to(device),
        cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=device),
        max_length=max(lengths),
        predict=predict.to(device),
        labels=input_ids[predict + 1].to(device),
        advantages=torch.cat([rows[i].advantages for i in indices]).to(device),
        row_sizes=[len(rows[i].advantages) for i in indices],
    )


def micro_batches(rows: list[Row], indices: list[int], budget: int, device: torch.device) -> list[MicroBatch]:
    """First-fit-decreasing into micro-batches of at most `budget` tokens (our planner, the same as ours uses);
    under DP every rank runs as many (a rank with fewer adds one-row repeats of weight zero)."""
    from skyrl_megatron.compute.microbatch.plan import plan_micro_batches

    lengths = torch.tensor([len(rows[i].tokens) for i in indices])
    plan = plan_micro_batches(lengths, max_tokens=budget)
    groups = [[indices[int(k)] for k in group] for group in plan.groups]
    count = torch.tensor(len(groups), device=device)  # NCCL reduces device tensors only
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    batches = [pack(rows, group, device) for group in groups]
    while len(batches) < int(count):
        filler = pack(rows, [min(indices, key=lambda i: len(rows[i].tokens))], device)
        filler.advantages.zero_()
        filler.rows = []  # contributes nothing and is not reported
        batches.append(filler)
    return batches


# ----------------------------------------------------------------------------------------------
# Kernels: varlen attention, logprobs
# ----------------------------------------------------------------------------------------------


_KERNEL = {"name": "flash2"}  # the GPU's varlen kernel, set by `register_attention`


def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _flash4_varlen():
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention call on one packed sequence ([1, heads, T, dim]); rows end at `cu_seq_lens_q`."""
    cu_seqlens, max_length = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    if query.is_cuda:
        q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
        if _KERNEL["name"] == "flash4":
            out = _flash4_varlen()(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_length,
                                   max_seqlen_k=max_length, softmax_scale=scaling, causal=True)
            out = out[0] if isinstance(out, tuple) else out  # (out, lse) in some releases
        else:
            out = _flash_varlen()(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, softmax_scale=scaling,
                                  causal=True)
        return out[None], None  # [1, T, heads, dim]
    # CPU (the smoke test): causal SDPA row by row
    bounds = cu_seqlens.tolist()
    parts = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=True)
        for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def register_attention(kernel: str = "flash2") -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _KERNEL["name"] = kernel

    AttentionInterface.register(ATTENTION, varlen_attention)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)  # the row bounds are the mask


def _triton_cross_entropy():
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
    except ImportError:
        return None
    return cross_entropy_loss


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, inplace: bool) -> torch.Tensor:
    """log p(label) per row of `logits` [N, vocab], in fp32."""
    if logits.is_cuda and (cross_entropy := _triton_cross_entropy()) is not None:
        losses, _ = cross_entropy(logits, labels, inplace_backward=inplace)
        return -losses
    parts = [chunk.float().log_softmax(-1).gather(-1, chunk_labels[:, None])[:, 0]
             for chunk, chunk_labels in zip(logits.split(LOGPROB_CHUNK), labels.split(LOGPROB_CHUNK))]
    return torch.cat(parts)


# ----------------------------------------------------------------------------------------------
# The model and the two phases
# ----------------------------------------------------------------------------------------------


class PlainFSDP2Loop:
    def __init__(self, settings: LoopSettings, device: torch.device):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        register_attention(settings.attention_kernel)
        self.device = device
        torch.manual_seed(0)
        with device:
            model = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=torch.float32,
                                                         attn_implementation=ATTENTION)
        model.config.use_cache = False
        gpu = device.type == "cuda"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if gpu else None, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp, reshard_after_forward=False)  # the root is needed again at once
        self.model = model
        self.settings = settings
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.999),
                                           weight_decay=0.0, fused=gpu)

    def path(self) -> dict:
        gpu = self.device.type == "cuda"
        if gpu and _flash_varlen() is None:  # imports it: the attention's first call may not have run yet
            raise RuntimeError("fsdp2_loop on GPU needs flash-attn (or bench/flash_attn_standin first on sys.path)")
        flash4 = gpu and self.settings.attention_kernel == "flash4"
        if flash4:
            _flash4_varlen()  # fails here, not in the first step, where flash-attn-4 does not import
        flash = sys.modules.get("flash_attn.flash_attn_interface")
        kernel = ("SDPA per row (CPU)" if not gpu else
                  "flash-attn-4 (flash_attn.cute) varlen" if flash4 else
                  "stand-in: torch FA2 varlen" if hasattr(flash, "UnsupportedByStandIn") else
                  f"flash-attn {sys.modules['flash_attn'].__version__} varlen")
        triton = gpu and _triton_cross_entropy() is not None
        return {"transformer_engine": False, "attention": "varlen (transformers attention interface)",
                "sample_packing": True, "flash_attn": kernel,
                "logprobs": "flash-attn Triton cross entropy" if triton else "torch chunked log_softmax",
                "fsdp": "fully_shard per layer, bf16 compute, fp32 master and reduce" if gpu else "fully_shard, fp32",
                "optimizer": "AdamW (fused)" if gpu else "AdamW", "recompute": False,
                "torch_threads": torch.get_num_threads()}

    def _logprobs(self, mb: MicroBatch, inplace: bool) -> torch.Tensor:
        # logits_to_keep: the output layer only where the next token is a response token
        logits = self.model(input_ids=mb.input_ids, position_ids=mb.position_ids, logits_to_keep=mb.predict,
                            cu_seq_lens_q=mb.cu_seqlens, cu_seq_lens_k=mb.cu_seqlens, max_length_q=mb.max_length,
                            max_length_k=mb.max_length).logits
        return token_logprobs(logits[0], mb.labels, inplace)

    @torch.no_grad()
    def score(self, batches: list[MicroBatch]) -> dict[int, torch.Tensor]:
        """Each row's response-token logprobs, by row index."""
        out = {}
        for mb in batches:
            for row, logprobs in zip(mb.rows, self._logprobs(mb, inplace=False).split(mb.row_sizes)):
                out[row] = logprobs
        return out

    def train(self, batches: list[MicroBatch], old: dict[int, torch.Tensor]) -> float:
        """One optimizer step over all micro-batches: the PPO clipped loss, the mean over the whole batch's
        response tokens (every rank's); returns that loss before the step."""
        tokens = torch.tensor(float(sum(sum(mb.row_sizes) for mb in batches if mb.rows)), device=self.device)
        dist.all_reduce(tokens)
        scale = dist.get_world_size() / tokens  # FSDP averages gradients over ranks
        total = torch.zeros((), device=self.device)
        for mb in batches:
            logprobs = self._logprobs(mb, inplace=True)
            old_logprobs = (torch.cat([old[r] for r in mb.rows]) if mb.rows else logprobs.detach())
            ratio = torch.exp(logprobs - old_logprobs)
            clipped = ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS)
            loss = -torch.minimum(ratio * mb.advantages, clipped * mb.advantages).sum() * scale
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        return float(total) / dist.get_world_size()


# ----------------------------------------------------------------------------------------------
# One rank's run
# ----------------------------------------------------------------------------------------------


def rank_device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def build(settings: LoopSettings, batch: dict[str, torch.Tensor], rank: int, world: int):
    """The loop and this rank's scoring and training micro-batches."""
    if settings.flash_attn_site and settings.flash_attn_site not in sys.path:
        sys.path.insert(0, settings.flash_attn_site)
    device = rank_device(rank)
    loop = PlainFSDP2Loop(settings, device)
    rows = host_rows(batch, settings.prompt_tokens)
    mine = rank_rows([len(r.tokens) for r in rows], world, rank)
    scoring = micro_batches(rows, mine, SCORING_BUDGET_FACTOR * settings.token_budget, device)
    training = micro_batches(rows, mine, settings.token_budget, device)
    return loop, scoring, training


def _timed(device: torch.device, fn, *args):
    """fn(*args), its seconds between device synchronisations and its peak allocated GiB."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = fn(*args)
    if cuda:
        torch.cuda.synchronize()
    return result, time.perf_counter() - started, (torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)


def measure(rank: int, world: int, settings: LoopSettings, batch: dict[str, torch.Tensor]) -> Measurement:
    """`warmup + steps` steps of scoring then training; seconds and peaks are the slowest / largest rank's."""
    loop, scoring, training = build(settings, batch, rank, world)
    result = Measurement(path={**loop.path(), "micro_batches": {"forward": len(scoring), "train": len(training)},
                               "omp_num_threads": os.environ.get("OMP_NUM_THREADS")})
    for number in range(settings.warmup + settings.steps):
        old, forward_s, forward_gib = _timed(loop.device, loop.score, scoring)
        loss, train_s, train_gib = _timed(loop.device, loop.train, training, old)
        if number < settings.warmup:
            continue
        for phase, seconds, gib in (("forward", forward_s, forward_gib), ("train", train_s, train_gib)):
            worst = torch.tensor([seconds, gib], dtype=torch.float64, device=loop.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            result.seconds[phase].append(float(worst[0]))
            result.peak_gib[phase] = max(result.peak_gib[phase], float(worst[1]))
        result.losses.append(loss)
    if settings.profile_phase:
        result.profile = profile_step(loop, scoring, training, settings)
    return result


def profile_step(loop: PlainFSDP2Loop, scoring: list[MicroBatch], training: list[MicroBatch],
                 settings: LoopSettings) -> dict:
    """One more step with its `settings.profile_phase` under torch.profiler (after the measured steps, as the
    policy bench profiles our workers); rank 0 writes the report."""
    from torch.profiler import ProfilerActivity, profile

    import gpu_idle  # bench/, beside this file

    phase, cuda = settings.profile_phase, loop.device.type == "cuda"
    old = loop.score(scoring) if phase == "train" else None  # the training call's old logprobs, unprofiled
    profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    with profiler:
        if phase in ("step", "forward"):
            old = loop.score(scoring)
        if phase in ("step", "train"):
            loop.train(training, old)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - started
    out_file = settings.profile_file if dist.get_rank() == 0 else None
    return gpu_idle.write_profile_report(profiler, wall, settings.profile_heading, out_file)
