#!/usr/bin/env bash
# Instructions Redis spends on one noop job (valgrind's callgrind on redis-server: instructions,
# not seconds, so the figure holds on a busy machine and compares two binaries exactly). It
# starts its own redis-server under callgrind on a free loopback port in a temporary directory,
# pushes N jobs of a builtin `noop` class locked by TEMPLATE, and runs the daemon
# (`--workers 2`) until they are processed; at N = 300 and N = 1300, and a job's figure is the
# difference over the 1,000 jobs between them (the start-up, the FUNCTION load and the
# registration are left out; the pushes are in, about 10 k a job).
#
# usage: bench/callgrind-redis-noop.sh LOCKETD_BINARY [TEMPLATE] [one_call_take: true|false|omit]
#   TEMPLATE defaults to '{class}:{args[0]}'; `omit` writes no [locket] section (for a binary
#   older than the setting).
# prints: K instructions of Redis per job
set -euo pipefail
exe=$(readlink -f "$1"); template=${2:-'{class}:{args[0]}'}; take=${3:-true}
. "$(dirname "$0")/hot-key-lib.sh"
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 2; }

# Redis instructions of one drain of N jobs.
run() {
  local n=$1 dir
  dir=$(mktemp -d)
  callgrind_redis "$dir"
  {
    printf 'queues = "bench"\nworkers = 2\nredis = "redis://127.0.0.1:%s"\n' "$CG_PORT"
    [ "$take" = omit ] || printf '[locket]\none_call_take = %s\n' "$take"
    printf '[classes.Noop]\nbuiltin = "noop"\nlock = "%s"\n' "$template"
  } >"$dir/c.toml"
  for i in $(seq 0 $((n - 1))); do
    printf 'RPUSH resque:queue:bench "{\\"class\\":\\"Noop\\",\\"args\\":[%d]}"\n' "$i"
  done | redis-cli -p "$CG_PORT" >/dev/null
  callgrind_drain "$dir" "$exe" "$n"
}

a=$(run 300); b=$(run 1300)
k=$(python3 -c "print(f'{($b - $a) / 1000 / 1e3:.1f}')")
echo "Redis per noop job ($template, one_call_take=$take): $k k instr"
