-- RESERVE (locking-semantics.md A-1, A-2, A-3, A-16; resque-protocol.md §3 pause rule).
-- Pops the first job from the first queue, in priority order, whose lock counter is below its
-- length, and moves it into the slot's inflight record in the same step.
--
-- KEYS[1]       <ns>:locket:inflight:<slot key>
-- KEYS[2]       <ns>:pause-all-workers
-- ARGV[1]       rid (fresh, 16 hex chars)
-- ARGV[2]       Resque worker id of the slot
-- ARGV[3]       flags, a number: + 1 to clear the counters of skipped queues when nothing
--               was reserved; + 2 when the worker looked at the types of the pause and cap
--               keys less than a second ago (A-20: queue_guards may then trust the MGET)
-- ARGV[4]       locket key prefix "<ns>:locket:" (O-3 stats)
-- ARGV[5]       queue key prefix "<ns>:queue:"
-- ARGV[6]       the worker's clock in ms (reserved_at: shown, never a deadline)
-- ARGV[6+i]     queue name q_i                for i = 1..n, in priority order
-- The queue keys <ns>:queue:<q_i> and counters <ns>:locket:counter:<q_i> are built here from
-- the names (S-1 allows it: no Cluster), so a RESERVE over 100 queues carries 100 names, not
-- 300 strings.
--
-- A queue key that is not a list (another tool wrote a string or a hash there) cannot be
-- popped: it is passed over and reported, so that it does not stop every queue after it.
--
-- Returns one of
--   {"job", queue, payload, rid, odd}
--                         odd: "1" when a pause or cap key of another type was found (the
--                         worker then looks at every RESERVE until none is), else "0"
--   {"nothing", {skipped queue...}, {unreadable queue...}, {paused queue...}, {capped queue...},
--    {refused queue...}}
--                         a refused queue (A-22, S-6: its <ns>:locket:cap:<q> holds another
--                         type, or a string that is not a number) that holds jobs is passed
--                         over in this same step: nothing is popped from it
--                         a capped queue (A-22: <ns>:locket:cap:<q> holds N and N of its jobs
--                         hold a unit in <ns>:locket:running:<q>) is passed over in this same
--                         step: nothing is popped from it
--                         a paused queue (A-20: <ns>:pause:queue:<q> or <ns>:pause:all
--                         exists) that holds jobs is passed over in this same step: nothing
--                         is popped from it
--   {"paused"}            pause-all-workers is "true" (trimmed, any case)
--   {"busy"}              the slot already holds a reservation (K-2; a bug report)
--   {"dead"}              the slot's process lease alive:<process id> is gone (R-2): it may
--                         have been recovered, so it reserves nothing
-- Raises nothing while the keys under <ns>:locket: have
-- the types locking-semantics.md §2 gives them (only locketd writes there, K-1).

local inflight = KEYS[1]
-- One MGET reads the pause flag, the lease, and the first queues' counters, caps and pause
-- keys (lib.lua); a batch of RESERVEs reads them once.
if not reads_done then prefetch(reserve_reads(KEYS, ARGV)) end
if is_true(sget(KEYS[2])) then
  return {'paused'}
end

local n = #ARGV - 6
local prefix = ARGV[4]
local queue_prefix = ARGV[5]
local counter_prefix = prefix .. 'counter:'
local flags = tonumber(ARGV[3]) or 0
local trust = math.floor(flags / 2) % 2 == 1
-- K-2, A-20, A-22: the slot's record, the pause keys and the caps, in one EXISTS (lib_reads.lua,
-- queue_guards). A RESERVE fused with its slot's FINISH (the record freed in this run) needs
-- no K-2 check and reads the rest at the first queue that may hold a job.
local guards = nil
if not inflight_freed[inflight] then
  local busy
  busy, guards = queue_guards(prefix, queue_prefix, ARGV, 7, 6 + n, inflight, trust)
  if busy then return {'busy'} end
end
if not lease_held(prefix, inflight) then
  return {'dead'}
end
local function guard()
  if guards == nil then
    local _
    _, guards = queue_guards(prefix, queue_prefix, ARGV, 7, 6 + n, nil, trust)
  end
  return guards
end

local qkeys = {}
local function qkey(i)
  local k = qkeys[i]
  if k == nil then
    k = queue_prefix .. ARGV[6 + i]
    qkeys[i] = k
  end
  return k
end
local skipped = {}
local unreadable = {}
local paused = {}
local capped = {}
local refused = {}
-- LPOP / LLEN of queue i, or false (and the queue noted) when its key is not a list.
local function read(cmd, i)
  local r = redis.pcall(cmd, qkey(i))
  if type(r) == 'table' and r.err then
    unreadable[#unreadable + 1] = ARGV[6 + i]
    return false
  end
  return r
end
-- Redis keeps no empty list, so one EXISTS over a run of queue keys tells whether any of them
-- holds a job: with many configured queues, runs of empty ones cost one call instead of one
-- LLEN each. Runs are up to 16 queues long; the last 3 queues are read directly.
local checked_until, empty_until = 0, 0
for i = 1, n do
  if i > checked_until and n - i >= 3 then
    local last = math.min(n, i + 15)
    local run = {}
    for j = i, last do run[#run + 1] = qkey(j) end
    checked_until = last
    if redis.call('EXISTS', unpack(run)) == 0 then
      empty_until = last
    end
  end
  local payload = false
  local q = ARGV[6 + i]
  local g = (i > empty_until) and guard() or nil
  if g and g.paused and g.paused[q] then
    -- A-20: passed over when it holds jobs (an empty paused queue is watched as empty).
    if redis.call('EXISTS', qkey(i)) == 1 then paused[#paused + 1] = q end
  elseif g and g.refused[q] then
    -- A-22, S-6: its cap key is not a number: passed over, reported, when it holds jobs.
    if redis.call('EXISTS', qkey(i)) == 1 then refused[#refused + 1] = q end
  elseif g then
    -- A-2: skip q when its counter has reached its length. With no counter (the common
    -- case) nothing can be skipped, so the length is not needed: LPOP answers both.
    local ck = counter_key(prefix, q)
    local c = tonumber(sget(ck) or 0) or 0
    -- A-22: a queue at its cap is passed over (its running units counted here, atomically
    -- with the pop).
    local cap = g.caps[q]
    if cap and redis.call('SCARD', prefix .. 'running:' .. q) >= cap then
      if redis.call('EXISTS', qkey(i)) == 1 then capped[#capped + 1] = q end
    elseif c <= 0 then
      payload = read('LPOP', i)
    else
      local len = read('LLEN', i)
      if len and len > 0 then
        if c >= len then
          skipped[#skipped + 1] = q
        else
          payload = read('LPOP', i)
        end
      end
    end
  end
  if payload then
    local now = tonumber(ARGV[6]) or 0
    record_reservation(inflight, prefix, ARGV[1], ARGV[2], ARGV[6 + i], payload, now)
    if guards.caps[ARGV[6 + i]] then
      redis.call('SADD', prefix .. 'running:' .. ARGV[6 + i], ARGV[1] .. ' ' .. inflight)
    end
    if #skipped > 0 then count(prefix, now, 'queue_skipped', '', #skipped) end
    return {'job', ARGV[6 + i], payload, ARGV[1], guards.odd and '1' or '0'}
  end
end

if flags % 2 == 1 then
  for _, q in ipairs(skipped) do
    clear_counter(counter_prefix .. q)
  end
end
if #skipped > 0 then count(prefix, nil, 'queue_skipped', '', #skipped) end
return {'nothing', skipped, unreadable, paused, capped, refused}
