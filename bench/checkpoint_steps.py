"""Step times with checkpoints written synchronously and in the background (`megatron_config.async_save`).

Runs the demo (`python -m skyrl_megatron.demo --gpu --no-weight-check`: a Qwen3-0.6B-shaped policy, its
reference and the inference engine, vLLM where installed, colocated on one GPU) once per mode, saving every `--ckpt-interval` steps, and prints per mode the
median time of a step without a save, of a step with one (its `save_checkpoints` part too), and how much
longer a save step is. The first step and the first save (warm-ups) and the last step (its save is the run's final
one) are left out of the medians; the first save is reported on its own.
The second run trains the first run's model (`--model`), so the weights are written once. `--shape NAME` trains
a random-weight checkpoint of a published shape (examples/megatron/model_configs, written once by
bench/policy_bench.py's writer) instead of the demo's 0.6B-shaped one.

    python bench/checkpoint_steps.py --out $OUT            # on one GPU; a few minutes
    python bench/checkpoint_steps.py --out $OUT --shape Qwen3-4B   # Qwen3-4B's widths (random weights)
    python bench/checkpoint_steps.py --cpu --steps 8 --ckpt-interval 2   # the CPU demo (a smoke run of this script)

A disk that holds one checkpoint but not two (Qwen3-4B's 52 GiB on a 64 GiB disk): `--drop-complete` deletes
each checkpoint from this script once it is complete (the trainer's pointer names it and its files are in
place), so the next save finds room; `--scratch /dev/shm/ck` keeps the random-weight model and the conversion
cache off the disk. Neither changes what a step does: the trainer's own deletion of old checkpoints runs off
the step as well, and a background save is published once written, before the next save begins.

    python bench/checkpoint_steps.py --out $OUT --shape Qwen3-4B --drop-complete --scratch /dev/shm/ck

Writes $OUT/checkpoint_steps.json and $OUT/checkpoint_steps.md (the table), and each run's log and per-step
metrics ($OUT/<mode>.log, $OUT/<mode>_metrics.jsonl: kept when a run fails, with the steps it finished). Runs live
under `--workdir` (a checkpoint each is the run's own: 52 GiB at Qwen3-4B); two runs side by side on one machine
need a `--workdir` each, and on skyrl 0.4 the second needs its own vLLM and router ports
(`SKYRL_VLLM_START_PORT=8100`, `'generator.inference_engine.router_init_kwargs={prometheus_port: 29100}'`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

MODES = {"sync": "false", "async": "true"}


class CompleteCheckpointDropper:
    """Deletes each complete checkpoint under `root` (bench only, `--drop-complete`): one the trainer's pointer
    names or passed, whose policy directory is in place (a save in flight is still its hidden partial
    directory)."""

    def __init__(self, root: Path):
        self.root = root
        self.dropped: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="drop-complete", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        from skyrl_megatron.checkpoint.latest import read_latest, saved_steps, step_dir

        while not self._stop.wait(0.5):
            latest = read_latest(self.root)  # (written atomically: the old pointer or the new one)
            for step in saved_steps(self.root) if latest is not None else ():
                directory = step_dir(self.root, step)
                if step <= latest and (directory / "policy").is_dir():
                    aside = directory.with_name(f".{directory.name}.dropped")
                    os.rename(directory, aside)
                    shutil.rmtree(aside)
                    self.dropped.append(step)


def run_demo(run_dir: Path, mode: str, args, model: Path | None, log: Path) -> float:
    # --no-weight-check: the demo's per-step weight comparison hashes every tensor inside the host's timed step
    # (about 30 s of a 44 s Qwen3-4B step with our HF engine), which would hide what a save adds to a step
    command = [sys.executable, "-m", "skyrl_megatron.demo", "--out", str(run_dir), "--fresh", "--no-weight-check",
               "--steps", str(args.steps), "--ckpt-interval", str(args.ckpt_interval)]
    command += [] if args.cpu else ["--gpu"]
    command += ["--model", str(model)] if model else []
    command += [f"trainer.policy.megatron_config.async_save={MODES[mode]}", "trainer.hf_save_interval=-1",
                f"trainer.max_ckpts_to_keep={args.keep}", *args.overrides]
    env = dict(os.environ)
    if args.scratch:
        env["SKYRL_MEGATRON_CHECKPOINT_DIR"] = str(args.scratch / "conversion_cache")
    shutil.rmtree(run_dir, ignore_errors=True)  # (the demo's --fresh, before the dropper watches it)
    started = time.perf_counter()
    with log.open("w") as out, CompleteCheckpointDropper(run_dir / "ckpts") if args.drop_complete else nullcontext() as drop:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout, env=env)
    finished = keep_metrics(run_dir / "metrics.jsonl", args.out / f"{mode}_metrics.jsonl")
    if result.returncode != 0:
        kept = f" and {args.out / f'{mode}_metrics.jsonl'}" if finished else ""
        raise SystemExit(f"{mode} run failed (exit {result.returncode}) after {finished} finished step(s); see {log}{kept}")
    if drop is not None:
        print(f"{mode}: checkpoints deleted once complete (--drop-complete): steps {drop.dropped}", flush=True)
    return time.perf_counter() - started


def keep_metrics(metrics_file: Path, kept: Path) -> int:
    """Copy a run's per-step metrics out of its run directory (which the next run of the mode replaces); returns
    how many steps it finished (0 when it wrote none)."""
    if not metrics_file.is_file():
        return 0
    shutil.copyfile(metrics_file, kept)
    return len(step_records(kept))


def step_records(metrics_file: Path) -> dict[int, dict]:
    """The demo's training-step records by step (evaluations, which carry no global step, left out)."""
    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in records if "trainer/global_step" in r}


