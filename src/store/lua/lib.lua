-- Shared helpers, prepended to every locket script by src/store/scripts.rs.
-- Nothing here touches a key on its own; the functions act on the keys they are given.

-- (scripts.rs puts REPLICATE, for Redis 5, before this in every EVAL script.)

-- S-6: a step checks, before its first write, every key another tool may have written that it
-- is about to write (a queue, the `queues` set, a failure list, `failed_queues`): one whose
-- type is not `want` stops the step with a LOCKET_STORE error that names the step and the key,
-- and nothing has been written. Redis does not roll a script back, so a WRONGTYPE raised by a
-- later push would leave the step half-applied. (Keys under <ns>:locket: are written by
-- locketd only, K-1, and their type is not checked.)
local function must_be(step, key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then
    error({err = 'LOCKET_STORE ' .. step .. ': WRONGTYPE ' .. key .. ' holds a ' .. t .. ', not a ' ..
      want .. '; nothing was changed'})
  end
end

-- Parked waits (PK-*): defined in lib_park.lua (appended to this file), named here so that
-- the release helpers below can wake the jobs parked on what they free.
local parked_wake, lock1_handoff, lockn_handoff, parked_wake_freed

-- HDEL of every field in `fields`, 1,000 at a time: `unpack()` of a long list raises ("too
-- many results to unpack") past Lua's stack limit of about 8,000 values.
local function hdel_all(key, fields)
  for i = 1, #fields, 1000 do
    redis.call('HDEL', key, unpack(fields, i, math.min(i + 999, #fields)))
  end
end

-- t[i..j] as a new list: unpack() into a table constructor for the usual short lists, a loop
-- past unpack's stack limit (a RESERVE over thousands of queues).
local function slice(t, i, j)
  if j - i < 4000 then return {unpack(t, i, j)} end
  local out = {}
  for x = i, j do out[#out + 1] = t[x] end
  return out
end

-- Redis server time in milliseconds (S-2: no worker clock is ever used for deadlines), read
-- once per run: a script, or a batch of them (batch.lua), runs as one atomic step.
local cached_now = nil
local function now_ms()
  if cached_now == nil then
    local t = redis.call('TIME')
    cached_now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return cached_now
end

-- String values this run has read or written (key -> value, or false for absent / not a
-- string), so that a step reads each at most once and a batch of steps reads them together:
-- prefetch() gets every key a step will read in one MGET before it starts (the pause flag,
-- the process lease, the queues' lock counters, the job's limit-1 locks). MGET answers nil
-- for a key of another type, so a value another tool wrote cannot make a step raise. Every
-- write of such a key here updates the entry (a batch is one atomic step: nothing else writes
-- meanwhile).
local known = {}
local function prefetch(keys)
  local want = {}
  for _, k in ipairs(keys) do
    if known[k] == nil then
      want[#want + 1] = k
      known[k] = false
    end
  end
  for i = 1, #want, 1000 do
    local last = math.min(i + 999, #want)
    local vals = redis.call('MGET', unpack(want, i, last))
    for j = i, last do known[want[j]] = vals[j - i + 1] or false end
  end
end
-- Set once a FINISH+RESERVE or a batch has prefetched what all its parts read: the parts then
-- skip building their lists of keys again.
local reads_done = false
-- The string value of `key`, or false.
local function sget(key)
  local v = known[key]
  if v == nil then
    v = redis.call('MGET', key)[1] or false
    known[key] = v
  end
  return v
end

-- "<prefix>alive:<process id>" of the slot record `inflight` ("<prefix>inflight:<process
-- id>:<n>"), or nil for a record name without a process.
-- Each record's lease key is worked out once and kept across runs (reset_run's memos).
local lease_keys = {}
local function lease_key(prefix, inflight)
  local k = lease_keys[inflight]
  if k == nil then
    local process = string.match(string.sub(inflight, #prefix + 10), '^(.*):%d+$')
    k = process ~= nil and (prefix .. 'alive:' .. process)
    lease_keys[inflight] = k
  end
  return k or nil
end

-- R-2, A-1, A-6: whether the process owning the slot record `inflight` still holds its lease.
-- A process whose lease is gone may have been recovered already: it must not reserve or
-- start anything, since nothing would recover what it took. While the lease is held, nothing
-- but the process itself writes its slot records (recovery needs the lease gone, R-4, and
-- HEARTBEAT only extends a lease that exists, never recreates it).
-- Whether the slot record `inflight` can be trusted to be this process's own without reading
-- it: the lease is held (lease_held). A record name without a process (no lease to check)
-- is read.
local function lease_trusted(prefix, inflight)
  local k = lease_key(prefix, inflight)
  return k ~= nil and sget(k) ~= false
end

-- A-21: `<prefix>cancel_start:<rid>`, an operator's cancel of reservation `rid` before it
-- starts (cancel.lua writes it; ACQUIRE and RETURN take it instead of starting or returning
-- the job). A string, read in the step's MGET: a job path without cancels pays no command.
local function cancel_start_key(prefix, rid)
  return prefix .. 'cancel_start:' .. rid
end

-- A-21: the cancel request for reservation `rid` that has not started, or false. Taking it
-- deletes the key, so that exactly one step acts on it.
local function take_cancel_start(prefix, rid)
  local k = cancel_start_key(prefix, rid)
  local v = sget(k)
  if v then
    redis.call('DEL', k)
    known[k] = false
  end
  return v
end

local function lease_held(prefix, inflight)
  local k = lease_key(prefix, inflight)
  if k == nil then return true end
  return sget(k) ~= false
end

-- Inflight records deleted by FINISH in this run (a RESERVE of the same slot in the same run
-- needs no K-2 check; its HSET forgets it).
local inflight_freed = {}

-- Deletes a lock counter unless this run knows it is absent.
local function clear_counter(key)
  if known[key] ~= false then
    redis.call('DEL', key)
    known[key] = false
  end
end

-- A whole number as decimal text for redis.call. Redis formats a Lua number argument with
-- "%.17g", which costs glibc's multi-precision float printing; "%d" is plain integer printing.
local function int(n)
  return string.format('%d', n)
end
