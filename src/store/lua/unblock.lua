-- UNBLOCK lapsed locks (locking-semantics.md A-14, R-3 step 2): a limit-1 lock has no index
-- and its key expires on its own (lib_lock.lua), so the janitor finds the blocked:lock: sets with
-- SCAN and, for each whose lock key is gone, resets the counters of the queues it names.
-- A limit-1 lock held again by a holder that never conflicted with those queues gets its flag
-- set here, so that its release frees them (lib_lock.lua, lock1_flag); a larger lock's release
-- always reads its set.
--
-- ARGV[1]    key prefix, "<ns>:locket:"
-- ARGV[1+i]  lock id i
--
-- Returns the number of queues whose counters were reset. Raises nothing while the keys under
-- <ns>:locket: have the types locking-semantics.md §2 gives them (only locketd writes there, K-1).

local prefix = ARGV[1]
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  local lk = prefix .. 'lock:' .. id
  if redis.call('EXISTS', lk) == 0 then
    n = n + reset_blocked(prefix .. 'blocked:lock:' .. id, prefix .. 'counter:')
  else
    lock1_flag(lk)
  end
end
return n
