"""Assemble the flash_attn stand-in as an importable site directory:

    DEST/flash_attn/                   our __init__ and flash_attn_interface (PyTorch FA2 kernels), plus
                                       flash-attn's own bert_padding.py and ops/triton/cross_entropy.py,
                                       copied unchanged from an installed flash-attn's Python files
                                       and flash-attn-4's flash_attn/cute where the library holds it
                                       (the route FLASH_ATTN_STANDIN_KERNEL=flash4 takes)
    DEST/flash_attn-2.8.3.dist-info/   the distribution metadata transformers checks for flash_attention_2

    python bench/flash_attn_standin/assemble.py DEST [--library DIR]

DIR is flash-attn's package directory (default: where `flash_attn` is found on this Python's path:
the venv's pure-Python install on a CPU box, /tmp/site/flash_attn on the GPU machines, which
bench/device_setup.sh fills from .whl6/flash_attn_pkg). Put DEST first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VERSION = "2.8.3"
OURS = ("__init__.py", "flash_attn_interface.py")
FLASH4_PACKAGE = "cute"  # flash-attn-4's namespace, flash_attn.cute: carried along where the library has it
LIBRARY_FILES = ("bert_padding.py", "ops/__init__.py", "ops/triton/__init__.py", "ops/triton/cross_entropy.py")


def installed_library() -> Path:
    # not our own half-package beside this file (on sys.path when this file runs as a script)
    path = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]
    spec = importlib.machinery.PathFinder.find_spec("flash_attn", path)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("assemble: no flash_attn package on this Python's path; pass --library DIR "
                         "(flash-attn's package directory, e.g. .whl6/flash_attn_pkg from bench/fetch_wheels.sh)")
    return Path(next(iter(spec.submodule_search_locations)))


def assemble(dest: Path, library: Path | None = None) -> Path:
    """Write the stand-in into `dest` (replacing an earlier one) and return `dest`."""
    library = Path(library) if library is not None else installed_library()
    missing = [name for name in LIBRARY_FILES if not (library / name).is_file()]
    if missing:
        raise SystemExit(f"assemble: {library} lacks flash-attn's {', '.join(missing)}")
    package = dest / "flash_attn"
    if package.exists():
        shutil.rmtree(package)
    for name in LIBRARY_FILES:
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library / name, package / name)
    for name in OURS:
        shutil.copyfile(HERE / "flash_attn" / name, package / name)
    if (library / FLASH4_PACKAGE).is_dir():  # flash-attn-4 installed inside the library's package (device_setup.sh 4)
        shutil.copytree(library / FLASH4_PACKAGE, package / FLASH4_PACKAGE)
    info = dest / f"flash_attn-{VERSION}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: flash-attn\nVersion: {VERSION}\n"
        "Summary: stand-in (skyrl-megatron bench): flash-attn's API on PyTorch's FlashAttention-2 kernels\n"
    )
    (info / "top_level.txt").write_text("flash_attn\n")
    (info / "INSTALLER").write_text("skyrl-megatron bench/flash_attn_standin/assemble.py\n")
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--library", type=Path, help="flash-attn's package directory (default: the installed one)")
    args = parser.parse_args()
    print(assemble(args.dest, args.library))


if __name__ == "__main__":
    main()
