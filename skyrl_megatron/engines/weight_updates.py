"""Weight updates an engine receives: HF-named full tensors, checked as a whole before any is written."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

import torch


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    dtype = name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must name a floating-point torch dtype (float32, bfloat16, ...), got {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorAnnouncement:
    """What a broadcast will carry, in order: the receivers allocate from it before the tensors arrive."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(f"{len(self.names)} names, {len(self.dtypes)} dtypes, {len(self.shapes)} shapes")
        if not self.names:
            raise ValueError("weight update must not be empty")

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> TensorAnnouncement:
        return cls(
            names=tuple(tensors),
            dtypes=tuple(str(t.dtype) for t in tensors.values()),
            shapes=tuple(tuple(t.shape) for t in tensors.values()),
        )

    def empty_tensors(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=torch_dtype(dtype), device=device) for dtype, shape in zip(self.dtypes, self.shapes)]


def check_update(parameters: Mapping[str, torch.Tensor], names: list[str], tensors: list[torch.Tensor]) -> None:
    """Every problem with an update at once, before anything is written (all or nothing)."""
    problems = []
    if len(names) != len(tensors):
        problems.append(f"{len(names)} names but {len(tensors)} tensors")
    for name, tensor in zip(names, tensors):
        target = parameters.get(name)
        if target is None:
            close = difflib.get_close_matches(name, parameters, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"{name}: not a parameter of this model{hint}")
        elif target.shape != tensor.shape:
            problems.append(f"{name}: shape {list(tensor.shape)}, model has {list(target.shape)}")
        elif target.dtype != tensor.dtype:
            problems.append(f"{name}: dtype {tensor.dtype}, model has {target.dtype} (export in the engine's dtype)")
    if problems:
        raise ValueError("weight update rejected, nothing was loaded:\n  " + "\n  ".join(problems))
