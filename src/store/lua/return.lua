-- RETURN a reservation that never started to the head of its queue
-- (locking-semantics.md R-8, rid-checked like every move out of an inflight record).
--
-- KEYS[1]  <ns>:locket:inflight:<slot key>
-- KEYS[2]  <ns>:queue:<q>
-- KEYS[3]  <ns>:queues
-- ARGV[1]  rid
-- ARGV[2]  queue name q
-- ARGV[3]  locket key prefix "<ns>:locket:" (O-3 stats; the cancel request's key, A-21)
-- KEYS[4]  (deferring only) <ns>:locket:counter:<q>
-- ARGV[4]  (deferring only) counter_ttl in ms: the job goes to the TAIL of its queue and the
--          queue's lock counter goes up, as a lock conflict's requeue does (A-6, A-15): its
--          handler cannot take it yet (H-8), so a queue full of such jobs is skipped (A-2)
--          rather than reserved over and over.
--
-- Returns "ok", "missing" when the record is not this reservation's, or {"cancelled", request}
-- when an operator cancelled the reservation before it started (A-21): the request
-- (`cancel_start:<rid>`, JSON) is taken and deleted, the job stays in its record, and the
-- worker records it as cancelled by FINISH instead of returning it. Raises a
-- LOCKET_STORE error, having changed nothing, when the queue key is not a list or `queues` not
-- a set (S-6): the job then stays in its inflight record, where status shows it and recovery
-- finds it.

if redis.call('HGET', KEYS[1], 'rid') ~= ARGV[1] then
  return 'missing'
end
local cancelled = take_cancel_start(ARGV[3], ARGV[1])
if cancelled then
  return {'cancelled', cancelled}
end
local payload = redis.call('HGET', KEYS[1], 'payload')
local class = redis.call('HGET', KEYS[1], 'class') or ''
must_be('return', KEYS[2], 'list')
must_be('return', KEYS[3], 'set')
if ARGV[4] then
  redis.call('RPUSH', KEYS[2], payload)
  if redis.call('INCR', KEYS[4]) == 1 then
    redis.call('PEXPIRE', KEYS[4], ARGV[4])
  end
else
  redis.call('LPUSH', KEYS[2], payload)
end
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[1])
count(ARGV[3], now_ms(), ARGV[4] and 'deferred' or 'returned', class)
return 'ok'
