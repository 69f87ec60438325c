-- The scheduler's master lock (scheduler-protocol.md SC-7, SC-8): take it when free or still
-- ours, renew by compare-and-expire, release by compare-and-delete. Never touches a key whose
-- value is not ours.
--
-- KEYS[1]  the lock key
-- ARGV[1]  "acquire", "renew" or "release"
-- ARGV[2]  our value, locketd-<host>:<pid>
-- ARGV[3]  TTL in seconds (acquire, renew)
--
-- acquire: `SET NX EX`, and also when the key still holds our own value (a lock this process
-- gave up locally after renewals failed, SC-9, is taken again at once instead of when the key
-- expires). Returns 1 when taken, 0 when another value holds it.
-- renew, release: 1 when the key was ours (and was renewed or deleted), 0 when another value
-- holds it, -1 when there is no key (it expired, or Redis restarted without it).
-- The GET comes first: a key of another type raises before any write (S-6).

local v = redis.call('GET', KEYS[1])
if ARGV[1] == 'acquire' then
  if v and v ~= ARGV[2] then return 0 end
  redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
  return 1
end
if not v then return -1 end
if v ~= ARGV[2] then return 0 end
if ARGV[1] == 'renew' then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
else
  redis.call('DEL', KEYS[1])
end
return 1
