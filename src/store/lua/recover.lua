-- RECOVER one slot of a dead process (locking-semantics.md R-4, R-5, L-5, NEVER-2, NEVER-3).
-- The janitor read the slot's inflight record first; this script acts only if the process is
-- still dead and the record still carries the rid it read, so two janitors cannot move one
-- payload twice.
--
-- KEYS[1]      <ns>:locket:inflight:<slot key>
-- KEYS[2]      <ns>:locket:alive:<process id>
-- KEYS[3]      <ns>:queue:<q>                (q from the record; any key when there is no record)
-- KEYS[4]      <ns>:queues
-- KEYS[5]      failure list: <ns>:failed, or <ns>:<q>_failed with redis_multi_queue
-- KEYS[6]      <ns>:locket:recoveries
-- KEYS[7]      <ns>:locket:slots:<process id>
-- KEYS[8]      <ns>:locket:processes
-- KEYS[9]      <ns>:workers
-- KEYS[10]     <ns>:worker:<resque worker id>
-- KEYS[11]     <ns>:worker:<resque worker id>:started
-- KEYS[12]     <ns>:workers:heartbeat
-- KEYS[13]     <ns>:stat:processed:<resque worker id>
-- KEYS[14]     <ns>:stat:failed:<resque worker id>
-- KEYS[15]     <ns>:locket:locks
-- KEYS[13+3i]  <ns>:locket:lock:<id_i>          for i = 1..n (the record's locks)
-- KEYS[14+3i]  <ns>:locket:lockinfo:<id_i>
-- KEYS[15+3i]  <ns>:locket:blocked:lock:<id_i>
-- ARGV[1]      rid read from the record, or "" when the slot had no record
-- ARGV[2]      on_worker_death: "fail" or "requeue"
-- ARGV[3]      failure record JSON (Resque::DirtyExit naming the dead process)
-- ARGV[4]      max_recoveries
-- ARGV[5]      Resque worker id of the slot
-- ARGV[6]      slot number
-- ARGV[7]      process id
-- ARGV[8]      counter key prefix, "<ns>:locket:counter:"
-- ARGV[8+i]    lock id i
--
-- A running job's unique entry (record field `unique`, U-2..U-4): requeued, it is placed again
-- if free; failed, an until_executed entry is released. A reserved or waiting job never
-- started, so its entry is still in place and stays.
-- Returns one of "alive" (nothing done), "changed" (the record changed since it was read;
-- nothing done), "idle", "recovered_reserved", "recovered_running", "requeued_running".
-- Raises a LOCKET_STORE error, having changed nothing, when the job's queue, `queues` or (for
-- a running job) the failure list holds another type (S-6): the record stays for a later pass.

if redis.call('EXISTS', KEYS[2]) == 1 then
  return 'alive'
end
local rid = redis.call('HGET', KEYS[1], 'rid')
if (rid or '') ~= ARGV[1] then
  return 'changed'
end

local result = 'idle'
if rid then
  local state = redis.call('HGET', KEYS[1], 'state')
  local payload = redis.call('HGET', KEYS[1], 'payload')
  local queue = redis.call('HGET', KEYS[1], 'queue')
  local token = redis.call('HGET', KEYS[1], 'token') or ''
  -- S-6: every list this recovery may push to is checked before its first write.
  must_be('recover', KEYS[3], 'list')
  must_be('recover', KEYS[4], 'set')
  if state == 'running' then must_be('recover', KEYS[5], 'list') end
  must_be('recover', locket_prefix(ARGV[8]) .. 'running:' .. (queue or ''), 'set')
  if state == 'running' then
    local digest = redis.call('HGET', KEYS[1], 'digest') or ''
    -- A-7a: a job TAKE started on free limit-1 locks has no digest in its record; it is the
    -- payload's, worked out here (a payload the renderer refuses keeps none).
    if digest == '' and payload then
      local ok, job = pcall(render_payload, payload, queue or '')
      if ok then digest = render_digest(job) end
    end
    local requeue = false
    if ARGV[2] == 'requeue' and digest ~= '' then
      local n = redis.call('HINCRBY', KEYS[6], digest, 1)
      redis.call('PEXPIRE', KEYS[6], 86400000)
      requeue = n <= tonumber(ARGV[4])
    end
    if requeue then
      redis.call('RPUSH', KEYS[3], payload)
      redis.call('SADD', KEYS[4], queue)
      result = 'requeued_running'
    else
      redis.call('RPUSH', KEYS[5], ARGV[3])
      result = 'recovered_running'
    end
    -- U-2..U-4: the job's unique entry, as START recorded it: a job requeued waits again
    -- (its entry placed again if free), a failed one holds none.
    local u = unique_entry.decode(redis.call('HGET', KEYS[1], 'unique'))
    local class = redis.call('HGET', KEYS[1], 'class') or ''
    unique_entry.settle(locket_prefix(ARGV[8]), u, digest, requeue and 'waits' or 'failure', class)
  else
    -- reserved or waiting: nothing ran, so the job goes back where it was
    redis.call('LPUSH', KEYS[3], payload)
    redis.call('SADD', KEYS[4], queue)
    result = 'recovered_reserved'
  end
  if token ~= '' then
    for i = 1, #ARGV - 8 do
      release_any(KEYS[13 + 3 * i], KEYS[14 + 3 * i], KEYS[15 + 3 * i], KEYS[15],
        ARGV[8 + i], token, ARGV[8])
    end
  end
  local stat = result
  if stat == 'requeued_running' then stat = 'recovered_running' end
  count(locket_prefix(ARGV[8]), now_ms(), stat, redis.call('HGET', KEYS[1], 'class') or '')
  -- A-22: the dead holder's unit of its queue's cap is free again.
  redis.call('SREM', locket_prefix(ARGV[8]) .. 'running:' .. queue, rid .. ' ' .. KEYS[1])
  redis.call('DEL', KEYS[1])
end

redis.call('SREM', KEYS[9], ARGV[5])
redis.call('DEL', KEYS[10], KEYS[11], KEYS[13], KEYS[14])
redis.call('HDEL', KEYS[12], ARGV[5])
redis.call('HDEL', KEYS[7], ARGV[6])
if redis.call('HLEN', KEYS[7]) == 0 then
  redis.call('DEL', KEYS[7])
  redis.call('SREM', KEYS[8], ARGV[7])
end
return result
