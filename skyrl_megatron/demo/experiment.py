"""The demo's experiment: the host's BasePPOExp and RayPPOTrainer, with checks and a readable console.

Nothing here changes what the host trainer does; it observes:

* the weights the engine samples with are compared with a fresh export of the policy (SHA-256 per
  tensor, so "equal" means bitwise), reported as ``sync/bitwise_equal``: our HF engine's before each
  step's scoring (it still holds the last sync's weights), a vLLM engine's right after each sync (it
  discards its weights when it sleeps), read back under HF names in its worker
  (``engines.vllm_weights``); each sync's own time is ``sync/seconds``. The check hashes every tensor on
  both sides inside the step the host times (our HF engine's within ``timing/fwd_logprobs_values_reward``),
  so its own seconds are reported as ``timing/weight_check``; ``weight_check=False`` (the demo's
  ``--no-weight-check``) leaves it out, for step times as a run without the demo's observer has them;
* the logprobs the engine reported while sampling are compared with the policy's ``forward`` on the
  same tokens (the train-inference gap), reported as ``sync/rollout_logprob_max_diff`` and
  ``sync/rollout_logprob_mean_diff``;
* in colocated runs, the host's offload/backload traffic of policy and ref (GiB, seconds) and the
  memory each still held after its last offload, reported as ``offload/<role>_*``; on GPUs, the
  device memory peak of each phase (scoring, training, optimizer step) over the ranks, as
  ``memory/<role>_<phase>_peak_{allocated,reserved}_gib``;
* each step's prompt ids and token count are recorded, so a resumed run's data order can be checked;
* with a critic (PPO), the host's value loss on each step's batch is measured with the values GAE
  used and again after the critic's update (``critic/value_loss_before_update``, ``..._after_update``);
* a tracker prints one line per step, keeps every metric in ``metrics.jsonl`` and draws the reward
  curve at the end.

The token count, the train-inference gap and the prompt ids are read from what the driver holds anyway, so
they work whatever the workers (``experiment_class(run_dir, checked=False)``: the host's FSDP2 workers too,
as ``bench/rl_step_bench.py`` runs them); the weight, transfer and memory checks ask our workers.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

from skyrl_megatron.hosts import current
from skyrl_megatron.demo.task import DEMO_PROMPTS, register_environment

REWARD = "reward/avg_raw_reward"
VALUE_LOSS = "critic/critic_loss"  # PPO runs only (`--ppo`)
# PPO: the demo's observation of each critic update (see CheckedTrainer._check_critic_update)
VALUE_LOSS_BEFORE = "critic/value_loss_before_update"
VALUE_LOSS_AFTER = "critic/value_loss_after_update"
CONSOLE_COLUMNS = (
    ("reward", REWARD, "{:.3f}"),
    ("loss", "policy/final_loss", "{:+.4f}"),
    ("kl", "policy/policy_kl", "{:.2e}"),
    ("grad", ("policy/raw_grad_norm", "policy/grad_norm"), "{:.3f}"),  # skyrl-train 0.3.1's name, skyrl 0.4's
    ("vloss", VALUE_LOSS, "{:.4f}"),
    ("resp", "generate/avg_num_tokens", "{:.1f}"),
    ("tok/s", "throughput/tokens_per_second", "{:.0f}"),
    ("sync", "sync/bitwise_equal", "{:.0f}"),
    ("|lp diff|", "sync/rollout_logprob_max_diff", "{:.1e}"),
)
MEAN_GAP = "sync/rollout_logprob_mean_diff"
WEIGHT_CHECK_SECONDS = "timing/weight_check"  # inside the step the host times (see the module docstring)


class StepReporter:
    """The host's tracker interface (``log``, ``finish``): one console line and one JSON line per step,
    with the tokens per second of the whole step (generation, scoring, training, sync) added."""

    def __init__(self, metrics_file: Path, write=None):
        from tqdm import tqdm

        self.metrics_file = metrics_file
        self.write = write or tqdm.write  # keeps a progress bar (when one is on) below the lines
        self._header_done = False

    def log(self, data: dict[str, Any], step: int, commit: bool = False) -> None:
        seconds, tokens = data.get("timing/step"), data.get("throughput/tokens")
        if seconds and tokens:
            data = {**data, "throughput/tokens_per_second": tokens / seconds}
        record = {"step": step, **{k: _plain(v) for k, v in data.items()}}
        with self.metrics_file.open("a") as out:
            out.write(json.dumps(record) + "\n")
        if "trainer/global_step" not in data:  # e.g. eval before training
            return
        if not self._header_done:
            self.write(f"{'step':>5} " + " ".join(f"{name:>10}" for name, _, _ in CONSOLE_COLUMNS))
            self._header_done = True
        cells = []
        for _, keys, fmt in CONSOLE_COLUMNS:
            value = next((data[key] for key in _names(keys) if key in data), None)
            cells.append(f"{fmt.format(value) if isinstance(value, (int, float)) else '-':>10}")
        self.write(f"{step:>5} " + " ".join(cells))

    def finish(self) -> None:
        pass

    def log_exception(self, error: BaseException, step: int | None = None) -> None:
        pass  # the run's error reaches the console from the demo itself


def _names(keys: str | tuple[str, ...]) -> tuple[str, ...]:
    return (keys,) if isinstance(keys, str) else keys


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_metrics(metrics_file: Path) -> list[dict[str, Any]]:
    """Per-step records of every run that wrote to `metrics_file` (a resumed run appends)."""
    if not metrics_file.exists():
        return []
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def reward_figure(metrics_file: Path, subtitle: str = "Megatron workers, CPU engine"):
    """Reward per step (the last record of each step wins, so resumed runs draw one curve); the
    subtitle names the run's workers and engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step = {r["step"]: r[REWARD] for r in read_metrics(metrics_file) if REWARD in r}
    steps = sorted(by_step)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [by_step[s] for s in steps], marker="o")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward (digit share of reply)")
    ax.set_title(f"skyrl-megatron demo\n{subtitle}", fontsize=10)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_rewards(metrics_file: Path, out_file: Path, subtitle: str = "Megatron workers, CPU engine") -> Path:
    import matplotlib.pyplot as plt

    fig = reward_figure(metrics_file, subtitle)
    fig.savefig(out_file, dpi=120)
    plt.close(fig)
    return out_file


