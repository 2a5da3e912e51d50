#!/bin/bash
# Rebuild the ignored wheel folders .whl ... .whl6 that bench/device_setup.sh installs on a lent GPU
# machine (see its header for what goes in which device call). Run in the repository root of a
# checkout whose .git/info/exclude ignores `/.whl*/`:
#
#   bash bench/fetch_wheels.sh            # versions read from the venv ($VENV, default /work/main/.venv-skyrl-train)
#   bash bench/fetch_wheels.sh vllm       # only the vLLM folders .whlv1 ... .whlv4
#   bash bench/fetch_wheels.sh skyrl04    # only the skyrl 0.4 folders .whls1 ... .whls3 (versions from $VENV04,
#                                         # default /work/main/.venv; device_setup.sh s1-s3 install them)
#
# Versions are those installed in $VENV, the skyrl-train 0.3.1 environment (`make setup-skyrl-train`):
# the GPU machines run skyrl-train 0.3.1, as CI's second leg does here. Not carried:
# what the machines' image already has (torch 2.11+cu130, peft, numpy, pandas, pyarrow, triton,
# aiohttp, protobuf, ...: .library/device/KINDS.md). transformers IS carried: the image has 5.17,
# Megatron-Bridge 0.6.2 allows at most 5.12.1, and 5.12.1 needs tokenizers < 0.23 (the image has
# 0.23.2). Each device call carries at most 64 MiB: Ray's wheel (71 MB) travels in two halves.
set -euo pipefail
VENV=${VENV:-/work/main/.venv-skyrl-train}
PY="$VENV/bin/python"
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pinned() { for name in "$@"; do echo "$name==$(version "$name")"; done; }

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {  # download DIR SPEC...: binary wheels for the machine (CPython 3.12, x86-64 Linux), no deps
    local dir=$1; shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$dir" "$@"
}
download_in_halves() {  # SPEC WHEEL PART_SIZE PREFIX DIR_A DIR_B: a wheel too large for one device call,
    # split in two parts that device_setup.sh joins back into WHEEL on the machine
    local spec=$1 wheel=$2 size=$3 prefix=$4 first=$5 second=$6 dir
    dir=$(mktemp -d)
    download "$dir" "$spec"
    test -f "$dir/$wheel" || { echo "fetch_wheels: expected $wheel, got $(ls "$dir")" >&2; exit 1; }
    (cd "$dir" && split -b "$size" "$wheel" "$prefix")
    mv "$dir/${prefix}aa" "$first/"
    mv "$dir/${prefix}ab" "$second/"
    test ! -e "$dir/${prefix}ac" || { echo "fetch_wheels: $wheel split in more than two parts" >&2; exit 1; }
    rm -rf "$dir"
}

download_py_spy() {  # DIR: py-spy (not in the venvs: pinned here; its wheel names an older manylinux), which dumps
    # the stacks of a run that stalls on the machine
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$1" py-spy==0.4.3
}

flash_attn_files() {  # DIR VERSION: flash-attn's own pure-Python files, unchanged, from its sdist, into DIR/flash_attn_pkg
    local dir=$1 version=$2 tmp src file
    tmp=$(mktemp -d)
    # (pip prepares its metadata by running its setup.py: in the venv, which has torch, with no CUDA build)
    FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
        -d "$tmp" "flash-attn==$version"
    tar -xzf "$tmp"/flash_attn-"$version".tar.gz -C "$tmp"
    src="$tmp/flash_attn-$version/flash_attn"
    for file in bert_padding.py ops/__init__.py ops/triton/__init__.py ops/triton/cross_entropy.py; do
        mkdir -p "$dir/flash_attn_pkg/$(dirname "$file")"
        cp "$src/$file" "$dir/flash_attn_pkg/$file"
    done
    rm -rf "$tmp"
}

ONLY=${1:-all}
if [[ $ONLY == all ]]; then
rm -rf .whl .whl2 .whl3 .whl4 .whl5 .whl6 .whl7 .whl8 .whl9
mkdir -p .whl .whl2 .whl3 .whl4 .whl5 .whl6 .whl7 .whl8 .whl9

# .whl (call 1): the training stack (tokenizers travels in .whl5: call 1 carries Ray's first half too)
download .whl $(pinned megatron-core megatron-bridge transformers omegaconf hydra-core)
# antlr4's 4.9.3 (the only version hydra-core 1.3.2 takes) is published as an sdist only
"$PY" -m pip download -q --no-deps --no-binary :all: -d .whl "antlr4-python3-runtime==$(version antlr4-python3-runtime)"

# .whl3 + .whl4: Ray in two halves, joined on the machine by device_setup.sh 2
# (the wheel's name is the one device_setup.sh 2 joins into)
download_in_halves "ray==$(version ray)" "ray-$(version ray)-cp312-cp312-manylinux2014_x86_64.whl" 38M raypart_ .whl3 .whl4

