--- Ghost text drawn with extmarks, for Neovim 0.10 / 0.11 (no native inline completion there) or
--- when setup({ inline = 'extmark' }) forces it.
---
--- Every keystroke cancels the request in flight (`$/cancelRequest`, the server stops the model
--- within one decode step) and schedules a new one after `debounce_ms`; typing the characters the
--- suggestion shows just trims it, with no request at all.
local compat = require('spark.compat')
local parts = require('spark.parts')

local M = {}

local ns = vim.api.nvim_create_namespace('spark_ghost')
M.ns = ns

local AUTOMATIC, INVOKED = 2, 1

--- Per-buffer state: { req = {client_id, id}?, timer?, item?, row, prefix, tick }
local state = {}
local opts = { debounce_ms = 60 }
local enabled = true

local function resolve(buf)
  return (buf == nil or buf == 0) and vim.api.nvim_get_current_buf() or buf
end

local function st(buf)
  state[buf] = state[buf] or {}
  return state[buf]
end

local function spark_client(buf)
  return compat.get_clients({ bufnr = buf, name = 'spark' })[1]
end

local function stop_timer(s)
  if s.timer then
    s.timer:stop()
    if not s.timer:is_closing() then
      s.timer:close()
    end
    s.timer = nil
  end
end

--- Cancel the request in flight for `buf`, if any.
local function cancel_inflight(buf)
  local s = st(buf)
  stop_timer(s)
  if s.req then
    local client = vim.lsp.get_client_by_id(s.req.client_id)
    if client then
      compat.cancel_request(client, s.req.id)
    end
    s.req = nil
  end
end

function M.clear(buf)
  buf = resolve(buf)
  if vim.api.nvim_buf_is_valid(buf) then
    vim.api.nvim_buf_clear_namespace(buf, ns, 0, -1)
  end
  local s = st(buf)
  s.item = nil
end

--- Dismiss: hide the suggestion and cancel what is in flight.
function M.dismiss(buf)
  buf = resolve(buf)
  cancel_inflight(buf)
  M.clear(buf)
end

local function cursor()
  local pos = vim.api.nvim_win_get_cursor(0)
  return pos[1] - 1, pos[2]
end

