-- PURGE expired holders of locks whose earliest deadline has passed (locking-semantics.md
-- R-3 step 2, L-5, L-6, L-7, A-14, NEVER-4). Run by the janitor with at most 100 ids.
-- The key names are built here from the ids found in the `locks` index (S-1: no Cluster).
--
-- KEYS[1]  <ns>:locket:locks
-- ARGV[1]  key prefix, "<ns>:locket:"
-- ARGV[2]  batch size (at most 100)
--
-- Returns the number of holders removed. Raises nothing while the keys under <ns>:locket: have
-- the types locking-semantics.md §2 gives them (only locketd writes there, K-1).

local now = now_ms()
local prefix = ARGV[1]
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local removed = 0
for _, id in ipairs(ids) do
  local lk, ik, bk = prefix .. 'lock:' .. id, prefix .. 'lockinfo:' .. id, prefix .. 'blocked:lock:' .. id
  removed = removed + purge_expired(lk, ik, bk, now, prefix .. 'counter:')
  fix_lock(lk, ik, KEYS[1], id)
end
count(prefix, now, 'expired', '', removed)
return removed
