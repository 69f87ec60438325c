-- RENDER's reader for the usual payload (render.lua's `render_payload` asks it first): a
-- payload read by Redis's cjson, one C call, where render.lua's own reader makes dozens.
-- Returns render.lua's job table {class, args, queue} (its values: strings, {num = text, int =
-- true}, {arr = true, n, [1..n]}, {obj = true, names, map}), or nil when render.lua must read
-- the payload.
do
  local find, gsub, fmt, floor, abs
  -- Most payloads are compact JSON in printable ASCII, without escapes, of strings, arrays,
  -- objects and whole numbers: for those, Redis's cjson reads the same values, once what it takes and JSON does not is ruled out on
  -- the text. Any doubt returns nil, and render.lua's reader decides (and words a refusal). On the
  -- text: no byte outside 0x20-0x7E and no backslash (no escape, no UTF-8 to check: each
  -- string is `"[^"]*"`); outside the strings, only digits, `-`, `,`, `:` and brackets (no
  -- space, no true, false or null, no fraction or exponent; cjson also reads `nan`, `inf`,
  -- `0x10`, `+1` and `1.`), no leading zero (cjson reads `01`), no `[]` or `{}` (cjson reads
  -- both as one empty table) and, in a long text, fewer than 120 brackets (cjson allows 1,000
  -- levels, args 127). Each number is then a whole one (a double under 10^15, whose `%.0f` is
  -- its text).
  local function from_cjson(v)
    local tv = type(v)
    if tv == 'string' then return v end
    if tv == 'number' then
      if v ~= floor(v) or abs(v) >= 1e15 then error(false) end
      if v == 0 then return {num = '0', int = true} end
      return {num = fmt('%.0f', v), int = true}
    end
    if tv ~= 'table' then error(false) end
    if v[1] ~= nil then
      local n = #v
      local arr = {arr = true, n = n}
      for i = 1, n do arr[i] = from_cjson(v[i]) end
      return arr
    end
    local names, map, i = {}, {}, 0
    for k, x in pairs(v) do
      if type(k) ~= 'string' then error(false) end
      i = i + 1
      names[i] = k
      map[k] = from_cjson(x)
    end
    return {obj = true, names = names, map = map}
  end

  render_cjson_payload = function(text, queue)
    if not find then
      find, gsub, fmt = string.find, string.gsub, string.format
      floor, abs = math.floor, math.abs
    end
    if find(text, '\\', 1, true) or find(text, '[^ -~]') then return nil end
    local sk = gsub(text, '"[^"]*"', '""')
    if find(sk, '[^%d%-,:%[%]{}"]') or find(sk, '[]', 1, true) or find(sk, '{}', 1, true) or
      (find(sk, '0', 1, true) and find(sk, '%D0%d')) then
      return nil
    end
    if #text > 240 and select(2, gsub(sk, '[%[{]', '')) >= 120 then return nil end
    local ok, v = pcall(cjson.decode, text)
    if not ok or type(v) ~= 'table' or v[1] ~= nil then return nil end
    local class, args = v['class'], v['args']
    if type(class) ~= 'string' or class == '' then return nil end
    if args == nil then
      args = {arr = true, n = 0}
    else
      if type(args) ~= 'table' or args[1] == nil then return nil end
      local okc, a = pcall(from_cjson, args)
      if not okc then return nil end
      args = a
    end
    return {class = class, args = args, queue = queue}
  end
end