# .whl2 (call 2): the host and the small pure-Python packages its imports (and Ray's) need
download .whl2 $(pinned skyrl-train loguru pydantic pydantic_core typing-inspection fastapi starlette uvicorn \
    opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto \
    opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-http \
    opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common googleapis-common-protos \
    jsonschema jsonschema-specifications referencing rpds-py)
# .whl5 (call 2); py-spy (not in the venv: pinned here) dumps the stacks of a run that stalls on the machine
download .whl5 $(pinned annotated-types sniffio tokenizers)
# ray[default]'s own dependencies: with them Ray's dashboard agent serves the metrics exporter (a minimal Ray
# logs an error in every process); a call of their own (call 5) for the 64 MiB limit
download .whl9 $(pinned aiohttp aiohttp_cors aiosignal aiohappyeyeballs frozenlist multidict propcache yarl wrapt colorful \
    opencensus opencensus-context opentelemetry-exporter-prometheus prometheus_client smart_open virtualenv distlib \
    google-api-core google-auth proto-plus pyasn1 pyasn1-modules)
download_py_spy .whl5
# .whl6 (call 2): imported by the host trainer's modules
download .whl6 $(pinned botocore jmespath datasets multiprocess dill torchdata skyrl-gym)

# .whl6/flash_attn_pkg: flash-attn 2.8.3's own pure-Python files, unchanged, from its sdist: the
# padding helpers (the host imports them) and the Triton cross entropy (the host's logprobs). No
# CUDA extension: device_setup.sh puts a version line in place of its __init__, and
# bench/flash_attn_standin/ adds attention functions on torch's FlashAttention-2 kernels.
flash_attn_files .whl6 "$(version flash_attn)"

# .whl7 + .whl8 (calls 3 and 4, only for flash-attn-4): flash-attn-4's CuTe kernels and the
# CuTe DSL they compile with (not in the venv: pinned here). The DSL's CUDA 13 library wheel (92 MB) travels
# in two halves, joined on the machine by device_setup.sh 4.
FA4_PINS=(flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
          nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5)  # the image has
# cuda-bindings, cuda-pathfinder and einops (.library/device/KINDS.md)
download .whl7 --pre "${FA4_PINS[@]}"
# two of them ride with the second half (call 3 stays under 64 MiB with the working tree)
mv .whl7/apache_tvm_ffi-*.whl .whl7/nvidia_cutlass_dsl_libs_base-*.whl .whl8/
# (the wheel's name is the one device_setup.sh 4 joins into)
download_in_halves nvidia-cutlass-dsl-libs-cu13==4.8.1 nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
    47M cutlasspart_ .whl7 .whl8

echo "fetch_wheels: MiB per device call (limit 64, the working tree included):"
echo "  call 1 (.whl .whl3):             $(du -cm .whl .whl3 | tail -1 | cut -f1)"
echo "  call 2 (.whl2 .whl4 .whl5 .whl6): $(du -cm .whl2 .whl4 .whl5 .whl6 | tail -1 | cut -f1)"
echo "  call 3 (.whl7):                   $(du -cm .whl7 | tail -1 | cut -f1)"
echo "  call 4 (.whl8):                   $(du -cm .whl8 | tail -1 | cut -f1)"
echo "  call 5 (.whl9):                   $(du -cm .whl9 | tail -1 | cut -f1)"
fi

if [[ $ONLY == skyrl04 ]]; then
# .whls1 ... .whls3 (calls s1-s3 of device_setup.sh, which install them all into /tmp/site04 in call s3): the skyrl
# 0.4 host and what it, our package and vLLM's servers import that the image lacks, at the versions of the skyrl 0.4
# environment ($VENV04, `scripts/setup.sh`). Self-contained: /tmp/site (skyrl-train 0.3.1, Ray 2.51) is not used;
# vLLM itself comes from .whlv1-4 (calls v1-v4 after s3 put it into /tmp/site04 too), so its small dependencies
# there (VLLM_DEPS below: pyzmq, openai, msgspec, setproctitle, pybase64, ...) are not carried again here.
# Not carried: the image's packages (torch 2.11 stays; tokenizers 0.23.2 fits transformers 5.16.1), wandb (skyrl
# imports it only for logger=wandb), the cloud clients (gcsfs, s3fs, google-cloud-storage, botocore: optional
# imports), nixl, tensordict, polars, debugpy (not imported by the trainer), Transformer Engine (ours replaces
# skyrl's Megatron worker).
VENV04=${VENV04:-/work/main/.venv}
PY=$VENV04/bin/python  # (read by version, pinned and download)
RAY04=$(version ray)
rm -rf .whls1 .whls2 .whls3
mkdir -p .whls1 .whls2 .whls3
# .whls1: the first half of Ray 2.57 (skyrl 0.4 pins it), Megatron, hydra-core 1.3.4 (skyrl's pin), omegaconf
download .whls1 $(pinned megatron-core megatron-bridge omegaconf hydra-core)
"$PY" -m pip download -q --no-deps --no-binary :all: -d .whls1 "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
# .whls2: Ray's second half (the wheel's name is the one device_setup.sh s2 joins into), the host, Ray's imports,
# the web stack of the host's and vLLM's servers, and vLLM's OpenAI server's imports that .whlv1-4 lack
download_in_halves "ray==$RAY04" "ray-$RAY04-cp312-cp312-manylinux2014_x86_64.whl" 38M raypart_ .whls1 .whls2
download .whls2 $(pinned skyrl skyrl-gym loguru cloudpathlib datasets dill multiprocess torchdata orjson \
    fastapi starlette uvicorn python-multipart pydantic pydantic_core typing-inspection annotated-types sniffio \
    jsonschema jsonschema-specifications referencing rpds-py \
    opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto \
    opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-http \
    opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common googleapis-common-protos \
    google-api-core google-auth proto-plus pyasn1 pyasn1-modules platformdirs \
    model-hosting-container-standards supervisor jmespath)
