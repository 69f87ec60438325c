-- TAKE's steps (take.lua; locking-semantics.md A-7a): the worker's take plan read for a
-- reserved job's class, and that job's ACQUIRE call built from the plan and the payload.
-- Needs render.lua (render_payload, render_template, render_digest, render_json_string), which
-- scripts.rs puts before it.
local take = {}

-- The largest payload TAKE decodes: the renderer is Lua, and a script runs alone (a 10 MB
-- payload would hold Redis for seconds); a larger one is left to the worker's own ACQUIRE.
local TAKE_MAX_PAYLOAD = 65536

-- A-7a: the rid of a TAKE's k-th reservation. The worker sends the first; each one after it
-- (a job before it was settled away) is the first 16 hex digits of the SHA1 of
-- "<first rid>/<k>" (src/store/take.rs take_rid makes the same), so no rid that goes unused
-- is sent, and a step sent again names the same ones.
local function take_rid(first, k)
  if k == 1 then return first end
  return string.sub(redis.sha1hex(first .. '/' .. k), 1, 16)
end

-- Take plan entries decoded, by their text: a FUNCTION library keeps them between calls (an
-- EVAL script decodes each once per call). Cleared past 256, so a plan set that changes often
-- cannot grow it without bound.
local take_decoded, take_count = {}, 0

-- Plan entries read, by plan key and class. A plan key names the SHA-256 of its plan set
-- (src/store/take.rs), so the entry read once is that key's entry for as long as the library
-- lives: the job after the first costs no HMGET. Cleared past 1,024 (a class name comes from
-- the payload). A key found gone is not remembered: the worker writes it again.
local take_entries, take_entry_count = {}, 0

-- The entry for `class` in the worker's take plan `plan_key` (its class, else "*"): the table
-- {on = conflict fallback, locks = {{template, limit}...}}, or nil and the reason the job is
-- left to the worker's own ACQUIRE ("no_plan": the key is gone; else the entry's word, "class"
-- or "digest", src/store/take.rs).
function take.plan(plan_key, class)
  local per = take_entries[plan_key]
  local text = per and per[class]
  if text == nil then
    local got = redis.call('HMGET', plan_key, class, '*')
    text = got[1] or got[2]
    if not text then return nil, 'no_plan' end
    if take_entry_count >= 1024 then
      take_entries, take_entry_count, per = {}, 0, nil
    end
    if not per then
      per = {}
      take_entries[plan_key] = per
    end
    per[class] = text
    take_entry_count = take_entry_count + 1
  end
  if string.byte(text, 1) ~= 123 then return nil, text end
  local p = take_decoded[text]
  if p == nil then
    local ok, v = pcall(cjson.decode, text)
    p = (ok and type(v) == 'table' and type(v['locks']) == 'table') and v or false
    if take_count >= 256 then take_decoded, take_count = {}, 0 end
    take_decoded[text] = p
    take_count = take_count + 1
  end
  if not p then return nil, 'class' end
  return p
end

-- A string as JSON (render.lua's writer), kept per string while the library lives: a queue's
-- and a class's name are written into every record of their jobs.
local json_names, json_count = {}, 0
local function json_name(str)
  local j = json_names[str]
  if j == nil then
    j = render_json_string(str)
    if json_count >= 1024 then json_names, json_count = {}, 0 end
    json_names[str] = j
    json_count = json_count + 1
  end
  return j
end

-- ACQUIRE's KEYS and ARGV (acquire.lua's layout) for the job reserved as {"job", q, payload,
-- rid, ...} in the slot record `inflight` (`s`: take.lua's step state). Returns them, the job's
-- class, its lock ids and their limits; or nil and the reason the plan cannot take the job.
function take.acquire_call(s, res, again)
  local q, payload, rid = res[2], res[3], res[4]
  if #payload > s.max_bytes or #payload > TAKE_MAX_PAYLOAD then return nil, 'size' end
  -- The class as the payload's text seems to name it, to read the plan before decoding the
  -- payload: a job of a class left to the worker costs no decode. The match is only a guess
  -- (a "class" member inside args may come first): the decoded class must be the same.
  -- (Compact JSON, what the clients write, is looked for first, by plain searches: a pattern
  -- search costs several times more.)
  local guess
  local _, e = string.find(payload, '"class":"', 1, true)
  if e then
    local close = string.find(payload, '"', e + 1, true)
    guess = close and string.sub(payload, e + 1, close - 1)
    if guess and string.find(guess, '\\', 1, true) then guess = nil end
  end
  if not guess then guess = string.match(payload, '"class"%s*:%s*"([^"\\]*)"') end
  local plan, why = take.plan(s.plan_key, guess or '')
  if not plan then return nil, why end
  local ok, job = pcall(render_payload, payload, q)
  if not ok or job.class ~= guess then return nil, 'payload' end
  local prefix = s.prefix
  local K = {s.inflight, s.queue_prefix .. q, s.ns .. 'queues', prefix .. 'counter:' .. q,
    s.worker_key, prefix .. 'locks'}
  local A = {rid, s.token, s.lock_ttl, s.counter_ttl, plan['on'], '', '', prefix .. 'counter:', q,
    job.class, '', '', s.wnow, again and '1' or '0'}
  local ids, limits, seen = {}, {}, {}
  for _, l in ipairs(plan['locks']) do
    local okr, id, text = pcall(render_template, l[1], job)
    -- T-5: an id hashed from a longer text needs its source sent (lock_id_source): the
    -- worker's own ACQUIRE sends it.
    if not okr or id ~= text then return nil, 'render' end
    -- One id twice in a job is one lock (as the worker renders it).
    if not seen[id] then
      seen[id] = true
      local i = #ids + 1
      -- (The limit's text is kept with the decoded plan.)
      local limit = l[3]
      if not limit then
        limit = int(l[2])
        l[3] = limit
      end
      ids[i], limits[i] = id, limit
      K[6 + i] = prefix .. 'lock:' .. id
      A[13 + 2 * i] = id
      A[14 + 2 * i] = limits[i]
    end
  end
  prefetch(acquire_reads(K, A))
  -- The payload digest (SHA-256 in Lua: the costliest step of TAKE) is left out: a start on
  -- limit-1 locks does without it (its record's digest and its locks' lockinfo have none; the
  -- worker works it out and sends it with FINISH), and so does a park (its unit is keyed by
  -- the payload's SHA1, PK-3); ACQUIRE works it out only for a start that holds a lock of a
  -- larger limit, or a handoff an earlier version made (acq.digest_later, set by take.lua).
  local qj = json_name(q)
  A[6] = '{"queue":' .. qj .. ',"run_at":"' .. s.run_at .. '","payload":' .. payload ..
    ',"worker":' .. s.node_worker .. '}'
  A[7] = s.info_head .. ',"queue":' .. qj .. ',"class":' .. json_name(job.class) .. '}'
  s.job = job
  return K, A, job.class, ids, limits
end
