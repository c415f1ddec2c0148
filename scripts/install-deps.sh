#!/usr/bin/env bash
# Installs softkv's Debian build dependencies that are missing; does nothing when all are present.
# Idempotent: checks each package with dpkg -s, runs apt-get update at most once.
# Extra package names given as arguments are installed too.
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libxsimd-dev xtl-dev          # SIMD kernels (xtl must be found before xsimd)
  libopenblas-dev               # BLAS for FAISS, libxsmm's fallbacks and the benchmark baseline
  libxsmm-dev                   # JIT small GEMMs for the batch passes' tiles, where they measure faster
  libfaiss-dev                  # top-k pruning index
  libboost1.81-dev              # Asio for the server (not libboost-dev: it conflicts)
  libcereal-dev                 # snapshots
  catch2                        # tests (Catch2 2.13)
  libcli11-dev libspdlog-dev    # command-line parsing and logs
  zlib1g-dev                    # reading the gzip idx files of the data set example
  dataset-fashion-mnist         # the real data set of examples/fashion_mnist
  python3 python3-numpy         # Python client and module
  pybind11-dev python3-dev      # the native Python module (import softkv)
  python3-pytest                # its tests
  libopenmpi-dev openmpi-bin    # softkv::mpi and the sharded server (mpirun)
)
packages+=("$@")                # extra packages a caller needs (e.g. scripts/fuzz.sh: clang)

missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update
$sudo apt-get install -y --no-install-recommends "${missing[@]}"
