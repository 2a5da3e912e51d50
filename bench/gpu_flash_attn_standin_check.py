"""GPU parity of the flash_attn stand-in (bench/flash_attn_standin) before the FSDP2 baseline uses it.

    python bench/gpu_flash_attn_standin_check.py [--out FILE.json]

Checks, in bf16 on one GPU, against float32 math (bench/flash_attn_standin/reference.py):
- `flash_attn_varlen_func` over packed sequences of mixed lengths (1 to 2000 tokens), GQA 16/8
  heads, d=128: causal, causal with a 256-token window, and non-causal; outputs, log-sum-exp and
  the gradients of q, k and v;
- `flash_attn_func` on [batch, seqlen] inputs, GQA 32/4: causal with equal lengths, and causal with
  fewer queries than keys (flash-attn aligns the mask to the bottom right);
- flash-attn's own Triton cross entropy (the host's logprobs) on bf16 logits against
  torch's float32 cross entropy, losses and logit gradients;
- a tiny Qwen3 through transformers: `flash_attention_2` on a packed row (the host's sample packing)
  against `sdpa` on the padded rows, logits.
A bf16 result passes when its error against float32 math is at most twice that of PyTorch's own
bf16 SDPA on the same inputs (its flash backend where SDPA's masks allow), plus 1e-3; the
log-sum-exp (float32) within 1e-2, the cross entropy's losses within 1e-3 and its bf16 logit
gradients within twice float32's rounded to bf16. Prints one
line per check and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "flash_attn_standin"
sys.path.insert(0, str(STANDIN))
import assemble  # noqa: E402  (bench/flash_attn_standin/assemble.py)

SITE = assemble.assemble(Path(tempfile.mkdtemp(prefix="flash_attn_standin_")))
sys.path.insert(0, str(SITE))  # before transformers reads the installed distributions

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flash_attn  # noqa: E402
import reference  # noqa: E402
from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: E402

results: list[dict] = []


def record(name: str, error: float, baseline: float | None, extra: dict | None = None, limit: float | None = None) -> None:
    limit = 2 * baseline + 1e-3 if limit is None else limit
    ok = error <= limit
    results.append({"check": name, "error": error, "sdpa_bf16_error": baseline, "limit": limit, "ok": ok, **(extra or {})})
    base = "-" if baseline is None else f"{baseline:.2e}"
    print(f"{'PASS' if ok else 'FAIL'} {name}: max abs error {error:.2e} (bf16 SDPA {base}, limit {limit:.2e})", flush=True)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def sdpa_bf16(q, k, v, window_size):
    """PyTorch's bf16 SDPA on one segment ((L, heads, dim) tensors): the baseline error. Flash backend
    where SDPA's own masks say the same (full, or causal with equal lengths), else an explicit mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lq, lk = q.shape[0], k.shape[0]
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if window_size == (-1, -1) or (window_size == (-1, 0) and lq == lk):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=window_size == (-1, 0), enable_gqa=True)
    else:
        mask = reference.allowed(lq, lk, window_size).to(q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def check_varlen() -> None:
    torch.manual_seed(0)
    lengths = [17, 512, 1, 2000, 300, 64]
    total, heads, kv_heads, dim = sum(lengths), 16, 8, 128
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    for label, causal, window in (("causal", True, (-1, -1)), ("causal window 256", True, (256, 256)),
                                  ("non-causal", False, (-1, -1))):
        q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        grad = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal,
                                             window_size=window, return_attn_probs=True)
        got = torch.autograd.grad(out, (q, k, v), grad)
        effective = (window[0], 0) if causal else window
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        want_out, want_lse = reference.varlen_attention(qf, kf, vf, cu, cu, max(lengths), max(lengths),
                                                        return_aux=_aux(), window_size=effective)
        want = torch.autograd.grad(want_out, (qf, kf, vf), grad.float())
        qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
        bounds = cu.tolist()
        base_out = torch.cat([sdpa_bf16(qb[a:b], kb[a:b], vb[a:b], effective) for a, b in zip(bounds, bounds[1:])])
        base_grads = torch.autograd.grad(base_out, (qb, kb, vb), grad)
        record(f"varlen {label} out", max_diff(out, want_out), max_diff(base_out, want_out))
        record(f"varlen {label} lse", max_diff(lse, want_lse), None, {"lse_shape": list(lse.shape)}, limit=1e-2)
        for name, g, w, b in zip("qkv", got, want, base_grads):
            record(f"varlen {label} d{name}", max_diff(g, w), max_diff(b, w))


def _aux():
    from torch.nn.attention.varlen import AuxRequest

    return AuxRequest(lse=True)


