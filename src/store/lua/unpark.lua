-- UNPARK (parked-waits.md PK-9): moves parked jobs back to the heads of their queues, so that a
-- fleet can be stopped or downgraded without stranding them. One call moves at most 1,000
-- entries of one list, atomically (lib.lua, parked_wake); `locketd unpark` calls it again
-- until the lists it was asked for are empty.
--
-- ARGV[1]  locket key prefix "<ns>:locket:"
-- ARGV[2]  the resource, "lock:<id>" or "dep:<name>"
-- ARGV[3]  most entries to move (at most 1,000)
-- ARGV[4]  a queue name: only that queue's entries move (then at most 100 a call, each
--          removed by value), or "" for every entry from the head
-- ARGV[5]  with a queue: the position in the list to look from
--
-- Returns {moved, looked at, stuck}: stuck is 1 when the next entry cannot move (its queue
-- holds another type, PK-6). Raises nothing.

local prefix, res = ARGV[1], ARGV[2]
local max = math.min(tonumber(ARGV[3]) or 1000, 1000)
local q = ARGV[4] or ''
if q == '' then
  local moved, _, bad = parked_wake(prefix, res, max)
  return {#moved, #moved, (bad and #moved == 0) and 1 or 0}
end
local pk = prefix .. 'parked:' .. res
local from = tonumber(ARGV[5]) or 0
local raw = redis.pcall('LRANGE', pk, from, from + 999)
if type(raw) ~= 'table' or raw.err then return {0, 0, 1} end
local ns = string.sub(prefix, 1, #prefix - 7)
local qk = ns .. 'queue:' .. q
local t = redis.call('TYPE', qk)['ok']
if t ~= 'none' and t ~= 'list' then return {0, 0, 1} end
local picked = {}
local looked = 0
for _, e in ipairs(raw) do
  looked = looked + 1
  local ok, d = pcall(cjson.decode, e)
  if ok and type(d) == 'table' and d['queue'] == q and type(d['payload']) == 'string' then
    picked[#picked + 1] = {e, d}
    if #picked >= math.min(max, 100) then break end
  end
end
for i = #picked, 1, -1 do redis.call('LPUSH', qk, picked[i][2]['payload']) end
for _, p in ipairs(picked) do
  redis.call('LREM', pk, 1, p[1])
  count(prefix, nil, 'woken', type(p[2]['class']) == 'string' and p[2]['class'] or '')
end
if #picked > 0 then
  redis.pcall('SADD', ns .. 'queues', q)
  redis.pcall('HINCRBY', prefix .. 'parked_queues', q, int(-#picked))
  if redis.call('LLEN', pk) == 0 then redis.pcall('ZREM', prefix .. 'parked', res) end
end
return {#picked, looked, 0}
