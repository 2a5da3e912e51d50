"""The CPU inference engine (skyrl_megatron.engines): the host's engine contract, checked numerically.

Every test runs a tiny random-weight Qwen3 on CPU in this process. Reference values come from plain
full-sequence HF forwards, independent of the engine's KV-cached, left-padded decode loop.
"""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

from skyrl_megatron.engines.cpu_engine import CpuInferenceEngine, NamedTensorsUpdateRequest
from skyrl_megatron.engines.sampling import SamplingSettings
from skyrl_megatron.testing import make_tiny_hf_model
from skyrl_megatron.weights import WeightBucket

# Different lengths, so the batch is left-padded.
PROMPTS = [[1, 40, 41, 42], [1, 50], [1, 60, 61, 62, 63, 64, 65]]
LOGPROB_TOLERANCE = 1e-5


def run(coroutine):
    return asyncio.run(coroutine)


def generate(engine, prompts=PROMPTS, **sampling_params):
    return run(engine.generate({"prompt_token_ids": prompts, "sampling_params": sampling_params}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("engine") / "qwen3", seed=3)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """Same architecture, different weights: the "trained" policy a weight sync delivers."""
    return make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("engine") / "qwen3-other", seed=4)


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture
def engine(model_dir):
    return CpuInferenceEngine(model_dir, seed=0)


@torch.no_grad()
def reference_logits(model, prompt, response):
    """Logits predicting each response token, from one unpadded forward over prompt + response."""
    logits = model(torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(response) - 1]


def reference_logprobs(model, prompt, response, temperature):
    logits = reference_logits(model, prompt, response)
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@torch.no_grad()
def greedy_tokens(model, prompt, steps):
    """Greedy decoding without a KV cache: a full forward for every token."""
    tokens = []
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
    return tokens


# ----------------------------------------------------------------------------------------------
# Greedy decoding and stop reasons
# ----------------------------------------------------------------------------------------------


def test_greedy_matches_full_forward_argmax_and_stops_at_max_tokens(engine, reference):
    out = generate(engine, temperature=0.0, max_tokens=6)
    assert out["stop_reasons"] == ["length"] * 3
    for prompt, response in zip(PROMPTS, out["response_ids"]):
        assert response == greedy_tokens(reference, prompt, 6)
    # deterministic, and top_k=1 / a tiny top_p / min_p=1 sampling all reduce to greedy
    assert generate(engine, temperature=0.0, max_tokens=6)["response_ids"] == out["response_ids"]
    for filters in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert generate(engine, temperature=1.0, max_tokens=6, **filters)["response_ids"] == out["response_ids"]


def test_eos_ids_from_generation_config_stop_with_reason_stop(model_dir, tmp_path, engine):
    (prompt,) = PROMPTS[:1]
    free_run = generate(engine, [prompt], temperature=0.0, max_tokens=8)["response_ids"][0]
    eos = free_run[3]
    first = free_run.index(eos)
    # Real checkpoints list several EOS ids in generation_config.json (Qwen: <|im_end|>, <|endoftext|>).
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [config["eos_token_id"], eos]
    eos_dir = tmp_path / "eos"
    eos_dir.mkdir()
    for path in model_dir.iterdir():
        (eos_dir / path.name).write_bytes(path.read_bytes())
    (eos_dir / "generation_config.json").write_text(json.dumps(config))
    eos_engine = CpuInferenceEngine(eos_dir)

    out = generate(eos_engine, [prompt], temperature=0.0, max_tokens=8)
    assert out["response_ids"] == [free_run[: first + 1]]  # the EOS token is part of the response
    assert out["stop_reasons"] == ["stop"]
    ignored = generate(eos_engine, [prompt], temperature=0.0, max_tokens=8, ignore_eos=True)
    assert ignored["response_ids"] == [free_run] and ignored["stop_reasons"] == ["length"]


def test_stop_token_ids_and_min_tokens(engine):
    (prompt,) = PROMPTS[:1]
    free_run = generate(engine, [prompt], temperature=0.0, max_tokens=8)["response_ids"][0]
    stop_id = free_run[2]
    first = free_run.index(stop_id)
    out = generate(engine, [prompt], temperature=0.0, max_tokens=8, stop_token_ids=[stop_id])
    assert out["response_ids"] == [free_run[: first + 1]] and out["stop_reasons"] == ["stop"]
    # min_tokens suppresses stop tokens until that many tokens exist, so the row runs past `first`
    late = generate(engine, [prompt], temperature=0.0, max_tokens=8, stop_token_ids=[stop_id], min_tokens=first + 2)
    assert len(late["response_ids"][0]) >= first + 2
    assert stop_id not in late["response_ids"][0][: first + 2]


