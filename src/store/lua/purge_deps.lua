-- PURGE expired dependency holds (locking-semantics.md R-3 step 3, D-1, D-6, A-14, NEVER-4).
-- Run by the janitor with at most 100 names whose earliest field deadline has passed.
--
-- KEYS[1]  <ns>:locket:deps
-- ARGV[1]  locket key prefix "<ns>:locket:" (hold keys are built here: S-1)
-- ARGV[2]  batch size (at most 100)
--
-- Returns the number of hold fields dropped. Raises nothing while the keys under <ns>:locket: have
-- the types locking-semantics.md §2 gives them (only locketd writes there, K-1).

local now = now_ms()
local names = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local dropped = 0
for _, name in ipairs(names) do
  local _, _, d = dep_state(ARGV[1], name, now)
  dropped = dropped + d
end
count(ARGV[1], now, 'holds_expired', '', dropped)
return dropped
