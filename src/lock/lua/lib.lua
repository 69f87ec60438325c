-- Shared helpers, prepended to every locket script by src/lock/scripts.rs.
-- Nothing here touches a key on its own; the functions act on the keys they are given.

-- Redis 5 needs effects replication before writing after TIME; later versions always do it.
if redis.replicate_commands then pcall(redis.replicate_commands) end

-- Redis server time in milliseconds (S-2: no worker clock is ever used for deadlines).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A-14: a resource lost a holder, so the queues whose jobs were requeued because of it
-- may run again: delete their counters and the blocked set.
local function reset_blocked(blocked_key, counter_prefix)
  local queues = redis.call('SMEMBERS', blocked_key)
  for _, q in ipairs(queues) do
    redis.call('DEL', counter_prefix .. q)
  end
  if #queues > 0 then
    redis.call('DEL', blocked_key)
  end
  return #queues
end

-- L-1/A-6 step 2: drop holders whose deadline is not later than now, with their lockinfo
-- fields, and run A-14 when any were dropped. Returns the number removed.
local function purge_expired(lock_key, info_key, blocked_key, now, counter_prefix)
  local expired = redis.call('ZRANGEBYSCORE', lock_key, '-inf', now)
  if #expired == 0 then
    -- A key that lapsed on its own (L-6) lost its holders by expiry too: A-14 still applies.
    if redis.call('EXISTS', lock_key) == 0 then
      reset_blocked(blocked_key, counter_prefix)
    end
    return 0
  end
  redis.call('ZREMRANGEBYSCORE', lock_key, '-inf', now)
  redis.call('HDEL', info_key, unpack(expired))
  reset_blocked(blocked_key, counter_prefix)
  return #expired
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
  local expire_at = tonumber(last[2]) + 1000
  redis.call('PEXPIREAT', lock_key, expire_at)
  if redis.call('EXISTS', info_key) == 1 then
    redis.call('PEXPIREAT', info_key, expire_at)
  end
  redis.call('ZADD', locks_index, first[2], lock_id)
end

-- L-5: compare-and-delete of one holder. Releasing a token that is not a member changes
-- nothing but the A-14 reset.
local function release_token(lock_key, info_key, blocked_key, locks_index, lock_id, token, counter_prefix)
  local removed = redis.call('ZREM', lock_key, token)
  redis.call('HDEL', info_key, token)
  reset_blocked(blocked_key, counter_prefix)
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
