-- The job path's reads (A-1, A-8, A-13, A-20, A-22): the queues' key sets and guards, and
-- the string keys each step reads in its one MGET. Appended after lib_count.lua by
-- src/store/scripts.rs.

-- "<prefix>counter:<queue>", made once per queue and kept across runs (every RESERVE names
-- the same queues call after call).
local counter_keys = {}
local function counter_key(prefix, q)
  local by_q = child(counter_keys, prefix)
  local k = by_q[q]
  if k == nil then
    k = prefix .. 'counter:' .. q
    by_q[q] = k
  end
  return k
end

-- The keys RESERVE names from queue q: {queue key, counter, cap (A-22), pause key (A-20)},
-- made once per queue and kept across runs; [1] of a prefix's table is its "<ns>:pause:all".
-- `prefix` is "<ns>:locket:", `queue_prefix` "<ns>:queue:".
local queue_key_sets = {}
local function queue_keys(prefix, queue_prefix, q)
  local by_prefix = child(queue_key_sets, prefix)
  local sets = by_prefix[queue_prefix]
  if sets == nil then
    sets = {string.sub(queue_prefix, 1, -7) .. 'pause:all'}
    by_prefix[queue_prefix] = sets
  end
  local ks = sets[q]
  if ks == nil then
    ks = {queue_prefix .. q, counter_key(prefix, q), prefix .. 'cap:' .. q,
      string.sub(queue_prefix, 1, -7) .. 'pause:queue:' .. q}
    sets[q] = ks
  end
  return ks, sets[1]
end

