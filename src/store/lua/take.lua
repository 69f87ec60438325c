-- TAKE (locking-semantics.md A-7a): the slot's next job reserved, carrying its last job's
-- FINISH when one is pending, and the job's ACQUIRE+START in the same step when the worker's
-- take plan (src/store/take.rs) names its class: the lock ids are rendered here from the
-- payload (render.lua, the renderer PUSH uses, held to the Rust one by tests/it/render.rs), so
-- a job that meets no conflict costs one round trip from reserve to run. A job the step
-- settles away (parked, requeued, discarded by its class's policy) is followed by the next
-- reservation, up to one per rid sent. A job whose class the plan does not name, or whose
-- payload or ids the plan cannot render, stays reserved for the worker's own ACQUIRE (today's
-- two-call path), with the reason in the reply.
--
-- KEYS[1..n]    the inner call's keys: reserve.lua's, or finish_reserve.lua's
-- KEYS[n+1]     <ns>:locket:take:<plan set digest>, the worker's take plan (a HASH: class or
--               "*" -> the class's entry, or the word "class" or "digest" for a class taken
--               the two-call way; src/store/take.rs)
-- ARGV[1]       the inner call: "reserve" or "finish_reserve"
-- ARGV[2]       n, the inner call's number of keys
-- ARGV[3]       m, the inner call's number of arguments
-- ARGV[4..3+m]  the inner call's arguments; its RESERVE's rid is the first rid below
-- with t = 3 + m:
-- ARGV[t+1]     the lock token of this step's jobs (one job of them starts)
-- ARGV[t+2]     lock_ttl in ms
-- ARGV[t+3]     counter_ttl in ms
-- ARGV[t+4]     the holder's lockinfo fields: a JSON object without its closing brace
-- ARGV[t+5]     Resque's run_at text, and ARGV[t+6] the worker's node-resque name as a JSON
--               string, for the working-on record
-- ARGV[t+7]     the largest payload in bytes the worker decodes
-- ARGV[t+8]     "1" when the step is sent again after one whose reply never came: a
--               reservation of one of the step's rids found in the slot's record is answered
--               as the first step left it (started: the same reply; reserved: ACQUIRE again,
--               marked as sent again), nothing reserved twice
-- ARGV[t+9]     the most reservations the step makes: one, and one more for each job settled
--               away. The first's rid is its RESERVE's; the k-th's is take_rid(first, k), made
--               here (lib_take.lua), so the worker sends one rid
--
-- Returns {finished, reserved, taken, settled}:
--   finished   FINISH's reply, or false without one
--   reserved   the slot's last RESERVE reply (reserve.lua), or finish_reserve.lua's error pair
--   taken      for a reserved job: {"acquired", ACQUIRE's reply, digest or "", id, limit, ...} or
--              {"kept", reason}: reason "no_plan" (KEYS[n+1] is gone), "class", "digest", "size",
--              "payload", "render", "error" (ACQUIRE raised, having written nothing) or
--              "started" (sent again, and the job was started by another token); false for
--              no job
--   settled    per job settled away before it: {queue, class, digest or "", rid, payload
--              (when the digest is ""), ACQUIRE's reply}

local nk, na = tonumber(ARGV[2]), tonumber(ARGV[3])
local t = 3 + na
local ik, ia = split_take(KEYS, ARGV)
-- RESERVE's keys and arguments: the last two inner keys, the inner arguments after FINISH's
-- (finish_reserve.lua's layout).
local rk = {ik[nk - 1], ik[nk]}
local fin = ARGV[1] == 'finish_reserve'
local ra = slice(ia, fin and (3 + tonumber(ia[2])) or 1, #ia)
local s = {plan_key = KEYS[nk + 1], inflight = rk[1], prefix = ra[4], queue_prefix = ra[5],
  ns = string.sub(ra[5], 1, -7), token = ARGV[t + 1], lock_ttl = ARGV[t + 2],
  counter_ttl = ARGV[t + 3], info_head = ARGV[t + 4], run_at = ARGV[t + 5],
  node_worker = ARGV[t + 6], max_bytes = tonumber(ARGV[t + 7]) or 0, wnow = ra[6]}
local first_rid, most = ra[1], tonumber(ARGV[t + 9]) or 1
s.worker_key = s.ns .. 'worker:' .. ra[2]

-- ACQUIRE of the reserved job `res` (acquire.lua, run as its own step would run it):
-- {"acquired", ACQUIRE's reply, digest, id, limit, ...} and the job's class, or {"kept",
-- reason}. Under pcall: ACQUIRE raises before its first write (S-6), but RESERVE's writes (and
-- FINISH's) are made, so the job stays reserved, for the worker's own ACQUIRE to report.
local function take_job(res, again)
  local rd = reads_done
  local ok, out, class = pcall(function()
    local K, A, cls, ids, limits = take.acquire_call(s, res, again)
    if not K then return {'kept', A}, nil end
    acq.digest_later = function() return render_digest(s.job) end
    acq.take_payload = res[3]
    -- take.acquire_call read ACQUIRE's keys with its MGET: ACQUIRE does not list them again
    -- (only for this call: a RESERVE after it lists its own).
    reads_done = true
    local reply = acquire_part(K, A)
    acq.digest_later, acq.take_payload = nil, nil
    local o = {'acquired', reply, A[11]}
    for i = 1, #ids do
      o[#o + 1] = ids[i]
      o[#o + 1] = limits[i]
    end
    return o, cls
  end)
  acq.digest_later, acq.take_payload = nil, nil
  reads_done = rd
  if ok then return out, class end
  return {'kept', 'error'}, nil
end

-- Whether ACQUIRE settled the job away from the slot (parked, requeued, discarded), which may
-- then reserve again.
local function settled_away(taken)
  local r = taken[1] == 'acquired' and taken[2]
  return r and r[1] == 'conflict' and r[2] ~= 'none' or false
end

local finished = false
-- Sent again after a lost reply: a reservation of this step's rids still in the slot's record
-- is answered as it stands (ACQUIRE sent again is rid- and token-checked: a job it started
-- gets the same "ok"), and nothing is reserved twice.
if ARGV[t + 8] == '1' then
  local rec = redis.call('HMGET', s.inflight, 'rid', 'state', 'token', 'queue', 'payload')
  local mine = false
  for k = 1, most do
    if rec[1] == take_rid(first_rid, k) then
      mine = true
      break
    end
  end
  if mine and rec[4] and rec[5] then
    if fin then
      finished = finish_part(slice(ik, 1, nk - 2), slice(ia, 3, 2 + tonumber(ia[2])))
    end
    local res = {'job', rec[4], rec[5], rec[1], '0'}
    if rec[2] == 'running' and rec[3] ~= s.token then
      return {finished, res, {'kept', 'started'}, {}}
    end
    return {finished, res, (take_job(res, true)), {}}
  end
end

local reserved
if fin then
  local pair = finish_reserve_part(ik, ia)
  finished, reserved = pair[1], pair[2]
else
  reserved = reserve_part(rk, ra)
end
local settled = {}
local used = 1
while reserved[1] == 'job' do
  local taken, class = take_job(reserved, false)
  if not settled_away(taken) or used >= most then
    return {finished, reserved, taken, settled}
  end
  -- A park sends no digest (its unit is keyed by the payload's SHA1, PK-3): the payload
  -- then goes with the entry, and the worker works the digest out for its log.
  local digest = taken[3]
  settled[#settled + 1] = {reserved[2], class, digest, reserved[4],
    digest == '' and reserved[3] or '', taken[2]}
  used = used + 1
  ra[1] = take_rid(first_rid, used)
  reserved = reserve_part(rk, ra)
end
return {finished, reserved, false, settled}
