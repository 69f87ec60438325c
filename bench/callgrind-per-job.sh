#!/usr/bin/env bash
# Instructions one worker process spends on N noop jobs (valgrind's callgrind counts
# instructions, not seconds: the same binary and inputs give the same count, whatever else the
# machine is doing). It starts its own redis-server on a free loopback port in a temporary
# directory, pushes N jobs of a `builtin = "noop"` class (default lock on), runs the binary as
# a worker (LOCKETD_ROLE=worker, config on stdin, interval 0: it drains and exits), and prints
# the total. Per job: (Ir at N - Ir at 0) / N. HANDLER `ruby` runs the class through the
# persistent Ruby adapter instead (examples/ruby-app's `Noop`, started with the slot; valgrind
# follows only the worker, not the handler): that count varies by a few thousand instructions
# a job between runs, with how often the worker wakes for the handler's frames.
#
# usage: bench/callgrind-per-job.sh LOCKETD_BINARY N [SLOTS] [HANDLER: builtin|ruby]
# e.g.:  for n in 0 2000; do bench/callgrind-per-job.sh target/release/locketd $n 1; done
# LOG_LEVEL=info runs the worker at `info` (default `warn`): the per-job log lines included.
set -euo pipefail
exe=$(readlink -f "$1"); n=$2; slots=${3:-1}; handler=${4:-builtin}
root=$(cd "$(dirname "$0")/.." && pwd)
case "$handler" in
  builtin) handlers=''; class_table='builtin = "noop"' ;;
  ruby)
    handlers="[handlers.app]
mode = \"persistent\"
command = [\"$root/adapters/ruby/locketd-ruby\", \"$root/examples/ruby-app/app.rb\"]
preload = true"
    class_table='handler = "app"' ;;
  *) echo "HANDLER must be builtin or ruby, not $handler" >&2; exit 2 ;;
esac
dir=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save "" --appendonly no \
  --daemonize yes --pidfile "$dir/redis.pid" >/dev/null
cleanup() {
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
python3 - "$n" <<'PY' | redis-cli -p "$port" --pipe >/dev/null
import sys
def cmd(*a):
    out = "*%d\r\n" % len(a)
    for x in a:
        x = str(x)
        out += "$%d\r\n%s\r\n" % (len(x.encode()), x)
    return out
sys.stdout.write(cmd("SADD", "resque:queues", "bench"))
for i in range(int(sys.argv[1])):
    sys.stdout.write(cmd("RPUSH", "resque:queue:bench", '{"class":"Noop","args":[%d]}' % i))
PY
cat > "$dir/locketd.toml" <<TOML
redis = "redis://127.0.0.1:$port/0"
queues = "bench"
interval = 0
slots = $slots
log_level = "${LOG_LEVEL:-warn}"
$handlers
[classes.Noop]
$class_table
TOML
# argv[0] starting with "resque-" spares the re-exec for title space, which valgrind cannot
# follow.
ln -s "$exe" "$dir/resque-callgrind-locketd"
LOCKETD_ROLE=worker LOCKETD_INCARNATION=c0ffee01 PATH="$dir:$PATH" \
  valgrind --tool=callgrind --callgrind-out-file="$dir/callgrind.out" \
  resque-callgrind-locketd < "$dir/locketd.toml" >/dev/null 2>"$dir/valgrind.log"
ir=$(grep -m1 '^summary:\|^totals:' "$dir/callgrind.out" | awk '{print $2}')
echo "$exe n=$n slots=$slots handler=$handler Ir=$ir processed=$(redis-cli -p "$port" get resque:stat:processed) left=$(redis-cli -p "$port" llen resque:queue:bench)"