-- Operator controls of a queue, read by RESERVE in its own step (issue 27): resque-pause's
-- keys <ns>:pause:queue:<q> and <ns>:pause:all (A-20) and the fleet-wide cap
-- <ns>:locket:cap:<q> (A-22). A pause key that exists pauses, whatever it holds (resque-pause
-- reads "not nil"; one of another type, written by hand, pauses too and is never overwritten:
-- `locketd pause` refuses it). A cap key holds a whole number; one of another type, or a
-- string that is not a number, refuses its queue (nothing is popped from it, the worker
-- reports it) instead of reading as "no cap" (S-6).
--
-- One EXISTS over all these keys, and over the slot record `inflight` when given (the K-2
-- check of a RESERVE not fused with its slot's FINISH), settles the common case: it counts 0,
-- or exactly the string keys this run's MGET read already (reserve_reads reads the pause and
-- cap keys of up to 16 queues), so the slot is free and those values are all there is.
-- Otherwise the record gets an EXISTS of its own, the keys not read yet one MGET, and only
-- when a key exists that MGET cannot read (another type), the unread ones an EXISTS each.
-- `trust` (the worker looked at these keys' types less than a second ago, A-20): with no
-- record to check and every key read by this run's MGET, that MGET is taken as the whole
-- answer and the EXISTS is left out, so a key of another type is seen within a second, by
-- the worker's next look, instead of at once. Strings (what every tool writes) are read at once
-- either way.
-- Returns true when the record exists (nothing else is worked out), else false and
-- {paused = false or a set of paused queue names, caps = queue -> cap, refused = set of
-- queue names whose cap key is unreadable, odd = whether a key of another type was found}.
-- The keys' part is kept for the run (a batch's RESERVEs name the same queues; no job-path
-- step writes these keys).
-- `prefix` is "<ns>:locket:", `queue_prefix` "<ns>:queue:"; `A[first..last]` the queue names.
local guards_of = {}
local function queue_guards(prefix, queue_prefix, A, first, last, inflight, trust)
  local id = prefix .. '\n' .. table.concat(A, '\n', first, last)
  local g = guards_of[id]
  if g ~= nil then
    if inflight and redis.call('EXISTS', inflight) == 1 then return true, nil end
    return false, g
  end
  local pause_prefix = string.sub(queue_prefix, 1, -7) .. 'pause:'
  local keys = {pause_prefix .. 'all'}
  for i = first, last do keys[#keys + 1] = pause_prefix .. 'queue:' .. A[i] end
  for i = first, last do keys[#keys + 1] = prefix .. 'cap:' .. A[i] end
  local ek = keys
  if inflight then
    ek = {inflight}
    for _, k in ipairs(keys) do ek[#ek + 1] = k end
  end
  -- The string keys this run's MGET read already, and whether it read them all.
  local strings, all_read = 0, true
  for _, k in ipairs(keys) do
    if known[k] == nil then all_read = false elseif known[k] then strings = strings + 1 end
  end
  local trusted = trust and not inflight and all_read
  local total = strings
  if not trusted then
    total = 0
    for i = 1, #ek, 1000 do
      total = total + redis.call('EXISTS', unpack(ek, i, math.min(i + 999, #ek)))
    end
  end
  g = {paused = false, caps = {}, refused = {}, odd = false}
  if total > 0 then
    -- Keys that exist but hold another type than a string.
    local other = {}
    if not (all_read and total == strings) then
      if inflight and redis.call('EXISTS', inflight) == 1 then return true, nil end
      -- The record is absent: `total` counts the keys alone.
      prefetch(keys)
      strings = 0
      for _, k in ipairs(keys) do
        if known[k] then strings = strings + 1 end
      end
      if total > strings then
        g.odd = true
        for j, k in ipairs(keys) do
          if not known[k] and redis.call('EXISTS', k) == 1 then other[j] = true end
        end
      end
    end
    local n = last - first + 1
    local paused, any = {}, false
    for i = first, last do
      local q, j = A[i], i - first + 1
      local pj, cj = 1 + j, 1 + n + j
      if known[keys[1]] or other[1] or known[keys[pj]] or other[pj] then
        paused[q] = true
        any = true
      end
      if other[cj] then
        g.refused[q] = true
      elseif known[keys[cj]] then
        local cap = tonumber(known[keys[cj]])
        if cap then g.caps[q] = cap else g.refused[q] = true end
      end
    end
    if any then g.paused = paused end
  end
  -- A look that trusted the MGET is not kept: a later RESERVE of the run (a batch's) may be
  -- the one that looks at the types.
  if not trusted then guards_of[id] = g end
  return false, g
end

-- The string keys each job-path step reads, gathered so that a FINISH+RESERVE, or a batch
-- of steps, reads all of them in one MGET (prefetch). The layouts are the scripts' own.
-- RESERVE: the pause flag, the lease, and, when there are at most 16 queues, the queues'
-- counters, caps (A-22) and pause keys (A-20) (with more, most are empty, and RESERVE reads
-- the counter of a queue only once an EXISTS over its run of queues found a job, and the caps
-- and pause keys only once queue_guards found some).
local function reserve_reads(K, A)
  local out = {K[2]}
  out[#out + 1] = lease_key(A[4], K[1])
  if #A - 6 <= 16 then
    local pause_prefix = string.sub(A[5], 1, -7) .. 'pause:'
    out[#out + 1] = pause_prefix .. 'all'
    for i = 1, #A - 6 do
      out[#out + 1] = counter_key(A[4], A[6 + i])
      out[#out + 1] = A[4] .. 'cap:' .. A[6 + i]
      out[#out + 1] = pause_prefix .. 'queue:' .. A[6 + i]
    end
  end
  return out
end
-- FINISH: the lease and the job's limit-1 locks.
local function finish_reads(K, A)
  local out = {}
  out[#out + 1] = lease_key(locket_prefix(A[6]), K[1])
  -- A-22: the queue's cap, if any (its unit is freed).
  out[#out + 1] = locket_prefix(A[6]) .. 'cap:' .. A[7]
  for i = 1, (#A - 12) / 2 do
    if (tonumber(A[12 + 2 * i]) or 1) <= 1 then out[#out + 1] = K[11 + i] end
  end
  return out
end
-- ACQUIRE: the lease, the queue's counter and cap (A-22: a conflict frees its unit) and the
-- job's limit-1 locks. (The list is made by one constructor, and the cap's key once per
-- queue: a table grown one entry at a time is resized at each power of two.)
local cap_keys = {}
local function acquire_reads(K, A)
  local prefix = locket_prefix(A[8])
  local by_q = child(cap_keys, prefix)
  local cap = by_q[A[9]]
  if cap == nil then
    cap = prefix .. 'cap:' .. A[9]
    by_q[A[9]] = cap
  end
  local lease = lease_key(prefix, K[1])
  local out
  if lease then
    out = {lease, cancel_start_key(prefix, A[1]), K[4], cap}
  else
    out = {cancel_start_key(prefix, A[1]), K[4], cap}
  end
  for i = 1, (#A - 14) / 2 do
    if (tonumber(A[14 + 2 * i]) or 1) <= 1 then out[#out + 1] = K[6 + i] end
  end
  -- RL-1, RL-4: the rates' logs (rate.lua), with their closes.
  if string.find(A[12], '"rates":', 1, true) then
    local ok, o = pcall(cjson.decode, A[12])
    if ok and type(o) == 'table' and type(o['rates']) == 'table' then
      for _, r in ipairs(o['rates']) do
        out[#out + 1] = locket_prefix(A[8]) .. 'ratelog:' .. tostring(r[1])
      end
    end
  end
  return out
end

-- FINISH+RESERVE's KEYS and ARGV cut into each part's (finish_reserve.lua gives the layout),
-- once per call: a batch cuts them for its MGET and the call uses the same parts.
local splits = {}
local function split_finish_reserve(K, A)
  local s = splits[K]
  if s == nil then
    local nk, na = tonumber(A[1]), tonumber(A[2])
    s = {slice(K, 1, nk), slice(A, 3, 2 + na), slice(K, nk + 1, #K), slice(A, 3 + na, #A)}
    splits[K] = s
  end
  return s[1], s[2], s[3], s[4]
end
local function finish_reserve_reads(K, A)
  local fk, fa, rk, ra = split_finish_reserve(K, A)
  local reads = finish_reads(fk, fa)
  for _, k in ipairs(reserve_reads(rk, ra)) do reads[#reads + 1] = k end
  return reads
end

-- TAKE's KEYS and ARGV cut into its inner call's (take.lua gives the layout), once per call
-- and kept in `splits` as FINISH+RESERVE's are: a batch cuts them for its MGET (take_reads)
-- and the call uses the same tables, so the inner FINISH+RESERVE's own cut is found too.
local function split_take(K, A)
  local s = splits[K]
  if s == nil then
    local nk, na = tonumber(A[2]), tonumber(A[3])
    s = {slice(K, 1, nk), slice(A, 4, 3 + na)}
    splits[K] = s
  end
  return s[1], s[2]
end
-- The keys TAKE's inner RESERVE (or FINISH+RESERVE) reads, for a batch's one MGET
-- (batch.lua). The reserved job's ACQUIRE reads are not known before its pop:
-- take.acquire_call reads them itself.
local function take_reads(K, A)
  local ik, ia = split_take(K, A)
  if A[1] == 'finish_reserve' then return finish_reserve_reads(ik, ia) end
  return reserve_reads(ik, ia)
end
