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
#                                (no registry is reachable: public base images can't be pulled);
#                                the image's CERTS_IMAGE (the TLS roots are copied from it)
#   * a distroless-like base   - from the same rootfs, only what gcr.io/distroless/cc-debian12
#                                ships that the glibc binary needs (loader, glibc, libgcc_s,
#                                TLS roots, tzdata, passwd/group with nonroot 65532; no shell,
#                                no apt, no coreutils), as localhost/nightshift-distroless-cc:bookworm:
#                                the image's RUNTIME_IMAGE, standing in for the Dockerfile's default
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
# (~40 s to make once), the distroless-like one made from it (a second or two), the pause
# binary, containers.conf and env.sh, which exports:
#   CONTAINERS_CONF  podman's configuration for this VM (runc, explicit ulimits)
#   NODE_BASE_IMAGE, NODE_RUNTIME_IMAGE, NODE_PAUSE_IMAGE  the local images (in podman's store)
#   CONTAINERD, CONTAINERD_SHIM, RUNC, CTR, CNI_BIN_DIR, PODMAN
# Idempotent: with everything in place it takes a second or two.
set -euo pipefail

LOG_TAG=install-node
# shellcheck source=tests/tools/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PACKAGES=(containerd runc containernetworking-plugins iptables conntrack podman debootstrap gcc libc6-dev)
BASE_IMAGE=localhost/nightshift-base:bookworm
RUNTIME_IMAGE=localhost/nightshift-distroless-cc:bookworm
PAUSE_IMAGE=localhost/nightshift-pause:1
# Bump when a recipe changes so the cached rootfs is remade (the runtime's follows the base's).
BASE_RECIPE=2
RUNTIME_RECIPE=1

TOOLS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}"
NODE_CACHE="$CACHE_ROOT/node"
BASE_TAR="$NODE_CACHE/bookworm-base.tar"
BASE_STAMP="$NODE_CACHE/bookworm-base.stamp"
RUNTIME_TAR="$NODE_CACHE/distroless-cc.tar"
RUNTIME_STAMP="$NODE_CACHE/distroless-cc.stamp"

# The base rootfs: minbase bookworm with the TLS roots, without docs, manuals, locales, apt
# lists and the .debs debootstrap downloaded (what debian:bookworm-slim drops too).
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
        "$r"/var/cache/apt/*.bin "$r"/var/cache/apt/archives/*.deb "$r"/var/lib/apt/lists/* "$r"/var/log/*.log
    tar -C "$r" -cf "$BASE_TAR.tmp" .
    mv -f "$BASE_TAR.tmp" "$BASE_TAR"
    echo "$BASE_RECIPE" >"$BASE_STAMP"
    rm -rf "$work"
    trap - EXIT
}

# The distroless-like runtime rootfs, taken from the base's tarball (as any user): what
# gcr.io/distroless/cc-debian12 ships that a glibc Rust binary needs. `ldd` of the binary:
# ld-linux-x86-64.so.2, libc.so.6, libm.so.6, libgcc_s.so.1. Every shared library of the
# libc6 and libgcc-s1 packages is taken (libdl, libpthread, librt, the NSS modules, ...; not
# the gconv modules), as distroless does; no libssl (rustls), no shell, apt or coreutils.
make_runtime() {
    local work
    work="$(mktemp -d "$NODE_CACHE/runtime.XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    local r="$work/rootfs" libs=()
    mkdir -p "$r"
    # The packages' libraries as the merged-/usr tarball names them (/lib/x -> ./usr/lib/x).
    mapfile -t libs < <(tar -xOf "$BASE_TAR" ./var/lib/dpkg/info/libc6:amd64.list ./var/lib/dpkg/info/libgcc-s1:amd64.list |
        grep -E '^/(usr/)?lib(64)?/(x86_64-linux-gnu/)?[^/]+\.so(\.[0-9]+)*$' |
        sed -E 's#^/(lib|lib64)/#/usr/\1/#; s#^/#./#' | sort -u)
    [ "${#libs[@]}" -gt 10 ] || die "too few libraries in the base's libc6 and libgcc-s1 lists: ${libs[*]}"
    log "making the distroless-like runtime rootfs (${#libs[@]} libraries from $BASE_TAR)"
    tar -xf "$BASE_TAR" -C "$r" "${libs[@]}" ./etc/ssl/certs/ca-certificates.crt ./usr/share/zoneinfo \
        ./usr/lib/os-release ./etc/os-release
    ln -s usr/lib "$r/lib"
    ln -s usr/lib64 "$r/lib64"
    printf '%s\n' \
        'root:x:0:0:root:/root:/sbin/nologin' \
        'nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin' \
        'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$r/etc/passwd"
    printf '%s\n' 'root:x:0:' 'nobody:x:65534:' 'tty:x:5:' 'staff:x:50:' 'nonroot:x:65532:' >"$r/etc/group"
    printf '%s\n' 'passwd:         files' 'group:          files' 'shadow:         files' \
        'gshadow:        files' '' 'hosts:          files dns' 'networks:       files' '' \
        'protocols:      files' 'services:       files' 'ethers:         files' 'rpc:            files' \
        >"$r/etc/nsswitch.conf"
    mkdir -p "$r/tmp" "$r/root" "$r/home/nonroot"
    chmod 1777 "$r/tmp"
    chmod 0700 "$r/root" "$r/home/nonroot"
    # Everything is root's but nonroot's home (owners set in the tarball: no root needed).
    tar -C "$r" --sort=name --numeric-owner --owner=0 --group=0 --exclude=./home/nonroot -cf "$RUNTIME_TAR.tmp" .
    tar -C "$r" --numeric-owner --owner=65532 --group=65532 --no-recursion -rf "$RUNTIME_TAR.tmp" ./home/nonroot
    mv -f "$RUNTIME_TAR.tmp" "$RUNTIME_TAR"
    echo "$RUNTIME_RECIPE" >"$RUNTIME_STAMP"
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
    if [ ! -f "$RUNTIME_TAR" ] || [ "$(cat "$RUNTIME_STAMP" 2>/dev/null)" != "$RUNTIME_RECIPE" ] ||
        [ "$BASE_TAR" -nt "$RUNTIME_TAR" ]; then
        make_runtime
        podman rmi -f "$RUNTIME_IMAGE" >/dev/null 2>&1 || true
    fi
    if ! podman image exists "$RUNTIME_IMAGE"; then
        log "importing $RUNTIME_IMAGE into podman"
        # The configuration of distroless's :nonroot tags (no entrypoint: there is no shell).
        podman import --quiet --change 'USER 65532:65532' --change 'WORKDIR /home/nonroot' \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
            - "$RUNTIME_IMAGE" <"$RUNTIME_TAR" >/dev/null
    fi
    make_pause

    local shim
    shim="$(command -v containerd-shim-runc-v2 || true)"
    [ -n "$shim" ] || die "containerd-shim-runc-v2 not found after installing containerd"
    {
        echo "CONTAINERS_CONF=$NODE_CACHE/containers.conf"
        echo "NODE_BASE_IMAGE=$BASE_IMAGE"
        echo "NODE_RUNTIME_IMAGE=$RUNTIME_IMAGE"
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
