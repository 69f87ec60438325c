-- Locks (L-*, A-14, L-1b): purging lapsed holders, fixing a lock's expiry and index entry,
-- releasing a holder's token, and the limit-1 lock's value and flags. Appended to lib.lua by
-- src/store/scripts.rs (it uses lib.lua's sget, int, clear_counter and the parked-wait names
-- declared there).

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
  -- L-1b: a limit-1 holder's STRING (a handoff made the lock one) has no member to purge.
  local first = redis.pcall('ZRANGE', lock_key, 0, 0, 'WITHSCORES')
  if first.err then return 0, false end
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
  -- PK-2: an expiry purge frees units; as many parked jobs wake.
  parked_wake_freed(lock_key, counter_prefix, #expired)
  return #expired, false
end

-- L-6/L-7: after any change, expire the lock keys 1 s after the latest deadline and score the
-- `locks` index with the earliest one; an empty lock disappears from both.
-- A lock that a handoff made a limit-1 holder's STRING (L-1b) leaves the index, which lists
-- the larger locks only.
local function fix_lock(lock_key, info_key, locks_index, lock_id)
  local first = redis.pcall('ZRANGE', lock_key, 0, 0, 'WITHSCORES')
  if first.err then
    redis.call('ZREM', locks_index, lock_id)
    return
  end
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
  local p = string.sub(counter_prefix, 1, #counter_prefix - 8)
  local parked_key = p .. 'parked:lock:' .. lock_id
  -- The common case, the last holder leaving a lock that blocked no queue and has no job
  -- parked on it: one EXISTS tells.
  if redis.call('EXISTS', lock_key, blocked_key, parked_key) == 0 then
    redis.call('DEL', info_key)
    redis.call('ZREM', locks_index, lock_id)
    return removed
  end
  reset_blocked(blocked_key, counter_prefix)
  if redis.call('EXISTS', lock_key) == 0 then
    -- The last holder left: both keys and the index entry go (no per-field delete needed).
    redis.call('DEL', info_key)
    redis.call('ZREM', locks_index, lock_id)
  else
    redis.call('HDEL', info_key, token)
    fix_lock(lock_key, info_key, locks_index, lock_id)
  end
  -- PK-2: the unit freed wakes one parked job.
  parked_wake_freed(lock_key, counter_prefix, removed)
  return removed
end

-- L-1 with limit 1, the common lock: a STRING key lock:<id>, taken with `SET NX PX` (the
-- check, the take and the lease's expiry in one call) and released by compare-and-delete. Its
-- value is the holder's info, a JSON object that starts with a flag and the token:
-- {"blocked":0,"token":"<token>",...}. The flag turns 1 when a conflict requeue named a
-- queue in blocked:lock:<id> while this holder held it, so that the release knows from the
-- value it read whether A-14 has anything to reset. A lock of a larger limit is a ZSET with
-- `lockinfo` and the `locks` index (fix_lock above). A key of the other kind counts as full
-- (a class whose limit changed while its old holders run never gets more holders), except for
-- the job a unit of it was handed to (L-1b, acquire.lua).
local LOCK1_HEAD = '{"blocked":0,"token":"'
local function lock1_holds(v, token)
  return v and string.sub(v, 23, 22 + #token) == token and
    string.sub(v, 23 + #token, 23 + #token) == '"'
end
-- The flag is a digit of two bits: 1, a requeue named a queue in blocked:lock:<id> (A-14);
-- 2, jobs are parked on the lock (PK-2): 0 neither, 3 both.
local function lock1_flagged(v)
  if not v then return false end
  local c = string.sub(v, 12, 12)
  return c == '1' or c == '3'
end
local function lock1_parked(v)
  if not v then return false end
  local c = string.sub(v, 12, 12)
  return c == '2' or c == '3'
end
-- Sets bit `bit` (1 or 2) of a limit-1 holder's flag (the expiry is kept).
local function lock1_set_bit(lk, bit)
  local v = sget(lk)
  if not v or string.sub(v, 1, 11) ~= '{"blocked":' then return end
  local c = tonumber(string.sub(v, 12, 12)) or 0
  if math.floor(c / bit) % 2 == 1 then return end
  local nv = '{"blocked":' .. int(c + bit) .. string.sub(v, 13)
  redis.call('SET', lk, nv, 'KEEPTTL')
  known[lk] = nv
end
-- A-14 for a conflict on a limit-1 lock: flag its holder.
local function lock1_flag(lk)
  lock1_set_bit(lk, 1)
end
-- PK-1 for a park on a limit-1 lock: flag its holder, so that its release wakes (PK-2).
local function lock1_mark_parked(lk)
  lock1_set_bit(lk, 2)
end
-- L-5 for a limit-1 lock: compare-and-delete, and A-14 when the holder was flagged. The key is
-- appended to `dels` when given (the caller deletes it with its own keys, in one DEL, before
-- anything else in the run touches it), else deleted here. `bk`, the lock's blocked set, is
-- named from `lk` when nil ("<prefix>lock:<id>" -> "<prefix>blocked:lock:<id>"). Returns 1 when
-- released.
-- A holder flagged as parked on (PK-2) hands the lock to the first parked job instead
-- (lock1_handoff): the key is then rewritten, not deleted.
local function lock1_release(lk, bk, token, counter_prefix, dels)
  local v = sget(lk)
  if not lock1_holds(v, token) then return 0 end
  local handed = false
  if lock1_parked(v) then
    local p = string.sub(counter_prefix, 1, #counter_prefix - 8)
    handed = lock1_handoff(p, lk, string.sub(lk, #p + 6))
  end
  if not handed then
    if dels then dels[#dels + 1] = lk else redis.call('DEL', lk) end
    known[lk] = false
  end
  if lock1_flagged(v) then
    if bk == nil then
      local p = string.sub(counter_prefix, 1, #counter_prefix - 8)
      bk = p .. 'blocked:' .. string.sub(lk, #p + 1)
    end
    reset_blocked(bk, counter_prefix)
  end
  return 1
end
-- L-5 for a lock of either kind (recovery and admin releases do not know the limit).
local function release_any(lk, ik, bk, index, id, token, counter_prefix)
  if sget(lk) then return lock1_release(lk, bk, token, counter_prefix, nil) end
  return release_token(lk, ik, bk, index, id, token, counter_prefix)
end