def host_value_loss(values, old_values, returns, loss_mask, algorithm) -> float:
    """The host's value loss (clipped around `old_values`) over a whole batch."""
    critic_loss = current().critic_loss_function()
    loss, _ = critic_loss(values.float(), old_values.float(), returns.float(), config=algorithm,
                          loss_mask=loss_mask.float())
    return float(loss)


def engine_actors(inference_engine_client) -> list:
    """Our engines' Ray actors behind either host's client (0.3.1 wraps each in RayWrappedInferenceEngine)."""
    return [getattr(engine, "inference_engine_actor", engine) for engine in inference_engine_client.engines]


def is_vllm_engine(actor) -> bool:
    """A host's vLLM engine actor (ours answer ``weight_digests`` themselves)."""
    return not hasattr(actor, "weight_digests")


def serves_over_http(inference_engine_client) -> bool:
    """skyrl 0.4's client of its vLLM servers (not an engine actor in sight)."""
    return hasattr(inference_engine_client, "server_urls")


def _vllm_engine_digests(engine, names: list[str]) -> list[dict[str, str]]:
    """Run in the host's vLLM engine actor (Ray's ``__ray_call__``): each worker's digests of the tensors
    it holds, read back under HF names. The host's synchronous engine keeps a ``vllm.LLM`` as ``llm``;
    with its engine core in the actor's process (``generator.vllm_v1_disable_multiproc``, the host's
    default) the function is called, not serialised."""
    from skyrl_megatron.engines.vllm_weights import engine_weight_digests

    llm = getattr(engine, "llm", None)
    if llm is None or not hasattr(llm, "collective_rpc") or asyncio.iscoroutinefunction(llm.collective_rpc):
        raise RuntimeError("the demo reads a vLLM engine's weights through the host's synchronous engine: "
                           "set generator.async_engine=false")
    return llm.collective_rpc(engine_weight_digests, args=(names,))


async def vllm_server_digests(inference_engine_client, names: list[str]) -> list[dict[str, str]]:
    """Each vLLM server worker's digests of `names`, through vLLM's ``/collective_rpc`` route and our worker
    extension's read-back (`engines.vllm_extension`), fanned out by the client's `_call_all_servers` (what its own
    control-plane methods use; it has no public one for a custom route)."""
    from skyrl_megatron.engines.vllm_extension import READ_BACK_METHOD

    replies = await inference_engine_client._call_all_servers("/collective_rpc",
                                                              {"method": READ_BACK_METHOD, "args": [names]})
    return [digests for reply in replies.values() for digests in reply["body"]["results"]]


def engine_weight_digests(actors: list, names: list[str]) -> list[dict[str, str]]:
    """The digests each engine (each vLLM worker) holds for `names`."""
    if actors and is_vllm_engine(actors[0]):
        per_engine = ray.get([actor.__ray_call__.remote(_vllm_engine_digests, names) for actor in actors])
        return [digests for workers in per_engine for digests in workers]
    return ray.get([actor.weight_digests.remote(names) for actor in actors])


