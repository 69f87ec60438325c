-- ACQUIRE with START (locking-semantics.md A-6, A-7, A-8, L-2, L-4, P-1, R-6).
-- Takes every lock of the job or none; on success starts the job, on conflict either
-- requeues it to the tail with the counter bump (fallback "requeue") or leaves it reserved
-- (fallback "none"). With no locks it is START alone.
--
-- KEYS[1]      <ns>:locket:inflight:<slot key>
-- KEYS[2]      <ns>:queue:<q>
-- KEYS[3]      <ns>:queues
-- KEYS[4]      <ns>:locket:counter:<q>
-- KEYS[5]      <ns>:worker:<resque worker id>        (Resque "working on" record)
-- KEYS[6]      <ns>:locket:locks                     (index, L-7)
-- KEYS[4+3i]   <ns>:locket:lock:<id_i>               for i = 1..n
-- KEYS[5+3i]   <ns>:locket:lockinfo:<id_i>
-- KEYS[6+3i]   <ns>:locket:blocked:lock:<id_i>
-- ARGV[1]      rid
-- ARGV[2]      token (32 hex chars, new for this attempt)
-- ARGV[3]      lock_ttl in ms
-- ARGV[4]      counter_ttl in ms
-- ARGV[5]      fallback: "requeue" or "none"
-- ARGV[6]      Resque working-on JSON for KEYS[5]
-- ARGV[7]      lockinfo JSON object (holder metadata; limit, times and source are added here)
-- ARGV[8]      counter key prefix, "<ns>:locket:counter:"
-- ARGV[9]      queue name q
-- ARGV[10]     class
-- ARGV[11]     digest
-- ARGV[10+2i]  lock id i       for i = 1..n
-- ARGV[11+2i]  limit i
--
-- Returns one of
--   {"ok", deadline_ms}   (also when this rid and token already started: a retried call)
--   {"conflict", action, lock id, holders, limit, earliest deadline ms}
--        action is "requeued" (payload at the tail, counter bumped) or "none" (still reserved)
--   {"missing"}   the reservation is no longer this slot's (R-6); nothing changed
-- Raises nothing.

local inflight = KEYS[1]
if redis.call('HGET', inflight, 'rid') ~= ARGV[1] then
  return {'missing'}
end
-- A retry after a lost reply: this attempt already started; answer as the first call did.
if redis.call('HGET', inflight, 'token') == ARGV[2] and redis.call('HGET', inflight, 'state') == 'running' then
  local n0 = (#ARGV - 11) / 2
  local deadline = 0
  if n0 > 0 then
    deadline = tonumber(redis.call('ZSCORE', KEYS[7], ARGV[2]) or '0')
  end
  return {'ok', deadline}
end

local now = now_ms()
local ttl = tonumber(ARGV[3])
local n = (#ARGV - 11) / 2
local counter_prefix = ARGV[8]
local queue = ARGV[9]

-- Purge and count every lock first: all or nothing (L-4).
local conflict = nil
for i = 1, n do
  local lk, ik, bk = KEYS[4 + 3 * i], KEYS[5 + 3 * i], KEYS[6 + 3 * i]
  local id, limit = ARGV[10 + 2 * i], tonumber(ARGV[11 + 2 * i])
  if purge_expired(lk, ik, bk, now, counter_prefix) > 0 then
    fix_lock(lk, ik, KEYS[6], id)
  end
  local holders = redis.call('ZCARD', lk)
  if holders >= limit and conflict == nil then
    local first = redis.call('ZRANGE', lk, 0, 0, 'WITHSCORES')
    conflict = {id, holders, limit, first[2] or '0'}
  end
end

if conflict ~= nil then
  local action = 'none'
  if ARGV[5] == 'requeue' then
    local payload = redis.call('HGET', inflight, 'payload')
    redis.call('DEL', inflight)
    redis.call('RPUSH', KEYS[2], payload)
    redis.call('SADD', KEYS[3], queue)
    if redis.call('INCR', KEYS[4]) == 1 then
      redis.call('PEXPIRE', KEYS[4], ARGV[4])
    end
    for i = 1, n do
      local lk, bk = KEYS[4 + 3 * i], KEYS[6 + 3 * i]
      if redis.call('ZCARD', lk) >= tonumber(ARGV[11 + 2 * i]) then
        redis.call('SADD', bk, queue)
        redis.call('PEXPIRE', bk, ARGV[4])
      end
    end
    action = 'requeued'
  end
  return {'conflict', action, conflict[1], conflict[2], conflict[3], conflict[4]}
end

local deadline = now + ttl
local info = cjson.decode(ARGV[7])
info['acquired_at'] = now
info['extended_at'] = now
local ids = {}
for i = 1, n do
  local lk, ik = KEYS[4 + 3 * i], KEYS[5 + 3 * i]
  local id = ARGV[10 + 2 * i]
  ids[#ids + 1] = id
  redis.call('ZADD', lk, deadline, ARGV[2])
  info['limit'] = tonumber(ARGV[11 + 2 * i])
  info['lock_id'] = id
  redis.call('HSET', ik, ARGV[2], cjson.encode(info))
  fix_lock(lk, ik, KEYS[6], id)
end

-- START (A-8): the job runs; work could be done in q, so its counter restarts.
redis.call('HSET', inflight,
  'state', 'running',
  'started_at', now,
  'token', ARGV[2],
  'locks', (#ids == 0) and '[]' or cjson.encode(ids),
  'class', ARGV[10],
  'digest', ARGV[11])
redis.call('SET', KEYS[5], ARGV[6])
redis.call('DEL', KEYS[4])
return {'ok', deadline}
