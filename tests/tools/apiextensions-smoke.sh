#!/usr/bin/env bash
# Smoke test of the apiextensions-apiserver built by tests/tools/install-apiextensions.sh: start
# etcd and the server (client-certificate auth, on free loopback ports, everything in a temp dir),
# create a CRD with CEL rules over HTTPS with curl (kubectl cannot use this server: it has no core
# API discovery), and check that the rules, server-side apply, the status subresource and
# x-kubernetes-map-type/list-type behave as on a real 1.36 API server. Then it applies the
# project's own CRDs (crds/nightshift.yaml) and stops everything.
#
# Usage: tests/tools/apiextensions-smoke.sh
# Uses $APIEXTENSIONS_APISERVER and $ETCD when set, else <cache>/apiextensions/env.sh and
# <cache>/kube/env.sh, else `etcd` on PATH.
#   SMOKE_KEEP=1   keep the temp dir (certs, kubeconfig, logs) and print its path
# Needs: openssl, curl, python3.
set -euo pipefail

LOG_TAG=apiextensions-smoke
# shellcheck source=tests/tools/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE_ROOT="${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}"

if [ -z "${APIEXTENSIONS_APISERVER:-}" ] && [ -f "$CACHE_ROOT/apiextensions/env.sh" ]; then
    # shellcheck disable=SC1091
    . "$CACHE_ROOT/apiextensions/env.sh"
fi
if [ -z "${ETCD:-}" ] && [ -f "$CACHE_ROOT/kube/env.sh" ]; then
    # shellcheck disable=SC1091
    . "$CACHE_ROOT/kube/env.sh"
fi
APISERVER="${APIEXTENSIONS_APISERVER:-}"
ETCD="${ETCD:-$(command -v etcd || true)}"
if [ -z "$APISERVER" ] || [ ! -x "$APISERVER" ]; then
    die "no apiextensions-apiserver: run tests/tools/install-apiextensions.sh"
fi
if [ -z "$ETCD" ] || [ ! -x "$ETCD" ]; then
    die "no etcd: run tests/tools/install-kube.sh"
fi
for tool in openssl curl python3; do
    command -v "$tool" >/dev/null || die "$tool is needed"
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/apiextensions-smoke.XXXXXX")"
ETCD_PID="" APISERVER_PID=""