def step_times(metrics_file: Path, interval: int, steps: int) -> dict:
    by_step = step_records(metrics_file)

    def median(steps, key):  # a metric some steps may lack counts 0 there
        return statistics.median(by_step[s].get(key, 0.0) for s in steps)

    middle = [s for s in sorted(by_step) if 1 < s < steps]
    # the first save is a warm-up as the first step is: it allocates the pinned staging buffers, and the host's
    # first clean-up of old checkpoints starts a Ray task on each node
    first_save, *saving = [s for s in middle if s % interval == 0]
    plain = [s for s in middle if s % interval]
    if not saving or not plain:
        raise SystemExit(f"need two saves and a step without one between the first step and the last: --steps {steps}, "
                         f"--ckpt-interval {interval}")
    # the workers' account of each save (trainer_faults.py) and the host's deferred clean-up
    parts = sorted({k for s in saving for k in by_step[s] if k.startswith("timing/checkpoint_")}
                   | {"timing/cleanup_old_checkpoints"})
    breakdown = {k.removeprefix("timing/"): median(saving, k) for k in parts}
    # a background save published once written, by a later step as its training starts
    published = {s: by_step[s]["timing/checkpoint_publish"] for s in plain if "timing/checkpoint_publish" in by_step[s]}
    # the trainer's offload after a save: in the save step's record, or (skyrl-train 0.3.1) in the next step's
    after_saves = [after for s in saving if (after := _offload_after(by_step, s)) in by_step]
    normal = statistics.median(by_step[s]["timing/step"] for s in plain)
    save = statistics.median(by_step[s]["timing/step"] for s in saving)

    return {
        "normal_step_s": normal,
        "save_step_s": save,
        "save_checkpoints_s": median(saving, "timing/save_checkpoints"),
        "save_step_overhead": save / normal - 1,
        "save_breakdown_s": breakdown,
        "published_at_steps_s": published,
        "staged_gib": median(saving, "checkpoint/staged_gib"),
        # a colocated run's offloads (zero without colocation): the offload after a save parks what the save's host
        # copies hold there (lent), copying only the rest
        "offload_s": {"after_saves": median(after_saves, "offload/policy_offload_s"),
                      "other_steps": median([s for s in plain if s not in after_saves], "offload/policy_offload_s")},
        "offload_lent_gib": median(after_saves, "offload/policy_offload_lent_gib"),
        # what the policy still held on the device after its last offload in a step (a save must not add to it)
        "allocated_gib_after_offload": max(by_step[s].get("offload/policy_allocated_gib_after_offload", 0.0)
                                           for s in middle),
        "tokens_per_s": {s: by_step[s].get("throughput/tokens_per_second") for s in sorted(by_step)},
        "save_steps": saving,
        "plain_steps": plain,
        "first_save": {"step": first_save, "step_s": by_step[first_save]["timing/step"],
                       "save_checkpoints_s": by_step[first_save].get("timing/save_checkpoints", 0.0)},
    }


