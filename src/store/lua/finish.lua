-- FINISH (locking-semantics.md A-13, A-14, L-5, R-6; resque-protocol.md §4 done_working, §5, §6).
-- Ends one reservation: deletes the inflight record if it is still this slot's, releases the
-- attempt's locks by token, and records the outcome the way Resque does.
--
-- KEYS[1]      <ns>:locket:inflight:<slot key>
-- KEYS[2]      <ns>:worker:<resque worker id>
-- KEYS[3]      <ns>:stat:processed
-- KEYS[4]      <ns>:stat:processed:<resque worker id>
-- KEYS[5]      <ns>:stat:failed
-- KEYS[6]      <ns>:stat:failed:<resque worker id>
-- KEYS[7]      failure list: <ns>:failed, or <ns>:<q>_failed with the redis_multi_queue backend
-- KEYS[8]      <ns>:failed_queues
-- KEYS[9]      <ns>:queue:<q>
-- KEYS[10]     <ns>:queues
-- KEYS[11]     <ns>:locket:locks
-- KEYS[11+i]   <ns>:locket:lock:<id_i>               for i = 1..n (read once with the lease: lib.lua);
--              its lockinfo:<id_i> and blocked:lock:<id_i> are named here from the id, and
--              only when used (S-1: no Cluster)
-- ARGV[1]      rid
-- ARGV[2]      token ("" when no lock was taken)
-- ARGV[3]      outcome:
--                success  the job ran and succeeded: processed + 1
--                failure  the job raised / exited non-zero: failure record, processed + 1, failed + 1
--                dirty    the job was killed (Resque::DirtyExit): failure record, processed + 1
--                requeue  the payload goes back to the tail of its queue, no Resque stats
--                return   the payload goes back to the head of its queue, no Resque stats (a
--                         persistent handler that never started the job, H-9)
--                throttled  the remote side throttled the run (rate-limits.md RL-4): the rate
--                         key in ARGV[4] is closed until now + its `for` ms, and the job is
--                         parked at the head of the key's line; no Resque stats, no failure
-- ARGV[4]      for throttled: {key, limit, period, spread, for} (ms);
--              failure record JSON (outcomes failure and dirty); "" when the app recorded the
--              failure through its own backend (persistent-handlers.md H-17): nothing is pushed,
--              the stats are counted as for any failure
-- ARGV[5]      "" for <ns>:failed, or the list name "<q>_failed" to add to failed_queues
-- ARGV[6]      counter key prefix, "<ns>:locket:counter:"
-- ARGV[7]      queue name q
-- ARGV[8]      class (for the O-3 stats)
-- ARGV[9]      payload digest (whose holds are released)
-- ARGV[10]     JSON array of hold names to release (D-6, D-7: chosen by the supervisor from
--              the outcome and each hold's release_on), or ""
-- ARGV[11]     "1" when this FINISH is sent again after an attempt whose reply never came
--              (that attempt may have landed), else ""
-- ARGV[12]     "" (the class's unique entry, if any, is not this step's: the plain path), or
--              JSON [action, key, policy, ttl ms] (U-2..U-4, lib_unique.lua): action
--              "release" (compare-and-delete with ARGV[9]) or "replace" (SET NX: the job
--              waits again), chosen by the worker from the policy, the outcome and whether
--              the job started; a throttled job's parked entry carries [key, policy, ttl]
-- ARGV[12+2i]  lock id i
-- ARGV[13+2i]  its limit (1: a STRING lock, lib_lock.lua; more: a ZSET)
--
-- Returns "ok", or "missing" when the reservation had been recovered elsewhere: then only the
-- token is released (and holds are released as the outcome says) and nothing is recorded a
-- second time. A FINISH sent again that finds its reservation gone releases no holds: most
-- likely its first attempt landed and released them already, and a second release would let
-- a dependent start while another holder still runs (D-6). In the rare other case, a janitor
-- recovered the job during the outage and recorded it as failed; its holds then stay, as a
-- failed job's do, until a retry or their TTL.
-- Raises a LOCKET_STORE error, having changed nothing (no lock or hold released, the
-- reservation kept), when the list the outcome pushes to (the failure list, or the queue for
-- a requeue) or its index set holds another type (S-6).

local inflight = KEYS[1]
local outcome = ARGV[3]
local throttle = nil
local prefix = locket_prefix(ARGV[6])
local n = (#ARGV - 12) / 2
if not reads_done then prefetch(finish_reads(KEYS, ARGV)) end
-- While the lease is held only this process writes its slot record (lib.lua, lease_held): a
-- first FINISH needs no rid check. One sent again, or one whose lease is gone, reads it.
local mine, payload = true, nil
if ARGV[11] == '1' or not lease_trusted(prefix, inflight) then
  local rec = redis.call('HMGET', inflight, 'rid', 'payload')
  mine = rec[1] == ARGV[1]
  payload = rec[2]
elseif outcome == 'requeue' or outcome == 'return' or outcome == 'throttled' then
  payload = redis.call('HGET', inflight, 'payload')
  mine = payload ~= false
end
-- Keys deleted together at the end: the released limit-1 locks, then the reservation.
local dels = {}
-- The reservation and Resque's "working on" record end together (done_working), once the
-- payload is where the outcome puts it (S-6: a push that raises leaves the record in place).
local function end_reservation()
  -- A-22: the job's unit of its queue's cap is free again.
  local cap_key = prefix .. 'cap:' .. ARGV[7]
  if sget(cap_key) then
    redis.call('SREM', prefix .. 'running:' .. ARGV[7], ARGV[1] .. ' ' .. inflight)
  end
  dels[#dels + 1] = inflight
  dels[#dels + 1] = KEYS[2]
  redis.call('DEL', unpack(dels))
  dels = {}
  inflight_freed[inflight] = true
end

-- S-6: the keys the outcome pushes to are checked before anything is released or written;
-- and, for a capped queue (A-22), the set its unit is freed from.
if sget(prefix .. 'cap:' .. ARGV[7]) then
  must_be('finish', prefix .. 'running:' .. ARGV[7], 'set')
end
if mine then
  if outcome == 'requeue' or outcome == 'return' then
    must_be('finish', KEYS[9], 'list')
    must_be('finish', KEYS[10], 'set')
  elseif outcome == 'throttled' then
    -- RL-4: the key's parked list is pushed to (PK-6: checked before anything is released).
    throttle = cjson.decode(ARGV[4])
    must_be('finish', prefix .. 'parked:rate:' .. throttle['key'], 'list')
  elseif (outcome == 'failure' or outcome == 'dirty') and ARGV[4] ~= '' then
    must_be('finish', KEYS[7], 'list')
    if ARGV[5] ~= '' then must_be('finish', KEYS[8], 'set') end
  end
end

local class = ARGV[8]
if ARGV[2] ~= '' then
  local released = 0
  for i = 1, n do
    local lk = KEYS[11 + i]
    if tonumber(ARGV[12 + 2 * i]) <= 1 then
      released = released + lock1_release(lk, nil, ARGV[2], ARGV[6], dels)
    else
      local id = ARGV[11 + 2 * i]
      released = released + release_any(lk, prefix .. 'lockinfo:' .. id,
        prefix .. 'blocked:lock:' .. id, KEYS[11], id, ARGV[2], ARGV[6])
    end
  end
  count(prefix, nil, 'released', class, released)
end
if ARGV[10] ~= '' and (mine or ARGV[11] ~= '1') then
  local released = 0
  local now = now_ms()
  for _, name in ipairs(cjson.decode(ARGV[10])) do
    released = released + hold_release(prefix, name, ARGV[9], now)
  end
  count(prefix, now, 'holds_released', class, released)
end

if not mine then
  if #dels > 0 then redis.call('DEL', unpack(dels)) end
  count(prefix, nil, 'finished_after_recovery', class)
  return 'missing'
end

-- U-2..U-4: the job's unique entry, only when this step ends its own reservation (a recovered
-- job's entry is recovery's business, R-4).
local unique = nil
if ARGV[12] ~= '' then
  local u = cjson.decode(ARGV[12])
  unique = {u[2], u[3], u[4]}
  if u[1] == 'release' then
    unique_entry.release(prefix, u[2], ARGV[9], class)
  elseif u[1] == 'replace' then
    unique_entry.replace(prefix, u[2], ARGV[9], u[4], class)
  end
end

if outcome == 'throttled' then
  -- RL-4: closed until now + for (a later close stays), the job at the head of the key's line,
  -- the index due when the key opens.
  local key = throttle['key']
  local now = now_ms()
  local untl = now + tonumber(throttle['for'])
  -- The close goes in the key's log (rate.lua); a log of another type is left as it is (the
  -- job's next ACQUIRE reports it).
  local closed = rate_close(prefix, {key, throttle['limit'], throttle['period'],
    throttle['spread']}, untl, now)
  untl = math.max(untl, closed or untl)
  redis.call('LPUSH', prefix .. 'parked:rate:' .. key, cjson.encode({rid = ARGV[1],
    queue = ARGV[7], payload = payload, parked_at = now, class = class, digest = ARGV[9],
    attempt = 1, ttl = 0, limit = tonumber(throttle['limit']),
    period = tonumber(throttle['period']), spread = tonumber(throttle['spread']),
    unique = unique}))
  redis.call('ZADD', prefix .. 'parked', int(untl), 'rate:' .. key)
  redis.pcall('HINCRBY', prefix .. 'parked_queues', ARGV[7], 1)
  end_reservation()
  count(prefix, now, 'throttled', class)
  return 'ok'
end

if outcome == 'requeue' or outcome == 'return' then
  if outcome == 'return' then
    redis.call('LPUSH', KEYS[9], payload)
  else
    redis.call('RPUSH', KEYS[9], payload)
  end
  end_reservation()
  redis.call('SADD', KEYS[10], ARGV[7])
  return 'ok'
end

if (outcome == 'failure' or outcome == 'dirty') and ARGV[4] ~= '' then
  redis.call('RPUSH', KEYS[7], ARGV[4])
  if ARGV[5] ~= '' then
    redis.call('SADD', KEYS[8], ARGV[5])
  end
end
end_reservation()
if outcome == 'failure' then
  incr_later(KEYS[5])
  incr_later(KEYS[6])
end
incr_later(KEYS[3])
incr_later(KEYS[4])
return 'ok'
