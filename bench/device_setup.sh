#!/bin/bash
# What the lent GPU machine lacks (it has torch, transformers, numpy, pandas, pyarrow, peft, ...),
# installed into /tmp/site in two device calls: one call carries at most 64 MiB, and Ray's wheel
# alone is 71 MB, so it travels split in two (`split -b 38M`) and is joined on the machine. The
# machine keeps /tmp while it stays warm (30 s after a call), so call 2 must follow call 1 at once.
#
#   call 1 (carry .whl .whl3):            bash bench/device_setup.sh 1
#   call 2 (carry .whl2 .whl4 .whl5 .whl6): source bench/device_setup.sh 2 && python bench/...
#   call 5 (carry .whl2 .whl9), at once after call 2: bash bench/device_setup.sh 5 (ray[default]'s dependencies: without
#        them Ray's dashboard agent runs minimal and every Ray process logs that the metrics exporter is missing);
#        where call 2 is refused as over 64 MiB (the working tree grows), .whl5 moves from call 2 to call 5
#   for flash-attn-4 (attention_kernel=auto takes it; bench/gpu_fa4_check.py) also (flash-attn-4 and the CuTe DSL, about 97 MiB):
#   call 3 (carry .whl7): bash bench/device_setup.sh 3;  call 4 (carry .whl8): source bench/device_setup.sh 4 && ...
#
# Runs longer than a call: bench/device_jobs.sh (started detached after the set-up, polled call after call).
#
# The folders are ignored (.gitignore: /.whl*/); `bash bench/fetch_wheels.sh` rebuilds them
# on a fresh checkout with `pip download`, at the versions installed in .venv-skyrl-train (about 57 and 50
# MiB: with the working tree, each call stays under 64).
# .whl:  megatron-core, megatron-bridge, transformers 5.12.1 (tokenizers 0.22 in .whl5; the image has 5.17
#        and 0.23; Megatron-Bridge 0.6.2 allows transformers <= 5.12.1), omegaconf, hydra-core, antlr4
# .whl2: skyrl-train and the small pure-Python packages its imports and Ray's need (loguru, pydantic,
#        fastapi, starlette, uvicorn, opentelemetry, jsonschema, ...)
# .whl3, .whl4: the two halves of ray-2.51.1 (cp312 manylinux2014)
# .whl5: annotated-types, sniffio, tokenizers 0.22, py-spy (stack dumps of a stalled run)
# .whl7, .whl8: flash-attn-4 4.0.0b36 (flash_attn.cute), quack-kernels, the CuTe DSL (its CUDA 13 library wheel
#        in two halves, its libs-core), apache-tvm-ffi, torch-c-dlpack-ext
# .whl9: aiohttp, aiohttp_cors, opencensus, prometheus_client, smart_open, virtualenv, ... (ray[default]'s extras)
# .whl6: botocore, jmespath, datasets, multiprocess, dill, torchdata, skyrl-gym (imported by the host
#        trainer), and flash_attn_pkg: flash-attn 2.8.3's own pure-Python padding helpers and Triton
#        cross entropy, unchanged (the host imports both). No CUDA extension: its __init__ here is a
#        version line, and no distribution metadata, so transformers offers no flash_attention_2 to
#        the megatron and fsdp2_sdpa cases. The fsdp2 case of bench/policy_bench.py assembles
#        bench/flash_attn_standin (flash-attn's API on PyTorch's FlashAttention-2 kernels, plus these
#        files) in its work directory and puts it first on that case's PYTHONPATH only.
# vLLM 0.24.0 for the GPU demo and bench/rl_step_bench.py (after calls 1 and 2, each call at once after the last):
#   calls v1, v2, v3 (carry .whlv1 / .whlv2 / .whlv3):  bash bench/device_setup.sh v1 (v2, v3)
#   call v4 (carry .whlv4):                             source bench/device_setup.sh v4 && python -m skyrl_megatron.demo --gpu ...
# .whlv1-4 (`bash bench/fetch_wheels.sh vllm`): four parts of one tar, vLLM's wheel without its FlashAttention-2
# library and the small wheels it imports. A later call on the same warm machine: source bench/device_setup.sh env.
# With vLLM, bench/vllm_bridges/ comes first on PYTHONPATH: skyrl-train 0.3.1 imports vLLM 0.11's module names.
#
# skyrl 0.4.0 (the new host: skyrl.train, skyrl.backends.skyrl_train, Ray 2.57, vllm-router) instead of parts 1-5,
# into its own target /tmp/site04 (self-contained: /tmp/site is not read), each call at once after the last:
#   call s1 (carry .whls1): bash bench/device_setup.sh s1     Ray's first half, Megatron, hydra-core 1.3.4, omegaconf
#   call s2 (carry .whls2): bash bench/device_setup.sh s2     Ray's second half, skyrl 0.4.0, skyrl-gym, fastapi, ...
#   call s3 (carry .whls3): source bench/device_setup.sh s3   vllm-router, transformers 5.16.1, peft 0.18.1, ray[default]'s
#        dependencies, flash-attn's files; installs all three folders in one pip call and sets the environment
#   calls v1-v4 as above: with /tmp/site04 there, v4 puts vLLM 0.24.0 and its small wheels into /tmp/site04
#        (source bench/device_setup.sh v4 && python -m skyrl.train.entrypoints.main_base ... trainer.strategy=megatron)
#   a later call on the same warm machine: source bench/device_setup.sh env04
# .whls1-3 (`bash bench/fetch_wheels.sh skyrl04`, versions of the skyrl 0.4 environment .venv): 43, 45 and 44 MiB.
set -e
# flash-attn-4, quack and the CuTe DSL (parts 3 and 4). The folder's path names site-packages: quack fingerprints the
# functions an epilogue calls, and takes those under site-packages as the installed library's (by name); elsewhere it
# reads into the DSL's own globals and refuses their context variables (`quack.epilogue.library` fails to import).
FA4SITE=/tmp/fa4/site-packages
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade --target /tmp/site"
_device_env() {  # SITE: /tmp/site (skyrl-train 0.3.1, parts 1-5) or /tmp/site04 (skyrl 0.4, parts s1-s3), read alone
    local site=${1:-/tmp/site}
    # run from the source tree: the wheel would install config/ as the package skyrl_megatron.conf
    ln -sfn ../config skyrl_megatron/conf
    export PYTHONPATH=$site:$PWD:$PWD/bench PATH=$site/bin:$PATH PYTHONUNBUFFERED=1
    if [ "$site" = /tmp/site ] && [ -d $FA4SITE ]; then
        # flash-attn-4 (part 4): its distribution metadata and the CuTe DSL (whose .pth a --target directory does not
        # read). Without them on the path, `attention_kernel: auto` sees no flash-attn-4 and takes varlen_attn.
        export PYTHONPATH=$site:$FA4SITE:$FA4SITE/nvidia_cutlass_dsl/dsl_packages:$PWD:$PWD/bench
    fi
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    if [ -d "$site/vllm" ]; then
        # the bridges: skyrl-train 0.3.1's vLLM 0.11 names, skyrl 0.4's vLLM 0.30 transfer API, on vLLM 0.24
        export PYTHONPATH=$PWD/bench/vllm_bridges:$PYTHONPATH
        # no flashinfer on the machines; a forked engine process can deadlock after torch's CPU work
        export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
    fi
}
case "$1" in
  1)
    mkdir -p /tmp/stage
    cp .whl3/raypart_aa /tmp/stage/
    $PIP .whl/*.whl .whl/*.tar.gz >/dev/null 2>&1
    echo "device_setup: part 1 done"
    ;;
  2)
    test -f /tmp/stage/raypart_aa || { echo "device_setup: run part 1 first, within 30 s" >&2; return 1 2>/dev/null || exit 1; }
    cat /tmp/stage/raypart_aa .whl4/raypart_ab > /tmp/stage/ray-2.51.1-cp312-cp312-manylinux2014_x86_64.whl
    # .whl5 may come with part 5 instead, where the working tree leaves this call too little room
    $PIP /tmp/stage/ray-*.whl .whl2/*.whl $(ls .whl5/*.whl 2>/dev/null) .whl6/*.whl >/dev/null 2>&1
    cp -r .whl6/flash_attn_pkg /tmp/site/flash_attn
    # Its own __init__ loads the CUDA extension we do not carry; transformers imports the package
    # to probe it (no dist-info here), and the host needs only bert_padding and the Triton loss.
    echo '__version__ = "2.8.3"' > /tmp/site/flash_attn/__init__.py
    _device_env
    echo "device_setup: part 2 done"
    ;;
  5)
    test -d /tmp/site || { echo "device_setup: run parts 1 and 2 first" >&2; exit 1; }
    # with .whl2 in the same pip call: --target replaces a top-level folder that exists (opentelemetry/, google/),
    # so namespace packages must land together
    $PIP .whl2/*.whl .whl9/*.whl $(ls .whl5/*.whl 2>/dev/null) >/dev/null 2>&1
    echo "device_setup: part 5 done"
    ;;
  v1|v2|v3)
    test -d /tmp/site -o -d /tmp/site04 || { echo "device_setup: run parts 1 and 2 (or s1-s3) first" >&2; exit 1; }
    mkdir -p /tmp/stage/vllm
    cp ".whl$1"/vllmpart_* /tmp/stage/vllm/
    echo "device_setup: part $1 done"
    ;;
  v4)
    test "$(ls /tmp/stage/vllm 2>/dev/null | wc -l)" = 3 || { echo "device_setup: run v1, v2 and v3 first, each within 30 s" >&2; return 1 2>/dev/null || exit 1; }
    cat /tmp/stage/vllm/vllmpart_* .whlv4/vllmpart_* | tar xf - -C /tmp/stage/vllm
    if [ -d /tmp/site04 ]; then
        # the skyrl 0.4 set: beside s3's install, merged into it (pip --target --upgrade would replace its bin/)
        ${PIP/\/tmp\/site//tmp/stage/vllm/site} /tmp/stage/vllm/deps/*.whl >/dev/null 2>&1
        cp -a /tmp/stage/vllm/site/. /tmp/site04/
        python3 -m zipfile -e /tmp/stage/vllm/vllm-*-trimmed.zip /tmp/site04
        rm -rf /tmp/stage/vllm
        _device_env /tmp/site04
    else
        $PIP /tmp/stage/vllm/deps/*.whl >/dev/null 2>&1
        python3 -m zipfile -e /tmp/stage/vllm/vllm-*-trimmed.zip /tmp/site
        rm -rf /tmp/stage/vllm
        _device_env
    fi
    echo "device_setup: part v4 done (vllm $(python3 -c 'import importlib.metadata as m; print(m.version("vllm"))'))"
    ;;
  env)
    _device_env
    ;;
  s1)
    rm -rf /tmp/stage/s04 && mkdir -p /tmp/stage/s04
    cp -r .whls1/. /tmp/stage/s04/  # installed in part s3, in one pip call (namespace packages such as
    echo "device_setup: part s1 done"  # megatron/, google/, opentelemetry/ and bin/ must land together)
    ;;
  s2)
    test -f /tmp/stage/s04/raypart_aa || { echo "device_setup: run part s1 first, within 30 s" >&2; exit 1; }
    cp -r .whls2/. /tmp/stage/s04/
    # (the wheel's name is the one fetch_wheels.sh skyrl04 split)
    cat /tmp/stage/s04/raypart_aa /tmp/stage/s04/raypart_ab > /tmp/stage/s04/ray-2.57.0-cp312-cp312-manylinux2014_x86_64.whl
    rm /tmp/stage/s04/raypart_a?
    echo "device_setup: part s2 done"
    ;;
  s3)
    test -f /tmp/stage/s04/ray-2.57.0-cp312-cp312-manylinux2014_x86_64.whl || { echo "device_setup: run parts s1 and s2 first, each within 30 s" >&2; return 1 2>/dev/null || exit 1; }
    cp -r .whls3/. /tmp/stage/s04/
    ${PIP/\/tmp\/site//tmp/site04} /tmp/stage/s04/*.whl /tmp/stage/s04/*.tar.gz >/dev/null 2>&1
    # flash-attn 2.8.3's pure-Python files, and a version line for its __init__ (as part 2)
    rm -rf /tmp/site04/flash_attn && cp -r /tmp/stage/s04/flash_attn_pkg /tmp/site04/flash_attn
    echo '__version__ = "2.8.3"' > /tmp/site04/flash_attn/__init__.py
    rm -rf /tmp/stage/s04
    _device_env /tmp/site04
    echo "device_setup: part s3 done (skyrl $(python3 -c 'import importlib.metadata as m; print(m.version("skyrl"))'), ray $(python3 -c 'import ray; print(ray.__version__)'))"
    ;;
  env04)
    _device_env /tmp/site04
    ;;
  3)
    # flash-attn-4 and the CuTe DSL, flash-attn-4 only: into their own target, so
    # that pip's --upgrade cannot replace /tmp/site/flash_attn (flash-attn 2's files the host imports)
    test -d /tmp/site || { echo "device_setup: run parts 1 and 2 first" >&2; exit 1; }
    mkdir -p /tmp/stage/fa4
    cp .whl7/* /tmp/stage/fa4/  # installed in part 4, in one pip call: the DSL's base and CUDA 13 wheels
    echo "device_setup: part 3 done"  # share the directory nvidia_cutlass_dsl, which --upgrade would replace
    ;;
  4)
    test -f /tmp/stage/fa4/cutlasspart_aa || { echo "device_setup: run part 3 first, within 30 s" >&2; return 1 2>/dev/null || exit 1; }
    cat /tmp/stage/fa4/cutlasspart_aa .whl8/cutlasspart_ab > /tmp/stage/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
    cp .whl8/*.whl /tmp/stage/fa4/  # the wheels that ride with the second half
    ${PIP/\/tmp\/site/$FA4SITE} /tmp/stage/fa4/*.whl >/dev/null 2>&1
    # flash-attn-4 is the namespace flash_attn.cute: put it inside the flash_attn package already there
    cp -r $FA4SITE/flash_attn/cute /tmp/site/flash_attn/
    _device_env /tmp/site  # with $FA4SITE on the path (as `env` in later calls and device_jobs.sh's jobs)
    echo "device_setup: part 4 done"
    ;;
  *)
    echo "usage: bash bench/device_setup.sh 1 | source bench/device_setup.sh 2 | bash bench/device_setup.sh 3 | source bench/device_setup.sh 4 | bash bench/device_setup.sh v1|v2|v3 | source bench/device_setup.sh v4 | source bench/device_setup.sh env | bash bench/device_setup.sh s1|s2 | source bench/device_setup.sh s3 | source bench/device_setup.sh env04" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
