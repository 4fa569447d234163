#!/usr/bin/env bash
# Install a real Kubernetes control-plane toolchain for Nightshift integration
# tests, using only the Debian package archive (no other downloads):
#
#   * etcd                     - Debian package `etcd-server` (3.4.x)
#   * kube-apiserver           - built from Debian's own `kubernetes` source package
#   * kube-controller-manager  - built from the same source package
#   * kube-scheduler, kubelet, kube-proxy - the same source, one build, for the real
#                                node of tests/common/node.rs (tests/tools/install-node.sh
#                                installs the node's runtime: containerd, runc, CNI)
#   * kubectl                  - the one on PATH, else Debian's kubernetes-client
#
# Built binaries are cached under ${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}/kube/bin.
# The script is idempotent: with the cache present it only checks and prints the
# paths (a few seconds). The first run builds from source (~7 min, ~2.3 GB of
# temporary disk under the cache dir, removed afterwards).
#
# Output: the last lines are shell-assignable, e.g.
#   eval "$(tests/tools/install-kube.sh | grep -E '^[A-Z_]+=')"
# and the same assignments are written to <cache>/kube/env.sh.
#
# Environment knobs:
#   NIGHTSHIFT_CACHE       cache root (default: $HOME/.cache/nightshift)
#   KUBE_FORCE_REBUILD=1   rebuild even if cached binaries exist
#   KUBE_KEEP_BUILD=1      keep the source/build tree (for debugging)
set -euo pipefail

K8S_SRC_PKG=kubernetes
K8S_SRC_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
# Upstream version actually contained in the Debian source (see "+really").
K8S_GIT_VERSION="v1.20.2"
ETCD_PKG=etcd-server
REFLECT2_PKG=golang-github-modern-go-reflect2-dev
REFLECT2_SRC=/usr/share/gocode/src/github.com/modern-go/reflect2
BUILD_DEPS=(golang-go dpkg-dev rsync "$REFLECT2_PKG")
# Bump when the build recipe changes so caches get rebuilt.
BUILD_RECIPE=2
KUBE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)

CACHE_ROOT="${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}"
KUBE_CACHE="$CACHE_ROOT/kube"
BIN_DIR="$KUBE_CACHE/bin"
STAMP="$BIN_DIR/.build-stamp"
WANT_STAMP="src=$K8S_SRC_PKG/$K8S_SRC_VERSION reflect2=$REFLECT2_PKG recipe=$BUILD_RECIPE"

LOG_TAG=install-kube
# shellcheck source=tests/tools/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

print_paths() {
    local etcd_bin="$1" kubectl_bin="$2"
    {
        echo "KUBE_APISERVER=$BIN_DIR/kube-apiserver"
        echo "KUBE_CONTROLLER_MANAGER=$BIN_DIR/kube-controller-manager"
        echo "KUBE_SCHEDULER=$BIN_DIR/kube-scheduler"
        echo "KUBELET=$BIN_DIR/kubelet"
        echo "KUBE_PROXY=$BIN_DIR/kube-proxy"
        echo "ETCD=$etcd_bin"
        echo "KUBECTL=$kubectl_bin"
    } | tee "$KUBE_CACHE/env.sh.tmp"
    sed 's/^/export /' "$KUBE_CACHE/env.sh.tmp" >"$KUBE_CACHE/env.sh"
    rm -f "$KUBE_CACHE/env.sh.tmp"
}