def test_stop_strings_cut_the_text_as_vllm_does(engine):
    (prompt,) = PROMPTS[:1]
    # the random model also samples the tokenizer's filler tokens, which decode to nothing (greedy repeats
    # one): seeded sampling, and the stop string is two characters of the visible text
    seeded = {"temperature": 1.0, "max_tokens": 48, "seed": 11}
    free_run = generate(engine, [prompt], **seeded)
    tokenizer = engine.tokenizer
    text = free_run["responses"][0]
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = text.index(stop)
    kept = generate(engine, [prompt], **seeded, stop=[stop], include_stop_str_in_output=True)
    dropped = generate(engine, [prompt], **seeded, stop=[stop])
    assert kept["responses"] == [text[: cut + len(stop)]] and dropped["responses"] == [text[:cut]]
    for out in (kept, dropped):
        assert out["stop_reasons"] == ["stop"]
        # tokens stop where it matched (the text skips special tokens, as vLLM's default)
        assert tokenizer.decode(out["response_ids"][0], skip_special_tokens=True) == text[: cut + len(stop)]


# ----------------------------------------------------------------------------------------------
# Sampling and logprobs
# ----------------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(model_dir):
    params = {"temperature": 1.0, "max_tokens": 12}
    first, second = CpuInferenceEngine(model_dir, seed=7), CpuInferenceEngine(model_dir, seed=7)
    runs = [generate(first, **params)["response_ids"] for _ in range(2)]
    assert [generate(second, **params)["response_ids"] for _ in range(2)] == runs
    assert runs[0] != runs[1]  # the engine's stream moves on between calls
    assert generate(CpuInferenceEngine(model_dir, seed=8), **params)["response_ids"] != runs[0]
    # a per-request seed does not depend on what the engine generated before
    assert generate(first, seed=5, **params)["response_ids"] == generate(second, seed=5, **params)["response_ids"]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7, "top_p": 0.9, "top_k": 50},
        {"temperature": 1.3, "min_p": 0.05, "repetition_penalty": 1.2},
        {"temperature": 0.0},  # greedy: logprobs of the plain softmax (temperature 1)
    ],
)
def test_logprobs_equal_an_independent_forward_at_the_sampling_temperature(engine, reference, params):
    out = generate(engine, max_tokens=16, logprobs=1, **params)
    temperature = params["temperature"] or 1.0
    for prompt, response, logprobs in zip(PROMPTS, out["response_ids"], out["response_logprobs"]):
        assert len(logprobs) == len(response) > 0
        expected = reference_logprobs(reference, prompt, response, temperature)
        torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=0, atol=LOGPROB_TOLERANCE)
    assert generate(engine, max_tokens=4, **params)["response_logprobs"] is None  # only when asked


def test_top_k_limits_sampled_tokens_to_the_k_most_likely(engine, reference):
    def worst_rank(**filters):
        out = generate(engine, temperature=2.0, max_tokens=24, seed=1, **filters)
        ranks = []
        for prompt, response in zip(PROMPTS, out["response_ids"]):
            logits = reference_logits(reference, prompt, response)
            chosen = logits.gather(-1, torch.tensor(response)[:, None])
            ranks.append(int((logits > chosen).sum(-1).max()))
        return max(ranks)

    assert worst_rank() >= 3  # at this temperature unfiltered sampling leaves the top 3
    assert worst_rank(top_k=3) < 3


def test_sampling_params_from_the_host_config_are_accepted_and_unknown_ones_rejected():
    from omegaconf import OmegaConf
    from skyrl_train.inference_engines.utils import get_vllm_sampling_params

    # the host config's sampling_params, with logprobs and a stop string set
    host_params = OmegaConf.create(
        {
            "max_generate_length": 32,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_p": 1.0,
            "min_p": 0.0,
            "top_k": -1,
            "logprobs": 0,
            "stop": ["</answer>"],
        }
    )
    settings = SamplingSettings.from_request(get_vllm_sampling_params(host_params))
    assert (settings.max_tokens, settings.min_tokens, settings.logprobs, settings.stop) == (32, 1, 0, ("</answer>",))
    assert settings.include_stop_str_in_output and settings.skip_special_tokens
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingSettings.from_request({"presence_penalty": 0.5})
    with pytest.raises(ValueError, match="n=2"):
        SamplingSettings.from_request({"n": 2})
    with pytest.raises(ValueError, match="conflicting token limits"):
        SamplingSettings.from_request({"max_tokens": 4, "max_generate_length": 8})


