-- Shared helpers, prepended to every locket script by src/store/scripts.rs.
-- Nothing here touches a key on its own; the functions act on the keys they are given.

-- Redis 5 needs effects replication before writing after TIME; later versions always do it.
if redis.replicate_commands then pcall(redis.replicate_commands) end

-- S-6: a step checks, before its first write, every key another tool may have written that it
-- is about to write (a queue, the `queues` set, a failure list, `failed_queues`): one whose
-- type is not `want` stops the step with a LOCKET_STORE error that names the step and the key,
-- and nothing has been written. Redis does not roll a script back, so a WRONGTYPE raised by a
-- later push would leave the step half-applied. (Keys under <ns>:locket: are written by
-- locketd only, K-1, and their type is not checked.)
local function must_be(step, key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then
    error({err = 'LOCKET_STORE ' .. step .. ': WRONGTYPE ' .. key .. ' holds a ' .. t .. ', not a ' ..
      want .. '; nothing was changed'})
  end
end

-- HDEL of every field in `fields`, 1,000 at a time: `unpack()` of a long list raises ("too
-- many results to unpack") past Lua's stack limit of about 8,000 values.
local function hdel_all(key, fields)
  for i = 1, #fields, 1000 do
    redis.call('HDEL', key, unpack(fields, i, math.min(i + 999, #fields)))
  end
end

-- Redis server time in milliseconds (S-2: no worker clock is ever used for deadlines), read
-- once per run: a script, or a batch of them (batch.lua), runs as one atomic step.
local cached_now = nil
local function now_ms()
  if cached_now == nil then
    local t = redis.call('TIME')
    cached_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return cached_now
end

-- R-2, A-1, A-6: whether the process owning the slot record `inflight`
-- ("<prefix>inflight:<process id>:<n>") still holds its lease "<prefix>alive:<process id>".
-- A process whose lease is gone may have been recovered already: it must not reserve or
-- start anything, since nothing would recover what it took. Asked once per run and process.
local lease_seen = {}
local function lease_held(prefix, inflight)
  local process = string.match(string.sub(inflight, #prefix + 10), '^(.*):%d+$')
  if process == nil then return true end
  local held = lease_seen[process]
  if held == nil then
    held = redis.call('EXISTS', prefix .. 'alive:' .. process) == 1
    lease_seen[process] = held
  end
  return held
end

-- pause-all-workers as RESERVE read it in this run (1 paused, 0 not), nil before the first read.
local pause_seen = nil

-- What this run knows without asking again (a batch of calls is one atomic step, and nothing
-- else writes meanwhile): lock counter keys known to be absent (read as absent, or deleted
-- here; an INCR here forgets it), and inflight records deleted here by FINISH (a RESERVE of
-- the same slot in the same run needs no K-2 check; its HSET forgets it).
local counter_absent = {}
local inflight_freed = {}

-- Deletes a lock counter unless this run knows it is absent.
local function clear_counter(key)
  if not counter_absent[key] then
    redis.call('DEL', key)
    counter_absent[key] = true
  end
end

-- A whole number as decimal text for redis.call. Redis formats a Lua number argument with
-- "%.17g", which costs glibc's multi-precision float printing; "%d" is plain integer printing.
local function int(n)
  return string.format('%d', n)
end

-- A-14: a resource lost a holder, so the queues whose jobs were requeued because of it
-- may run again: delete their counters and the blocked set.
local function reset_blocked(blocked_key, counter_prefix)
  local queues = redis.call('SMEMBERS', blocked_key)
  for _, q in ipairs(queues) do
    clear_counter(counter_prefix .. q)
  end
  if #queues > 0 then
    redis.call('DEL', blocked_key)
  end
  return #queues
end

-- L-1/A-6 step 2: drop holders whose deadline is not later than now, with their lockinfo
-- fields, and run A-14 when any were dropped. Returns the number removed, and whether the lock
-- has no holder left. The earliest holder alone tells the common cases in one call: no key (or
-- an empty one), or nothing expired.
local function purge_expired(lock_key, info_key, blocked_key, now, counter_prefix)
  -- The common case, a free lock that blocked no queue, costs one call.
  if redis.call('EXISTS', lock_key, blocked_key) == 0 then
    return 0, true
  end
  local first = redis.call('ZRANGE', lock_key, 0, 0, 'WITHSCORES')
  if #first == 0 then
    -- A key that lapsed on its own (L-6) lost its holders by expiry too: A-14 still applies.
    reset_blocked(blocked_key, counter_prefix)
    return 0, true
  end
  if tonumber(first[2]) > now then
    return 0, false
  end
  local expired = redis.call('ZRANGEBYSCORE', lock_key, '-inf', int(now))
  redis.call('ZREMRANGEBYSCORE', lock_key, '-inf', int(now))
  hdel_all(info_key, expired)
  reset_blocked(blocked_key, counter_prefix)
  return #expired, false
end

-- L-6/L-7: after any change, expire the lock keys 1 s after the latest deadline and score the
-- `locks` index with the earliest one; an empty lock disappears from both.
local function fix_lock(lock_key, info_key, locks_index, lock_id)
  local first = redis.call('ZRANGE', lock_key, 0, 0, 'WITHSCORES')
  if #first == 0 then
    redis.call('DEL', lock_key, info_key)
    redis.call('ZREM', locks_index, lock_id)
    return
  end
  local last = redis.call('ZRANGE', lock_key, -1, -1, 'WITHSCORES')
  local expire_at = int(tonumber(last[2]) + 1000)
  redis.call('PEXPIREAT', lock_key, expire_at)
  if redis.call('EXISTS', info_key) == 1 then
    redis.call('PEXPIREAT', info_key, expire_at)
  end
  redis.call('ZADD', locks_index, first[2], lock_id)
end

-- fix_lock for a lock whose only holder (with its lockinfo field) has just been added with
-- `deadline`: the earliest and latest deadlines are that one, known without reading them.
local function fix_sole_holder(lock_key, info_key, locks_index, lock_id, deadline)
  local expire_at = int(deadline + 1000)
  redis.call('PEXPIREAT', lock_key, expire_at)
  redis.call('PEXPIREAT', info_key, expire_at)
  redis.call('ZADD', locks_index, int(deadline), lock_id)
end

-- L-5: compare-and-delete of one holder. Releasing a token that is not a member changes
-- nothing but the A-14 reset.
local function release_token(lock_key, info_key, blocked_key, locks_index, lock_id, token, counter_prefix)
  local removed = redis.call('ZREM', lock_key, token)
  -- The common case, the last holder leaving a lock that blocked no queue: one EXISTS tells.
  if redis.call('EXISTS', lock_key, blocked_key) == 0 then
    redis.call('DEL', info_key)
    redis.call('ZREM', locks_index, lock_id)
    return removed
  end
  reset_blocked(blocked_key, counter_prefix)
  if redis.call('EXISTS', lock_key) == 0 then
    -- The last holder left: both keys and the index entry go (no per-field delete needed).
    redis.call('DEL', info_key)
    redis.call('ZREM', locks_index, lock_id)
    return removed
  end
  redis.call('HDEL', info_key, token)
  fix_lock(lock_key, info_key, locks_index, lock_id)
  return removed
end

local function is_true(v)
  return v and string.lower((string.gsub(v, '^%s*(.-)%s*$', '%1'))) == 'true'
end

-- Epoch seconds as Ruby's Time#iso8601 in UTC, "2026-11-21T12:18:29+00:00": the form Resque
-- writes into workers:heartbeat (from the Redis clock, resque-protocol.md §4).
local function iso8601(secs)
  local days = math.floor(secs / 86400)
  local rem = secs - days * 86400
  -- civil-from-days (proleptic Gregorian), days since 1970-01-01
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp + 3
  if m > 12 then m = m - 12 end
  if m <= 2 then y = y + 1 end
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d+00:00', y, m, d,
    math.floor(rem / 3600), math.floor((rem % 3600) / 60), rem % 60)
end

-- O-3: count an event in stat:<event> and in the current metrics:<epoch minute> bucket
-- (`<event>` and `<event>|<class>`), inside the script that caused it. `prefix` is
-- "<ns>:locket:". Counts are summed in Lua and written once per run by flush_counts(), which
-- src/store/scripts.rs calls at the end of every script (and of every batch of them): a job's
-- four events, or a batch's hundreds, cost one INCRBY and one HINCRBY per distinct field.
local counts, counts_prefix, counts_bucket = {}, nil, nil
local function count(prefix, now, event, class, n)
  n = n or 1
  if n == 0 then return end
  if counts_prefix == nil then
    counts_prefix = prefix
    counts_bucket = prefix .. 'metrics:' .. int(math.floor(now / 60000))
  end
  counts[event] = (counts[event] or 0) + n
  if class and class ~= '' then
    local f = event .. '|' .. class
    counts[f] = (counts[f] or 0) + n
  end
end

-- Resque's own counters (stat:processed and the like) are summed the same way: a batch of
-- FINISHes writes stat:processed once.
local incrs = {}
local function incr_later(key, n)
  incrs[key] = (incrs[key] or 0) + (n or 1)
end

-- Writes the counts summed by count() and incr_later(). The bucket gets its 8 h expiry when one of its event
-- fields is created (event names hold no '|'; the class fields do).
local function flush_counts()
  -- Counts are observability: a counter key another tool made a non-integer or another type
  -- is passed over (redis.pcall), so it never fails the step whose writes are already made.
  for key, n in pairs(incrs) do
    redis.pcall('INCRBY', key, int(n))
  end
  incrs = {}
  if counts_prefix == nil then return end
  local m = counts_bucket
  local fresh = false
  for field, n in pairs(counts) do
    local s = int(n)
    if string.find(field, '|', 1, true) then
      redis.pcall('HINCRBY', m, field, s)
    else
      redis.pcall('INCRBY', counts_prefix .. 'stat:' .. field, s)
      if redis.pcall('HINCRBY', m, field, s) == n then fresh = true end
    end
  end
  if fresh then redis.pcall('PEXPIRE', m, '28800000') end
  counts, counts_prefix, counts_bucket = {}, nil, nil
end

-- "<ns>:locket:" from the counter prefix "<ns>:locket:counter:" the scripts already receive.
local function locket_prefix(counter_prefix)
  return string.sub(counter_prefix, 1, #counter_prefix - 8)
end

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
