#!/usr/bin/env bash
# Smoke test for the toolchain installed by install-kube.sh.
#
# Starts, on 127.0.0.1 only and inside a temporary directory:
#   etcd -> kube-apiserver (token auth, RBAC) -> kube-controller-manager
# then uses kubectl to
#   * create a namespaced CustomResourceDefinition with a status subresource,
#     create a custom resource, read it back and patch its status;
#   * create a batch/v1 Job and wait until the job controller creates its Pod
#     (the Pod never runs: there is no kubelet).
# Everything is stopped and removed on exit.
#
# Binary locations come from KUBE_APISERVER / KUBE_CONTROLLER_MANAGER / ETCD /
# KUBECTL if set, otherwise from <cache>/kube/env.sh written by install-kube.sh
# (which is run if that file is missing).
# Set KUBE_SMOKE_KEEP=1 to keep the temp dir (logs) after exit.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}"
ENV_FILE="$CACHE_ROOT/kube/env.sh"

log() { printf '[kube-smoke] %s\n' "$*" >&2; }
die() {
    printf '[kube-smoke] FAILED: %s\n' "$*" >&2
    exit 1
}

if [ -z "${KUBE_APISERVER:-}" ] || [ -z "${KUBE_CONTROLLER_MANAGER:-}" ] || [ -z "${ETCD:-}" ] || [ -z "${KUBECTL:-}" ]; then
    [ -f "$ENV_FILE" ] || "$HERE/install-kube.sh" >/dev/null
    # shellcheck disable=SC1090
    eval "$(sed -n 's/^export \([A-Z_]*\)=\(.*\)$/: "${\1:=\2}"/p' "$ENV_FILE")"
fi
for v in KUBE_APISERVER KUBE_CONTROLLER_MANAGER ETCD KUBECTL; do
    [ -n "${!v:-}" ] && [ -x "${!v}" ] || { log "$v not executable: '${!v:-}' (run $HERE/install-kube.sh)"; exit 1; }
done

TMP="$(mktemp -d "${TMPDIR:-/tmp}/kube-smoke.XXXXXX")"
PIDS=()

