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
-- Returns the number of jobs pushed. A member that cannot be read, or whose queue key holds
-- another type than a list, is not pushed: it stays in `delayed`, due again in an hour (S-6,
-- NEVER-2). Raises a LOCKET_STORE error, having changed nothing, when `queues` is not a set.

local now = now_ms()
must_be('promote', KEYS[2], 'set')
local members
if ARGV[4] == '' then
  members = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
else
  members = {ARGV[4]}
end
local pushed = 0
for _, m in ipairs(members) do
  local ok, d = pcall(cjson.decode, m)
  local qk = nil
  if ok and type(d) == 'table' and type(d['queue']) == 'string' and type(d['payload']) == 'string' then
    qk = ARGV[1] .. 'queue:' .. d['queue']
    local t = redis.call('TYPE', qk)['ok']
    if t ~= 'none' and t ~= 'list' then qk = nil end
  end
  if qk == nil then
    -- Not ours to read, or its queue key holds another type: the member stays visible in
    -- `delayed` (NEVER-2), tried again in an hour, instead of being dropped.
    if redis.call('ZSCORE', KEYS[1], m) then
      redis.call('ZADD', KEYS[1], now + 3600000, m)
    end
  elseif redis.call('ZREM', KEYS[1], m) == 1 then
    redis.call('RPUSH', qk, d['payload'])
    redis.call('SADD', KEYS[2], d['queue'])
    pushed = pushed + 1
  end
end
count(ARGV[2], now, 'promoted', '', pushed)
return pushed
