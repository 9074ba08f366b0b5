#!/usr/bin/env bash
# FlashAttention-4 (the `fa4` engine) on a GPU machine that cannot reach any registry: its wheels (~100 MB, the
# CUDA 13 CuTe DSL libraries alone 92 MB) travel in two parts, over the device tool's 64 MiB per call. Prepare the
# parts here once:
#
#   scripts/gpu_fa4.sh split          # -> .fa4carry/p1 (part 1), .fa4carry/p2 (part 2, sha256)
#
# then on the GPU machine, two calls within its warm window (it keeps its disk only ~30 s after a call):
#
#   scripts/gpu_fa4.sh stage          # call 1, carry .fa4carry/p1: keeps part 1 in /root/fa4parts
#   scripts/gpu_fa4.sh install && ... # call 2, carry .fa4carry/p2: reassemble, check, install, then your command
#
# The wheels are installed with --no-deps into /tmp/fa4site, added to the interpreter's site dirs through a .pth
# file (the CuTe DSL's own .pth must run), for CPython 3.12 on manylinux x86_64 (the GPU machine's Python).
# Versions: the `fa4` extra of pyproject.toml and what FA4 4.0.0b36 needs on a CUDA 13 torch.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
        apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5)

case "${1:-}" in
  split)
    mkdir -p .fa4whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
      -d .fa4whl "${WHEELS[@]}"
    rm -rf .fa4carry && mkdir -p .fa4carry/p1 .fa4carry/p2
    tar cf .fa4carry/wheels.tar -C .fa4whl .
    sha256sum .fa4carry/wheels.tar | cut -d' ' -f1 > .fa4carry/p2/sha
    size=$(stat -c %s .fa4carry/wheels.tar)
    split -b $(( (size + 1) / 2 )) .fa4carry/wheels.tar .fa4carry/fa4part.
    mv .fa4carry/fa4part.aa .fa4carry/p1/ && mv .fa4carry/fa4part.ab .fa4carry/p2/ && rm .fa4carry/wheels.tar
    ls -la .fa4carry/p1 .fa4carry/p2 ;;
  stage)
    mkdir -p /root/fa4parts && cp .fa4carry/p1/fa4part.aa /root/fa4parts/ ;;
  install)
    if python3 -c "import flash_attn.cute" 2>/dev/null; then exit 0; fi
    cat /root/fa4parts/fa4part.aa .fa4carry/p2/fa4part.ab > /tmp/fa4wheels.tar
    echo "$(cat .fa4carry/p2/sha)  /tmp/fa4wheels.tar" | sha256sum -c --quiet
    rm -rf /tmp/fa4whl && mkdir -p /tmp/fa4whl && tar xf /tmp/fa4wheels.tar -C /tmp/fa4whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa4site /tmp/fa4whl/*.whl
    echo "import site; site.addsitedir('/tmp/fa4site')" \
      > "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_mtrain_fa4.pth"
    python3 -c "import flash_attn.cute, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))" ;;
  *)
    echo "usage: $0 split | stage | install" >&2; exit 2 ;;
esac
