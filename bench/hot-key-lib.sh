# Shared by callgrind-redis-hot-key.sh and paced-hot-free.sh (sourced, not run): a free
# loopback port, the daemon's config of the `Hot` class (a builtin `sleep` locked by
# `user:{args[1]}`, limit 1, `park`), and the jobs pushed to its queue.

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