def test_abort_returns_partial_responses(engine):
    async def generate_then_abort():
        params = {"max_tokens": 400, "logprobs": 0, "ignore_eos": True}
        task = asyncio.create_task(engine.generate({"prompt_token_ids": PROMPTS, "sampling_params": params}))
        while not engine._in_flight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await engine.abort_generation()
        return await task

    out = run(generate_then_abort())
    assert out["stop_reasons"] == ["abort"] * 3
    lengths = [len(response) for response in out["response_ids"]]
    assert 0 < lengths[0] < 400 and len(set(lengths)) == 1
    assert [len(logprobs) for logprobs in out["response_logprobs"]] == lengths


# ----------------------------------------------------------------------------------------------
# Weight updates
# ----------------------------------------------------------------------------------------------


def other_weights(other_model_dir):
    model = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_update_named_weights_loads_the_sent_tensors_bitwise(engine, model_dir, other_model_dir):
    before = generate(engine, temperature=0.0, max_tokens=8)["response_ids"]
    sent = other_weights(other_model_dir)
    names = list(sent)
    half = len(names) // 2
    # in two buckets, as the exporter streams them: one of ours, one built by name
    bucket = WeightBucket.of(names[:half], [sent[name] for name in names[:half]])
    run(engine.update_named_weights(NamedTensorsUpdateRequest.from_chunk(bucket)))
    run(engine.update_named_weights(NamedTensorsUpdateRequest.of({n: sent[n] for n in names[half:]})))

    state = engine.model.state_dict()
    assert set(state) == set(sent)
    assert all(torch.equal(state[name], sent[name]) for name in sent)
    after = generate(engine, temperature=0.0, max_tokens=8)["response_ids"]
    assert after != before
    assert after == generate(CpuInferenceEngine(other_model_dir), temperature=0.0, max_tokens=8)["response_ids"]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda sent: {"model.layers.0.mlp.gate_proj.weightt": sent.pop("model.layers.0.mlp.gate_proj.weight")},
            "not a parameter of this model \\(did you mean model.layers.0.mlp.gate_proj.weight",
        ),
        (lambda sent: {"lm_head.weight": sent["lm_head.weight"][:-1]}, "lm_head.weight: shape \\[255, 64\\]"),
        (lambda sent: {"lm_head.weight": sent["lm_head.weight"].bfloat16()}, "dtype torch.bfloat16"),
    ],
)
def test_bad_updates_are_rejected_and_load_nothing(engine, other_model_dir, change, message):
    sent = other_weights(other_model_dir)
    good = {"model.norm.weight": sent["model.norm.weight"]}
    request = NamedTensorsUpdateRequest.of({**good, **change(sent)})
    original = engine.model.state_dict()["model.norm.weight"].clone()
    with pytest.raises(ValueError, match=message):
        run(engine.update_named_weights(request))
    assert torch.equal(engine.model.state_dict()["model.norm.weight"], original)
    assert not torch.equal(original, good["model.norm.weight"])  # the good entry would have changed it


