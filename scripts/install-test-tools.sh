#!/usr/bin/env bash
# System tools some integration tests drive (Debian packages): skopeo (OCI client), chromium (dashboard) and
# docker-registry (CNCF distribution, the registry `kiln push` is tested against; runs as a plain process).
set -u
need=()
command -v skopeo >/dev/null || need+=(skopeo)
command -v chromium >/dev/null || need+=(chromium)
command -v docker-registry >/dev/null || [ -x /usr/bin/docker-registry ] || need+=(docker-registry)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then echo "install-test-tools: not root; skipping ${need[*]}" >&2; exit 1; fi
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
