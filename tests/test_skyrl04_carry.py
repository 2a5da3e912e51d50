"""bench/fetch_wheels.sh's skyrl04 mode and bench/device_setup.sh's parts s1-s3 (skyrl 0.4 carried to a lent GPU
machine) agree: every folder fetched is installed by a part, Ray's halves are joined in the order and under the
name they were split, nothing the vLLM bundle carries is carried twice, and env04 puts /tmp/site04 alone first."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FETCH = (REPO / "bench" / "fetch_wheels.sh").read_text()
SETUP = (REPO / "bench" / "device_setup.sh").read_text()


def _block(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end, text.index(start))]


SKYRL04 = _block(FETCH, "if [[ $ONLY == skyrl04 ]]; then", "\nfi\n")


def _part(name: str) -> str:
    """The body of device_setup.sh's `case` branch NAME."""
    match = re.search(rf"^  {re.escape(name)}\)\n(.*?)^    ;;", SETUP, re.S | re.M)
    assert match, f"device_setup.sh has no part {name}"
    return match.group(1)


def _logical_lines(text: str) -> list[str]:
    return [line for line in text.replace("\\\n", " ").splitlines() if not line.lstrip().startswith("#")]


def test_every_folder_fetched_is_installed_by_one_part_of_its_own():
    fetched = re.findall(r"\.whls\d+", SKYRL04)
    folders = sorted(set(fetched))
    assert folders == [".whls1", ".whls2", ".whls3"]
    created = re.search(r"mkdir -p ((?:\.whls\d+ ?)+)", SKYRL04).group(1).split()
    assert sorted(created) == folders
    for i, folder in enumerate(folders, start=1):
        assert f"cp -r {folder}/. /tmp/stage/s04/" in _part(f"s{i}"), f"part s{i} does not stage {folder}"
    # s3 installs everything staged into /tmp/site04, in one pip call
    s3 = _part("s3")
    assert "${PIP/\\/tmp\\/site//tmp/site04} /tmp/stage/s04/*.whl /tmp/stage/s04/*.tar.gz" in s3
    # what is not a wheel: antlr4's sdist (installed through *.tar.gz) and flash-attn's files (copied)
    assert "--no-binary :all: -d .whls1 \"antlr4-python3-runtime" in SKYRL04
    assert "flash_attn_files .whls3" in SKYRL04 and "/tmp/stage/s04/flash_attn_pkg /tmp/site04/flash_attn" in s3


def test_rays_halves_are_joined_in_order_under_the_name_they_were_split():
    split = re.search(r'download_in_halves "ray==\$RAY04" "ray-\$RAY04-([^"]+)" \S+ (\w+) (\.whls\d) (\.whls\d)', SKYRL04)
    assert split, "the skyrl04 mode no longer splits Ray"
    tail, prefix, first, second = split.groups()
    assert (first, second) == (".whls1", ".whls2")  # the first half arrives in s1, the second in s2
    pinned = re.search(r"^ray==(\S+)", (REPO / "requirements" / "host04.txt").read_text(), re.M).group(1)
    wheel = f"ray-{pinned}-{tail}"
    s2 = _part("s2")
    assert f"cat /tmp/stage/s04/{prefix}aa /tmp/stage/s04/{prefix}ab > /tmp/stage/s04/{wheel}" in s2
    assert f"test -f /tmp/stage/s04/{prefix}aa" in s2
    assert f"test -f /tmp/stage/s04/{wheel}" in _part("s3")


def _names(spec_text: str) -> set[str]:
    names = set()
    for word in shlex.split(spec_text):
        if word.startswith(("-", "$", ".", '"')) or word in {"download", "pinned", "$(pinned"}:
            continue
        names.add(re.split(r"[=<>)]", word)[0].lower().replace("_", "-"))
    return names - {""}


def test_nothing_the_vllm_bundle_carries_is_carried_again():
    carried = set()
    for line in _logical_lines(SKYRL04):
        if line.lstrip().startswith("download .whls"):
            carried |= _names(line.split(None, 2)[2].replace("$(pinned", " ").replace(")", " "))
    assert {"skyrl", "skyrl-gym", "vllm-router", "megatron-core", "transformers", "fastapi"} <= carried
    assert "torch" not in carried and "vllm" not in carried
    vllm_deps = re.search(r"VLLM_DEPS=\((.*?)\)", FETCH, re.S).group(1)
    vllm_pinned = re.search(r"VLLM_PINNED=\((.*?)\)", FETCH, re.S).group(1)
    bundle = _names(vllm_deps) | _names(vllm_pinned)
    assert "pyzmq" in bundle and "setproctitle" in bundle
    assert not carried & bundle, f"carried twice: {sorted(carried & bundle)}"


def test_env04_puts_site04_first_and_keeps_the_machines_settings(tmp_path):
    (tmp_path / "skyrl_megatron").mkdir()
    script = REPO / "bench" / "device_setup.sh"
    shown = subprocess.run(
        ["bash", "-c", f"source {script} env04 && echo \"$PYTHONPATH\" && echo \"$PATH\" && "
         "echo $NCCL_NVLS_ENABLE $TORCH_SYMM_MEM_DISABLE_MULTICAST $NVSHMEM_DISABLE_NVLS"],
        cwd=tmp_path, capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONPATH": ""})
    assert shown.returncode == 0, shown.stderr
    pythonpath, path, settings = shown.stdout.splitlines()
    entries = pythonpath.split(":")
    if os.path.isdir("/tmp/site04/vllm"):  # with vLLM installed there, the bridges come first
        assert entries[0] == f"{tmp_path}/bench/vllm_bridges"
        entries = entries[1:]
    assert entries == ["/tmp/site04", str(tmp_path), f"{tmp_path}/bench"]  # /tmp/site (Ray 2.51, skyrl-train) absent
    assert path.startswith("/tmp/site04/bin:")
    assert settings == "0 1 1"
    assert os.readlink(tmp_path / "skyrl_megatron" / "conf") == "../config"


def test_device_jobs_takes_the_skyrl04_environment_where_it_was_installed():
    jobs = (REPO / "bench" / "device_jobs.sh").read_text()
    assert ("if [ -d /tmp/site04 ]; then source bench/device_setup.sh env04; "
            "elif [ -d /tmp/site ]; then source bench/device_setup.sh env; fi") in jobs
