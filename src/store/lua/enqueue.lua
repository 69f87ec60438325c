-- ENQUEUE a job with its enqueue-time dependency holds (locking-semantics.md D-2, D-3,
-- NEVER-6). Published for clients in any language: load it with SCRIPT LOAD (or EVAL it) and
-- call it with these keys and arguments. The hold count and the push happen in one step, so a
-- hold never exists for a push that did not happen, and the other way round.
--
-- KEYS[1]    <ns>:queue:<q>
-- KEYS[2]    <ns>:queues
-- ARGV[1]    queue name q
-- ARGV[2]    payload, Resque's format: {"class":"<Class>","args":[...]}
-- ARGV[3]    locket key prefix "<ns>:locket:"
-- ARGV[4]    payload digest: lowercase hex SHA-256 of the canonical JSON of
--            {"args":<args>,"class":"<Class>"} (locking-semantics.md §1.1, T-2)
-- ARGV[5]    hold_ttl in ms
-- ARGV[5+i]  hold name i (rendered hold template), for i = 0..n
--
-- Returns the queue length after the push. Raises a LOCKET_STORE error, having changed
-- nothing (no hold added, nothing pushed), when the queue key is not a list or `queues` not a
-- set (S-6).

must_be('enqueue', KEYS[1], 'list')
must_be('enqueue', KEYS[2], 'set')
local now = now_ms()
local ttl = tonumber(ARGV[5])
for i = 6, #ARGV do
  hold_add(ARGV[3], ARGV[i], ARGV[4], ttl, now)
end
count(ARGV[3], now, 'holds_added', '', #ARGV - 5)
redis.call('SADD', KEYS[2], ARGV[1])
return redis.call('RPUSH', KEYS[1], ARGV[2])
