--- Ghost text through Neovim 0.12's native `vim.lsp.inline_completion`, plus what it lacks:
--- accepting one word or line, and cancelling the request in flight on every keystroke (the
--- native completor only debounces, so an old request would otherwise keep the model busy).
local compat = require('spark.compat')
local parts = require('spark.parts')

local M = {}

local enabled = true
local ic = vim.lsp.inline_completion

local function spark_client(buf)
  return compat.get_clients({ bufnr = buf, name = 'spark' })[1]
end

--- Cancel every inlineCompletion request to spark still pending for `buf`.
function M.cancel_pending(buf)
  local client = spark_client(buf)
  if not client then
    return
  end
  for id, req in pairs(client.requests or {}) do
    if req.bufnr == buf and req.method == 'textDocument/inlineCompletion' and req.type == 'pending' then
      compat.cancel_request(client, id)
    end
  end
end

--- The text of the suggestion shown in `buf` (nil when none), read from the native extmark.
function M.current(buf)
  buf = buf or vim.api.nvim_get_current_buf()
  local ns = vim.api.nvim_get_namespaces()['nvim.lsp.inline_completion']
  if not ns then
    return nil
  end
  local marks = vim.api.nvim_buf_get_extmarks(buf, ns, 0, -1, { details = true })
  if #marks == 0 then
    return nil
  end
  local d = marks[1][4]
  local parts = {}
  for _, chunk in ipairs(d.virt_text or {}) do
    parts[#parts + 1] = chunk[1]
  end
  local out = table.concat(parts)
  for _, vl in ipairs(d.virt_lines or {}) do
    local l = {}
    for _, chunk in ipairs(vl) do
      l[#l + 1] = chunk[1]
    end
    out = out .. '\n' .. table.concat(l)
  end
  return out
end

function M.accept(buf)
  return ic.get({ bufnr = buf })
end

--- Accept a leading part of the suggestion (`patterns`, first match wins).
local function accept_part(buf, patterns)
  return ic.get({
    bufnr = buf,
    on_accept = function(item)
      local text = type(item.insert_text) == 'string' and item.insert_text or item.insert_text.value
      local row, col = unpack(vim.api.nvim_win_get_cursor(0))
      row = row - 1
      local typed = ''
      if item.range then
        local sr, sc = item.range.start.row, item.range.start.col
        if sr == row and sc <= col then
          typed = vim.api.nvim_buf_get_text(buf, row, sc, row, col, {})[1] or ''
        end
      end
      if text:sub(1, #typed) == typed then
        text = text:sub(#typed + 1)
      end
      local part = parts.leading(text, patterns)
      local lines = vim.split(part, '\n', { plain = true })
      vim.api.nvim_buf_set_text(buf, row, col, row, col, lines)
      vim.api.nvim_win_set_cursor(0, { row + #lines, (#lines == 1 and col or 0) + #lines[#lines] })
    end,
  })
end

function M.accept_word(buf)
  return accept_part(buf, parts.WORD)
end

function M.accept_line(buf)
  return accept_part(buf, parts.LINE)
end

function M.dismiss(buf)
  M.cancel_pending(buf)
  local ns = vim.api.nvim_get_namespaces()['nvim.lsp.inline_completion']
  if ns then
    vim.api.nvim_buf_clear_namespace(buf, ns, 0, -1)
  end
end

function M.trigger(_)
  -- The native module has no public "request now"; leaving and re-entering the debounce window
  -- is what it reacts to, so nudge it through its CursorMovedI autocmd.
  vim.api.nvim_exec_autocmds('CursorMovedI', { buffer = vim.api.nvim_get_current_buf(), modeline = false })
end

function M.select(count)
  ic.select({ count = count })
end

function M.set_enabled(on)
  enabled = on
  for _, client in ipairs(compat.get_clients({ name = 'spark' })) do
    ic.enable(on, { client_id = client.id })
  end
end

function M.is_enabled()
  return enabled
end

function M.attach(buf, client)
  if enabled then
    ic.enable(true, { client_id = client.id })
  end
  local group = vim.api.nvim_create_augroup('spark_native_' .. buf, { clear = true })
  vim.api.nvim_create_autocmd('TextChangedI', {
    group = group, buffer = buf, callback = function() M.cancel_pending(buf) end,
  })
end

return M