def _offload_after(by_step: dict[int, dict], save: int) -> int:
    """The step whose record holds the offload after the save of step `save`: the one that parked state in the
    save's copies, else the next."""
    lent = [s for s in (save, save + 1) if by_step.get(s, {}).get("offload/policy_offload_lent_gib", 0.0) > 0]
    return lent[0] if lent else save + 1


def table(results: dict) -> str:
    lines = ["| mode | normal step (s) | save step (s) | save_checkpoints (s) | of which (s) | save step vs normal "
             "| published in a later step (s) | policy offload after a save / other steps (s) | lent (GiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in r["save_breakdown_s"].items() if seconds)
        published = ", ".join(f"step {step}: {seconds:.2f}" for step, seconds in r["published_at_steps_s"].items())
        offload = r["offload_s"]
        lines.append(f"| {mode} | {r['normal_step_s']:.2f} | {r['save_step_s']:.2f} | {r['save_checkpoints_s']:.2f} "
                     f"| {parts or '-'} | {r['save_step_overhead']:+.0%} | {published or '-'} "
                     f"| {offload['after_saves']:.2f} / {offload['other_steps']:.2f} | {r['offload_lent_gib']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/checkpoint_steps"))
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--ckpt-interval", type=int, default=4,
                        help="steps between saves: far enough apart for a background write to finish (the 0.6B demo "
                             "shape on an H200: 1.6 s steps, 5.5 s writes)")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--keep", type=int, default=1,
                        help="trainer.max_ckpts_to_keep: one kept and one being written must fit on the disk")
    parser.add_argument("--cpu", action="store_true", help="the CPU demo instead of --gpu")
    parser.add_argument("--timeout", type=int, default=280, help="seconds per run")
    parser.add_argument("--shape", help="a shape in examples/megatron/model_configs (default: the demo's model)")
    parser.add_argument("--drop-complete", action="store_true",
                        help="delete each checkpoint once complete, for a disk that holds one but not two")
    parser.add_argument("--scratch", type=Path,
                        help="where the random-weight model and the conversion cache go (default: beside the runs)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/checkpoint_steps_runs"),
                        help="where the runs (and their checkpoints) live; one per run side by side")
    parser.add_argument("overrides", nargs="*", help="more overrides for both runs")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.workdir
    model = None
    if args.shape:
        from policy_bench import write_checkpoint  # bench/ is this script's directory

        model = (args.scratch or work) / f"model_{args.shape}"
        if not (model / "config.json").is_file():
            write_checkpoint(args.shape, model, cpu=args.cpu)
    results = {}
    for mode in args.modes.split(","):
        run_dir = work / mode
        seconds = run_demo(run_dir, mode, args, model, args.out / f"{mode}.log")
        model = model or run_dir / "model"
        results[mode] = step_times(args.out / f"{mode}_metrics.jsonl", args.ckpt_interval, args.steps)
        results[mode]["run_s"] = seconds
        print(f"{mode}: {json.dumps({k: v for k, v in results[mode].items() if k != 'tokens_per_s'})}", flush=True)
    (args.out / "checkpoint_steps.json").write_text(json.dumps(results, indent=2))
    rendered = table(results)
    (args.out / "checkpoint_steps.md").write_text(rendered + "\n")
    print(rendered)


if __name__ == "__main__":
    main()
