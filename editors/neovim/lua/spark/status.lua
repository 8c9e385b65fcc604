--- The last `spark/status` figures (tokens/s, TTFT, reused prompt tokens, projected wafer speed)
--- and the work-done progress tokens of running live edits, so :SparkStatus can show the first and
--- cancel can stop the second.
local M = {}

M.last = nil -- last spark/status payload of a generation
M.engine = nil -- where generations run ("in-process", "engine service ws://…", "llamacpp http://…")
M.error = nil -- the engine service's or backend's failure, until it answers again (kind "health")
M.progress = {} -- token -> { client_id, title, message }

local listeners = {}

function M.on_update(fn)
  listeners[#listeners + 1] = fn
end

--- lsp handler for `spark/status`.
function M.handler(_, result, ctx)
  if type(result) ~= 'table' then
    return
  end
  result.client_id = ctx and ctx.client_id
  if type(result.engine) == 'string' then
    M.engine = result.engine
  end
  if result.kind == 'health' then
    M.error = type(result.error) == 'string' and result.error or nil
  else
    M.last = result
  end
  for _, fn in ipairs(listeners) do
    pcall(fn, result)
  end
  vim.api.nvim_exec_autocmds('User', { pattern = 'SparkStatus', modeline = false, data = result })
end

--- `$/progress` wrapper: remember running progresses, then defer to Neovim's own handler.
function M.progress_handler(err, result, ctx, config)
  if type(result) == 'table' and type(result.value) == 'table' then
    local v = result.value
    if v.kind == 'begin' then
      M.progress[result.token] = { client_id = ctx.client_id, title = v.title, message = v.message,
        cancellable = v.cancellable }
    elseif v.kind == 'report' and M.progress[result.token] then
      M.progress[result.token].message = v.message or M.progress[result.token].message
    elseif v.kind == 'end' then
      M.progress[result.token] = nil
    end
  end
  return vim.lsp.handlers['$/progress'](err, result, ctx, config)
end

local function rate(v)
  if type(v) ~= 'number' then
    return nil
  end
  if v >= 1000 then
    return string.format('%.1fk', v / 1000)
  end
  return string.format(v >= 100 and '%.0f' or '%.1f', v)
end

--- A short statusline component: "spark 312 tok/s · TTFT 18 ms · wafer 9.1k tok/s".
function M.statusline()
  if M.error then
    return 'spark unavailable'
  end
  local s = M.last
  if not s then
    return next(M.progress) and 'spark …' or 'spark'
  end
  local out = 'spark'
  if rate(s.tokensPerSecond) then
    out = out .. ' ' .. rate(s.tokensPerSecond) .. ' tok/s'
  end
  if type(s.ttftMs) == 'number' then
    out = out .. string.format(' · TTFT %.0f ms', s.ttftMs)
  end
  if rate(s.waferDecodeTokensPerSecond) then
    out = out .. ' · wafer ' .. rate(s.waferDecodeTokensPerSecond) .. ' tok/s'
  end
  return out
end

--- Lines for :SparkStatus.
function M.describe(server_metrics)
  local lines = {}
  local s = M.last
  if M.engine then
    lines[#lines + 1] = 'runs: ' .. M.engine
  end
  if M.error then
    lines[#lines + 1] = 'UNAVAILABLE: ' .. M.error
  end
  if s then
    lines[#lines + 1] = string.format('model %s — last %s', s.model or '?', s.kind or 'generation')
    local rows = {
      { 'tokens/s', s.tokensPerSecond }, { 'TTFT (ms)', s.ttftMs },
      { 'prompt tokens', s.promptTokens }, { 'reused prompt tokens', s.reusedPromptTokens },
      { 'new tokens', s.newTokens }, { 'total (ms)', s.totalMs },
      { 'projected wafer tokens/s', s.waferDecodeTokensPerSecond },
    }
    for _, r in ipairs(rows) do
      if r[2] ~= nil and r[2] ~= vim.NIL then
        lines[#lines + 1] = string.format('  %-26s %s', r[1], tostring(r[2]))
      end
    end
  else
    lines[#lines + 1] = 'no generation yet'
  end
  if server_metrics then
    local m = server_metrics
    lines[#lines + 1] = string.format('server: model %s, loaded %s, inline requests %s, typing-through %s, '
      .. 'model calls %s, cancelled %s, superseded %s', tostring(m.model), tostring(m.loaded),
      tostring(m.inlineRequests), tostring(m.typingThrough), tostring(m.modelCalls),
      tostring(m.cancelled), tostring(m.superseded))
    local e = m.engine
    if type(e) == 'table' and e.target ~= nil then -- generating in the engine service
      lines[#lines + 1] = string.format('engine service: %s, %s', tostring(e.engine),
        e.connected and 'connected' or 'NOT connected')
    end
  end
  for _, p in pairs(M.progress) do
    lines[#lines + 1] = string.format('running: %s %s', p.title or '', p.message or '')
  end
  return lines
end

return M