--- Draw s.item (the text still to insert at the cursor) as inline virtual text + virtual lines.
local function render(buf)
  vim.api.nvim_buf_clear_namespace(buf, ns, 0, -1)
  local s = st(buf)
  if not s.item or s.item.text == '' then
    return
  end
  local row, col = cursor()
  local lines = vim.split(s.item.text, '\n', { plain = true })
  local first = lines[1]
  -- The suggestion may end with text already on the line after the cursor (a closing bracket);
  -- show only what is new so the line does not appear doubled.
  local tail = s.item.tail
  if #lines == 1 and tail ~= '' and first:sub(-#tail) == tail then
    first = first:sub(1, #first - #tail)
  end
  local virt_lines = {}
  for i = 2, #lines do
    virt_lines[#virt_lines + 1] = { { lines[i], 'SparkGhost' } }
  end
  vim.api.nvim_buf_set_extmark(buf, ns, row, col, {
    virt_text = first ~= '' and { { first, 'SparkGhost' } } or nil,
    virt_text_pos = 'inline',
    virt_lines = #virt_lines > 0 and virt_lines or nil,
    hl_mode = 'combine',
    priority = 200,
  })
end

--- The text currently offered (nil when none), for tests and statuslines.
function M.current(buf)
  local s = state[resolve(buf)]
  return s and s.item and s.item.text or nil
end

--- Turn an InlineCompletionItem into { text = what to insert at the cursor, tail = line text after
--- the cursor that accepting replaces }, or nil when it does not fit the current cursor.
local function fit(item, buf, row, col, enc)
  local insert = item.insertText
  if type(insert) == 'table' then
    insert = insert.value -- a snippet: shown and inserted literally
  end
  if type(insert) ~= 'string' or insert == '' then
    return nil
  end
  local line = vim.api.nvim_buf_get_lines(buf, row, row + 1, false)[1] or ''
  local tail = ''
  if item.range then
    local r = item.range
    if r.start.line ~= row then
      return nil
    end
    local scol = compat.byte_col(line, r.start.character, enc)
    local ecol = r['end'].line == row and compat.byte_col(line, r['end'].character, enc) or #line
    if scol > col or ecol < col then
      return nil
    end
    local typed = line:sub(scol + 1, col)
    if insert:sub(1, #typed) ~= typed then
      return nil
    end
    insert = insert:sub(#typed + 1)
    tail = line:sub(col + 1, ecol)
  end
  if insert == '' then
    return nil
  end
  return { text = insert:gsub('\r\n', '\n'), tail = tail }
end

local function request(buf, kind)
  local client = spark_client(buf)
  if not client or not vim.api.nvim_buf_is_valid(buf) then
    return
  end
  cancel_inflight(buf)
  local s = st(buf)
  local row, col = cursor()
  local tick = vim.api.nvim_buf_get_changedtick(buf)
  local line = vim.api.nvim_buf_get_lines(buf, row, row + 1, false)[1] or ''
  local enc = client.offset_encoding or 'utf-16'
  local params = {
    textDocument = vim.lsp.util.make_text_document_params(buf),
    position = { line = row, character = compat.lsp_col(line, col, enc) },
    context = { triggerKind = kind },
  }
  local ok, id
  ok, id = compat.request(client, 'textDocument/inlineCompletion', params, function(err, result)
    if s.req and s.req.id == id then
      s.req = nil
    end
    if err or not result then
      return -- cancelled (-32800), superseded or failed: the next keystroke asks again
    end
    if not vim.api.nvim_buf_is_valid(buf) or vim.api.nvim_get_current_buf() ~= buf
        or vim.api.nvim_buf_get_changedtick(buf) ~= tick or not vim.fn.mode():match('^i') then
      return -- stale: the buffer or cursor moved on
    end
    local r2, c2 = cursor()
    if r2 ~= row or c2 ~= col then
      return
    end
    local items = result.items or result
    local item
    for _, it in ipairs(items) do
      item = fit(it, buf, row, col, enc)
      if item then
        break
      end
    end
    s.item = item
    s.row, s.prefix, s.tick = row, line:sub(1, col), tick
    render(buf)
  end, buf)
  if ok and id then
    s.req = { client_id = client.id, id = id }
  end
end

--- Ask now (Invoked): used by the trigger key.
function M.trigger(buf)
  buf = resolve(buf)
  M.clear(buf)
  request(buf, INVOKED)
end

--- TextChangedI: keep the suggestion if the user typed what it shows, else cancel and re-ask.
local function on_text_changed(buf)
  local s = st(buf)
  local row, col = cursor()
  local line = vim.api.nvim_buf_get_lines(buf, row, row + 1, false)[1] or ''
  local prefix = line:sub(1, col)
  if s.item and s.row == row and #prefix > #s.prefix and prefix:sub(1, #s.prefix) == s.prefix then
    local typed = prefix:sub(#s.prefix + 1)
    if s.item.text:sub(1, #typed) == typed and #typed < #s.item.text then
      cancel_inflight(buf)
      s.item.text = s.item.text:sub(#typed + 1)
      s.prefix, s.tick = prefix, vim.api.nvim_buf_get_changedtick(buf)
      render(buf)
      return
    end
  end
  M.dismiss(buf)
  if not enabled then
    return
  end
  s.timer = vim.defer_fn(function()
    s.timer = nil
    if vim.api.nvim_get_current_buf() == buf and vim.fn.mode():match('^i') then
      request(buf, AUTOMATIC)
    end
  end, opts.debounce_ms)
end

--- Insert `text` at the cursor replacing `tail_len` bytes after it; cursor ends after the text.
local function insert_at_cursor(buf, text, tail_len)
  local row, col = cursor()
  local lines = vim.split(text, '\n', { plain = true })
  vim.api.nvim_buf_set_text(buf, row, col, row, col + tail_len, lines)
  local last_row = row + #lines - 1
  local last_col = (#lines == 1 and col or 0) + #lines[#lines]
  vim.api.nvim_win_set_cursor(0, { last_row + 1, last_col })
end

--- Accept the whole suggestion; false when there is none (so a key can fall back).
function M.accept(buf)
  buf = resolve(buf)
  local s = st(buf)
  if not s.item then
    return false
  end
  local item = s.item
  M.dismiss(buf)
  insert_at_cursor(buf, item.text, #item.tail)
  return true
end

local function accept_part(buf, pattern_list)
  buf = resolve(buf)
  local s = st(buf)
  if not s.item then
    return false
  end
  local text = s.item.text
  local part = parts.leading(text, pattern_list)
  if part == text then
    return M.accept(buf)
  end
  -- Insert the part; TextChangedI then sees typed text matching the suggestion and trims it.
  insert_at_cursor(buf, part, 0)
  return true
end

--- Accept up to the end of the next word.
function M.accept_word(buf)
  return accept_part(buf, parts.WORD)
end

--- Accept up to the end of the current line of the suggestion.
function M.accept_line(buf)
  return accept_part(buf, parts.LINE)
end

function M.set_enabled(on)
  enabled = on
  if not on then
    for buf in pairs(state) do
      M.dismiss(buf)
    end
  end
end

function M.is_enabled()
  return enabled
end

--- Attach the autocmds to `buf` (idempotent).
function M.attach(buf, o)
  opts = o
  local s = st(buf)
  if s.attached then
    return
  end
  s.attached = true
  local group = vim.api.nvim_create_augroup('spark_ghost_' .. buf, { clear = true })
  vim.api.nvim_create_autocmd('TextChangedI', {
    group = group, buffer = buf, callback = function() on_text_changed(buf) end,
  })
  vim.api.nvim_create_autocmd('CursorMovedI', {
    group = group, buffer = buf,
    callback = function()
      -- A move without a change (arrow keys, mouse) makes the suggestion stale.
      if s.item and vim.api.nvim_buf_get_changedtick(buf) == s.tick then
        local row, col = cursor()
        if row ~= s.row or col ~= #s.prefix then
          M.dismiss(buf)
        end
      end
    end,
  })
  vim.api.nvim_create_autocmd({ 'InsertLeave', 'BufLeave' }, {
    group = group, buffer = buf, callback = function() M.dismiss(buf) end,
  })
  vim.api.nvim_create_autocmd({ 'BufUnload', 'BufWipeout' }, {
    group = group, buffer = buf,
    callback = function()
      cancel_inflight(buf)
      state[buf] = nil
      pcall(vim.api.nvim_del_augroup_by_id, group)
    end,
  })
end

return M
