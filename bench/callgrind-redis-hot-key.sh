#!/usr/bin/env bash
# Instructions Redis spends on a hot key's job against a free job's (valgrind's callgrind on
# redis-server: instructions, not seconds, so the figure holds on a busy machine). It starts its
# own redis-server under callgrind on a free loopback port in a temporary directory, pushes N
# jobs of a class locked `user:{args[1]}` (limit 1, `park`), and runs the daemon
# (`--workers 2`) until they are processed. HOT jobs are all for one user (each 20 ms, so each
# parks behind the one before and is handed the lock in turn); FREE jobs are each for a user of
# its own (0 ms). Each kind runs at N = 100 and N = 300, and a job's figure is the difference
# over the 200 jobs between them, which leaves out the start-up (the FUNCTION load, the
# registration).
#
# usage: bench/callgrind-redis-hot-key.sh LOCKETD_BINARY [one_call_take: true|false]
# prints: free job K instr, hot job K instr, their ratio
set -euo pipefail
exe=$(readlink -f "$1"); take=${2:-true}
. "$(dirname "$0")/hot-key-lib.sh"
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 2; }

# Redis instructions of one drain: KIND hot|free, N jobs.
run() {
  local kind=$1 n=$2 dir port
  dir=$(mktemp -d)
  port=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" redis-server --port "$port" \
    --bind 127.0.0.1 --dir "$dir" --save "" --appendonly no >"$dir/valgrind.log" 2>&1 &
  local vpid=$!
  for _ in $(seq 300); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  hot_config "$dir" "$port" "[locket]
one_call_take = $take"
  push_jobs "$port" "$kind" "$n" 0
  "$exe" --config "$dir/c.toml" >"$dir/daemon.log" 2>&1 &
  local dpid=$!
  for _ in $(seq 1200); do
    [ "$(redis-cli -p "$port" get resque:stat:processed)" = "$n" ] && break
    sleep 0.1
  done
  kill "$dpid"; wait "$dpid" || true
  local done_n; done_n=$(redis-cli -p "$port" get resque:stat:processed)
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  wait "$vpid" || true
  [ "$done_n" = "$n" ] || { echo "only $done_n of $n $kind jobs ran" >&2; rm -rf "$dir"; exit 1; }
  callgrind_annotate "$dir/cg.out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}'
  rm -rf "$dir"
}

f1=$(run free 100); f3=$(run free 300); h1=$(run hot 100); h3=$(run hot 300)
python3 -c "
f = ($f3 - $f1) / 200; h = ($h3 - $h1) / 200
print(f'one_call_take=$take: free job {f / 1e3:.0f} k instr, hot job {h / 1e3:.0f} k instr, ratio {h / f:.2f}')"
