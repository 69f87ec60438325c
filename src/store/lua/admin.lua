-- ADMIN releases (locking-semantics.md O-2, L-5, D-6, A-14, NEVER-5): the only way besides a
-- holder's own token to remove a live lock member is `force`, which is counted.
--
-- KEYS[1]  <ns>:locket:locks
-- ARGV[1]  locket key prefix "<ns>:locket:"
-- ARGV[2]  operation:
--            lock_token   release holder ARGV[4] of lock ARGV[3] (compare-and-delete)
--            lock_force   remove every holder of lock ARGV[3]
--            hold_digest  release one hold of name ARGV[3] by digest ARGV[4]
--            hold_all     delete every hold of name ARGV[3]
-- ARGV[3]  lock id or hold name
-- ARGV[4]  token or digest (or "")
--
-- Returns the number of holders or holds removed. Raises nothing while the keys under <ns>:locket: have
-- the types locking-semantics.md §2 gives them (only locketd writes there, K-1).

local prefix, op, id = ARGV[1], ARGV[2], ARGV[3]
local now = now_ms()
local counter_prefix = prefix .. 'counter:'
local lk, ik, bk = prefix .. 'lock:' .. id, prefix .. 'lockinfo:' .. id, prefix .. 'blocked:lock:' .. id
if op == 'lock_token' then
  local n = release_any(lk, ik, bk, KEYS[1], id, ARGV[4], counter_prefix)
  count(prefix, now, 'released', '', n)
  return n
elseif op == 'lock_force' then
  if sget(lk) then
    -- a limit-1 lock (lib_lock.lua): its one holder; a job parked on it gets the unit (PK-2)
    local v = sget(lk)
    if not (lock1_parked(v) and lock1_handoff(prefix, lk, id)) then
      redis.call('DEL', lk)
      known[lk] = false
    end
    reset_blocked(bk, counter_prefix)
    count(prefix, now, 'force_released', '', 1)
    return 1
  end
  local members = redis.call('ZRANGE', lk, 0, -1)
  for _, t in ipairs(members) do
    -- L-1b: a release that left only a unit kept for a parked limit-1 job handed it the lock
    -- (its STRING now, lib_park.lua): the ZSET and its other units are gone.
    if known[lk] then break end
    release_token(lk, ik, bk, KEYS[1], id, t, counter_prefix)
  end
  reset_blocked(bk, counter_prefix)
  fix_lock(lk, ik, KEYS[1], id)
  count(prefix, now, 'force_released', '', #members)
  return #members
elseif op == 'hold_digest' then
  local n = hold_release(prefix, id, ARGV[4], now)
  count(prefix, now, 'holds_released', '', n)
  return n
elseif op == 'hold_all' then
  local total = dep_state(prefix, id, now)
  redis.call('DEL', prefix .. 'dep:' .. id)
  dep_state(prefix, id, now)
  count(prefix, now, 'holds_released', '', total)
  return total
end
return 0