def test_our_broadcast_group_delivers_buckets_bitwise_and_a_bad_bucket_loads_nothing(engine, other_model_dir):
    """skyrl 0.4's sync path (workers/engine_sync.py): the sender (rank 0, here this thread) announces a
    bucket, the engine receives it over our own gloo group and checks it whole before writing."""
    import threading

    from skyrl_megatron.engines.broadcast import BroadcastGroup, BroadcastRendezvous
    from skyrl_megatron.engines.weight_updates import TensorAnnouncement

    sent = other_weights(other_model_dir)
    rendezvous = BroadcastRendezvous.on_this_host(world_size=2, timeout_s=60)
    joined = threading.Thread(target=run, args=(engine.join_weight_broadcast(rendezvous, rank=1),))
    joined.start()
    sender = BroadcastGroup(rendezvous, rank=0)
    joined.join()

    def send(tensors: dict[str, torch.Tensor]):
        receipt = {}
        receiver = threading.Thread(
            target=lambda: receipt.update(result=_outcome(engine.receive_broadcast(TensorAnnouncement.of(tensors))))
        )
        receiver.start()
        for tensor in tensors.values():
            sender.broadcast(tensor.contiguous())
        receiver.join()
        return receipt["result"]

    original_norm = engine.model.state_dict()["model.norm.weight"].clone()
    bad = {"model.norm.weight": sent["model.norm.weight"], "lm_head.weight": sent["lm_head.weight"][:-1]}
    outcome = send(bad)
    assert isinstance(outcome, ValueError) and "lm_head.weight: shape [255, 64]" in str(outcome)
    assert torch.equal(engine.model.state_dict()["model.norm.weight"], original_norm)

    names = list(sent)
    assert send({n: sent[n] for n in names[: len(names) // 2]}) == len(names) // 2
    assert send({n: sent[n] for n in names[len(names) // 2 :]}) == len(names) - len(names) // 2
    state = engine.model.state_dict()
    assert all(torch.equal(state[name], sent[name]) for name in sent)


def _outcome(coroutine):
    try:
        return run(coroutine)
    except Exception as error:  # noqa: BLE001 - returned to the test thread
        return error


def test_broadcast_needs_a_gloo_communicator_and_other_channels_are_refused(engine):
    from skyrl_train.weight_sync import BroadcastInitInfo, BroadcastWeightUpdateRequest, CudaIpcInitInfo

    with pytest.raises(RuntimeError, match="before init_weight_update_communicator"):
        request = BroadcastWeightUpdateRequest(["lm_head.weight"], ["float32"], [[256, 64]])
        run(engine.update_named_weights(request))
    nccl = BroadcastInitInfo(False, "127.0.0.1", 1, 1, 2, "skyrl", "nccl", "float32")
    with pytest.raises(ValueError, match="backend 'nccl'.*weight_sync_backend=gloo"):
        run(engine.init_weight_update_communicator(nccl))
    with pytest.raises(ValueError, match="CudaIpcInitInfo.*colocate_all=false"):
        run(engine.init_weight_update_communicator(CudaIpcInitInfo(False, "float32")))
    with pytest.raises(ValueError, match="declared torch.float32"):
        NamedTensorsUpdateRequest(["w"], ["torch.float32"], [[2]], [torch.zeros(2, dtype=torch.bfloat16)])


def _peft_adapter(model_dir, out_dir, seed: int):
    """A PEFT LoRA adapter with non-zero B (so it changes the logits), saved as a trainer would."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, config).eval()
    peft_model.save_pretrained(out_dir)
    return peft_model


def test_lora_adapter_loads_from_disk_and_replaces_the_previous_one(engine, model_dir, tmp_path):
    from skyrl_train.weight_sync import LoraLoadRequest

    tokens = torch.tensor([PROMPTS[2]])
    for seed in (1, 2):  # the second adapter replaces the first; it does not stack on it
        adapter = _peft_adapter(model_dir, tmp_path / f"adapter{seed}", seed)
        run(engine.update_named_weights(LoraLoadRequest(lora_path=str(tmp_path / f"adapter{seed}"))))
        with torch.no_grad():
            expected = adapter(tokens).logits
            served = engine.model(tokens).logits
        torch.testing.assert_close(served, expected, rtol=0, atol=1e-5)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(tokens).logits
    assert (served - base).abs().max() > 1e-3  # the adapter did change the model


def test_update_request_survives_pickling_bitwise(other_model_dir):
    """What Ray's object store does to a request on its way to an engine actor."""
    sent = other_weights(other_model_dir)
    restored = pickle.loads(pickle.dumps(NamedTensorsUpdateRequest.of(sent)))
    assert restored.names == list(sent)
    assert all(torch.equal(a, b) for a, b in zip(restored.tensors, sent.values()))


# ----------------------------------------------------------------------------------------------
# Through the host
# ----------------------------------------------------------------------------------------------


def test_host_inference_engine_client_drives_two_engines(model_dir, other_model_dir):
    from omegaconf import OmegaConf
    from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient

    engines = [CpuInferenceEngine(model_dir), CpuInferenceEngine(model_dir)]
    cfg = OmegaConf.create(
        {
            "trainer": {"policy": {"model": {"path": str(model_dir)}}},
            "generator": {
                "backend": "cpu",
                "enable_http_endpoint": False,
                "http_endpoint_host": "",
                "http_endpoint_port": 0,
            },
        }
    )
    client = InferenceEngineClient(engines, engines[0].tokenizer, cfg)
    conversations = [[{"role": "user", "content": text}] for text in ("1+1=", "2+3=", "7*6=", "hi")]
    params = {"temperature": 0.0, "max_tokens": 6, "logprobs": 0}

    out = run(client.generate({"prompts": conversations, "sampling_params": params}))  # split over both engines
    prompt_ids = engines[0].tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    direct = generate(engines[0], prompt_ids, **params)
    assert out["response_ids"] == direct["response_ids"] and out["stop_reasons"] == direct["stop_reasons"]
    client_logprobs, direct_logprobs = torch.tensor(out["response_logprobs"]), torch.tensor(direct["response_logprobs"])
    torch.testing.assert_close(client_logprobs, direct_logprobs, rtol=0, atol=LOGPROB_TOLERANCE)
    # one prompt takes the client's pause/retry path
    single = run(client.generate({"prompt_token_ids": prompt_ids[:1], "sampling_params": params}))
    assert single["response_ids"] == direct["response_ids"][:1]

    sent = other_weights(other_model_dir)
    run(client.update_named_weights(NamedTensorsUpdateRequest.of(sent)))
    for engine in engines:
        state = engine.model.state_dict()
        assert all(torch.equal(state[name], tensor) for name, tensor in sent.items())


@pytest.mark.slow
def test_engine_runs_as_a_ray_actor_behind_the_hosts_wrapper(model_dir, other_model_dir):
    import ray

    from skyrl_megatron.engines.cpu_engine import create_ray_wrapped_cpu_engines

    params = {"temperature": 1.0, "max_tokens": 6, "logprobs": 0}
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        (remote,) = create_ray_wrapped_cpu_engines(1, model_dir, seed=9)
        assert (remote.tp_size(), remote.pp_size(), remote.dp_size()) == (1, 1, 1)
        local = CpuInferenceEngine(model_dir, seed=9)

        def assert_same_generation():
            # the actor may use another BLAS thread count: tokens equal, logprobs to rounding
            remote_out = run(remote.generate({"prompt_token_ids": PROMPTS, "sampling_params": params}))
            local_out = generate(local, **params)
            assert remote_out["response_ids"] == local_out["response_ids"]
            torch.testing.assert_close(
                torch.tensor(remote_out["response_logprobs"]), torch.tensor(local_out["response_logprobs"]),
                rtol=0, atol=LOGPROB_TOLERANCE,
            )

        assert_same_generation()
        run(remote.update_named_weights(NamedTensorsUpdateRequest.of(other_weights(other_model_dir))))
        run(local.update_named_weights(NamedTensorsUpdateRequest.of(other_weights(other_model_dir))))
        assert_same_generation()
    finally:
        ray.shutdown()


def test_a_moe_engine_takes_per_expert_checkpoint_names_into_its_fused_experts(tmp_path):
    """transformers 5 fuses a MoE layer's experts (``experts.gate_up_proj`` [E, 2I, H], ``down_proj``);
    weight updates and checkpoints name each expert's projection. The engine writes them into the fused
    tensors and fingerprints them under the same names; the model then equals one loaded from a
    checkpoint of those tensors by transformers itself."""
    from safetensors.torch import load_file

    from skyrl_megatron.digests import tensor_sha256

    make_tiny_hf_model("qwen3_moe", tmp_path / "a", seed=0)
    make_tiny_hf_model("qwen3_moe", tmp_path / "b", seed=1)
    engine = CpuInferenceEngine(tmp_path / "a", seed=0)
    sent = load_file(str(tmp_path / "b" / "model.safetensors"))  # per-expert names, as our export sends
    assert any(".experts.3.up_proj.weight" in name for name in sent)
    run(engine.update_named_weights(NamedTensorsUpdateRequest.of(sent)))

    assert run(engine.weight_digests(list(sent))) == {name: tensor_sha256(t) for name, t in sent.items()}
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).state_dict()
    held = engine.model.state_dict()
    assert held.keys() == expected.keys() and all(torch.equal(held[k], expected[k]) for k in expected)
    # a name the model does not have is refused before anything is written
    with pytest.raises(ValueError, match="experts.99.gate_proj.weight: not a parameter"):
        run(engine.update_named_weights(NamedTensorsUpdateRequest.of(
            {"model.layers.0.mlp.experts.99.gate_proj.weight": sent["model.layers.0.mlp.experts.0.gate_proj.weight"]})))
