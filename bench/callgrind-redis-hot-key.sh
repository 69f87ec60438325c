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
  local kind=$1 n=$2 dir
  dir=$(mktemp -d)
  callgrind_redis "$dir"
  hot_config "$dir" "$CG_PORT" "[locket]
one_call_take = $take"
  push_jobs "$CG_PORT" "$kind" "$n" 0
  callgrind_drain "$dir" "$exe" "$n"
}

f1=$(run free 100); f3=$(run free 300); h1=$(run hot 100); h3=$(run hot 300)
python3 -c "
f = ($f3 - $f1) / 200; h = ($h3 - $h1) / 200
print(f'one_call_take=$take: free job {f / 1e3:.0f} k instr, hot job {h / 1e3:.0f} k instr, ratio {h / f:.2f}')"
