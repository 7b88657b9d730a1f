#!/usr/bin/env bash
# Runs the exactly-once job on idem and on every peer (Pebble, bbolt,
# SQLite, Redis, PostgreSQL, the file-append limit), several rounds at
# several concurrencies, and writes the figures as CSV plus the chart.
# SET=shared runs the shared stores a fleet of processes uses instead: the
# idem cluster (3 nodes), etcd (3 members), Redis and PostgreSQL, with the
# embedded engine for reference.
#
#   bash bench/peers/run.sh                      # the full run (~14 min on 2 cores)
#   SET=shared bash bench/peers/run.sh           # the shared stores (~8 min)
#   ROUNDS=1 CALLERS="1 64" FRESH=500ms DUP=300ms OUT=/tmp/smoke bash bench/peers/run.sh
#
# Settings (environment):
#   SET      "embedded" (default) or "shared": the defaults of PEERS,
#            CALLERS, NAME and BASE below
#   ROUNDS   rounds (default 5); every round runs every peer at every concurrency
#   CALLERS  concurrent callers (default "1 8 64 512"; shared: "8 64 512")
#   FRESH    length of each fresh phase (default 3s)
#   DUP      length of each duplicate phase (default 2s)
#   WARMUP   unmeasured fresh requests before each fresh phase (default 0: none)
#   PEERS    peers to run (default "idem pebble bbolt sqlite redis postgres
#            file"; shared: "idemcluster etcd redis postgres idem")
#   NAME     the output files' name (default peers; shared: peers-shared)
#   BASE     the peer the ratios are taken to (default idem; shared: idemcluster)
#   OUT      where NAME.csv, NAME-medians.csv, NAME.md, NAME-env.txt and
#            NAME.svg go (default: the repository's docs/)
#   WORKDIR  parent of the temporary directory holding every store and the
#            servers' data (default /var/tmp: a disk, unlike a tmpfs /tmp)
#
# Redis and PostgreSQL are Debian's packages (installed with apt-get when
# missing and running as root), started here on 127.0.0.1 on free ports
# with their data in the temporary directory, and stopped by their process
# ids when the script exits, however it exits.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# The command as given (the settings set in the environment), for the
# figures' record.
given=""
for v in SET ROUNDS CALLERS FRESH DUP WARMUP PEERS NAME BASE; do
	if [[ -n ${!v:-} ]]; then
		case ${!v} in
		*[!A-Za-z0-9._-]*) given+="$v=\"${!v}\" " ;;
		*) given+="$v=${!v} " ;;
		esac
	fi
done
SET=${SET:-embedded}
case $SET in
embedded)
	CALLERS=${CALLERS:-"1 8 64 512"}
	PEERS=${PEERS:-"idem pebble bbolt sqlite redis postgres file"}
	NAME=${NAME:-peers}
	BASE=${BASE:-idem}
	;;
shared)
	CALLERS=${CALLERS:-"8 64 512"}
	PEERS=${PEERS:-"idemcluster etcd redis postgres idem"}
	NAME=${NAME:-peers-shared}
	BASE=${BASE:-idemcluster}
	;;
*)
	echo "SET=$SET: want embedded or shared" >&2
	exit 2
	;;
esac
ROUNDS=${ROUNDS:-5}
FRESH=${FRESH:-3s}
DUP=${DUP:-2s}
WARMUP=${WARMUP:-0s}
OUT=${OUT:-$root/docs}
WORKDIR=${WORKDIR:-/var/tmp}

log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }
wants() { [[ " $PEERS " == *" $1 "* ]]; }

# --- servers: find them, install them when missing -----------------------

find_pg_bin() {
	local d
	for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
		if [[ -x $d/postgres && -x $d/initdb ]]; then echo "$d"; return 0; fi
	done
	if command -v postgres >/dev/null && command -v initdb >/dev/null; then
		dirname "$(readlink -f "$(command -v postgres)")"
		return 0
	fi
	return 1
}

