-- RESERVE (locking-semantics.md A-1, A-2, A-3, A-16; resque-protocol.md §3 pause rule).
-- Pops the first job from the first queue, in priority order, whose lock counter is below its
-- length, and moves it into the slot's inflight record in the same step.
--
-- KEYS[1]       <ns>:locket:inflight:<slot key>
-- KEYS[2]       <ns>:pause-all-workers
-- KEYS[2+2i-1]  <ns>:queue:<q_i>              for i = 1..n, in priority order
-- KEYS[2+2i]    <ns>:locket:counter:<q_i>
-- ARGV[1]       rid (fresh, 16 hex chars)
-- ARGV[2]       Resque worker id of the slot
-- ARGV[3]       "1" to clear the counters of skipped queues when nothing was reserved
-- ARGV[4]       locket key prefix "<ns>:locket:" (O-3 stats)
-- ARGV[4+i]     queue name q_i
--
-- Returns one of
--   {"job", queue, payload, rid}
--   {"nothing", skipped queue...}
--   {"paused"}            pause-all-workers is "true" (trimmed, any case)
--   {"busy"}              the slot already holds a reservation (K-2; a bug report)
-- Raises nothing.

local inflight = KEYS[1]
if is_true(redis.call('GET', KEYS[2])) then
  return {'paused'}
end
if redis.call('EXISTS', inflight) == 1 then
  return {'busy'}
end

local n = #ARGV - 4
local prefix = ARGV[4]
local skipped = {}
-- Redis keeps no empty list, so one EXISTS over a run of queue keys tells whether any of them
-- holds a job: with many configured queues, runs of empty ones cost one call instead of one
-- LLEN each. Runs are up to 16 queues long; the last 3 queues are read directly.
local checked_until, empty_until = 0, 0
for i = 1, n do
  local qkey = KEYS[2 + 2 * i - 1]
  if i > checked_until and n - i >= 3 then
    local last = math.min(n, i + 15)
    local run = {}
    for j = i, last do run[#run + 1] = KEYS[2 + 2 * j - 1] end
    checked_until = last
    if redis.call('EXISTS', unpack(run)) == 0 then
      empty_until = last
    end
  end
  local len = 0
  if i > empty_until then
    len = redis.call('LLEN', qkey)
  end
  if len > 0 then
    local c = tonumber(redis.call('GET', KEYS[2 + 2 * i]) or '0') or 0
    if c >= len then
      skipped[#skipped + 1] = ARGV[4 + i]
    else
      local payload = redis.call('LPOP', qkey)
      local now = now_ms()
      redis.call('HSET', inflight,
        'rid', ARGV[1],
        'queue', ARGV[4 + i],
        'payload', payload,
        'reserved_at', now,
        'state', 'reserved',
        'resque_worker', ARGV[2])
      count(prefix, now, 'reserved', '')
      if #skipped > 0 then count(prefix, now, 'queue_skipped', '', #skipped) end
      return {'job', ARGV[4 + i], payload, ARGV[1]}
    end
  end
end

if ARGV[3] == '1' then
  for i = 1, n do
    for _, q in ipairs(skipped) do
      if q == ARGV[4 + i] then
        redis.call('DEL', KEYS[2 + 2 * i])
      end
    end
  end
end
if #skipped > 0 then count(prefix, now_ms(), 'queue_skipped', '', #skipped) end
local out = {'nothing'}
for _, q in ipairs(skipped) do out[#out + 1] = q end
return out
