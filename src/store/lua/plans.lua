-- PLANS: the class plans PUSH reads (push.lua, locking-semantics.md D-3a), at the chunk's
-- level so that a FUNCTION library keeps its cache between calls.

-- A published plan's JSON (src/config/published.rs), decoded once per text: a FUNCTION
-- library keeps the decoded plans between calls (an EVAL script decodes it each time).
local push_plan
do
  local cache, cached = {}, 0
  push_plan = function(text)
    local plan = cache[text]
    if plan then return plan end
    plan = cjson.decode(text)
    if plan.v ~= 1 then
      error({err = 'LOCKET_PLAN a published plan has version ' .. tostring(plan.v) ..
        '; this locketd renders version 1 (a newer locketd published it: upgrade the client)'})
    end
    if cached >= 256 then cache, cached = {}, 0 end
    cache[text] = plan
    cached = cached + 1
    return plan
  end
end
