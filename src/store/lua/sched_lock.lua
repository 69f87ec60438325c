-- The scheduler's master lock (scheduler-protocol.md SC-7, SC-8): renew by compare-and-expire,
-- release by compare-and-delete. Never touches a key whose value is not ours.
--
-- KEYS[1]  the lock key
-- ARGV[1]  "renew" or "release"
-- ARGV[2]  our value, locketd-<host>:<pid>
-- ARGV[3]  TTL in seconds (renew)
--
-- Returns 1 when the key was ours (and was renewed or deleted), 0 when another value holds
-- it, -1 when there is no key (it expired, or Redis restarted without it).

local v = redis.call('GET', KEYS[1])
if not v then return -1 end
if v ~= ARGV[2] then return 0 end
if ARGV[1] == 'renew' then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
else
  redis.call('DEL', KEYS[1])
end
return 1
