"""Field names of Megatron-Core's config dataclasses, read from their source without importing them.

Our validation checks the pass-through sections (``ddp_config``, ``optimizer_config_kwargs``,
``transformer_config_kwargs``) against Megatron's dataclasses. Importing those pulls in torch and
most of Megatron-Core (seconds, and console lines), so a config error would print late. The field
names are the annotated assignments of each class body and its dataclass bases, which `ast` reads
from the installed files in milliseconds; `tests/test_config.py` checks them against
``dataclasses.fields`` of the imported classes.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

# pass-through section -> (module, class)
SECTIONS = {
    "ddp_config": ("megatron.core.distributed.distributed_data_parallel_config", "DistributedDataParallelConfig"),
    "optimizer_config_kwargs": ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
    "transformer_config_kwargs": ("megatron.core.transformer.transformer_config", "TransformerConfig"),
}


def _source(module: str) -> ast.Module:
    # locate the top-level package only: finding `megatron.core.x` would import `megatron.core` (and torch)
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root, *rest.split(".")).with_suffix(".py")
        if path.is_file():
            return ast.parse(path.read_text())
    raise ModuleNotFoundError(f"no source file for {module}")


def _resolve(module: str, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = module.split(".")[: -level]
    return ".".join(base + ([name] if name else []))


@functools.cache
def field_names(module: str, cls: str) -> frozenset[str]:
    """The dataclass field names of `module.cls`, bases included (annotations minus ClassVar)."""
    tree = _source(module)
    imported = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                imported[alias.asname or alias.name] = _resolve(module, node.level, node.module)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            names: set[str] = set()
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in imported:
                    names |= field_names(imported[base.id], base.id)
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    if "ClassVar" not in ast.unparse(item.annotation):
                        names.add(item.target.id)
            return frozenset(names)
    raise LookupError(f"{cls} not found in {module}")


def section_fields() -> dict[str, tuple[str, frozenset[str]]]:
    """Pass-through section -> (Megatron dataclass name, its field names)."""
    return {section: (cls, field_names(module, cls)) for section, (module, cls) in SECTIONS.items()}
