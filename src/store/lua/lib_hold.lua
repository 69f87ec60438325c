-- Dependency holds (D-1, D-4, D-9) and the per-run reset. Appended after lib_reads.lua by
-- src/store/scripts.rs; reset_run is last, as it empties the tables of every part above.

-- D-1: a hold field is "<count>:<deadline ms>".
local function dep_field(v)
  local c, d = string.match(v or '', '^(%d+):(%d+)$')
  return tonumber(c) or 0, tonumber(d) or 0
end

-- D-1, D-2, D-6, A-14: drop the expired fields of hold `name`, then set the key's expiry to the
-- latest field deadline and its `deps` score to the earliest; a name without fields is deleted,
-- leaves the index and resets the counters of the queues it blocked.
-- Returns the live total, a table digest -> count, and the number of fields dropped.
local function dep_state(prefix, name, now)
  local key = prefix .. 'dep:' .. name
  local all = redis.call('HGETALL', key)
  local total, counts, dropped, earliest, latest = 0, {}, {}, nil, nil
  for i = 1, #all, 2 do
    local c, d = dep_field(all[i + 1])
    if c <= 0 or d <= now then
      dropped[#dropped + 1] = all[i]
    else
      total = total + c
      counts[all[i]] = c
      if earliest == nil or d < earliest then earliest = d end
      if latest == nil or d > latest then latest = d end
    end
  end
  if #dropped > 0 then
    hdel_all(key, dropped)
  end
  if total == 0 then
    if #all > 0 then redis.call('DEL', key) end
    redis.call('ZREM', prefix .. 'deps', name)
    reset_blocked(prefix .. 'blocked:dep:' .. name, prefix .. 'counter:')
    -- PK-2, PK-7: a released hold wakes every job parked on it, 1,000 a call; the janitor
    -- moves the rest (the index entry is due now).
    if redis.call('EXISTS', prefix .. 'parked:dep:' .. name) == 1 then
      local _, left = parked_wake(prefix, 'dep:' .. name, 1000)
      if left > 0 then redis.pcall('ZADD', prefix .. 'parked', 'XX', int(now), 'dep:' .. name) end
    end
  else
    redis.call('PEXPIREAT', key, latest)
    redis.call('ZADD', prefix .. 'deps', earliest, name)
  end
  return total, counts, #dropped
end

-- D-2: one more hold of `name` by `digest`, living at least `ttl` ms from now.
local function hold_add(prefix, name, digest, ttl, now)
  local key = prefix .. 'dep:' .. name
  local c, d = dep_field(redis.call('HGET', key, digest))
  if d <= now then c = 0; d = 0 end
  local deadline = math.max(d, now + ttl)
  redis.call('HSET', key, digest, (c + 1) .. ':' .. deadline)
  dep_state(prefix, name, now)
end

-- D-6: one hold of `name` by `digest` fewer; never another digest's, never below zero.
-- Returns 1 when a hold was released.
local function hold_release(prefix, name, digest, now)
  local key = prefix .. 'dep:' .. name
  local v = redis.call('HGET', key, digest)
  if not v then return 0 end
  local c, d = dep_field(v)
  local released = 0
  if d > now and c > 0 then released = 1 end
  if c <= 1 or d <= now then
    redis.call('HDEL', key, digest)
  else
    redis.call('HSET', key, digest, (c - 1) .. ':' .. d)
  end
  dep_state(prefix, name, now)
  return released
end

-- Every per-run value above back to its start. A script's chunk runs anew for each EVALSHA,
-- so there this changes nothing; a FUNCTION library's locals live as long as the library, so
-- each of its functions calls this first (src/store/scripts.rs). Every local above that a run
-- writes is listed here.
-- Per-run tables are emptied, not made anew (a table made and grown key by key each run, and
-- its garbage, cost about 2% of a job's FCALL instructions: docs/dev/performance-log.md).
-- The memos of pure functions of their arguments (lease keys, locket prefixes, counter keys,
-- queue key sets, "<event>|<class>" fields) are kept from run to run, made anew every
-- MEMO_RUNS runs (a run adds a bounded number of entries, so this bounds them).
local MEMO_RUNS = 4096
local runs_since_memo_reset = 0
local function reset_run()
  cached_now = nil
  clear(known)
  reads_done = false
  clear(inflight_freed)
  clear(counts)
  counts_prefix, counts_bucket = nil, nil
  counts_reply = false
  clear(incrs)
  clear(splits)
  clear(guards_of)
  runs_since_memo_reset = runs_since_memo_reset + 1
  if runs_since_memo_reset > MEMO_RUNS then
    runs_since_memo_reset = 0
    lease_keys, class_fields, locket_prefixes, counter_keys = {}, {}, {}, {}
    one_entries, queue_key_sets = {}, {}
  end
end
