-- PROMOTE delayed jobs whose due time has come back to the tail of their queue
-- (locking-semantics.md P-4, R-3 step 1, K-3, NEVER-2, NEVER-3). Run by the janitor with at
-- most 100 members, and by `locketd delayed promote` for one member (then regardless of due
-- time; the CLI finds the member by its rid while listing).
-- A member moves only if this script's ZREM removed it, so it is pushed at most once.
--
-- KEYS[1]  <ns>:locket:delayed
-- KEYS[2]  <ns>:queues
-- ARGV[1]  Resque key prefix "<ns>:" (queue keys are "<ns>:queue:<q>", built here: S-1)
-- ARGV[2]  locket key prefix "<ns>:locket:"
-- ARGV[3]  batch size (at most 100)
-- ARGV[4]  the exact member to promote now, or "" for every due member
--
-- Returns the number of jobs pushed. Raises nothing.

local now = now_ms()
local members
if ARGV[4] == '' then
  members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
else
  members = {ARGV[4]}
end
local pushed = 0
for _, m in ipairs(members) do
  if redis.call('ZREM', KEYS[1], m) == 1 then
    local ok, d = pcall(cjson.decode, m)
    if ok and type(d) == 'table' and d['queue'] and d['payload'] then
      redis.call('RPUSH', ARGV[1] .. 'queue:' .. d['queue'], d['payload'])
      redis.call('SADD', KEYS[2], d['queue'])
      pushed = pushed + 1
    else
      -- Not ours to read: keep it visible instead of dropping it (NEVER-2).
      redis.call('ZADD', KEYS[1], now + 3600000, m)
    end
  end
end
count(ARGV[2], now, 'promoted', '', pushed)
return pushed
