# Shared by callgrind-redis-hot-key.sh, callgrind-redis-noop.sh and paced-hot-free.sh
# (sourced, not run): a free loopback port, a redis-server under callgrind and a drain on it,
# the daemon's config of the `Hot` class (a builtin `sleep` locked by `user:{args[1]}`, limit 1,
# `park`), and the jobs pushed to its queue.

# A free loopback port.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# hot_config DIR PORT [EXTRA]: DIR/c.toml for `--workers 2` against the redis-server on PORT,
# with EXTRA (TOML lines, e.g. a [locket] section) at its end.
hot_config() {
  cat >"$1/c.toml" <<EOT
queues = "q"
workers = 2
redis = "redis://127.0.0.1:$2"
[classes.Hot]
builtin = "sleep"
lock = "user:{args[1]}"
${3:-}
EOT
}

# push_jobs PORT KIND N FREE_SECS: N jobs of `Hot` on queue q. KIND hot: all for user u1,
# 20 ms each (each parks behind the one before and is handed the lock in turn); free: each for
# a user of its own, FREE_SECS each.
push_jobs() {
  local port=$1 kind=$2 n=$3 free_secs=$4 i user secs
  for i in $(seq 1 "$n"); do
    if [ "$kind" = hot ]; then user=u1; secs=0.02; else user="u$i"; secs=$free_secs; fi
    printf "RPUSH resque:queue:q '{\"class\":\"Hot\",\"args\":[%s,\"%s\",%d]}'\n" "$secs" "$user" "$i"
  done | redis-cli -p "$port" >/dev/null
}

# callgrind_redis DIR: a redis-server under callgrind, its files in DIR, on a free port, ready
# to answer; sets CG_PORT and CG_PID.
callgrind_redis() {
  CG_PORT=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$1/cg.out" redis-server --port "$CG_PORT" \
    --bind 127.0.0.1 --dir "$1" --save "" --appendonly no >"$1/valgrind.log" 2>&1 &
  CG_PID=$!
  for _ in $(seq 300); do redis-cli -p "$CG_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
}

# callgrind_drain DIR EXE N: runs EXE with DIR/c.toml until the redis-server of callgrind_redis
# has processed N jobs (at most 5 minutes), stops both and prints Redis's instructions; DIR is
# removed. Exits 1 when fewer ran.
callgrind_drain() {
  local dir=$1 exe=$2 n=$3 dpid done_n
  "$exe" --config "$dir/c.toml" >"$dir/daemon.log" 2>&1 &
  dpid=$!
  for _ in $(seq 3000); do
    [ "$(redis-cli -p "$CG_PORT" get resque:stat:processed)" = "$n" ] && break
    sleep 0.1
  done
  kill "$dpid"; wait "$dpid" || true
  done_n=$(redis-cli -p "$CG_PORT" get resque:stat:processed)
  redis-cli -p "$CG_PORT" shutdown nosave >/dev/null 2>&1 || true
  wait "$CG_PID" || true
  [ "$done_n" = "$n" ] || { echo "only $done_n of $n jobs ran" >&2; rm -rf "$dir"; exit 1; }
  callgrind_annotate "$dir/cg.out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}'
  rm -rf "$dir"
}
