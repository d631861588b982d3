#!/usr/bin/env bash
# Makes Docker usable for the compose tests on a Debian machine without systemd and without registry access:
#   bash scripts/setup-docker.sh          # install, start, build the base image (whatever is missing)
#   bash scripts/setup-docker.sh stop     # stop the dockerd this script started (its PID file)
#
# Idempotent, each step skipped when its result is already there:
#   1. apt-get install docker.io docker-compose debootstrap (when /usr/bin/docker, docker-compose or debootstrap
#      is missing);
#   2. start dockerd in the background (when `docker info` fails) and wait for it; its PID goes to
#      $HOTWIRE_DOCKERD_PIDFILE (default /tmp/hotwire-dockerd.pid), its log next to it (.log);
#   3. build local/debian:bookworm (when missing): debootstrap a bookworm minbase from the machine's apt mirror
#      and `docker import` it. No registry is reachable here, so the tests build FROM this image
#      (tests/docker_images.py); the shipped Dockerfiles keep their official bases as the default.
# Uses /usr/bin/docker (Debian's client, which matches its daemon; another docker on PATH may lack buildx).
set -euo pipefail

DOCKER=/usr/bin/docker
PIDFILE=${HOTWIRE_DOCKERD_PIDFILE:-/tmp/hotwire-dockerd.pid}
BASE_IMAGE=${HOTWIRE_LOCAL_DEBIAN:-local/debian:bookworm}
SUDO=
if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "setup-docker.sh: needs root (or sudo)" >&2; exit 1; }
    SUDO="sudo -n"
fi

if [[ "${1:-}" == stop ]]; then
    if [[ -f "$PIDFILE" ]]; then
        pid=$(cat "$PIDFILE")
        if kill -0 "$pid" 2>/dev/null; then
            echo "setup-docker.sh: stopping dockerd (pid $pid)"
            $SUDO kill "$pid"
            for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        fi
        rm -f "$PIDFILE"
    fi
    exit 0
fi

start=$SECONDS

# 1. packages
missing=()
[[ -x $DOCKER ]] || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || [[ -x /usr/sbin/debootstrap ]] || missing+=(debootstrap)
if (( ${#missing[@]} )); then
    echo "setup-docker.sh: apt-get install ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. the daemon
if ! $SUDO $DOCKER info >/dev/null 2>&1; then
    echo "setup-docker.sh: starting dockerd (log: $PIDFILE.log)"
    $SUDO bash -c "nohup dockerd >'$PIDFILE.log' 2>&1 & echo \$! >'$PIDFILE'"
    for _ in $(seq 120); do
        $SUDO $DOCKER info >/dev/null 2>&1 && break
        sleep 0.5
    done
    if ! $SUDO $DOCKER info >/dev/null 2>&1; then
        tail -n 30 "$PIDFILE.log" >&2 || true
        echo "setup-docker.sh: dockerd did not come up" >&2
        exit 1
    fi
fi

# 3. the local base image
if ! $SUDO $DOCKER image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    # The machine's Debian mirror: deb822 (URIs:) or one-line (deb URL bookworm ...) sources, not the security one.
    mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}')
    [[ -n "$mirror" ]] || mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
        | awk '$1 == "deb" && $3 ~ /^bookworm$/ {print $2; exit}')
    mirror=${mirror:-http://deb.debian.org/debian}
    rootfs=$(mktemp -d "${TMPDIR:-/tmp}/hotwire-rootfs.XXXXXX")
    trap '$SUDO rm -rf "$rootfs"' EXIT
    echo "setup-docker.sh: debootstrap bookworm minbase from $mirror -> $BASE_IMAGE"
    $SUDO debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 \
        || { tail -n 30 "$rootfs.log" >&2; exit 1; }
    rm -f "$rootfs.log"
    $SUDO rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    $SUDO tar -C "$rootfs" -c . | $SUDO $DOCKER import - "$BASE_IMAGE" >/dev/null
fi

echo "setup-docker.sh: OK ($($SUDO $DOCKER version --format 'docker {{.Server.Version}}'), $(docker-compose version --short 2>/dev/null || echo 'docker-compose ?'), $BASE_IMAGE; $((SECONDS - start))s)"
