#!/usr/bin/env bash
# Redis CPU per job of a hot key's chain against free jobs run at the same pace (issue 40's
# "a hot job's Redis CPU against a free job's"). The `hot-key` scenario compares a hot job with
# free jobs drained in a burst; this compares like with like: N jobs of one user (20 ms each,
# limit-1 lock, `park`: one runs at a time, the others parked and handed the lock in turn)
# against N jobs of 40 ms each for a user of its own on the same two workers (one job every
# 20 ms too). It starts its own redis-server on a free loopback port in a temporary directory;
# Redis CPU is INFO's used_cpu_user + used_cpu_sys from the first processed job to the last.
#
# usage: bench/paced-hot-free.sh LOCKETD_BINARY [N (default 500)]
set -euo pipefail
exe=$(readlink -f "$1"); n=${2:-500}
. "$(dirname "$0")/hot-key-lib.sh"

run() {
  local kind=$1 dir port pid c0 c1 p0 p1 t0 t1
  dir=$(mktemp -d)
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save "" --appendonly no \
    --daemonize yes --pidfile "$dir/redis.pid" >/dev/null
  for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  hot_config "$dir" "$port"
  push_jobs "$port" "$kind" "$n" 0.04
  cpu() { redis-cli -p "$port" info cpu | awk -F: '/used_cpu_(user|sys):/ {s += $2} END {printf "%.6f", s}'; }
  processed() { redis-cli -p "$port" get resque:stat:processed; }
  "$exe" --config "$dir/c.toml" >"$dir/daemon.log" 2>&1 &
  pid=$!
  for _ in $(seq 1000); do [ "$(processed)" != "" ] && break; sleep 0.01; done
  c0=$(cpu); p0=$(processed); t0=$(date +%s.%N)
  for _ in $(seq 6000); do [ "$(processed)" = "$n" ] && break; sleep 0.05; done
  c1=$(cpu); p1=$(processed); t1=$(date +%s.%N)
  kill "$pid"; wait "$pid" || true
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  rm -rf "$dir"
  [ "$p1" = "$n" ] || { echo "only $p1 of $n $kind jobs ran" >&2; exit 1; }
  python3 -c "print(f'$kind: {($c1 - $c0) * 1e6 / ($n - ${p0:-0}):.0f} us Redis CPU a job over {$t1 - $t0:.1f} s')"
}

run free
run hot
