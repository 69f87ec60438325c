#!/usr/bin/env bash
# Jobs a second of one drain over loopback TCP and over a Unix socket, alternated: N noop jobs
# locked by `{class}:{args[0]}`, `--workers 2`, `interval = 0` (the daemon drains and exits),
# timed from start to exit (start-up included). Each drain gets its own redis-server, listening
# on a free loopback port and on a socket in a temporary directory, both removed after it.
#
# usage: bench/socket-vs-tcp.sh LOCKETD_BINARY [N (default 40000)] [ROUNDS (default 2)]
# prints: one line per drain, "tcp|unix BINARY: J jobs/s"
set -euo pipefail
exe=$(readlink -f "$1"); n=${2:-40000}; rounds=${3:-2}
. "$(dirname "$0")/hot-key-lib.sh"

# drain KIND: one drain over KIND (tcp or unix); prints its line.
drain() {
  local kind=$1 dir port url start end done_n
  dir=$(mktemp -d)
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --unixsocket "$dir/r.sock" --unixsocketperm 700 \
    --dir "$dir" --save "" --appendonly no >"$dir/redis.log" 2>&1 &
  local rpid=$!
  trap 'kill "$rpid" 2>/dev/null; rm -rf "$dir"' RETURN
  for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  if [ "$kind" = unix ]; then url="redis+unix://$dir/r.sock"; else url="redis://127.0.0.1:$port/0"; fi
  printf 'queues = "bench"\nworkers = 2\ninterval = 0\nlog_level = "warn"\nredis = "%s"\n[classes.Noop]\nbuiltin = "noop"\nlock = "{class}:{args[0]}"\n' \
    "$url" >"$dir/c.toml"
  python3 - "$n" <<'PY' | redis-cli -p "$port" --pipe >/dev/null
import sys
def cmd(*a):
    sys.stdout.write("*%d\r\n" % len(a) + "".join("$%d\r\n%s\r\n" % (len(x), x) for x in a))
cmd("SADD", "resque:queues", "bench")
for i in range(int(sys.argv[1])):
    cmd("RPUSH", "resque:queue:bench", '{"class":"Noop","args":[%d]}' % i)
PY
  start=$(date +%s.%N)
  timeout 600 "$exe" --config "$dir/c.toml" >"$dir/daemon.log" 2>&1 || true
  end=$(date +%s.%N)
  done_n=$(redis-cli -p "$port" get resque:stat:processed)
  [ "$done_n" = "$n" ] || { echo "$kind: only $done_n of $n jobs ran" >&2; return 1; }
  python3 -c "print('$kind $(basename "$exe"): %d jobs/s' % ($n / ($end - $start)))"
}

for _ in $(seq "$rounds"); do
  drain tcp
  drain unix
done