stop() {
    local pid
    for pid in "$APISERVER_PID" "$ETCD_PID"; do
        [ -n "$pid" ] || continue
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    APISERVER_PID="" ETCD_PID=""
}
cleanup() {
    local rc=$?
    stop
    if [ "$rc" -ne 0 ]; then
        log "FAILED; last lines of the server logs:"
        tail -n 20 "$WORK/apiserver.log" "$WORK/etcd.log" >&2 2>/dev/null || true
    fi
    if [ "${SMOKE_KEEP:-0}" = 1 ]; then
        log "kept $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

# A free TCP port on 127.0.0.1 (the kernel picks it; a tiny race with other processes is fine).
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

ms_since() { echo $(($(date +%s%3N) - $1)); }

# ---------------------------------------------------------------------------------------------
# Certificates: a CA, a serving certificate for 127.0.0.1 and a client certificate in the
# system:masters group (authorized for everything). X509v3 with SANs and EC P-256 keys in PKCS#8,
# which rustls (kube-rs) accepts as well as Go.
make_certs() {
    local d="$WORK/pki"
    mkdir -p "$d"
    cp "$(dirname "${BASH_SOURCE[0]}")/apiextensions-openssl.cnf" "$d/openssl.cnf"
    local name
    for name in ca server client; do
        openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$d/$name.key" 2>/dev/null
    done
    openssl req -x509 -new -config "$d/openssl.cnf" -extensions ca_ext -key "$d/ca.key" \
        -subj "/CN=nightshift-test-ca" -days 3650 -sha256 -out "$d/ca.crt"
    # sign NAME SUBJECT EXTENSIONS
    sign() {
        openssl req -new -config "$d/openssl.cnf" -key "$d/$1.key" -subj "$2" -out "$d/$1.csr"
        openssl x509 -req -in "$d/$1.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" \
            -set_serial "0x$(openssl rand -hex 16)" -days 3650 -sha256 \
            -extfile "$d/openssl.cnf" -extensions "$3" -out "$d/$1.crt" 2>/dev/null
    }
    sign server "/CN=apiextensions-apiserver" server_ext
    sign client "/O=system:masters/CN=nightshift-test-admin" client_ext
}

# A kubeconfig with the CA, client certificate and key embedded (what a kube-rs harness can load
# with Kubeconfig::read_from + Config::from_custom_kubeconfig).
write_kubeconfig() {
    local d="$WORK/pki"
    b64() { base64 -w0 <"$1"; }
    cat >"$WORK/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: apiextensions
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority-data: $(b64 "$d/ca.crt")
users:
- name: admin
  user:
    client-certificate-data: $(b64 "$d/client.crt")
    client-key-data: $(b64 "$d/client.key")
contexts:
- name: apiextensions
  context:
    cluster: apiextensions
    user: admin
    namespace: default
current-context: apiextensions
EOF
}

# ---------------------------------------------------------------------------------------------
# HTTP helpers. `api METHOD PATH [CONTENT-TYPE BODY]` prints the status code; the response body
# is left in $WORK/resp.
api() {
    local method="$1" path="$2" ctype="${3:-}" body="${4:-}" args=()
    args=(-sS -o "$WORK/resp" -w '%{http_code}' -X "$method"
        --cacert "$WORK/pki/ca.crt" --cert "$WORK/pki/client.crt" --key "$WORK/pki/client.key")
    [ -n "$ctype" ] && args+=(-H "Content-Type: $ctype" --data-binary "$body")
    curl "${args[@]}" "https://127.0.0.1:$API_PORT$path" || echo 000
}
# expect CODE METHOD PATH [CONTENT-TYPE BODY]: the request must answer CODE.
expect() {
    local want="$1" got
    shift
    got="$(api "$@")"
    if [ "$got" != "$want" ]; then
        log "$1 $2 answered $got, expected $want:"
        cat "$WORK/resp" >&2
        echo >&2
        die "unexpected status"
    fi
}
# resp_has TEXT: the last response body contains TEXT.
resp_has() {
    grep -qF -- "$1" "$WORK/resp" || {
        cat "$WORK/resp" >&2
        die "response lacks: $1"
    }
}
# json EXPR: evaluate a Python expression on the last response body (as `r`).
json() {
    python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$WORK/resp" "$1"
}

# wait_for DESCRIPTION TIMEOUT_S COMMAND...: poll COMMAND every 0.1 s; print the time it took.
wait_for() {
    local what="$1" timeout="$2" t0
    shift 2
    t0="$(date +%s%3N)"
    until "$@"; do
        [ "$(ms_since "$t0")" -lt $((timeout * 1000)) ] || die "timed out after ${timeout}s waiting for $what"
        sleep 0.1
    done
    log "$what after $(ms_since "$t0") ms"
}

# ---------------------------------------------------------------------------------------------
start_etcd() {
    ETCD_PORT="$(free_port)"
    local peer
    peer="$(free_port)"
    "$ETCD" --name smoke --data-dir "$WORK/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
        --initial-cluster "smoke=http://127.0.0.1:$peer" >"$WORK/etcd.log" 2>&1 &
    ETCD_PID=$!
    etcd_healthy() { curl -fsS "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | grep -q '"health":"true"'; }
    wait_for "etcd ($("$ETCD" --version | head -n1)) healthy" 30 etcd_healthy
}

# Readiness: /readyz includes "informer-sync", which never passes here: the core Service
# informer (for conversion-webhook services) lists /api/v1/services, which this server lacks.
READYZ="/readyz?exclude=informer-sync"

start_apiserver() {
    API_PORT="$(free_port)"
    local d="$WORK/pki"
    write_kubeconfig
    # The server insists on kubeconfigs for the "core" API server it would normally extend
    # (informers; TokenReview/SubjectAccessReview delegation), else it tries the in-cluster config
    # and exits. It is given one pointing at itself: the client CA authenticates our requests, the
    # system:masters group authorizes them without any SubjectAccessReview.
    # Admission: NamespaceLifecycle needs the core API's namespaces (absent here: namespaces are
    # not checked at all) and the webhook/policy plugins need core informers; all are disabled.
    # Priority-and-fairness would need the flowcontrol API: disabled.
    local ADMISSION_OFF="NamespaceLifecycle,MutatingAdmissionWebhook,ValidatingAdmissionWebhook"
    ADMISSION_OFF+=",MutatingAdmissionPolicy,ValidatingAdmissionPolicy"
    APISERVER_ARGS=(
        --etcd-servers "http://127.0.0.1:$ETCD_PORT"
        --kubeconfig "$WORK/kubeconfig"
        --authentication-kubeconfig "$WORK/kubeconfig"
        --authorization-kubeconfig "$WORK/kubeconfig"
        --bind-address 127.0.0.1 --secure-port "$API_PORT"
        --tls-cert-file "$d/server.crt" --tls-private-key-file "$d/server.key"
        --client-ca-file "$d/ca.crt"
        --authentication-skip-lookup
        --disable-admission-plugins "$ADMISSION_OFF"
        --enable-priority-and-fairness=false
    )
    log "starting: $APISERVER ${APISERVER_ARGS[*]}"
    local t0
    t0="$(date +%s%3N)"
    "$APISERVER" "${APISERVER_ARGS[@]}" >"$WORK/apiserver.log" 2>&1 &
    APISERVER_PID=$!
    ready() {
        kill -0 "$APISERVER_PID" 2>/dev/null || die "apiextensions-apiserver exited"
        [ "$(api GET "$READYZ" 2>/dev/null)" = 200 ]
    }
    wait_for "apiextensions-apiserver $READYZ 200" 60 ready
    log "server up $(ms_since "$t0") ms after start"
}

# ---------------------------------------------------------------------------------------------
GROUP=smoke.nightshift.dev
CRS="/apis/$GROUP/v1/namespaces/default/widgets"
CRD_JSON='{
  "apiVersion": "apiextensions.k8s.io/v1",
  "kind": "CustomResourceDefinition",
  "metadata": {"name": "widgets.smoke.nightshift.dev"},
  "spec": {
    "group": "smoke.nightshift.dev",
    "scope": "Namespaced",
    "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
    "versions": [{
      "name": "v1", "served": true, "storage": true,
      "subresources": {"status": {}},
      "schema": {"openAPIV3Schema": {
        "type": "object",
        "properties": {
          "spec": {
            "type": "object",
            "required": ["x", "size"],
            "properties": {
              "x": {"type": "string"},
              "size": {"type": "integer"},
              "labels": {"type": "object", "additionalProperties": {"type": "string"},
                         "x-kubernetes-map-type": "atomic"},
              "ports": {"type": "array", "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["name"],
                        "items": {"type": "object", "required": ["name"],
                                  "properties": {"name": {"type": "string"}, "port": {"type": "integer"}}}}
            },
            "x-kubernetes-validations": [
              {"rule": "self.x == oldSelf.x", "message": "x is immutable"},
              {"rule": "self.size > 0", "message": "size must be positive"}
            ]
          },
          "status": {"type": "object", "properties": {"phase": {"type": "string"}}}
        }
      }}
    }]
  }
}'

widget() { # NAME X SIZE
    printf '{"apiVersion":"%s/v1","kind":"Widget","metadata":{"name":"%s"},"spec":{"x":"%s","size":%s}}' \
        "$GROUP" "$1" "$2" "$3"
}

crd_established() {
    [ "$(api GET "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/$1")" = 200 ] &&
        [ "$(json '[c["status"] for c in r.get("status", {}).get("conditions", []) if c["type"] == "Established"]')" = "['True']" ]
}

run_checks() {
    local t0
    t0="$(date +%s%3N)"
    expect 201 POST /apis/apiextensions.k8s.io/v1/customresourcedefinitions application/json "$CRD_JSON"
    wait_for "CRD widgets Established" 30 crd_established widgets.smoke.nightshift.dev
    served() { [ "$(api GET "$CRS")" = 200 ]; }
    wait_for "CRD widgets served (GET list 200)" 30 served
    log "CRD created -> served: $(ms_since "$t0") ms in total"

    # CEL: a create that breaks `self.size > 0`.
    expect 201 POST "$CRS" application/json "$(widget good a 1)"
    expect 422 POST "$CRS" application/json "$(widget bad a 0)"
    resp_has "size must be positive"
    log "bad widget rejected: $(json 'r["message"]')"
    # CEL transition rule `self.x == oldSelf.x` on update.
    expect 422 PATCH "$CRS/good" application/merge-patch+json '{"spec":{"x":"b"}}'
    resp_has "x is immutable"
    log "transition rule: $(json 'r["message"]')"
    expect 200 PATCH "$CRS/good" application/merge-patch+json '{"spec":{"size":2}}'

    # Status subresource: the main resource ignores status, /status ignores spec.
    expect 200 PATCH "$CRS/good" application/merge-patch+json '{"status":{"phase":"Ignored"}}'
    [ "$(json 'r.get("status")')" = None ] || die "status changed through the main resource"
    expect 200 PATCH "$CRS/good/status" application/merge-patch+json '{"status":{"phase":"Ready"},"spec":{"size":9}}'
    [ "$(json 'r["status"]["phase"], r["spec"]["size"]')" = "('Ready', 2)" ] || die "status subresource misbehaves"
    log "status subresource: ok"

    # Server-side apply; x-kubernetes-map-type: atomic makes a second manager's apply of another
    # key conflict (a granular map would merge the keys).
    local ssa="application/apply-patch+yaml"
    expect 201 PATCH "$CRS/ssa?fieldManager=alice" "$ssa" \
        "{apiVersion: $GROUP/v1, kind: Widget, metadata: {name: ssa}, spec: {x: a, size: 1, labels: {a: '1'}, ports: [{name: http, port: 80}]}}"
    [ "$(json '[m["manager"] for m in r["metadata"]["managedFields"]]')" = "['alice']" ] || die "no managedFields for alice"
    expect 409 PATCH "$CRS/ssa?fieldManager=bob" "$ssa" \
        "{apiVersion: $GROUP/v1, kind: Widget, metadata: {name: ssa}, spec: {labels: {b: '2'}}}"
    log "server-side apply: atomic map conflict: $(json 'r["message"]')"
    # A list-type map merges per key across managers...
    expect 200 PATCH "$CRS/ssa?fieldManager=bob" "$ssa" \
        "{apiVersion: $GROUP/v1, kind: Widget, metadata: {name: ssa}, spec: {ports: [{name: grpc, port: 90}]}}"
    [ "$(json '[p["name"] for p in r["spec"]["ports"]]')" = "['http', 'grpc']" ] || die "list-type map did not merge"
    # ... and rejects duplicate keys.
    expect 422 PATCH "$CRS/ssa" application/merge-patch+json '{"spec":{"ports":[{"name":"a"},{"name":"a"}]}}'
    resp_has "Duplicate value"
    log "server-side apply and list/map types: ok"

    # Namespaces are not checked (no core API, NamespaceLifecycle off): any name works.
    expect 201 POST "/apis/$GROUP/v1/namespaces/no-such-namespace/widgets" application/json "$(widget anywhere a 1)"

    # Deleting the CRD removes its custom resources (the CRD finalizer) and stops serving them.
    t0="$(date +%s%3N)"
    expect 200 DELETE /apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.smoke.nightshift.dev
    crd_gone() { [ "$(api GET /apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.smoke.nightshift.dev)" = 404 ]; }
    wait_for "CRD widgets deleted (with its 4 widgets)" 30 crd_gone
    expect 404 GET "$CRS"

    # The project's own CRDs: accepted (schemas, CEL cost limits) and Established.
    local crds="$REPO/crds/nightshift.yaml"
    if [ -f "$crds" ]; then
        local part n=0 name
        python3 - "$crds" "$WORK/crd" <<'EOF'
import sys
docs = [d for d in open(sys.argv[1]).read().split("\n---") if "kind: CustomResourceDefinition" in d]
for i, d in enumerate(docs):
    open(f"{sys.argv[2]}-{i}.yaml", "w").write(d.lstrip("-\n"))
EOF
        for part in "$WORK"/crd-*.yaml; do
            expect 201 POST /apis/apiextensions.k8s.io/v1/customresourcedefinitions application/yaml "$(cat "$part")"
            name="$(json 'r["metadata"]["name"]')"
            wait_for "CRD $name Established" 30 crd_established "$name"
            n=$((n + 1))
        done
        log "$n CRDs from crds/nightshift.yaml accepted and Established"
    fi
}

main() {
    log "apiextensions-apiserver: $APISERVER"
    make_certs
    start_etcd
    start_apiserver
    expect 200 GET /version
    log "/version: $(json 'r["gitVersion"]')"
    run_checks
    stop
    log "PASS"
}

main "$@"
