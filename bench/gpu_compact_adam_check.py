"""AdamW over compact master weights on one GPU: today's chain against the one-pass step, timed and checked.

Today's optimizer step over compact masters (`megatron_config.compact_master_weights`) joins each run's fp32
masters (`CompactMasterWeights.rebuild`), runs torch's fused AdamW over them (the clip's divisor and the skip flag
on the device, as `optim._step_then_read` passes them) and releases them through the split that writes the bf16
weights (`round_into_models`). `compact_adam.queue_run_step` does the same update in one Triton pass per run,
without the fp32 masters. This script lays out a model's parameters as Megatron's DDP buffer does (the shapes of
`gpu_master_weights_check.py`: 64-element starts, the last parameter first), runs both from the same masters,
gradients and moments for `--steps` steps, and reports:

- the seconds per step of each (median after one untimed step; the device synchronised around each);
- the one pass against its eager definition (`compact_adam.adam_step_reference` on fp32 copies, on the GPU):
  masters and moments bit for bit, over the first `--check-runs` runs;
- the one pass against torch's AdamW (fused on GPUs) after every step: how many masters differ and by how much
  (the two round differently: torch's kernel may contract multiplies and adds, ours does not; its CPU path takes
  the moments through lerp and addcmul).

    python bench/gpu_compact_adam_check.py --model Qwen3-30B-A3B --layers 2 --out $OUT/compact_adam_moe.json
    python bench/gpu_compact_adam_check.py --model Qwen3-1.7B --out $OUT/compact_adam_dense.json
    python bench/gpu_compact_adam_check.py --smoke --out /tmp/compact_adam.json      # CPU, tiny, eager
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_master_weights_check import SMOKE_CONFIG, make_pairs, parameter_sizes, shape_config  # noqa: E402

from skyrl_megatron import compact_adam, master_weights  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 1e-8, 0.1


_VECTOR_SIZES: set[int] = set()  # the norms' sizes (hidden, head_dim) of the shape being run


def _group(master: torch.Tensor) -> int:
    """0: decayed (matrices), 1: not (the norms' vectors), as Megatron's default groups split them."""
    return 1 if master.numel() in _VECTOR_SIZES else 0


def _scalars(step: int) -> list[compact_adam.AdamScalars]:
    return [compact_adam.AdamScalars(LR, *BETAS, EPS, WEIGHT_DECAY, step),
            compact_adam.AdamScalars(LR, *BETAS, EPS, 0.0, step)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gradients(pairs, seed: int = 1) -> list[torch.Tensor]:
    """One fp32 gradient per parameter, as views of one buffer laid out like the model's (Megatron's gradient
    buffer)."""
    device = pairs[0][1].device
    end = max(model.storage_offset() + model.numel() for _, model in pairs)
    buffer = torch.randn(end, generator=torch.Generator(device=device).manual_seed(seed), device=device) * 1e-3
    return [buffer[model.storage_offset() : model.storage_offset() + model.numel()] for _, model in pairs], buffer


class Chain:
    """Today's step: rebuild, torch's fused AdamW, the release writing the weights."""

    def __init__(self, pairs, grads):
        self.pairs, self.grads = pairs, grads
        self.compact = master_weights.CompactMasterWeights(pairs)
        self.compact.release()  # each run gathered into its buffer and released whole: a steady-state step follows
        masters = [master for master, _ in pairs]
        groups = [{"params": [m for m in masters if _group(m) == g], "weight_decay": wd}
                  for g, wd in ((0, WEIGHT_DECAY), (1, 0.0))]
        self.adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR, betas=BETAS, eps=EPS,
                                      fused=pairs[0][1].is_cuda)

    def step(self, skip: torch.Tensor, scale: torch.Tensor) -> None:
        self.compact.rebuild()
        for (master, _), grad in zip(self.pairs, self.grads):
            master.grad = grad
        if self.pairs[0][1].is_cuda:
            self.adam.found_inf, self.adam.grad_scale = skip, scale
        with self.compact.writing_models():
            self.adam.step()
            self.compact.round_into_models(0)
        self.compact.release()

    def masters(self) -> list[torch.Tensor]:
        with self.compact.materialised(read_only=True):
            return [master.detach().clone() for master, _ in self.pairs]


class OnePass:
    """The one-pass step: per run its remainder, tie list and moment buffers, stepped by `queue_run_step`."""

    def __init__(self, pairs, grad_buffer):
        self.pairs = pairs
        self.compact = master_weights.CompactMasterWeights(pairs)
        self.compact.release()
        self.compact.rebuild()
        self.compact.release()
        device = pairs[0][1].device
        self.runs = []
        for run in self.compact._runs:
            piece = run.piece
            spans = [(m.offset, m.offset + m.numel, _group(m.master)) for m in run.members]
            start = run.model.storage_offset()
            grad = grad_buffer[start : start + run.span]
            self.runs.append((run, piece, compact_adam.run_layout(spans, device), grad,
                              torch.zeros(run.span, device=device), torch.zeros(run.span, device=device)))
        self.step_count = 0

    def step(self, skip: torch.Tensor, scale: torch.Tensor) -> None:
        self.step_count += 1
        hyper = compact_adam.scalar_table(_scalars(self.step_count), self.pairs[0][1].device)
        queued = [compact_adam.queue_run_step(run.model, piece.remainder, piece.tie_indices, grad, avg, avg_sq,
                                              layout, hyper, skip, scale)
                  for run, piece, layout, grad, avg, avg_sq in self.runs]
        for (run, piece, *_), (remainder, ties) in zip(self.runs, compact_adam.settle(queued)):
            piece.remainder, piece.tie_indices = remainder, ties

    def masters(self) -> list[torch.Tensor]:
        with self.compact.materialised(read_only=True):
            return [master.detach().clone() for master, _ in self.pairs]


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def check_against_reference(pairs, grad_buffer, runs: int, device: torch.device) -> dict:
    """The one pass over the first `runs` runs against `adam_step_reference` on fp32 copies: bit for bit."""
    one_pass = OnePass(pairs, grad_buffer)
    exact, checked = True, 0
    for run, piece, layout, grad, avg, avg_sq in one_pass.runs[:runs]:
        fp32 = master_weights.join_master(run.model, piece.remainder, piece.tie_indices).clone()
        ref_avg, ref_sq = avg.clone(), avg_sq.clone()
        hyper = compact_adam.scalar_table(_scalars(1), device)
        skip, scale = torch.zeros((), device=device), torch.full((), 1.25, device=device)
        compact_adam.adam_step_reference(fp32, grad, ref_avg, ref_sq, layout.spans, hyper, skip, scale)
        (remainder, ties), = compact_adam.settle([compact_adam.queue_run_step(
            run.model, piece.remainder, piece.tie_indices, grad, avg, avg_sq, layout, hyper, skip, scale)])
        joined = master_weights.join_master(run.model, remainder, ties)
        exact = exact and torch.equal(joined.view(torch.int32), fp32.view(torch.int32)) \
            and torch.equal(avg, ref_avg) and torch.equal(avg_sq, ref_sq)
        checked += run.span
    return {"runs_checked": min(runs, len(one_pass.runs)), "elements_checked": checked, "bitwise": exact}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen3-30B-A3B", help="a shape in examples/megatron/model_configs")
    parser.add_argument("--layers", type=int, help="layers of that shape (default: all)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--check-runs", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model (the eager step)")
    parser.add_argument("--out", type=Path, default=Path("compact_adam.json"))
    args = parser.parse_args(argv)

    device = torch.device("cpu" if args.smoke else "cuda")
    config = SMOKE_CONFIG if args.smoke else shape_config(args.model, args.layers)
    sizes = parameter_sizes(config)
    _VECTOR_SIZES.update({config["hidden_size"], config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]})
    report = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU", "torch": torch.__version__,
              "model": "tiny" if args.smoke else args.model, "layers": config["num_hidden_layers"],
              "tensors": len(sizes), "elements": sum(sizes), "steps": args.steps}

    pairs = make_pairs(sizes, device, "ddp")
    grads, grad_buffer = _gradients(pairs)
    report["reference"] = check_against_reference(pairs, grad_buffer, args.check_runs, device)
    del pairs

    # the skip flag and the clip's divisor as the product passes them (no clip: a divisor of 1 leaves the gradient
    # bitwise, so torch's write-back of the unscaled gradient changes nothing the other side reads)
    skip, scale = torch.zeros((), device=device), torch.ones((), device=device)
    sides = {"chain": Chain(*_pair_and_grads(sizes, device, grad_buffer)),
             "one_pass": OnePass(make_pairs(sizes, device, "ddp"), grad_buffer)}
    seconds = {name: [] for name in sides}
    differing, worst = [], 0.0
    for _ in range(args.steps + 1):
        for name, side in sides.items():
            _synchronize(device)
            start = time.perf_counter()
            side.step(skip, scale)
            _synchronize(device)
            seconds[name].append(time.perf_counter() - start)
        theirs, ours = sides["chain"].masters(), sides["one_pass"].masters()
        differing.append(sum(int((a.view(torch.int32) != b.view(torch.int32)).sum()) for a, b in zip(theirs, ours)))
        worst = max([worst] + [_max_difference(a, b) for a, b in zip(theirs, ours)])
        del theirs, ours
    report["runs_of_masters"] = len(sides["one_pass"].runs)
    report["step_s"] = {name: statistics.median(times[1:]) for name, times in seconds.items()}
    report["first_step_s"] = {name: times[0] for name, times in seconds.items()}
    report["against_torch_adamw"] = {"differing_masters_per_step": differing, "elements": sum(sizes),
                                     "max_abs_difference": worst, "max_abs_difference_over_lr": worst / LR}
    if device.type == "cuda":
        report["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if report["reference"]["bitwise"] else 1


def _pair_and_grads(sizes, device, grad_buffer):
    pairs = make_pairs(sizes, device, "ddp")
    grads = [grad_buffer[model.storage_offset() : model.storage_offset() + model.numel()] for _, model in pairs]
    return pairs, grads


if __name__ == "__main__":
    sys.exit(main())
