-- FINISH of one job and RESERVE of the next, in one round trip (the no-conflict path then
-- costs two round trips per job: FINISH+RESERVE, ACQUIRE+START). The plain case (below) has a
-- short path of its own; every other case runs the two bodies, the unchanged finish.lua and
-- reserve.lua, wrapped by src/store/scripts.rs as finish_part(KEYS, ARGV) and
-- reserve_part(KEYS, ARGV); FINISH runs first, so the slot's inflight record is free again
-- when RESERVE checks it.
--
-- KEYS         finish.lua's keys, then reserve.lua's keys
-- ARGV[1]      number of finish.lua's keys
-- ARGV[2]      number of finish.lua's arguments
-- ARGV[3..]    finish.lua's arguments, then reserve.lua's arguments
--
-- Returns {finish.lua's reply, reserve.lua's reply}. When RESERVE raises, its reply is
-- {"__locket_reserve_error__", message}: the FINISH has landed either way, and the worker must
-- not send it again (a second FINISH would find "missing" and release the job's holds twice).

-- The plain case, in few steps (as ACQUIRE has one): a first FINISH of a success with no
-- holds, no unique entry to settle and at most one lock, of limit 1, that this attempt holds unflagged (no A-14 reset,
-- no parked job to hand it to), of a queue without a cap; a RESERVE of the same slot over at
-- most 16 queues whose worker looked at the pause and cap keys' types less than a second ago
-- (A-20, `trust`), with the lease held, no pause flag, and no counter, cap or pause key among
-- the queues. One MGET of those keys (memos: lib_reads.lua queue_keys) settles it; then FINISH's
-- writes are the full path's (one DEL of the lock, the record and the working-on key, the two
-- processed counters, the `released` count) and RESERVE pops the first job in priority order
-- into the record as the full path does. Anything else, found before any write, goes to the
-- full path below with what the MGET read.
local function plain()
  local nk, na = tonumber(ARGV[1]), tonumber(ARGV[2])
  -- FINISH's ARGV[i] is ARGV[2 + i]; RESERVE's KEYS[i] is KEYS[nk + i], its ARGV[i] ARGV[r + i].
  if ARGV[5] ~= 'success' or ARGV[13] == '1' or ARGV[12] ~= '' or ARGV[14] ~= '' then
    return nil
  end
  local nlocks = (na - 12) / 2
  local token = ARGV[4]
  if nlocks > 1 or (nlocks == 1 and (token == '' or tonumber(ARGV[16]) ~= 1)) then return nil end
  local r = 2 + na
  local nq = #ARGV - r - 6
  if nq < 1 or nq > 16 or math.floor((tonumber(ARGV[r + 3]) or 0) / 2) % 2 ~= 1 then
    return nil
  end
  local prefix = locket_prefix(ARGV[8])
  local inflight = KEYS[1]
  if ARGV[r + 4] ~= prefix or KEYS[nk + 1] ~= inflight then return nil end
  local lease = lease_key(prefix, inflight)
  if lease == nil then return nil end
  local queue_prefix = ARGV[r + 5]
  local reads = {lease, KEYS[nk + 2]}
  local sets = {}
  local pause_all
  for i = 1, nq do
    local ks
    ks, pause_all = queue_keys(prefix, queue_prefix, ARGV[r + 6 + i])
    sets[i] = ks
    reads[#reads + 1] = ks[2]
    reads[#reads + 1] = ks[3]
    reads[#reads + 1] = ks[4]
  end
  reads[#reads + 1] = pause_all
  local fin_cap = queue_keys(prefix, queue_prefix, ARGV[9])[3]
  reads[#reads + 1] = fin_cap
  if nlocks == 1 then reads[#reads + 1] = KEYS[12] end
  local vals = redis.call('MGET', unpack(reads))
  local ok = vals[1] and true or false
  if ok then
    for j = 2, #reads - nlocks do
      if vals[j] then
        ok = false
        break
      end
    end
  end
  local lock_v = nlocks == 1 and vals[#reads] or nil
  if ok and nlocks == 1 then
    ok = lock1_holds(lock_v, token) and not lock1_flagged(lock_v) and not lock1_parked(lock_v)
  end
  if not ok then
    -- The full path reads these from `known` instead of its own MGET.
    for j = 1, #reads do known[reads[j]] = vals[j] or false end
    return nil
  end

  -- FINISH (A-13, L-5, resque-protocol.md §4 done_working, §5).
  if nlocks == 1 then
    redis.call('DEL', KEYS[12], inflight, KEYS[2])
    count(prefix, nil, 'released', ARGV[10], 1)
  else
    redis.call('DEL', inflight, KEYS[2])
  end
  incr_later(KEYS[3])
  incr_later(KEYS[4])

  -- RESERVE (A-1): no counter, cap or pause among the queues, so the first job is popped.
  -- Runs of empty queues cost one EXISTS, as in the full path (reserve.lua).
  local unreadable = {}
  local now = tonumber(ARGV[r + 6]) or 0
  local checked_until, empty_until = 0, 0
  for i = 1, nq do
    if i > checked_until and nq - i >= 3 then
      local last = math.min(nq, i + 15)
      local run = {}
      for j = i, last do run[#run + 1] = sets[j][1] end
      checked_until = last
      if redis.call('EXISTS', unpack(run)) == 0 then empty_until = last end
    end
    if i > empty_until then
      local payload = redis.pcall('LPOP', sets[i][1])
      if type(payload) == 'table' and payload.err then
        unreadable[#unreadable + 1] = ARGV[r + 6 + i]
      elseif payload then
        record_reservation(inflight, prefix, ARGV[r + 1], ARGV[r + 2], ARGV[r + 6 + i], payload,
          now)
        return {'ok', {'job', ARGV[r + 6 + i], payload, ARGV[r + 1], '0'}}
      end
    end
  end
  return {'ok', {'nothing', {}, unreadable, {}, {}, {}}}
end
if not reads_done then
  local reply = plain()
  if reply then return reply end
end

local fk, fa, rk, ra = split_finish_reserve(KEYS, ARGV)
-- One MGET for what both parts read (lib.lua, prefetch).
if not reads_done then
  prefetch(finish_reserve_reads(KEYS, ARGV))
  reads_done = true
end
local finished = finish_part(fk, fa)
local ok, reserved = pcall(reserve_part, rk, ra)
if not ok then
  if type(reserved) == 'table' and reserved.err then reserved = reserved.err end
  reserved = {'__locket_reserve_error__', tostring(reserved)}
end
return {finished, reserved}
