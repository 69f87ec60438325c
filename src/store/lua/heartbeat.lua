-- HEARTBEAT (resque-protocol.md §4 heartbeat!, checklist 13; locking-semantics.md R-1, R-2).
-- Renews the process's liveness key only if it still exists and rewrites the Resque
-- heartbeat of each of its workers with the Redis server's time.
--
-- KEYS[1]    <ns>:locket:alive:<process id>
-- KEYS[2]    <ns>:workers:heartbeat
-- ARGV[1]    process_ttl in ms
-- ARGV[1+i]  Resque worker id i
--
-- Returns "ok", or "dead" when the liveness key was gone: the process was (or may have been)
-- recovered by a janitor and must stop (R-2); then no heartbeat is written.
-- Raises nothing while the keys under <ns>:locket: have
-- the types locking-semantics.md §2 gives them (only locketd writes there, K-1).

if redis.call('PEXPIRE', KEYS[1], ARGV[1]) == 0 then
  return 'dead'
end
local t = redis.call('TIME')
local beat = iso8601(tonumber(t[1]))
for i = 2, #ARGV do
  redis.call('HSET', KEYS[2], ARGV[i], beat)
end
return 'ok'