install_pkgs() {
	[[ $(id -u) == 0 ]] || die "missing $*: install the Debian packages ($*) or run as root"
	log "installing $* (apt-get)"
	if ! DEBIAN_FRONTEND=noninteractive apt-get install -y "$@" >&2; then
		apt-get update >&2
		DEBIAN_FRONTEND=noninteractive apt-get install -y "$@" >&2
	fi
}

missing=()
if wants redis && ! command -v redis-server >/dev/null; then missing+=(redis-server); fi
if wants postgres && ! find_pg_bin >/dev/null; then missing+=(postgresql); fi
if ((${#missing[@]})); then install_pkgs "${missing[@]}"; fi

# --- work directory, cleanup ---------------------------------------------

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
work=$(mktemp -d "$WORKDIR/idem-peers.XXXXXX")
chmod 755 "$work" # the postgres user must reach its data directory
redis_pid=""
pg_pid=""

stop_pid() { # pid signal name
	local pid=$1 sig=$2 name=$3 i
	[[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
	log "stopping $name (pid $pid)"
	kill "-$sig" "$pid" 2>/dev/null || true
	for ((i = 0; i < 300; i++)); do
		kill -0 "$pid" 2>/dev/null || return 0
		sleep 0.1
	done
	log "$name (pid $pid) did not stop in 30 s: SIGKILL"
	kill -KILL "$pid" 2>/dev/null || true
}

cleanup() {
	stop_pid "$redis_pid" TERM redis-server
	stop_pid "$pg_pid" INT postgres # fast shutdown
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fstype=$(df --output=fstype "$work" | tail -1 | tr -d " ")
if [[ $fstype == tmpfs || $fstype == ramfs ]]; then
	log "warning: $work is on $fstype: fsync costs nothing there, the figures say nothing about a disk (set WORKDIR)"
fi

log "building the harness"
(cd "$here" && go build -o "$work/peers" ./cmd/peers)
bin=$work/peers

# --- Redis ---------------------------------------------------------------

redis_args=()
if wants redis; then
	port=$("$bin" freeport)
	mkdir -p "$work/redis"
	redis-server --bind 127.0.0.1 --port "$port" --protected-mode yes --dir "$work/redis" \
		--appendonly yes --appendfsync always --save '' --daemonize no \
		--logfile "$work/redis.log" &
	redis_pid=$!
	for ((i = 0; ; i++)); do
		if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
		kill -0 "$redis_pid" 2>/dev/null || { cat "$work/redis.log" >&2; die "redis-server exited"; }
		((i < 100)) || die "redis-server not listening on 127.0.0.1:$port after 10 s"
		sleep 0.1
	done
	redis_args=(-redis "127.0.0.1:$port" -redis-pid "$redis_pid")
	log "redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/') on 127.0.0.1:$port, pid $redis_pid"
fi

# --- PostgreSQL ----------------------------------------------------------

pg_args=()
if wants postgres; then
	pgbin=$(find_pg_bin) || die "PostgreSQL binaries not found"
	pguser=$(id -un)
	as_pg() { "$@"; }
	if [[ $(id -u) == 0 ]]; then # postgres refuses to run as root
		pguser=postgres
		if ! id postgres >/dev/null 2>&1; then
			pguser=idempeers
			id "$pguser" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$pguser"
		fi
		as_pg() { setpriv --reuid="$pguser" --regid="$(id -g "$pguser")" --init-groups -- "$@"; }
	fi
	pgdata=$work/pg
	mkdir -p "$pgdata"
	chown "$pguser" "$pgdata"
	chmod 700 "$pgdata"
	as_pg "$pgbin/initdb" -D "$pgdata" -U postgres --auth=trust -E UTF8 --no-locale >"$work/initdb.log" 2>&1 ||
		{ cat "$work/initdb.log" >&2; die "initdb failed"; }
	port=$("$bin" freeport)
	# synchronous_commit and fsync are on by default; said here so that the
	# run does not depend on a default (the harness checks them too).
	as_pg "$pgbin/postgres" -D "$pgdata" -p "$port" -c listen_addresses=127.0.0.1 \
		-c unix_socket_directories="$pgdata" -c max_connections=600 -c shared_buffers=256MB \
		-c synchronous_commit=on -c fsync=on >"$work/postgres.log" 2>&1 &
	starter=$!
	for ((i = 0; ; i++)); do
		if [[ -s $pgdata/postmaster.pid ]] && "$pgbin/pg_isready" -q -h 127.0.0.1 -p "$port"; then break; fi
		kill -0 "$starter" 2>/dev/null || { cat "$work/postgres.log" >&2; die "postgres exited"; }
		((i < 300)) || die "postgres not ready on 127.0.0.1:$port after 30 s"
		sleep 0.1
	done
	pg_pid=$(head -1 "$pgdata/postmaster.pid") # the postmaster (setpriv execs it, so it is $starter)
	pg_args=(-postgres "postgres://postgres@127.0.0.1:$port/postgres?sslmode=disable" -postgres-pid "$pg_pid")
	log "postgres $("$pgbin/postgres" --version | awk '{print $3}') on 127.0.0.1:$port, pid $pg_pid"
fi

# --- what the figures were measured on -----------------------------------

{
	echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) memory, Linux $(uname -r)"
	echo "stores: $fstype on $(df --output=source "$work" | tail -1)"
	echo "go: $(go version | awk '{print $3}')"
	wants redis && echo "redis: $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/') appendonly yes, appendfsync always, save ''"
	wants postgres && echo "postgres: $("$pgbin/postgres" --version | awk '{print $3}') synchronous_commit=on fsync=on shared_buffers=256MB max_connections=600"
	wants idemcluster && echo "idemcluster: 3 nodes in the harness's process on loopback, one idemcluster.Client (linearizable reads)"
	wants etcd && echo "etcd: $(cd "$here" && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3) 3 members embedded in the harness's process on loopback (defaults), one client on the 3 endpoints"
	echo "rounds: $ROUNDS; callers: $CALLERS; fresh phase: $FRESH; duplicate phase: $DUP"
	echo "peers: $PEERS"
	echo "command: ${given}bash bench/peers/run.sh"
	echo "load average before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$work/env.txt"
cat "$work/env.txt" >&2

# --- the runs --------------------------------------------------------------

read -r -a peer_list <<<"$PEERS"
n=${#peer_list[@]}
raw=$work/raw.csv
start=$(date +%s)
for ((round = 1; round <= ROUNDS; round++)); do
	for c in $CALLERS; do
		# Each round starts the peer order one further, so that no peer
		# always runs right after the same other one.
		for ((k = 0; k < n; k++)); do
			p=${peer_list[(k + round - 1) % n]}
			extra=()
			[[ $p == redis ]] && extra=("${redis_args[@]}")
			[[ $p == postgres ]] && extra=("${pg_args[@]}")
			"$bin" run -peer "$p" -c "$c" -round "$round" -warmup "$WARMUP" -fresh "$FRESH" -dup "$DUP" \
				-dir "$work" -out "$raw" "${extra[@]}"
		done
	done
done
log "runs took $(($(date +%s) - start)) s"
echo "load average after the run: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$work/env.txt"

"$bin" summary -in "$raw" -base "$BASE" -csv "$OUT/$NAME.csv" -medians "$OUT/$NAME-medians.csv" >"$OUT/$NAME.md"
cp "$work/env.txt" "$OUT/$NAME-env.txt"
cat "$OUT/$NAME.md"
(cd "$here" && go run ./cmd/chart -in "$OUT/$NAME.csv" -env "$OUT/$NAME-env.txt" -out "$OUT/$NAME.svg")
log "wrote $OUT/$NAME.csv, $NAME-medians.csv, $NAME.md, $NAME-env.txt, $NAME.svg"
