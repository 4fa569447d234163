#!/usr/bin/env bash
# Install what the real-node tests need beside the control plane of install-kube.sh (which
# also builds kubelet, kube-scheduler and kube-proxy), using only Debian's packages:
#
#   * containerd + runc        - the kubelet's container runtime (CRI), Debian packages
#   * CNI plugins              - bridge, host-local, portmap, loopback (containernetworking-plugins)
#   * iptables, conntrack      - for kube-proxy's iptables mode
#   * podman (buildah inside)  - builds the image from the repository's Dockerfile
#   * a bookworm base image    - `debootstrap --variant=minbase` + ca-certificates, trimmed,
#                                imported into podman as localhost/nightshift-base:bookworm
#                                (no registry is reachable: public base images can't be pulled)
#   * a pause image            - tests/tools/pause.c built static, as localhost/nightshift-pause:1,
#                                the sandbox image of the test node's containerd
#
# What this VM needs, found out on Debian 12 / Firecracker / cgroup v1 (see tests/common/node.rs
# for the kubelet side):
#   * crun refuses hybrid cgroups: podman must use runc (set in containers.conf below);
#   * without CAP_SYS_RESOURCE podman's default ulimits are refused: explicit ones below;
#   * no swap, br_netfilter and nf_tables iptables are built in: nothing to load.
#
# Cached under ${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}/node: the base rootfs tarball
# (~40 s to make once), the pause binary, containers.conf and env.sh, which exports:
#   CONTAINERS_CONF  podman's configuration for this VM (runc, explicit ulimits)
#   NODE_BASE_IMAGE, NODE_PAUSE_IMAGE  the local images (present in podman's store)
#   CONTAINERD, CONTAINERD_SHIM, RUNC, CTR, CNI_BIN_DIR, PODMAN
# Idempotent: with everything in place it takes a second or two.
set -euo pipefail

LOG_TAG=install-node
# shellcheck source=tests/tools/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PACKAGES=(containerd runc containernetworking-plugins iptables conntrack podman debootstrap gcc libc6-dev)
BASE_IMAGE=localhost/nightshift-base:bookworm
PAUSE_IMAGE=localhost/nightshift-pause:1
# Bump when the base recipe changes so the cached rootfs is remade.
BASE_RECIPE=1

TOOLS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}"
NODE_CACHE="$CACHE_ROOT/node"
BASE_TAR="$NODE_CACHE/bookworm-base.tar"
BASE_STAMP="$NODE_CACHE/bookworm-base.stamp"

# The base rootfs: minbase bookworm with the TLS roots, without docs, manuals, locales and
# apt lists (what debian:bookworm-slim drops too).
make_base() {
    local codename mirror uri
    # shellcheck disable=SC1091
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    [ "$codename" = bookworm ] || log "WARNING: host is $codename; the base image is bookworm regardless"
    mirror="$(system_mirror "$codename")"
    [ -n "$mirror" ] || die "no enabled 'deb' source in the system apt configuration"
    read -r uri _ <<<"$mirror"
    local work
    work="$(mktemp -d "$NODE_CACHE/base.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    log "debootstrap --variant=minbase bookworm from $uri (once, ~40 s)"
    as_root debootstrap --variant=minbase --include=ca-certificates bookworm "$work/rootfs" "$uri" >"$work/log" 2>&1 ||
        { tail -20 "$work/log" >&2; die "debootstrap failed"; }
    local r="$work/rootfs"
    rm -rf "$r"/usr/share/doc/* "$r"/usr/share/man/* "$r"/usr/share/info/* "$r"/usr/share/locale/* \
        "$r"/var/cache/apt/*.bin "$r"/var/lib/apt/lists/* "$r"/var/log/*.log
    tar -C "$r" -cf "$BASE_TAR.tmp" .
    mv -f "$BASE_TAR.tmp" "$BASE_TAR"
    echo "$BASE_RECIPE" >"$BASE_STAMP"
    rm -rf "$work"
    trap - EXIT
}

# pause.c, static, as a one-file image.
make_pause() {
    local bin="$NODE_CACHE/pause" src="$TOOLS_DIR/pause.c"
    if [ ! -x "$bin" ] || [ "$src" -nt "$bin" ]; then
        log "building the pause binary"
        gcc -static -Os -Wall -Werror -o "$bin.tmp" "$src"
        strip "$bin.tmp"
        mv -f "$bin.tmp" "$bin"
    fi
    if ! podman image exists "$PAUSE_IMAGE" || [ "$bin" -nt "$NODE_CACHE/pause.imported" ]; then
        local ctx
        ctx="$(mktemp -d)"
        cp "$bin" "$ctx/pause"
        tar -C "$ctx" -c pause | podman import --quiet --change 'ENTRYPOINT ["/pause"]' - "$PAUSE_IMAGE" >/dev/null
        rm -rf "$ctx"
        touch "$NODE_CACHE/pause.imported"
    fi
}

main() {
    mkdir -p "$NODE_CACHE"
    apt_install "${PACKAGES[@]}"

    # podman on this kind of VM: runc (crun refuses hybrid cgroups) and ulimits within the
    # hard limits (no CAP_SYS_RESOURCE to raise them).
    cat >"$NODE_CACHE/containers.conf" <<'CONF'
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
runtime = "runc"
CONF
    export CONTAINERS_CONF="$NODE_CACHE/containers.conf"

    if [ ! -f "$BASE_TAR" ] || [ "$(cat "$BASE_STAMP" 2>/dev/null)" != "$BASE_RECIPE" ]; then
        make_base
        podman rmi -f "$BASE_IMAGE" >/dev/null 2>&1 || true
    fi
    if ! podman image exists "$BASE_IMAGE"; then
        log "importing $BASE_IMAGE into podman"
        podman import --quiet - "$BASE_IMAGE" <"$BASE_TAR" >/dev/null
    fi
    make_pause

    local shim
    shim="$(command -v containerd-shim-runc-v2 || true)"
    [ -n "$shim" ] || die "containerd-shim-runc-v2 not found after installing containerd"
    {
        echo "CONTAINERS_CONF=$NODE_CACHE/containers.conf"
        echo "NODE_BASE_IMAGE=$BASE_IMAGE"
        echo "NODE_PAUSE_IMAGE=$PAUSE_IMAGE"
        echo "CONTAINERD=$(command -v containerd)"
        echo "CONTAINERD_SHIM=$shim"
        echo "RUNC=$(command -v runc)"
        echo "CTR=$(command -v ctr)"
        echo "CNI_BIN_DIR=/usr/lib/cni"
        echo "PODMAN=$(command -v podman)"
    } | tee "$NODE_CACHE/env.sh.tmp"
    sed 's/^/export /' "$NODE_CACHE/env.sh.tmp" >"$NODE_CACHE/env.sh"
    rm -f "$NODE_CACHE/env.sh.tmp"
    log "containerd: $(containerd --version), runc: $(runc --version | head -n1), podman: $(podman --version)"
}

main "$@"