dump_logs() {
    local f
    for f in "$TMP"/*.log; do
        [ -f "$f" ] || continue
        printf '\n===== last lines of %s =====\n' "$f" >&2
        tail -n 25 "$f" >&2
    done
}

cleanup() {
    local rc=$? pid i
    [ "$rc" -eq 0 ] || dump_logs
    # Stop in reverse start order, each by its own PID.
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        pid="${PIDS[$i]}"
        kill -TERM "$pid" 2>/dev/null || continue
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [ "${KUBE_SMOKE_KEEP:-0}" = 1 ]; then
        log "kept $TMP"
    else
        rm -rf "$TMP"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# free_port VAR: store in VAR a free TCP port on 127.0.0.1 (nothing listening
# on it now and not handed out before by this script).
USED_PORTS=" "
free_port() {
    local p
    for _ in $(seq 1 200); do
        p=$((20000 + RANDOM % 40000))
        case "$USED_PORTS" in *" $p "*) continue ;; esac
        if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then continue; fi
        if command -v ss >/dev/null && ss -Htan "sport = :$p" 2>/dev/null | grep -q .; then continue; fi
        USED_PORTS+="$p "
        printf -v "$1" '%s' "$p"
        return 0
    done
    die "no free port found"
}

wait_for() { # <seconds> <description> <command...>
    local secs="$1" what="$2" start=$SECONDS
    shift 2
    until "$@" >/dev/null 2>&1; do
        ((SECONDS - start < secs)) || die "timed out after ${secs}s waiting for $what"
        sleep 0.2
    done
    log "$what: ok after $((SECONDS - start))s"
}

alive() { kill -0 "$1" 2>/dev/null || die "$2 exited early"; }

free_port ETCD_PORT
free_port ETCD_PEER_PORT
free_port API_PORT
free_port KCM_PORT
TOKEN="smoke-admin-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
log "tmp=$TMP etcd=127.0.0.1:$ETCD_PORT apiserver=https://127.0.0.1:$API_PORT kcm=127.0.0.1:$KCM_PORT"

# --- etcd -------------------------------------------------------------------
"$ETCD" \
    --name=smoke \
    --data-dir="$TMP/etcd" \
    --listen-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster="smoke=http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster-state=new \
    >"$TMP/etcd.log" 2>&1 &
ETCD_PID=$!
PIDS+=("$ETCD_PID")
wait_for 30 "etcd /health" bash -c "kill -0 $ETCD_PID && curl -fsS http://127.0.0.1:$ETCD_PORT/health | grep -q '\"health\":\"true\"'"

# --- kube-apiserver -----------------------------------------------------------
openssl genrsa -out "$TMP/sa.key" 2048 2>/dev/null
openssl rsa -in "$TMP/sa.key" -pubout -out "$TMP/sa.pub" 2>/dev/null
# token,user,uid,"group1,group2"
echo "$TOKEN,smoke-admin,smoke-admin,\"system:masters\"" >"$TMP/tokens.csv"
mkdir -p "$TMP/certs"

APISERVER_FLAGS=(
    --advertise-address=127.0.0.1
    --bind-address=127.0.0.1
    --secure-port="$API_PORT"
    --insecure-port=0
    --cert-dir="$TMP/certs"
    --etcd-servers="http://127.0.0.1:$ETCD_PORT"
    --token-auth-file="$TMP/tokens.csv"
    --authorization-mode=RBAC
    --service-account-issuer=https://kubernetes.default.svc.cluster.local
    --service-account-key-file="$TMP/sa.pub"
    --service-account-signing-key-file="$TMP/sa.key"
    --service-cluster-ip-range=10.0.0.0/24
    # 127.0.0.1 is not a valid Endpoints address; skip the "kubernetes" service endpoints.
    --endpoint-reconciler-type=none
)
API_START=$SECONDS
"$KUBE_APISERVER" "${APISERVER_FLAGS[@]}" >"$TMP/kube-apiserver.log" 2>&1 &
API_PID=$!
PIDS+=("$API_PID")
wait_for 90 "kube-apiserver /readyz" bash -c \
    "kill -0 $API_PID && curl -fsSk -H 'Authorization: Bearer $TOKEN' https://127.0.0.1:$API_PORT/readyz | grep -qx ok"
log "kube-apiserver ready $((SECONDS - API_START))s after start"

cat >"$TMP/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: smoke
  cluster:
    server: https://127.0.0.1:$API_PORT
    insecure-skip-tls-verify: true
users:
- name: smoke-admin
  user:
    token: $TOKEN
contexts:
- name: smoke
  context:
    cluster: smoke
    user: smoke-admin
    namespace: default
current-context: smoke
EOF
export KUBECONFIG="$TMP/kubeconfig"
k() { "$KUBECTL" --request-timeout=20s "$@"; }
api() { # <method> <path> [curl args...]: raw API call with the admin token
    local m="$1" p="$2"
    shift 2
    curl -fsSk -X "$m" -H "Authorization: Bearer $TOKEN" "https://127.0.0.1:$API_PORT$p" "$@"
}

k version 2>&1 | sed 's/^/    /' >&2 || true

# --- CRD + custom resource ----------------------------------------------------
k apply -f - <<'EOF'
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.smoke.nightshift.example.com
spec:
  group: smoke.nightshift.example.com
  scope: Namespaced
  names:
    plural: widgets
    singular: widget
    kind: Widget
    listKind: WidgetList
  versions:
  - name: v1alpha1
    served: true
    storage: true
    subresources:
      status: {}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size:
                type: integer
          status:
            type: object
            properties:
              phase:
                type: string
EOF
k wait --for=condition=Established --timeout=30s crd/widgets.smoke.nightshift.example.com
# Discovery of the new group may lag the Established condition slightly.
wait_for 30 "widgets API discoverable" api GET /apis/smoke.nightshift.example.com/v1alpha1/namespaces/default/widgets

k apply -f - <<'EOF'
apiVersion: smoke.nightshift.example.com/v1alpha1
kind: Widget
metadata:
  name: w1
  namespace: default
spec:
  size: 3
EOF
got="$(k get widget w1 -n default -o jsonpath='{.spec.size}')"
[ "$got" = 3 ] || die "custom resource read back spec.size='$got', want 3"
log "custom resource created and read back (spec.size=$got)"

# Status subresource write (what an operator does); raw API so any kubectl works.
api PATCH /apis/smoke.nightshift.example.com/v1alpha1/namespaces/default/widgets/w1/status \
    -H 'Content-Type: application/merge-patch+json' -d '{"status":{"phase":"Ready"}}' >/dev/null ||
    die "status subresource patch failed"
got="$(k get widget w1 -n default -o jsonpath='{.status.phase}')"
[ "$got" = Ready ] || die "status.phase='$got', want Ready"
log "status subresource patched and read back (status.phase=$got)"

# --- kube-controller-manager + Job -> Pod -------------------------------------
KCM_FLAGS=(
    --kubeconfig="$TMP/kubeconfig"
    --bind-address=127.0.0.1
    --secure-port="$KCM_PORT"
    --port=0
    --cert-dir="$TMP/kcm-certs"
    --leader-elect=false
    --use-service-account-credentials=false
    --service-account-private-key-file="$TMP/sa.key"
    --root-ca-file="$TMP/certs/apiserver.crt"
    --controllers=*
)
"$KUBE_CONTROLLER_MANAGER" "${KCM_FLAGS[@]}" >"$TMP/kube-controller-manager.log" 2>&1 &
KCM_PID=$!
PIDS+=("$KCM_PID")
wait_for 60 "kube-controller-manager /healthz" bash -c \
    "kill -0 $KCM_PID && curl -fsSk https://127.0.0.1:$KCM_PORT/healthz | grep -qx ok"

# The ServiceAccount admission plugin rejects pods until the default service
# account exists; the serviceaccount controller creates it.
wait_for 60 "default service account" k get serviceaccount default -n default

k apply -f - <<'EOF'
apiVersion: batch/v1
kind: Job
metadata:
  name: smoke-job
  namespace: default
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: main
        image: busybox
        command: ["true"]
EOF
wait_for 60 "job controller created a Pod" bash -c \
    "'$KUBECTL' get pods -n default -l job-name=smoke-job -o name | grep -q ."
k get pods -n default -l job-name=smoke-job -o wide >&2
alive "$API_PID" kube-apiserver
alive "$KCM_PID" kube-controller-manager

log "PASS"
