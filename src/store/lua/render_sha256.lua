-- RENDER's SHA-256 (FIPS 180-4), written with the `bit` library (Redis has SHA-1 only): the
-- digests of locking-semantics.md §1.1 (`{digest}`, `{args_digest}`, T-5's `h:` ids). The first
-- of the renderer's files (src/store/scripts.rs: render_sha256.lua, render_cjson.lua,
-- render.lua), it declares the names they define.
local render_payload, render_template, render_sha256, render_digest, render_json_string
local render_cjson_payload
do
  -- Set at the first call: a FUNCTION library's load may not read `string`, `math` or `bit`.
  local byte, char, floor, band, bor, bxor, rshift, lshift, ror, tobit, tohex
  local ready = false

  local K = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
  }
  local W = {}

  local function setup()
    byte, char, floor = string.byte, string.char, math.floor
    band, bor, bxor, rshift, lshift, ror, tobit, tohex =
      bit.band, bit.bor, bit.bxor, bit.rshift, bit.lshift, bit.ror, bit.tobit, bit.tohex
    for i = 1, 64 do K[i] = tobit(K[i]) end
    ready = true
  end

  -- Lowercase hex SHA-256 of the bytes of `msg`.
  render_sha256 = function(msg)
    if not ready then setup() end
    local len = #msg
    local bits = len * 8
    msg = msg .. '\128' .. string.rep('\0', (55 - len) % 64) ..
      char(floor(bits / 2^56) % 256, floor(bits / 2^48) % 256, floor(bits / 2^40) % 256,
        floor(bits / 2^32) % 256, floor(bits / 2^24) % 256, floor(bits / 2^16) % 256,
        floor(bits / 2^8) % 256, bits % 256)
    local h0, h1, h2, h3 = tobit(0x6a09e667), tobit(0xbb67ae85), tobit(0x3c6ef372), tobit(0xa54ff53a)
    local h4, h5, h6, h7 = tobit(0x510e527f), tobit(0x9b05688c), tobit(0x1f83d9ab), tobit(0x5be0cd19)
    for off = 1, #msg, 64 do
      for i = 0, 15 do
        local b1, b2, b3, b4 = byte(msg, off + i * 4, off + i * 4 + 3)
        W[i + 1] = bor(lshift(b1, 24), lshift(b2, 16), lshift(b3, 8), b4)
      end
      for i = 17, 64 do
        local w15, w2 = W[i - 15], W[i - 2]
        local s0 = bxor(ror(w15, 7), ror(w15, 18), rshift(w15, 3))
        local s1 = bxor(ror(w2, 17), ror(w2, 19), rshift(w2, 10))
        W[i] = tobit(W[i - 16] + s0 + W[i - 7] + s1)
      end
      local a, b, c, d, e, f, g, h = h0, h1, h2, h3, h4, h5, h6, h7
      for i = 1, 64 do
        local S1 = bxor(ror(e, 6), ror(e, 11), ror(e, 25))
        local ch = bxor(g, band(e, bxor(f, g)))
        local t1 = h + S1 + ch + K[i] + W[i]
        local S0 = bxor(ror(a, 2), ror(a, 13), ror(a, 22))
        local maj = bor(band(a, b), band(c, bor(a, b)))
        h, g, f, e = g, f, e, tobit(d + t1)
        d, c, b, a = c, b, a, tobit(t1 + S0 + maj)
      end
      h0, h1, h2, h3 = tobit(h0 + a), tobit(h1 + b), tobit(h2 + c), tobit(h3 + d)
      h4, h5, h6, h7 = tobit(h4 + e), tobit(h5 + f), tobit(h6 + g), tobit(h7 + h)
    end
    return tohex(h0, 8) .. tohex(h1, 8) .. tohex(h2, 8) .. tohex(h3, 8) ..
      tohex(h4, 8) .. tohex(h5, 8) .. tohex(h6, 8) .. tohex(h7, 8)
  end
end
