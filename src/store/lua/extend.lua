-- EXTEND (locking-semantics.md A-10, L-8, NEVER-5): compare-and-extend of one job's locks
-- (a limit-1 lock's key gets its PX again; a larger one's member its deadline).
-- Only an existing, unexpired member with the caller's token moves forward; a lapsed or
-- removed member is reported lost and never re-added.
--
-- KEYS[1]      <ns>:locket:locks                     (index)
-- KEYS[3i-1]   <ns>:locket:lock:<id_i>               for i = 1..n
-- KEYS[3i]     <ns>:locket:lockinfo:<id_i>
-- KEYS[3i+1]   <ns>:locket:blocked:lock:<id_i>
-- ARGV[1]      token
-- ARGV[2]      lock_ttl in ms
-- ARGV[3]      counter key prefix, "<ns>:locket:counter:"
-- ARGV[3+i]    lock id i
--
-- Returns {deadline_ms, lost_1, ..., lost_n} where lost_i is 1 when lock i was not extended.
-- Raises nothing while the keys under <ns>:locket: have
-- the types locking-semantics.md §2 gives them (only locketd writes there, K-1).

local token = ARGV[1]
local now = now_ms()
local deadline = now + tonumber(ARGV[2])
local out = {deadline}
local prefix = locket_prefix(ARGV[3])
local extended, lost, expired = 0, 0, 0
for i = 1, #ARGV - 3 do
  local lk, ik, bk = KEYS[3 * i - 1], KEYS[3 * i], KEYS[3 * i + 1]
  local id = ARGV[3 + i]
  local v = sget(lk)
  local held = false
  if v then
    -- A limit-1 lock (lib_lock.lua): the holder's key lives as long as its PX.
    held = lock1_holds(v, token)
    if held then redis.call('PEXPIRE', lk, ARGV[2]) end
  else
    expired = expired + purge_expired(lk, ik, bk, now, ARGV[3])
    -- L-1b: the purge's wake may have made the lock a parked limit-1 job's handoff (a STRING,
    -- lib_park.lua): no member of the ZSET was left then, this token's neither.
    held = not known[lk] and redis.call('ZSCORE', lk, token) ~= false
    if held then
      redis.call('ZADD', lk, 'XX', deadline, token)
      local raw = redis.call('HGET', ik, token)
      if raw then
        local ok, info = pcall(cjson.decode, raw)
        if ok and type(info) == 'table' then
          info['extended_at'] = now
          redis.call('HSET', ik, token, cjson.encode(info))
        end
      end
    end
    fix_lock(lk, ik, KEYS[1], id)
  end
  if held then
    out[#out + 1] = 0
    extended = extended + 1
  else
    out[#out + 1] = 1
    lost = lost + 1
  end
end
count(prefix, now, 'extended', '', extended)
count(prefix, now, 'lock_lost', '', lost)
count(prefix, now, 'expired', '', expired)
return out
