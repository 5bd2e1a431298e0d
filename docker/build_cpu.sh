#!/usr/bin/env bash
# Build the CPU target of docker/Dockerfile where no image registry is reachable (CI, tests/test_docker.py):
#   docker/build_cpu.sh [TAG]           # default dsharness:cpu; from any folder
# 1. the base: Debian bookworm from debootstrap (docker/build_base.sh; built once, its tag reused after),
# 2. docker/context/: the torch wheel pinned in constraints.txt (`pip download`, kept between builds) and the
#    host's extra CA certificates, without which pip inside the build cannot pass a TLS-inspecting proxy,
# 3. the legacy builder (DOCKER_BUILDKIT=0: BuildKit would pull its frontend from a registry). Its layer cache
#    makes a rebuild with unchanged files take seconds; changed project files redo only the last layers.
# Every build step's output line is prefixed with the seconds since the build started.
# PYTHON: the interpreter whose pip downloads the wheel (default python3).
set -euo pipefail
TAG=${1:-dsharness:cpu}
BASE=${DSHARNESS_BASE_IMAGE:-dsharness-base:bookworm}
cd "$(dirname "$0")/.."
start=$SECONDS
docker/build_base.sh "$BASE"

pin=$(grep '^torch==' constraints.txt)
if ! ls docker/context/torch-"${pin#torch==}"*.whl >/dev/null 2>&1; then
  # PyPI's Linux torch is the CUDA build; pip finds the CPU one where its configuration points to it (find-links,
  # an index). TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu names PyTorch's own CPU index instead.
  "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary :all: -d docker/context \
      ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$pin"
fi
if ! ls docker/context/torch-"${pin#torch==}"+cpu-*.whl >/dev/null 2>&1; then
  echo "[build] docker/context/ holds no CPU wheel of $pin:" $(cd docker/context && ls torch-*.whl 2>/dev/null) >&2
  echo "[build] delete it and run again with TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2
  exit 1
fi
for wheel in docker/context/torch-*.whl; do   # wheels of an older pin
  case "$wheel" in docker/context/torch-"${pin#torch==}"[-+]*) ;; *) rm -f "$wheel" ;; esac
done
find docker/context -name '*.crt' -delete
shopt -s nullglob
certs=(/usr/local/share/ca-certificates/*.crt)
[ ${#certs[@]} -eq 0 ] || cp "${certs[@]}" docker/context/
echo "[build] context ready after $((SECONDS - start)) s: $(ls docker/context | tr '\n' ' ')"

build_start=$SECONDS
DOCKER_BUILDKIT=0 docker build -f docker/Dockerfile --build-arg TARGET=cpu --build-arg BASE_IMAGE="$BASE" \
    -t "$TAG" . 2>&1 | while IFS= read -r line; do printf '[%4ds] %s\n' $((SECONDS - build_start)) "$line"; done
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[build] docker build failed" >&2; exit 1; }
size=$(docker image inspect -f '{{.Size}}' "$TAG")
echo "[build] $TAG built in $((SECONDS - build_start)) s ($((SECONDS - start)) s in all), $((size / 1000000)) MB"