def check_padded() -> None:
    torch.manual_seed(1)
    for label, sq, sk in (("equal lengths", 257, 257), ("fewer queries than keys", 100, 300)):
        q = torch.randn(3, sq, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(3, sk, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        grad = torch.randn_like(q)
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        got = torch.autograd.grad(out, (q, k, v), grad)
        errors, lse_errors, grad_errors = [0.0, 0.0], [], [[0.0, 0.0] for _ in range(3)]
        for b in range(3):
            qf, kf, vf = (t[b].detach().float().requires_grad_() for t in (q, k, v))
            want_out, want_lse = reference.segment_attention(qf, kf, vf, None, (-1, 0))
            want = torch.autograd.grad(want_out, (qf, kf, vf), grad[b].float())
            qb, kb, vb = (t[b].detach().clone().requires_grad_() for t in (q, k, v))
            base_out = sdpa_bf16(qb, kb, vb, (-1, 0))
            base = torch.autograd.grad(base_out, (qb, kb, vb), grad[b])
            errors = [max(errors[0], max_diff(out[b], want_out)), max(errors[1], max_diff(base_out, want_out))]
            lse_errors.append(max_diff(lse[b], want_lse))
            grad_errors = [[max(e[0], max_diff(g[b], w)), max(e[1], max_diff(bg, w))]
                           for e, g, w, bg in zip(grad_errors, got, want, base)]
        record(f"padded {label} out", *errors)
        record(f"padded {label} lse", max(lse_errors), None, {"lse_shape": list(lse.shape)}, limit=1e-2)
        for name, (error, baseline) in zip("qkv", grad_errors):
            record(f"padded {label} d{name}", error, baseline)


def check_cross_entropy() -> None:
    from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

    torch.manual_seed(2)
    logits = (4 * torch.randn(2048, 151936, device="cuda")).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 151936, (2048,), device="cuda")
    losses, _ = cross_entropy_loss(logits, labels)
    grad = torch.randn(2048, device="cuda")
    (got,) = torch.autograd.grad(losses, logits, grad)
    reference_logits = logits.detach().float().requires_grad_()
    want = F.cross_entropy(reference_logits, labels, reduction="none")
    (want_grad,) = torch.autograd.grad(want, reference_logits, grad)
    record("triton cross entropy losses (bf16 logits)", max_diff(losses, want), None, limit=1e-3)
    # the kernel writes bf16 gradients: the baseline is float32's gradient rounded to bf16
    record("triton cross entropy logit grads", max_diff(got, want_grad), max_diff(want_grad.bfloat16(), want_grad))


def check_transformers() -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config
    from transformers.utils import is_flash_attn_2_available

    record("transformers sees flash-attn 2 (the stand-in)", 0.0 if is_flash_attn_2_available() else 1.0, None, limit=0.0)
    config = Qwen3Config(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    models = {}
    for impl in ("flash_attention_2", "sdpa"):
        torch.manual_seed(3)  # the same weights
        with torch.device("cuda"):
            # a config of its own: from_config records the attention implementation on the config
            # it is given, so a shared one would leave both models on the last one chosen
            models[impl] = AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation=impl, dtype=torch.bfloat16
            ).eval()
    assert models["flash_attention_2"].config._attn_implementation == "flash_attention_2"
    models["flash_attention_2"].load_state_dict(models["sdpa"].state_dict())
    lengths = [300, 17, 1000, 64]
    ids = [torch.randint(0, 1024, (n,), device="cuda") for n in lengths]
    with torch.no_grad():
        packed = models["flash_attention_2"](torch.cat(ids).unsqueeze(0),
                                             position_ids=torch.cat([torch.arange(n, device="cuda") for n in lengths]).unsqueeze(0)).logits[0]
        width = max(lengths)
        padded_ids = torch.zeros(len(lengths), width, dtype=torch.long, device="cuda")
        mask = torch.zeros_like(padded_ids)
        for r, row in enumerate(ids):
            padded_ids[r, : row.numel()], mask[r, : row.numel()] = row, 1
        padded = models["sdpa"](padded_ids, attention_mask=mask).logits
        separate = torch.cat([models["sdpa"](row.unsqueeze(0)).logits[0] for row in ids])
        separate_fa2 = [models["flash_attention_2"](row.unsqueeze(0)).logits[0] for row in ids]
    unpadded = torch.cat([padded[r, :n] for r, n in enumerate(lengths)])
    baseline = max_diff(unpadded, separate)  # sdpa padded vs sdpa one row at a time: bf16 noise of the model
    # where a packed difference comes from: each row alone through flash_attention_2 (flash_attn_func),
    # and each packed segment against its row alone
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for r, n in enumerate(lengths):
        alone = separate_fa2[r]
        print(f"INFO row {r} ({n} tokens): fa2 alone vs sdpa alone {max_diff(alone, separate[bounds[r]:bounds[r + 1]]):.3e}; "
              f"packed segment vs fa2 alone {max_diff(packed[bounds[r]:bounds[r + 1]], alone):.3e}; "
              f"logit scale {float(alone.abs().max()):.2f}", flush=True)
    record("transformers packed flash_attention_2 vs padded sdpa logits", max_diff(packed, unpadded), baseline,
           limit=2 * baseline + 2e-2)


def _milliseconds(fn, warmup: int = 3, repeats: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def time_it() -> None:
    """Forward + backward of one packed 8192-token micro-batch at Qwen3-4B's attention shape: the
    stand-in against SDPA's flash backend on the same rows padded (reported, not asserted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lengths = [4352, 2048, 1024, 512, 256]
    total = sum(lengths)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(total, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def run():
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
        out.backward(torch.ones_like(out))

    varlen_ms = _milliseconds(run)
    qp = torch.randn(len(lengths), 32, max(lengths), 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kp, vp = (torch.randn(len(lengths), 8, max(lengths), 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def run_padded():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))

    padded_ms = _milliseconds(run_padded)
    results.append({"check": "timing", "varlen_fwd_bwd_ms": varlen_ms, "padded_sdpa_fwd_bwd_ms": padded_ms, "ok": True})
    print(f"TIME packed {total} tokens fwd+bwd: stand-in varlen {varlen_ms:.2f} ms; padded SDPA flash {padded_ms:.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    print(f"stand-in {flash_attn.__version__} at {flash_attn.__file__}; torch {torch.__version__}; "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    for check in (check_varlen, check_padded, check_cross_entropy, check_transformers, time_it):
        try:
            check()
        except Exception as error:  # noqa: BLE001 -- report every check
            results.append({"check": check.__name__, "ok": False, "error": f"{type(error).__name__}: {error}"})
            print(f"FAIL {check.__name__}: {type(error).__name__}: {error}", flush=True)
    failed = [r["check"] for r in results if not r["ok"]]
    print(f"flash_attn stand-in: {len(results) - len(failed)} passed, {len(failed)} failed {failed}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
