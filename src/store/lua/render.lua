-- RENDER: key templates rendered in Redis exactly as the workers render them in Rust
-- (src/locks/template.rs, src/locks/canonical.rs, src/resque/payload.rs; locking-semantics.md
-- §1.1, T-1..T-7). Used by PUSH (push.lua); a differential test (tests/it/render.rs) holds the
-- two renderers to the same ids over generated payloads.
--
-- Redis's cjson turns numbers into doubles (9007199254740993 becomes ...992, `1.0` and `1` are
-- one value, `1e400` is refused), so the payload is read here by a JSON reader of its own that
-- keeps each number's text; only a payload that cjson is sure to read the same (compact
-- printable ASCII, no escape, whole numbers under 10^15) is read by cjson
-- (render_cjson.lua, which costs Redis about a quarter less). SHA-256 is render_sha256.lua's.
-- Templates are not parsed here: Rust parses them (T-1, T-7) and publishes each one
-- compiled, as the `parts` list of its plan (src/config/published.rs):
--   "text"                        literal text (`{{`/`}}` already unescaped)
--   ["class"] ["queue"] ["digest"] ["args_digest"] ["args"]
--   ["path", i, step, ...]       `{args[i]...}`: a number step indexes an array (from 0), a
--                                 string step names an object member
--
-- Everything is inside one `do` block (a script's chunk has room for 200 locals) and reached
-- through `render_payload` and `render_template` (declared in render_sha256.lua, which
-- src/store/scripts.rs puts first, with render_cjson.lua, before this file). Errors are raised as
-- {err = 'LOCKET_RENDER ...'}: the caller sees them, and nothing has been written yet.
do
  -- Set by `setup` at the first call: a FUNCTION library's load may not read `string`,
  -- `math`, `table` or `bit` (only calls may).
  local byte, sub, char, find, fmt, concat, floor, abs
  local ready = false
  local setup

  local function fail(msg)
    error({err = 'LOCKET_RENDER ' .. msg})
  end

  -- ---------------------------------------------------------------- JSON reader
  -- Values: a Lua string (a JSON string, decoded), true/false, NULL, {num = '<text>'},
  -- {arr = true, n = count, [1..n] = items}, {obj = true, names = {...}, map = {name -> value}}
  -- (a repeated member keeps its first place and its last value, as serde_json's map does).
  local NULL = {}
  -- serde_json's recursion limit for a Value: 128 nested arrays or objects refused, 127 taken.
  local ARGS_DEPTH = 127
  -- Members other than class and args are skipped by Rust without a depth limit; here they are
  -- read, up to this depth (a deeper payload is refused, never rendered wrongly).
  local ANY_DEPTH = 1000

  local s, pos, lenient -- the text, the read position, whether lone surrogates are let through

  local function perr(what)
    fail('payload is not valid JSON: ' .. what .. ' at byte ' .. pos)
  end

  -- (A byte is looked at first: compact JSON, what the clients write, has no whitespace, and a
  -- pattern search costs several times a byte's read.)
  local function skip_ws()
    local c = byte(s, pos)
    if c == 32 or c == 9 or c == 10 or c == 13 then
      local _, e = find(s, '^[ \t\n\r]+', pos)
      pos = e + 1
    end
  end

  -- Rust's from_utf8: no overlong forms, no surrogates, nothing above U+10FFFF.
  local function check_utf8(seg)
    if not find(seg, '[\128-\255]') then return end
    local i, n = 1, #seg
    while i <= n do
      local c = byte(seg, i)
      if c < 0x80 then
        i = i + 1
      else
        local need, lo, hi = 0, 0x80, 0xBF
        if c >= 0xC2 and c <= 0xDF then need = 1
        elseif c == 0xE0 then need, lo = 2, 0xA0
        elseif c == 0xED then need, hi = 2, 0x9F
        elseif c >= 0xE1 and c <= 0xEF then need = 2
        elseif c == 0xF0 then need, lo = 3, 0x90
        elseif c >= 0xF1 and c <= 0xF3 then need = 3
        elseif c == 0xF4 then need, hi = 3, 0x8F
        else perr('invalid UTF-8') end
        local c2 = byte(seg, i + 1)
        if not c2 or c2 < lo or c2 > hi then perr('invalid UTF-8') end
        for j = i + 2, i + need do
          local cj = byte(seg, j)
          if not cj or cj < 0x80 or cj > 0xBF then perr('invalid UTF-8') end
        end
        i = i + need + 1
      end
    end
  end

  local function utf8(cp)
    if cp < 0x80 then return char(cp) end
    if cp < 0x800 then return char(0xC0 + floor(cp / 64), 0x80 + cp % 64) end
    if cp < 0x10000 then
      return char(0xE0 + floor(cp / 4096), 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
    end
    return char(0xF0 + floor(cp / 262144), 0x80 + floor(cp / 4096) % 64,
      0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
  end

  local simple_escapes = {
    [34] = '"', [92] = '\\', [47] = '/', [98] = '\b', [102] = '\f', [110] = '\n', [114] = '\r',
    [116] = '\t',
  }

  local function hex4()
    local h = sub(s, pos, pos + 3)
    if not find(h, '^%x%x%x%x$') then perr('bad \\u escape') end
    pos = pos + 4
    return tonumber(h, 16)
  end

  local function read_string()
    pos = pos + 1 -- the opening quote
    -- The usual string, without an escape: its text as it stands.
    local q = find(s, '[%z\1-\31"\\]', pos)
    if q and byte(s, q) == 34 then
      local seg = sub(s, pos, q - 1)
      check_utf8(seg)
      pos = q + 1
      return seg
    end
    local out = {}
    while true do
      local i = find(s, '[%z\1-\31"\\]', pos)
      if not i then perr('unterminated string') end
      if i > pos then
        local seg = sub(s, pos, i - 1)
        check_utf8(seg)
        out[#out + 1] = seg
      end
      local c = byte(s, i)
      pos = i + 1
      if c == 34 then return concat(out) end
      if c ~= 92 then perr('control character in a string') end
      local e = byte(s, pos)
      pos = pos + 1
      if e == 117 then -- \u
        local cp = hex4()
        if cp >= 0xD800 and cp <= 0xDBFF then
          if sub(s, pos, pos + 1) == '\\u' then
            pos = pos + 2
            local lo = hex4()
            if lo >= 0xDC00 and lo <= 0xDFFF then
              cp = 0x10000 + (cp - 0xD800) * 1024 + (lo - 0xDC00)
            elseif lenient then
              cp = 0xFFFD
            else
              perr('lone leading surrogate')
            end
          elseif lenient then
            cp = 0xFFFD
          else
            perr('lone leading surrogate')
          end
        elseif cp >= 0xDC00 and cp <= 0xDFFF then
          if not lenient then perr('lone trailing surrogate') end
          cp = 0xFFFD
        end
        out[#out + 1] = utf8(cp)
      elseif e and simple_escapes[e] then
        out[#out + 1] = simple_escapes[e]
      else
        perr('bad escape')
      end
    end
  end

  local read_value

  local function read_number()
    local start = pos
    local _, e = find(s, '^-?%d+', pos)
    if not e then perr('expected a value') end
    local e0 = e
    local z = start
    if byte(s, z) == 45 then z = z + 1 end -- -
    if byte(s, z) == 48 and e > z then perr('leading zero') end
    pos = e + 1
    if byte(s, pos) == 46 then -- .
      _, e = find(s, '^%.%d+', pos)
      if not e then perr('expected a digit after .') end
      pos = e + 1
    end
    local c = byte(s, pos)
    if c == 101 or c == 69 then -- e E
      _, e = find(s, '^[eE][+-]?%d+', pos)
      if not e then perr('expected an exponent') end
      pos = e + 1
    end
    -- `int`: digits alone (with a sign), which canonical_number leaves as they are.
    return {num = sub(s, start, pos - 1), int = pos == e0 + 1}
  end

  local function read_array(depth, max)
    pos = pos + 1
    local arr = {arr = true, n = 0}
    skip_ws()
    if byte(s, pos) == 93 then pos = pos + 1; return arr end
    while true do
      local v = read_value(depth + 1, max)
      arr.n = arr.n + 1
      arr[arr.n] = v
      skip_ws()
      local c = byte(s, pos)
      pos = pos + 1
      if c == 93 then return arr end
      if c ~= 44 then pos = pos - 1; perr('expected , or ]') end
    end
  end

  local function read_object(depth, max)
    pos = pos + 1
    local obj = {obj = true, names = {}, map = {}}
    skip_ws()
    if byte(s, pos) == 125 then pos = pos + 1; return obj end
    while true do
      skip_ws()
      if byte(s, pos) ~= 34 then perr('expected a member name') end
      local name = read_string()
      skip_ws()
      if byte(s, pos) ~= 58 then perr('expected :') end
      pos = pos + 1
      local v = read_value(depth + 1, max)
      if obj.map[name] == nil then obj.names[#obj.names + 1] = name end
      obj.map[name] = v
      skip_ws()
      local c = byte(s, pos)
      pos = pos + 1
      if c == 125 then return obj end
      if c ~= 44 then pos = pos - 1; perr('expected , or }') end
    end
  end

  -- `depth`: brackets open around this value; `max`: the most allowed.
  read_value = function(depth, max)
    skip_ws()
    local c = byte(s, pos)
    if c == 123 or c == 91 then
      if depth + 1 > max then fail('payload is nested too deeply (at most ' .. max .. ' levels)') end
      if c == 123 then return read_object(depth, max) end
      return read_array(depth, max)
    elseif c == 34 then
      return read_string()
    elseif c == 116 and sub(s, pos, pos + 3) == 'true' then
      pos = pos + 4; return true
    elseif c == 102 and sub(s, pos, pos + 4) == 'false' then
      pos = pos + 5; return false
    elseif c == 110 and sub(s, pos, pos + 3) == 'null' then
      pos = pos + 4; return NULL
    end
    return read_number()
  end

  -- ---------------------------------------------------------------- canonical JSON (T-2)
  local inf = 1 / 0

  -- The layout of the `ryu` crate for a C `%e` text (canonical.rs shortest_float).
  local function ryu_layout(sci)
    local sign, m, ex = string.match(sci, '^(-?)([%d.]+)e([-+]%d+)$')
    local digits = string.gsub(m, '%.', '')
    digits = string.gsub(digits, '0+$', '')
    if digits == '' then digits = '0' end
    local len = #digits
    local kk = tonumber(ex) + 1
    local k = kk - len
    local body
    if 0 <= k and kk <= 16 then
      body = digits .. string.rep('0', k) .. '.0'
    elseif 0 < kk and kk <= 16 then
      body = sub(digits, 1, kk) .. '.' .. sub(digits, kk + 1)
    elseif -5 < kk and kk <= 0 then
      body = '0.' .. string.rep('0', -kk) .. digits
    elseif len == 1 then
      body = digits .. 'e' .. fmt('%d', kk - 1)
    else
      body = sub(digits, 1, 1) .. '.' .. sub(digits, 2) .. 'e' .. fmt('%d', kk - 1)
    end
    return sign .. body
  end

  -- `sci` ("d.ddde±xx") with its last digit one higher, or nil when that carries out of the
  -- first digit (that candidate has fewer digits and was tried already).
  local function next_up(sci)
    local sign, m, ex = string.match(sci, '^(-?)([%d.]+)(e[-+]%d+)$')
    local t = {byte(m, 1, -1)}
    for i = #t, 1, -1 do
      if t[i] ~= 46 then
        if t[i] < 57 then t[i] = t[i] + 1; return sign .. char(unpack(t)) .. ex end
        if i == 1 then return nil end
        t[i] = 48
      end
    end
    return nil
  end

  -- The shortest text that reads back as `x`, choosing the nearest of that length (C's `%.Ne`
  -- rounds the exact binary value, ties to even, as Rust's `{:.Ne}` does). Just above a power
  -- of two the interval that reads back is lopsided: the nearest candidate may miss it while the
  -- next one up is inside, and that one is the shortest (as in Rust's `{:e}`).
  local function shortest(x)
    for p = 0, 16 do
      local sci = fmt('%.' .. p .. 'e', x)
      local y = tonumber(sci)
      if y == x then return ryu_layout(sci) end
      if abs(y) < abs(x) then
        local up = next_up(sci)
        if up and tonumber(up) == x then return ryu_layout(up) end
      end
    end
    return ryu_layout(fmt('%.16e', x))
  end

  local function canonical_number(t, int)
    if int then
      if t == '-0' then return '0' end
      return t
    end
    if not find(t, '[.eE]') then
      if t == '-0' then return '0' end
      return t
    end
    local x = tonumber(t)
    if x == nil or x ~= x or x == inf or x == -inf then
      return (string.gsub(string.gsub(t, 'E', 'e'), 'e%+', 'e'))
    end
    if x == floor(x) and abs(x) <= 9007199254740992 then
      if x == 0 then return '0' end
      return fmt('%.0f', x)
    end
    return shortest(x)
  end

  local escapes = {['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\t'] = '\\t',
    ['\n'] = '\\n', ['\f'] = '\\f', ['\r'] = '\\r'}

  setup = function()
    byte, sub, char, find, fmt = string.byte, string.sub, string.char, string.find, string.format
    concat, floor, abs = table.concat, math.floor, math.abs
    for c = 0, 31 do
      local ch = char(c)
      if not escapes[ch] then escapes[ch] = fmt('\\u%04x', c) end
    end
    ready = true
  end

  -- A string as serde_json's compact writer escapes it.
  local function json_string(str)
    return '"' .. string.gsub(str, '[%z\1-\31"\\]', escapes) .. '"'
  end

  -- Member names sorted by their bytes (Lua's `<` on strings follows the locale: strcoll).
  local function bytes_less(a, b)
    local n = #a
    if #b < n then n = #b end
    for i = 1, n do
      local x, y = byte(a, i), byte(b, i)
      if x ~= y then return x < y end
    end
    return #a < #b
  end

  local function write(v, out)
    local tv = type(v)
    if tv == 'string' then
      out[#out + 1] = json_string(v)
    elseif v == true then
      out[#out + 1] = 'true'
    elseif v == false then
      out[#out + 1] = 'false'
    elseif v == NULL then
      out[#out + 1] = 'null'
    elseif v.num then
      out[#out + 1] = canonical_number(v.num, v.int)
    elseif v.arr then
      out[#out + 1] = '['
      for i = 1, v.n do
        if i > 1 then out[#out + 1] = ',' end
        write(v[i], out)
      end
      out[#out + 1] = ']'
    else
      local names = {}
      for i, n in ipairs(v.names) do names[i] = n end
      table.sort(names, bytes_less)
      out[#out + 1] = '{'
      for i, n in ipairs(names) do
        if i > 1 then out[#out + 1] = ',' end
        out[#out + 1] = json_string(n)
        out[#out + 1] = ':'
        write(v.map[n], out)
      end
      out[#out + 1] = '}'
    end
  end

  local function canonical(v)
    local out = {}
    write(v, out)
    return concat(out)
  end

  -- ---------------------------------------------------------------- payloads and templates
  -- A payload as the worker decodes it (payload.rs Job::decode): a JSON object whose `class` is
  -- a non-empty string and whose `args` is an array (absent or null: `[]`). Returns a job table
  -- {class, args, queue} whose canonical args and digests are computed once, when first needed.
  render_payload = function(text, queue)
    if not ready then setup() end
    local fast = render_cjson_payload(text, queue)
    if fast then return fast end
    s, pos, lenient = text, 1, false
    skip_ws()
    if byte(s, pos) ~= 123 then
      if byte(s, pos) == nil then perr('empty payload') end
      read_value(0, ANY_DEPTH)
      skip_ws()
      if pos <= #s then perr('trailing characters') end
      fail('payload is not a JSON object')
    end
    -- The top level by hand: class and args are read as serde_json reads a Value (lone
    -- surrogates refused, 127 levels), the other members as it skips them.
    pos = pos + 1
    local class, args = nil, nil
    skip_ws()
    if byte(s, pos) == 125 then
      pos = pos + 1
    else
      while true do
        skip_ws()
        if byte(s, pos) ~= 34 then perr('expected a member name') end
        local name = read_string()
        skip_ws()
        if byte(s, pos) ~= 58 then perr('expected :') end
        pos = pos + 1
        if name == 'class' or name == 'args' then
          local v = read_value(0, ARGS_DEPTH)
          if name == 'class' then class = v else args = v end
        else
          lenient = true
          read_value(1, ANY_DEPTH)
          lenient = false
        end
        skip_ws()
        local c = byte(s, pos)
        pos = pos + 1
        if c == 125 then break end
        if c ~= 44 then pos = pos - 1; perr('expected , or }') end
      end
    end
    skip_ws()
    if pos <= #s then perr('trailing characters') end
    s = nil -- a library keeps its upvalues between calls: do not keep the payload
    if type(class) ~= 'string' or class == '' then
      fail('payload has no class (a non-empty string is required)')
    end
    if args == nil or args == NULL then
      args = {arr = true, n = 0}
    elseif type(args) ~= 'table' or not args.arr then
      fail('payload args is not an array')
    end
    return {class = class, args = args, queue = queue}
  end

  local function args_json(job)
    if not job.args_json then job.args_json = canonical(job.args) end
    return job.args_json
  end

  -- §1.1: SHA-256 of the canonical {"args":A,"class":C}.
  local function digest(job)
    if not job.digest then
      job.digest = render_sha256('{"args":' .. args_json(job) .. ',"class":' ..
        json_string(job.class) .. '}')
    end
    return job.digest
  end

  local function args_digest(job)
    if not job.args_digest then job.args_digest = render_sha256(args_json(job)) end
    return job.args_digest
  end

  local kinds = {string = 'a string', boolean = 'a boolean'}
  local function kind(v)
    if kinds[type(v)] then return kinds[type(v)] end
    if v == NULL then return 'null' end
    if v.num then return 'a number' end
    if v.arr then return 'an array' end
    return 'an object'
  end

  local function step_text(step)
    if type(step) == 'number' then return '[' .. fmt('%.0f', step) .. ']' end
    if find(step, '^[A-Za-z_][A-Za-z0-9_]*$') then return '.' .. step end
    return '[' .. json_string(step) .. ']'
  end

  -- T-6: `{args[i]...}` walked; a step that does not exist names the template and the path.
  -- (The walk that names the path; `walk` below, without the names, hands a step that does
  -- not exist to this one.)
  local function walk_named(t, job, steps)
    local cur, path = job.args, 'args'
    for i = 2, #steps do
      local step = steps[i]
      local here = path
      path = path .. step_text(step)
      local nxt
      if type(step) == 'number' and type(cur) == 'table' and cur.arr then
        nxt = cur[step + 1]
        if nxt == nil then
          fail('key template ' .. json_string(t.src) .. ': ' .. path ..
            ' does not exist (the array has ' .. cur.n .. ' items)')
        end
      elseif type(step) == 'string' and type(cur) == 'table' and cur.obj then
        nxt = cur.map[step]
        if nxt == nil then
          fail('key template ' .. json_string(t.src) .. ': ' .. path ..
            ' does not exist in the payload')
        end
      else
        fail('key template ' .. json_string(t.src) .. ': ' .. path .. ' does not exist (' ..
          here .. ' is ' .. kind(cur) .. ')')
      end
      cur = nxt
    end
    return cur
  end

  local function walk(t, job, steps)
    local cur = job.args
    for i = 2, #steps do
      local step, nxt = steps[i], nil
      if type(cur) == 'table' then
        if type(step) == 'number' then
          if cur.arr then nxt = cur[step + 1] end
        elseif cur.obj then
          nxt = cur.map[step]
        end
      end
      if nxt == nil then return walk_named(t, job, steps) end
      cur = nxt
    end
    return cur
  end

  -- One template `t` ({src = text, parts = {...}}) rendered for `job` (T-3), capped by T-5:
  -- returns the id and the full rendered text.
  render_template = function(t, job)
    local out = {}
    for _, part in ipairs(t.parts) do
      if type(part) == 'string' then
        out[#out + 1] = part
      else
        local what = part[1]
        if what == 'class' then out[#out + 1] = job.class
        elseif what == 'queue' then out[#out + 1] = job.queue
        elseif what == 'digest' then out[#out + 1] = digest(job)
        elseif what == 'args_digest' then out[#out + 1] = args_digest(job)
        elseif what == 'args' then out[#out + 1] = args_json(job)
        elseif what == 'path' then
          local v = walk(t, job, part)
          if type(v) == 'string' then
            out[#out + 1] = v
          elseif type(v) == 'table' and v.num then
            out[#out + 1] = canonical_number(v.num, v.int)
          else
            out[#out + 1] = canonical(v)
          end
        else
          fail('key template ' .. json_string(t.src) .. ': unknown part ' .. tostring(what))
        end
      end
    end
    local text = concat(out)
    if text == '' then fail('key template ' .. json_string(t.src) .. ': rendered an empty id') end
    if #text > 200 then return 'h:' .. render_sha256(text), text end
    return text, text
  end

  -- The job's digest, for the callers that place holds under it (D-1).
  render_digest = digest

  -- A string as serde_json writes it (TAKE's working-on record and lockinfo, lib_take.lua).
  render_json_string = function(str)
    if not ready then setup() end
    return json_string(str)
  end
end