def _observed_trainer_class():
    class ObservedTrainer(current().trainer_class()):
        """The host trainer plus what the driver sees of each step whatever the workers (any strategy): the
        step's prompt ids, its token count and the train-inference logprob gap. Cheap: tensors the driver
        holds anyway."""

        def postprocess_generator_output(self, generator_output, uids):
            self.all_metrics["data/prompt_uids"] = sorted(set(uids), key=int)
            return super().postprocess_generator_output(generator_output, uids)

        def fwd_logprobs_values_reward(self, training_input):
            training_input = super().fwd_logprobs_values_reward(training_input)
            self.all_metrics["throughput/tokens"] = int(training_input["attention_mask"].sum())
            rollout = training_input["rollout_logprobs"]
            if rollout is not None:
                mask = training_input["loss_mask"].bool()
                diff = (rollout - training_input["action_log_probs"]).abs()[mask]
                self.all_metrics["sync/rollout_logprob_max_diff"] = float(diff.max()) if diff.numel() else 0.0
                self.all_metrics[MEAN_GAP] = float(diff.mean()) if diff.numel() else 0.0
            return training_input

    return ObservedTrainer


def _trainer_class(weight_check: bool = True):
    class CheckedTrainer(_observed_trainer_class()):
        """The host trainer plus the demo's observations (see the module docstring); they ask our workers."""

        def _engines_are_vllm(self) -> bool:
            if serves_over_http(self.inference_engine_client):
                return True
            actors = engine_actors(self.inference_engine_client)
            return bool(actors) and is_vllm_engine(actors[0])

        def _exported_digests(self) -> dict[str, str]:
            return ray.get(self.policy_model.async_run_ray_method("pass_through", "weight_digests"))[0]

        def _check_engine_weights(self) -> None:
            started = time.perf_counter()
            exported = self._exported_digests()
            self._record_weight_check(exported, engine_weight_digests(engine_actors(self.inference_engine_client),
                                                                      list(exported)), started)

        def _record_weight_check(self, exported: dict[str, str], held: list[dict[str, str]], started: float) -> None:
            """Every tensor each engine holds equals the policy's export of it (a vLLM engine with tied
            embeddings holds one tensor where the export names two); the check's seconds since `started`
            add up over a step's checks."""
            self.all_metrics[WEIGHT_CHECK_SECONDS] = (self.all_metrics.get(WEIGHT_CHECK_SECONDS, 0.0)
                                                      + time.perf_counter() - started)
            equal = all(digests and all(exported.get(name) == digest for name, digest in digests.items())
                        for digests in held)
            # a step's record holds its last sync's check (and, at step 1, the first sync's too)
            self.all_metrics["sync/bitwise_equal"] = min(float(equal), self.all_metrics.get("sync/bitwise_equal", 1.0))
            self.all_metrics["sync/tensors"] = min(len(digests) for digests in held) if held else 0

        def sync_policy_weights_to_inference_engines(self):
            """The host's sync, timed on its own; a vLLM engine's weights are checked right after it."""
            started = time.perf_counter()
            ray.get(super().sync_policy_weights_to_inference_engines())
            self.all_metrics["sync/seconds"] = time.perf_counter() - started
            if weight_check and self._engines_are_vllm():
                self._check_engine_weights()
            return []

        def build_models(self, *args, **kwargs):
            """skyrl 0.4 with its vLLM servers syncs through its worker dispatch (at the start and after each
            step's training): each sync is timed and the servers' weights checked right after it, while awake."""
            super().build_models(*args, **kwargs)
            dispatch = getattr(self, "dispatch", None)
            if dispatch is None or not serves_over_http(self.inference_engine_client):
                return
            sync = dispatch.save_weights_for_sampler

            async def save_weights_for_sampler(*sync_args, **sync_kwargs):
                started = time.perf_counter()
                await sync(*sync_args, **sync_kwargs)
                self.all_metrics["sync/seconds"] = time.perf_counter() - started
                if not weight_check:
                    return
                started = time.perf_counter()
                exported = self._exported_digests()
                self._record_weight_check(exported, await vllm_server_digests(self.inference_engine_client,
                                                                              list(exported)), started)

            dispatch.save_weights_for_sampler = save_weights_for_sampler

        def _worker_groups(self):
            return [(role, group) for role in ("policy", "ref") if (group := getattr(self, f"{role}_model", None))]

        def _report_transfers(self) -> None:
            """The host's offload/backload traffic of policy and ref since the last step's scoring
            (colocated runs), and the memory each still held after its last offload (rank 0)."""
            for role, group in self._worker_groups():
                summary = ray.get(group.async_run_ray_method("pass_through", "transfer_summary"))[0]
                if summary.get("transfers"):
                    for key, value in summary.items():
                        self.all_metrics[f"offload/{role}_{key}"] = value

        def _report_memory_peaks(self) -> None:
            """The device memory peak of each of this step's phases over all ranks (GPU runs)."""
            for role, group in self._worker_groups():
                for rank_peaks in ray.get(group.async_run_ray_method("pass_through", "memory_peaks")):
                    for key, value in rank_peaks.items():
                        name = f"memory/{role}_{key}"
                        self.all_metrics[name] = max(value, self.all_metrics.get(name, 0.0))

        def train_critic_and_policy(self, data):
            status = super().train_critic_and_policy(data)
            self._report_memory_peaks()
            if self.critic_model is not None:
                self._check_critic_update(data)
            return status

        def _check_critic_update(self, data) -> None:
            """The host's value loss on this step's batch with the critic's values before its update
            (those GAE used) and after it (scored again)."""
            inputs = data.select(keys=["sequences", "attention_mask"], metadata_keys=["response_length"])
            colocated = self.cfg.trainer.placement.colocate_all  # the host offloaded the critic after training
            if colocated:
                self.critic_model.backload_to_gpu(backload_optimizer=False, backload_model=True)
            after = self._critic_values(inputs)
            if colocated:
                self.critic_model.offload_to_cpu(offload_optimizer=False, offload_model=True)
            before = data["values"]
            for name, values in ((VALUE_LOSS_BEFORE, before), (VALUE_LOSS_AFTER, after)):
                self.all_metrics[name] = host_value_loss(values, before, data["returns"], data["loss_mask"],
                                                         self.cfg.trainer.algorithm)

        def _critic_values(self, inputs):
            if hasattr(self, "dispatch"):  # skyrl 0.4: scoring goes through its worker dispatch
                return self._execute_forward_pass("critic", inputs, key="values", mini_batch_boundaries=None)
            return self.critic_model.run_method("mesh", "forward", inputs)["output"]

        def fwd_logprobs_values_reward(self, training_input):
            if weight_check and not self._engines_are_vllm():
                self._check_engine_weights()  # the policy is still where the last sync left it
            self._report_transfers()
            return super().fwd_logprobs_values_reward(training_input)

    return CheckedTrainer


