#!/usr/bin/env bash
# Idempotent installer used by `make install`: .venv with torch, OpenMPI, Horovod 0.28.1 (built once,
# wheel cached outside the repo), then osp itself (editable). Quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
CACHE=${OSP_WHEEL_CACHE:-$HOME/.cache/osp-wheels}
HVD_VERSION=0.28.1
TORCH_VERSION=${OSP_TORCH_VERSION:-2.13.0}
log() { printf '[install] %s\n' "$*"; }

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
VPY=$VENV/bin/python
pipq() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$VPY" -c 'import torch' 2>/dev/null; then
  log "installing torch==$TORCH_VERSION"
  pipq "torch==$TORCH_VERSION"
fi
"$VPY" -c 'import pytest, ruff, numpy, sklearn, ninja, psutil, cloudpickle, packaging, hypothesis' 2>/dev/null || {
  log "installing test and build requirements"
  pipq pytest ruff numpy scikit-learn ninja psutil cloudpickle packaging pyyaml setuptools wheel matplotlib hypothesis
}

# the Lightning strategy's tests (osp[lightning]) and the Accelerate example's; pinned: the versions tested
"$VPY" -c 'import pytorch_lightning, accelerate' 2>/dev/null || {
  log "installing pytorch-lightning and accelerate"
  pipq "pytorch-lightning==2.6.6" "accelerate==1.16.0"
}

# OSP_WITHOUT_HOROVOD=1: an environment without Horovod (and without OpenMPI), as a torchrun-only user has;
# osp.horovod stands in for horovod.torch there. The test suite's Horovod engine tests then skip.
if [ "${OSP_WITHOUT_HOROVOD:-0}" = 1 ]; then
  log "OSP_WITHOUT_HOROVOD=1: not installing OpenMPI or Horovod"
elif ! command -v mpirun >/dev/null || ! command -v mpicxx >/dev/null; then
  log "installing OpenMPI from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi

if [ "${OSP_WITHOUT_HOROVOD:-0}" != 1 ] && ! "$VPY" -c 'import horovod.torch' 2>/dev/null; then
  TV=$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])')
  PV=$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  WDIR=$CACHE/horovod-$HVD_VERSION-torch$TV-$PV
  WHL=$(ls "$WDIR"/horovod-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$WHL" ]; then
    log "building Horovod $HVD_VERSION against torch $TV (about 6 minutes on 2 cores; cached in $WDIR)"
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    "$VPY" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$BUILD"
    tar -xzf "$BUILD"/horovod-$HVD_VERSION.tar.gz -C "$BUILD"
    SRC=$BUILD/horovod-$HVD_VERSION
    # Horovod 0.28.1 asks for C++14; PyTorch >= 2.1 needs C++17 (upstream fix merged, never released).
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" || {
      echo "install: could not patch Horovod's CMakeLists for C++17" >&2; exit 1; }
    mkdir -p "$WDIR"
    (cd "$SRC" && CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 \
      HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      MAKEFLAGS=-j"$(nproc)" \
      "$OLDPWD/$VPY" -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation -w "$WDIR" .)
    WHL=$(ls "$WDIR"/horovod-*.whl | head -n1)
  fi
  log "installing $(basename "$WHL")"
  pipq --no-deps "$WHL"
  pipq cloudpickle psutil pyyaml packaging cffi
fi

if ! "$VPY" -c 'import osp._C' 2>/dev/null || [ -n "${OSP_REBUILD:-}" ]; then
  log "building osp (editable)"
  "$VPY" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
fi
log "ready: $("$VPY" -c '
import torch, osp
try:
    import horovod
    hv = horovod.__version__
except ImportError:
    hv = "not installed (osp.horovod stands in)"
print("torch", torch.__version__, "horovod", hv, "osp._C", osp.ops.HAS_EXTENSION)')"
