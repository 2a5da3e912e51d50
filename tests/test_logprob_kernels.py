"""The Triton kernels of the fused logprob head (compute/logprob_kernels.py), on CPU under Triton's interpreter.

A fresh process (TRITON_INTERPRET is read when triton is imported) runs the kernels against the eager chains
they replace: each kernel alone on a vocabulary shard where some labels belong to another shard (their logit
and gradient term are 0), over rows longer than one step of the walk (a masked tail), with and without the
entropy and the temperature; then the whole head, values and both gradients, through `vocab_parallel_logprobs`
with the kernels taken as on a GPU.
"""

from __future__ import annotations

from skyrl_megatron.testing import last_word_under_triton_interpreter

_TRITON_CHECK = """
import torch
from skyrl_megatron.compute import logprob_kernels, logprobs

VOCAB = 2 * logprob_kernels._STATISTICS_BLOCK + 300  # two whole steps of a row's walk and a masked tail
checked = 0
for dtype in (torch.float32, torch.bfloat16):
    for temperature in (1.0, 0.7):
        for with_entropy in (False, True):
            gen = torch.Generator().manual_seed(checked)
            rows = 6
            logits = (torch.randn(rows, VOCAB, generator=gen) * 4).to(dtype)
            labels = torch.randint(0, VOCAB, (rows,), generator=gen)
            labels[0], labels[1] = -3, VOCAB + 5  # other shards' labels, below and above this one's
            target, owned = logprobs._local_targets(labels, 0, VOCAB)
            assert not owned.all() and owned.any()

            want = logprobs._shard_statistics_eager(logits.clone(), target, owned, temperature, with_entropy)
            got = logprob_kernels.shard_statistics(logits, target, owned, temperature, with_entropy)
            assert (got[3] is None) == (not with_entropy)
            for name, a, b in zip(("max", "sum", "target logit", "weighted"), got, want):
                if b is not None:
                    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, msg=lambda m: f"{name} {dtype} {m}")

            lse = want[0] + want[1].log()
            entropy = (want[1].log() - want[3] / want[1]) if with_entropy else None
            # every other case expanded from one value (stride 0), as autograd hands a sum's gradient over
            g_logprob = torch.randn(1, generator=gen).expand(rows) if checked % 2 else torch.randn(rows, generator=gen)
            g_entropy = torch.randn(rows, generator=gen) if with_entropy else None
            want_grad = logprobs._logit_grads_eager(logits.clone(), lse, g_logprob, target, owned, temperature,
                                                    entropy, g_entropy).to(dtype)
            buffer = logits.clone()
            got_grad = logprob_kernels.logit_grads_(buffer, lse, g_logprob, target, owned, temperature,
                                                    entropy, g_entropy)
            assert got_grad.data_ptr() == buffer.data_ptr() and got_grad.dtype == dtype
            tolerance = dict(rtol=1.6e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(got_grad, want_grad, **tolerance)
            checked += 1

# the whole head: kernels taken as on a GPU, against the eager chunks, bf16 weights, entropy and temperature
logprobs._triton_runs_on = lambda device: True
gen = torch.Generator().manual_seed(7)
hidden = torch.randn(23, 64, generator=gen).to(torch.bfloat16)
weight = (torch.randn(VOCAB, 64, generator=gen) / 8).to(torch.bfloat16)
labels = torch.randint(0, VOCAB, (23,), generator=gen)
mask = torch.rand(23, generator=gen) > 0.3
loss_weights = torch.randn(2, 23, generator=gen)
results = {}
# eager; the kernels recomputing every chunk's logits; the kernels on the first chunk's kept logits, which the
# gradient kernel overwrites
for fused, kept_bytes in ((False, 0), (True, 0), (True, 9 * VOCAB * 2)):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = logprobs.vocab_parallel_logprobs(h, w, labels, mask=mask, temperature=0.8, with_entropy=True,
                                           chunk_tokens=9, fused=fused, kept_logits_bytes=kept_bytes)
    ((loss_weights[0] * out.logprobs).sum() + (loss_weights[1] * out.entropy).sum()).backward()
    results[fused, kept_bytes] = (out.logprobs, out.entropy, h.grad, w.grad)
for variant in ((True, 0), (True, 9 * VOCAB * 2)):
    for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight"), results[variant], results[False, 0]):
        error = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert error <= (1e-5 if name in ("logprobs", "entropy") else 1e-2), (variant, name, error)
for a, b in zip(results[True, 0], results[True, 9 * VOCAB * 2]):
    assert torch.equal(a, b)
checked += 1
print("checked", checked)
"""


def test_the_triton_kernels_match_the_eager_chunks():
    assert last_word_under_triton_interpreter(_TRITON_CHECK, timeout=600) == "9"
