-- REGISTER (resque-protocol.md §4 start_heartbeat + register_worker, checklist 12;
-- locking-semantics.md R-1). One slot becomes a Resque worker and its process becomes live.
--
-- KEYS[1]  <ns>:workers:heartbeat
-- KEYS[2]  <ns>:workers
-- KEYS[3]  <ns>:worker:<resque worker id>:started
-- KEYS[4]  <ns>:locket:processes
-- KEYS[5]  <ns>:locket:slots:<process id>
-- KEYS[6]  <ns>:locket:alive:<process id>
-- ARGV[1]  Resque worker id
-- ARGV[2]  started text ("%Y-%m-%d %H:%M:%S +0000")
-- ARGV[3]  process id
-- ARGV[4]  slot number
-- ARGV[5]  alive JSON
-- ARGV[6]  process_ttl in ms
--
-- Returns the heartbeat text written. Raises nothing while the keys under <ns>:locket: have
-- the types locking-semantics.md §2 gives them (only locketd writes there, K-1).

local t = redis.call('TIME')
local beat = iso8601(tonumber(t[1]))
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], beat)
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[3])
redis.call('HSET', KEYS[5], ARGV[4], ARGV[1])
redis.call('SET', KEYS[6], ARGV[5], 'PX', ARGV[6])
return beat