def experiment_class(run_dir: Path, checked: bool = True, weight_check: bool = True):
    """A BasePPOExp whose trainer is the checked one (`checked=False`: the observed one, which asks the
    workers nothing, for any strategy; `weight_check=False`: checked, without the per-step weight
    comparison) and whose tracker is the step reporter."""
    base = current().base_experiment_class()
    trainer_class = _trainer_class(weight_check) if checked else _observed_trainer_class()

    class DemoExperiment(base):
        def __init__(self, cfg):
            register_environment()  # the host's generator makes environments by name, in this process
            super().__init__(cfg)

        def get_generator(self, cfg, tokenizer, inference_engine_client):
            generator = super().get_generator(cfg, tokenizer, inference_engine_client)
            # one progress bar (the trainer's); the generator's per-batch bar would interleave with it
            generator.generate = functools.partial(generator.generate, disable_tqdm=True)
            return generator

        def get_tracker(self):
            return StepReporter(run_dir / "metrics.jsonl")

        def get_train_dataset(self):
            """The host's prompt dataset; the demo's own prompt file is length-filtered in this process.
            The host filters in 8 worker processes (skyrl 0.4 spawns them, each importing the tokenizer
            stack: ~20 s of a 2-core machine's start-up); the demo's file has a few hundred rows at
            most, which one process filters in milliseconds, to the same rows. Other data (a
            `data.train_data` override) gets the host's workers."""
            if [str(path) for path in self.cfg.data.train_data] != [str(run_dir.resolve() / DEMO_PROMPTS)]:
                return super().get_train_dataset()
            prompt_dataset = vars(sys.modules[base.get_train_dataset.__module__])["PromptDataset"]
            return prompt_dataset(datasets=self.cfg.data.train_data, tokenizer=self.tokenizer,
                                  max_prompt_length=self.cfg.trainer.max_prompt_length, num_workers=1)

        def get_trainer(self, cfg, tracker, tokenizer, train_dataset, eval_dataset, inference_engine_client,
                        generator, colocate_pg):
            return trainer_class(
                cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset,
                eval_dataset=eval_dataset, inference_engine_client=inference_engine_client,
                generator=generator, colocate_pg=colocate_pg,
            )

    return DemoExperiment


