# Shell helpers shared by the test-tool scripts (install-kube.sh, install-node.sh,
# install-apiextensions.sh, apiextensions-smoke.sh).
# Source it after setting LOG_TAG (the prefix of every message).
# shellcheck shell=bash

log() { printf '[%s] %s\n' "${LOG_TAG:-tools}" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "${LOG_TAG:-tools}" "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

pkg_installed() {
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" = installed ]
}

APT_UPDATED=0
# Install Debian packages that are not installed yet. Runs `apt-get update` only
# if the install fails (e.g. stale or missing package lists).
apt_install() {
    local missing=() p
    for p in "$@"; do
        pkg_installed "$p" || missing+=("$p")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    log "apt-get install ${missing[*]}"
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -y -q --no-install-recommends install)
    if ! as_root "${apt[@]}" "${missing[@]}"; then
        [ "$APT_UPDATED" -eq 1 ] && die "apt-get install ${missing[*]} failed"
        log "install failed; running apt-get update and retrying"
        as_root apt-get -q update
        APT_UPDATED=1
        as_root "${apt[@]}" "${missing[@]}"
    fi
}

# Print "<uri> <signed-by or ->" of the first enabled binary (deb) source of the
# system's apt configuration that serves suite $1 (e.g. bookworm). Handles both
# one-line (*.list) and deb822 (*.sources) formats.
system_mirror() {
    local suite="$1" SL="" SP="" f
    eval "$(apt-config shell SL Dir::Etc::sourcelist/f SP Dir::Etc::sourceparts/d)"
    local files=()
    [ -n "$SL" ] && [ -f "$SL" ] && files+=("$SL")
    if [ -n "$SP" ] && [ -d "$SP" ]; then
        for f in "$SP"/*.list "$SP"/*.sources; do
            [ -f "$f" ] && files+=("$f")
        done
    fi
    local file
    for file in "${files[@]}"; do
        case "$file" in
        *.sources)
            awk -v suite="$suite" '
                function flush() {
                    if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") &&
                        tolower(enabled) != "no" && uris != "") {
                        split(uris, u, " "); print u[1], (signed == "" ? "-" : signed); found = 1; exit
                    }
                    types = ""; uris = ""; suites = ""; signed = ""; enabled = ""
                }
                /^[ \t]*#/ { next }
                /^[ \t]*$/ { flush(); next }
                /^[ \t]/ { next }   # continuation lines (e.g. inline keys) are ignored
                {
                    key = tolower($0); sub(/:.*/, "", key)
                    val = $0; sub(/^[^:]*:[ \t]*/, "", val); gsub(/[ \t]+/, " ", val)
                    if (key == "types") types = val
                    else if (key == "uris") uris = val
                    else if (key == "suites") suites = val
                    else if (key == "signed-by" && val ~ /^\//) signed = val
                    else if (key == "enabled") enabled = val
                }
                END { if (!found) flush() }
            ' "$file" | head -n1
            ;;
        *)
            awk -v suite="$suite" '
                /^[ \t]*#/ || NF == 0 { next }
                $1 != "deb" { next }
                {
                    signed = "-"; i = 2
                    if ($2 ~ /^\[/) {
                        while (i <= NF) {
                            o = $i; gsub(/[\[\]]/, "", o)
                            if (o ~ /^signed-by=/) { sub(/^signed-by=/, "", o); signed = o }
                            if ($i ~ /\]$/) { i++; break }
                            i++
                        }
                    }
                    if ($(i + 1) == suite) { print $i, signed; exit }
                }
            ' "$file"
            ;;
        esac
    done | head -n1
}