build_kube() {
    apt_install "${BUILD_DEPS[@]}"
    [ -d "$REFLECT2_SRC" ] || die "$REFLECT2_SRC missing after installing $REFLECT2_PKG"
    command -v go >/dev/null || die "go not found after installing golang-go"

    local codename
    # shellcheck disable=SC1091
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    [ -n "$codename" ] || die "cannot determine the Debian codename from /etc/os-release"

    local mirror uri signed
    mirror="$(system_mirror "$codename")"
    [ -n "$mirror" ] || die "no enabled 'deb' source for suite $codename in the system apt configuration"
    read -r uri signed <<<"$mirror"
    log "using the system's Debian mirror for sources: $uri ($codename)"

    # Work tree inside the cache dir (same disk as the cache, avoids tmpfs /tmp).
    mkdir -p "$KUBE_CACHE"
    WORK="$(mktemp -d "$KUBE_CACHE/build.XXXXXX")"
    if [ "${KUBE_KEEP_BUILD:-0}" != 1 ]; then
        trap 'log "removing $WORK"; rm -rf "$WORK"' EXIT
    fi

    # Private apt configuration with only a deb-src line: the system's apt
    # sources and package lists stay untouched.
    local aptdir="$WORK/apt"
    mkdir -p "$aptdir/sources.list.d" "$aptdir/lists/partial"
    local opts=""
    [ "$signed" != "-" ] && opts="[signed-by=$signed] "
    echo "deb-src ${opts}${uri} ${codename} main" >"$aptdir/sources.list"
    local apt_private=(
        -o "Dir::Etc::sourcelist=$aptdir/sources.list"
        -o "Dir::Etc::sourceparts=$aptdir/sources.list.d"
        -o "Dir::State::Lists=$aptdir/lists"
        -o "Dir::Cache::pkgcache="
        -o "Dir::Cache::srcpkgcache="
        -o "APT::Sandbox::User=root"
        -o "APT::Get::List-Cleanup=false"
    )
    log "fetching source index into private apt state ($aptdir)"
    apt-get -q "${apt_private[@]}" update
    log "apt-get source $K8S_SRC_PKG=$K8S_SRC_VERSION"
    mkdir -p "$WORK/src"
    (cd "$WORK/src" && apt-get -q "${apt_private[@]}" source "$K8S_SRC_PKG=$K8S_SRC_VERSION")
    local tree
    tree="$(find "$WORK/src" -mindepth 1 -maxdepth 1 -type d -name "${K8S_SRC_PKG}-*" | head -n1)"
    [ -n "$tree" ] && [ -f "$tree/Makefile" ] || die "extracted source tree not found in $WORK/src"
    rm -f "$WORK/src"/*.tar.* "$WORK/src"/*.dsc

    # The vendored modern-go/reflect2 v1.0.1 breaks under Go >= 1.18 (panics on
    # the first custom-resource write). Use Debian's packaged 1.0.2 instead.
    log "replacing vendor/github.com/modern-go/reflect2 with $REFLECT2_SRC"
    rm -rf "$tree/vendor/github.com/modern-go/reflect2"
    cp -a "$REFLECT2_SRC" "$tree/vendor/github.com/modern-go/reflect2"
    rm -f "$tree/vendor/github.com/modern-go/reflect2/go.mod" "$tree/vendor/github.com/modern-go/reflect2/go.sum"

    log "building ${KUBE_BINARIES[*]} with $(go version) (takes several minutes)"
    local start=$SECONDS
    (
        cd "$tree"
        export CGO_ENABLED=0 GOPROXY=off GOFLAGS=-mod=vendor GOTOOLCHAIN=local
        export GOCACHE="$WORK/gocache" GOTMPDIR="$WORK/gotmp"
        export KUBE_GIT_VERSION="$K8S_GIT_VERSION" KUBE_GIT_TREE_STATE=clean
        mkdir -p "$GOTMPDIR"
        nice -n 10 make WHAT="${KUBE_BINARIES[*]/#/cmd/}"
    )
    log "build finished in $((SECONDS - start))s"

    mkdir -p "$BIN_DIR"
    local b src
    for b in "${KUBE_BINARIES[@]}"; do
        src="$(find "$tree/_output" -type f -name "$b" -perm -u+x | head -n1)"
        [ -n "$src" ] || die "built binary $b not found under $tree/_output"
        install -m 0755 "$src" "$BIN_DIR/.$b.tmp"
        mv -f "$BIN_DIR/.$b.tmp" "$BIN_DIR/$b"
    done
    echo "$WANT_STAMP" >"$STAMP"
}

all_built() {
    local b
    for b in "${KUBE_BINARIES[@]}"; do
        [ -x "$BIN_DIR/$b" ] || return 1
    done
}

main() {
    mkdir -p "$BIN_DIR"

    # 1. etcd from the Debian package.
    apt_install "$ETCD_PKG"
    local etcd_bin
    etcd_bin="$(command -v etcd || true)"
    [ -n "$etcd_bin" ] || etcd_bin=/usr/bin/etcd
    [ -x "$etcd_bin" ] || die "etcd binary not found after installing $ETCD_PKG"
    log "etcd: $etcd_bin ($("$etcd_bin" --version 2>/dev/null | head -n1))"

    # 2. The Kubernetes binaries, built from Debian source.
    if [ "${KUBE_FORCE_REBUILD:-0}" != 1 ] &&
        all_built &&
        [ "$(cat "$STAMP" 2>/dev/null || true)" = "$WANT_STAMP" ]; then
        log "using cached binaries in $BIN_DIR"
    else
        build_kube
    fi
    log "kube-apiserver: $("$BIN_DIR/kube-apiserver" --version 2>&1 | head -n1)"
    log "kube-controller-manager: $("$BIN_DIR/kube-controller-manager" --version 2>&1 | head -n1)"

    # 3. kubectl: the one on PATH, else Debian's kubernetes-client (the same 1.20).
    local kubectl_bin
    kubectl_bin="$(command -v kubectl || true)"
    if [ -z "$kubectl_bin" ]; then
        log "kubectl not found on PATH; installing Debian's kubernetes-client"
        apt_install kubernetes-client
        kubectl_bin="$(command -v kubectl || true)"
    fi
    if [ -n "$kubectl_bin" ]; then
        log "kubectl: $kubectl_bin ($("$kubectl_bin" version --client 2>/dev/null | head -n1))"
    else
        log "WARNING: kubectl could not be installed; the operator tests need it"
    fi

    print_paths "$etcd_bin" "$kubectl_bin"
    log "paths also written to $KUBE_CACHE/env.sh"
}

main "$@"
