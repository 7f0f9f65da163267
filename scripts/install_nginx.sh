#!/usr/bin/env bash
# Install Debian's nginx for the routing tests (tests/deploy/): the deploy/nginx config is checked with
# `nginx -t` and two replicas are run behind it. Idempotent: does nothing when nginx is already there.
# Needs root (or passwordless sudo) and apt; prints the nginx binary's path on success.
set -euo pipefail
find_nginx() { command -v nginx 2>/dev/null || { [ -x /usr/sbin/nginx ] && echo /usr/sbin/nginx; } || true; }
bin=$(find_nginx)
if [ -z "$bin" ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "install_nginx.sh: no apt-get here; install nginx (>= 1.18) by other means" >&2
        exit 1
    fi
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo -n"; fi
    export DEBIAN_FRONTEND=noninteractive
    # another apt (a boot-time update, a second test worker) may hold the dpkg lock: wait for it, do not fail
    apt=(apt-get -o DPkg::Lock::Timeout=600)
    # nginx-light: the small Debian build (the upstream hash module and WebSocket proxying are in it);
    # the package lists may be stale or absent on a fresh image, hence the update on failure.
    $sudo "${apt[@]}" install -y --no-install-recommends nginx-light >/dev/null \
        || { $sudo "${apt[@]}" update >/dev/null && $sudo "${apt[@]}" install -y --no-install-recommends nginx-light >/dev/null; } \
        || $sudo "${apt[@]}" install -y --no-install-recommends nginx >/dev/null
    bin=$(find_nginx)
fi
if [ -z "$bin" ]; then
    echo "install_nginx.sh: nginx is still not installed" >&2
    exit 1
fi
echo "$bin"
