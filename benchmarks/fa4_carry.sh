#!/usr/bin/env bash
# Packs FlashAttention 4 (`--attention-backend fa4`) for a GPU machine without internet access whose calls
# carry at most 64 MiB each (RESULTS.md run 4). Run here, in the repo root; it fills two git-ignored folders:
#   .whl/     flash-attn-4 and its small dependencies as wheels (~10 MB)
#   .fa4big/  nvidia-cutlass-dsl-libs-cu13 (a 92 MB wheel) unpacked and repacked as one xz tarball (~61 MiB)
# On the GPU machine, in two calls one right after the other (the second finds /tmp/t2 while the machine is
# still warm):
#   call 1, carry .whl:    python3 -m pip install -q --no-index --no-deps --target /tmp/t2 .whl/*.whl
#   call 2, carry .fa4big: mkdir -p /tmp/fa4site && tar xJf .fa4big/fa4_cu13.tar.xz -C /tmp/fa4site &&
#                          cp -rn /tmp/t2/. /tmp/fa4site/ &&
#                          export PYTHONPATH=$PWD:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
set -euo pipefail
FA4=4.0.0b36 DSL=4.8.1
cd "$(git rev-parse --show-toplevel)"
for d in .whl .fa4big; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude; done
mkdir -p .whl .fa4big
platform=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 17 24 27 28 31 34 35; do platform+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps -d .whl "flash-attn-4==$FA4" "nvidia-cutlass-dsl==$DSL" \
  "nvidia-cutlass-dsl-libs-core==$DSL" quack-kernels==0.6.5
python3 -m pip download -q --no-deps "${platform[@]}" -d .whl "nvidia-cutlass-dsl-libs-base==$DSL" \
  "apache-tvm-ffi==0.1.15.post2" "torch-c-dlpack-ext==0.1.5"
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp" "nvidia-cutlass-dsl-libs-cu13==$DSL"
python3 -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl "$tmp/x"
(cd "$tmp/x" && tar cf - .) | xz -9 -T0 >.fa4big/fa4_cu13.tar.xz  # ~2 minutes on 2 cores
rm -rf "$tmp"
du -sh .whl .fa4big
