#!/usr/bin/env bash
# Probe helper (not part of the library): pack a triton release small enough to carry to the device
# machine (its tool moves at most 64 MiB per call), to time our kernels under the triton that a
# newer torch pins (torch 2.13: triton 3.9) on a GPU whose image has an older one (torch 2.11: 3.6).
#
#   benchmarks/probes/pack_triton.sh [VERSION] [OUT.tar.xz]     (default 3.9.0, .whl/triton-VERSION.tar.xz)
#
# Keeps only what compiles and launches for NVIDIA sm_90: libtriton.so stripped of its symbol tables
# (477 -> 192 MB for 3.9.0), no AMD backend, CUPTI, proton or test plugins, and of the NVIDIA tools
# only ptxas-blackwell (triton 3.9 compiles sm_90 with it; CUDA 13.4). xz -9e: 52 MB for 3.9.0, about
# 2.5 min on 2 cores. On the device (python 3.12; `.whl/` is git-ignored, so pass it in `carry`):
#
#   python3 -c "import tarfile; tarfile.open('.whl/triton-3.9.0.tar.xz').extractall('/tmp/t39')"
#   TRITON_BACKENDS_IN_TREE=1 PYTHONPATH=/tmp/t39:src python3 -m flashpage.cli bench decode --out $OUT
#
# TRITON_BACKENDS_IN_TREE=1: the preinstalled triton's entry points name an AMD backend this pack
# leaves out. Used on 2026-12-06 (benchmarks/README.md, "Triton 3.9 on the GPU").
set -euo pipefail
version=${1:-3.9.0}
out=$(realpath -m "${2:-.whl/triton-$version.tar.xz}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$work" "triton==$version"
mkdir "$work/x"
(cd "$work/x" && python3 -m zipfile -e "$work"/triton-*.whl .)
t="$work/x/triton"
rm -rf "$t/backends/amd" "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" \
    "$t/_C/libproton.so" "$t/instrumentation" "$t/plugins" "$t/FileCheck" \
    "$t/backends/nvidia/bin/ptxas" "$t/backends/nvidia/bin/nvdisasm" "$t/backends/nvidia/bin/cuobjdump"
chmod +x "$t/backends/nvidia/bin/"*
strip --strip-unneeded "$t/_C/libtriton.so"
mkdir -p "$(dirname "$out")"
(cd "$work/x" && tar cf - triton triton-*.dist-info | xz -9e -T2 -c >"$out")
ls -l "$out"
