"""Tensor fingerprints: equal digests mean bitwise-equal tensors (same dtype bit patterns and bytes).

Kept apart from the weight export so an engine process can check what it holds without importing
Megatron or the model code.
"""

from __future__ import annotations

import hashlib

import torch


def tensor_sha256(tensor: torch.Tensor) -> str:
    """A fingerprint of a tensor's bytes (and so of its dtype's bit patterns): equal digests, bitwise equal."""
    data = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()
