"""The image's pinned package set resolves: pip resolves every pin of docker/Dockerfile.megatron together
(plus this plugin's own declared dependencies), without building or installing anything.

Needs registry access (PyPI, the image's only index): marked `registry`. If pip cannot reach the index the
test fails and says so; it never skips for that. pip reads each wheel's metadata from the index (PEP 658) or,
where the index serves none (NVIDIA's CUDA wheels, hundreds of MB each), by HTTP range requests into the wheel
(`--use-feature=fast-deps`): no whole wheel is downloaded, so a transfer cut off midway costs little. Such a
resolve is retried afresh, at most twice; a conflict is never retried. Takes ~3 min against PyPI, most of it
round trips.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_docker import ROOT, build_args, installs, requirements

pytestmark = pytest.mark.registry

# pip prints these when the index cannot be reached at all (DNS, proxy, TLS, refused connection).
UNREACHABLE = re.compile(r"NameResolutionError|NewConnectionError|ProxyError|SSLError|Max retries exceeded|Network is unreachable|ConnectTimeout")
# pip prints these when the index was reached but a transfer broke off: worth a fresh attempt.
INTERRUPTED = re.compile(r"incomplete-download|Connection interrupted|IncompleteRead|Connection broken|ReadTimeoutError|ConnectionResetError")
RESOLVE_ATTEMPTS = 3
# The image's pip reads no config (the base image's constraint is cleared); this machine's pip config and
# PIP_* variables must not change the answer either. Where CI points pip at a mirror of PyPI, these carry over.
FORWARDED_ENV = {"PIP_INDEX_URL": "--index-url", "PIP_CERT": "--cert", "PIP_PROXY": "--proxy"}


def image_pins() -> tuple[list[str], list[str]]:
    """(installed with dependencies, installed with --no-deps) requirement strings of the Dockerfile."""
    with_deps, no_deps = [], []
    for args in installs(("pip",)):
        specs = [spec for spec in requirements(args) if spec != "."]
        (no_deps if "--no-deps" in args else with_deps).extend(specs)
    return with_deps, no_deps


def plugin_requirements() -> list[str]:
    """What pyproject.toml declares for the plugin under skyrl 0.4 (the image installs it with --no-deps)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"]["skyrl"]


def pip_resolve(specs: list[str], tmp_path: Path, name: str, *flags: str) -> dict[str, str]:
    """Resolve `specs` with `pip install --dry-run --report`; {normalised name: version} of the result."""
    req_file, report = tmp_path / f"{name}.txt", tmp_path / f"{name}.json"
    req_file.write_text("\n".join(specs) + "\n")
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
           "--use-feature=fast-deps", "--timeout", "60", "--retries", "2", "--report", str(report), *flags,
           "-r", str(req_file)]
    for var, option in FORWARDED_ENV.items():
        if os.environ.get(var):
            cmd += [option, os.environ[var]]
    # flash-attn is an sdist whose setup imports torch: its metadata is built here without build isolation,
    # as pure Python (no CUDA compile, no prebuilt-binary download), exactly as the image installs it.
    # PIP_CONFIG_FILE=os.devnull: no pip config file at all (--isolated still reads the site-wide one).
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE", "FLASH_ATTENTION_FORCE_BUILD": "TRUE"}
    for attempt in range(1, RESOLVE_ATTEMPTS + 1):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        log = (out.stdout + out.stderr)[-6000:]
        if out.returncode == 0 or not INTERRUPTED.search(log):
            break
        print(f"pip resolve ({name}) attempt {attempt}/{RESOLVE_ATTEMPTS}: a download broke off, resolving afresh", file=sys.stderr)
    if out.returncode != 0 and (UNREACHABLE.search(log) or INTERRUPTED.search(log)):
        pytest.fail(f"pip could not reach the package index (or its downloads kept breaking off after {RESOLVE_ATTEMPTS} "
                    f"attempts): this test needs registry access (PyPI).\n{log}")
    assert out.returncode == 0, f"the image's pins do not resolve ({name}):\n{log}"
    resolved = json.loads(report.read_text())["install"]
    return {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item["metadata"]["version"] for item in resolved}


def pinned(specs: list[str]) -> dict[str, str]:
    return {re.sub(r"[-_.]+", "-", re.sub(r"\[.*\]", "", spec.partition("==")[0])).lower(): spec.partition("==")[2] for spec in specs}


@pytest.fixture(scope="module", autouse=True)
def the_image_platform():
    # Environment markers are evaluated for this interpreter: it must be the image's (Linux x86_64, CPython 3.12).
    if not (sys.platform == "linux" and platform.machine() == "x86_64" and sys.version_info[:2] == (3, 12)):
        pytest.skip(f"resolves for the image's platform only (Linux x86_64, Python 3.12), not {sys.platform} {platform.machine()} {sys.version.split()[0]}")
    # flash-attn's metadata build imports torch (requirements/base.txt installs it before anything else)
    assert importlib.util.find_spec("torch"), "torch is needed to build flash-attn's metadata: run scripts/setup.sh"


def test_every_pin_of_the_image_resolves_together_with_transformer_engine_and_the_plugin(tmp_path):
    with_deps, _ = image_pins()
    assert any(spec.startswith("transformer-engine[") for spec in with_deps)  # the WITH_TE=1 set is a superset
    resolved = pip_resolve(with_deps + plugin_requirements(), tmp_path, "image", "--no-build-isolation")
    for name, version in pinned(with_deps).items():
        assert resolved.get(name) == version, (name, version, resolved.get(name))
    # torch's PyPI wheel brings the CUDA runtime the build arg names (and the base image's nvcc must match)
    assert resolved["cuda-toolkit"].startswith(build_args()["CUDA_VERSION"] + "."), resolved["cuda-toolkit"]


def test_the_packages_installed_without_dependencies_exist_for_the_image_platform(tmp_path):
    _, no_deps = image_pins()
    assert "megatron-bridge==0.6.2" in no_deps and "flash-attn==2.8.3" in no_deps
    resolved = pip_resolve(no_deps, tmp_path, "no-deps", "--no-deps", "--no-build-isolation")
    assert resolved == pinned(no_deps)