# .whls3: vllm-router (skyrl 0.4 imports it at module level; 23 MB), transformers 5.16.1 (skyrl 0.4 allows
# <= 5.16.1, the image has 5.17), peft 0.18.1 (skyrl's pin), ray[default]'s own dependencies (as part 5 of
# the 0.3.1 set: without them Ray's dashboard agent logs a missing metrics exporter in every process; not in the
# venv: pinned here, the versions of .whl9), py-spy, and flash-attn's pure-Python files (skyrl 0.4's model
# wrapper imports bert_padding, its logprobs the Triton cross entropy)
download .whls3 $(pinned vllm-router transformers peft)
download .whls3 aiohttp_cors==0.8.1 colorful==0.5.8 opencensus==0.11.4 opencensus-context==0.1.3 \
    opentelemetry-exporter-prometheus==0.66b2 smart_open==9.0.2 virtualenv==21.15.11 distlib==0.4.4
download_py_spy .whls3
flash_attn_files .whls3 "$(version flash_attn)"
echo "fetch_wheels: MiB per device call (limit 64, the working tree included):"
for i in 1 2 3; do echo "  call s$i (.whls$i): $(du -sm .whls$i | cut -f1)"; done
exit 0
fi

# .whlv1 ... .whlv4 (calls v1-v4 of device_setup.sh): vLLM 0.24.0 (the release built for the machines' torch
# 2.11) and the small packages it imports that the image lacks. vLLM's wheel (266 MiB) travels without its
# FlashAttention-2 library and its Rust router binary (on Hopper vLLM's attention takes FlashAttention-3,
# and FA2's import is optional; the router is a separate server): 178 MiB. The trimmed wheel and the small
# wheels go in one tar, split into four parts that device_setup.sh v4 joins.
VLLM_VERSION=0.24.0
VENV_VLLM=${VENV_VLLM:-/work/main/.venv}  # the skyrl 0.4 environment, which installs vllm (requirements/host04.txt)
vllm_dep() { "$VENV_VLLM/bin/python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
# xgrammar 0.2.9 + apache-tvm-ffi 0.1.15.post2 (the venv resolves xgrammar 0.2.3, a 45 MB wheel): both import there
VLLM_PINNED=(xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2)
VLLM_DEPS=(pyzmq openai openai-harmony msgspec cachetools llguidance partial-json-parser cbor2
           blake3 compressed-tensors depyf mistral_common pycountry pydantic-extra-types pybase64 setproctitle ijson
           diskcache lark outlines_core lm-format-enforcer python-json-logger watchfiles jiter distro httpx2 httpcore2
           interegular astor prometheus-fastapi-instrumentator)
tmp=$(mktemp -d)
mkdir -p "$tmp/bundle/deps" "$tmp/wheel"
PLATFORMS+=(--platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
download "$tmp/bundle/deps" "${VLLM_PINNED[@]}" $(for name in "${VLLM_DEPS[@]}"; do echo "$name==$(vllm_dep "$name")"; done)
download "$tmp/wheel" "vllm==$VLLM_VERSION"
"$PY" - "$tmp/wheel"/vllm-$VLLM_VERSION-*.whl "$tmp/bundle/vllm-$VLLM_VERSION-trimmed.zip" <<'PY'
import sys, zipfile
DROP = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")
with zipfile.ZipFile(sys.argv[1]) as src, zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename not in DROP:
            dst.writestr(item, src.read(item.filename), compress_type=zipfile.ZIP_DEFLATED)
PY
rm -rf .whlv1 .whlv2 .whlv3 .whlv4
mkdir -p .whlv1 .whlv2 .whlv3 .whlv4
(cd "$tmp/bundle" && tar cf ../vllm_bundle.tar .)
(cd "$tmp" && split -n 4 -d vllm_bundle.tar vllmpart_)
for i in 1 2 3 4; do mv "$tmp/vllmpart_0$((i - 1))" ".whlv$i/"; done
rm -rf "$tmp"
echo "  calls v1-v4 (.whlv1 ... .whlv4):  $(du -cm .whlv1 .whlv2 .whlv3 .whlv4 | tail -1 | cut -f1) in all, four equal parts"
