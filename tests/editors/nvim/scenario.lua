-- End-to-end scenario in a real (headless) Neovim with the spark plugin and a real spark-lsp
-- server: keys go through nvim_input() like a user's typing, so mappings, autocmds and the
-- plugin's debounce/cancel logic all run. Results go to $SPARK_TEST_OUT as JSON, one entry per
-- check: { ok = bool, detail = ... }; tests/editors/test_neovim.py asserts on them.
local out_path = assert(os.getenv('SPARK_TEST_OUT'))
local file = assert(os.getenv('SPARK_TEST_FILE'))
local spark = require('spark')
local results = { _order = {} }
local t_start = vim.uv.hrtime()

local function now_ms()
  return (vim.uv.hrtime() - t_start) / 1e6
end

local function record(name, ok, detail)
  results[name] = { ok = ok and true or false, detail = detail }
  table.insert(results._order, name)
end

local function finish()
  results._elapsed_ms = now_ms()
  local f = assert(io.open(out_path, 'w'))
  f:write(vim.json.encode(results))
  f:close()
  vim.cmd('qall!')
end

-- what the server tells the user (window/showMessage reaches vim.notify): an edit whose result
-- failed the server's edit checks is refused with a message, and the buffer is left as it was
local refusals = {}
local restarted = {} -- the plugin's "started it again" messages
local notify = vim.notify
vim.notify = function(msg, ...)
  if type(msg) == 'string' and msg:find('was not applied', 1, true) then
    table.insert(refusals, msg)
  end
  if type(msg) == 'string' and msg:find('started it again', 1, true) then
    table.insert(restarted, msg)
  end
  return notify(msg, ...)
end

--- Whether an edit was refused since `count` refusals, leaving the buffer at `before`.
local function refused_cleanly(count, before)
  return #refusals > count and table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\n') == before
end

local co
local function sleep(ms)
  vim.defer_fn(function()
    local ok, err = coroutine.resume(co)
    if not ok then
      record('scenario_error', false, debug.traceback(co, err))
      finish()
    end
  end, ms)
  coroutine.yield()
end

local function wait_for(pred, timeout_ms, step)
  local t0 = now_ms()
  while now_ms() - t0 < timeout_ms do
    local ok, v = pcall(pred)
    if ok and v then
      return v
    end
    sleep(step or 10)
  end
  return nil
end

local function client()
  return vim.lsp.get_clients({ name = 'spark', bufnr = 0 })[1]
end

-- (`buf`: a real buffer number makes Client:request() first send that buffer's pending didChange;
-- Neovim's flush skips them for 0)
local function sync_request(method, params, timeout_ms, buf)
  local done, res, e
  client():request(method, params, function(err, result)
    done, res, e = true, result, err
  end, buf or 0)
  wait_for(function() return done end, timeout_ms or 10000)
  return res, e
end

--- :SparkStatus's output, once it holds every one of `needles` (nil if it does not in 5 s).
local function spark_status_showing(needles)
  vim.cmd('messages clear')
  vim.cmd('SparkStatus')
  return wait_for(function()
    local m = vim.api.nvim_exec2('messages', { output = true }).output
    for _, needle in ipairs(needles) do
      if not m:find(needle, 1, true) then
        return nil
      end
    end
    return m
  end, 5000)
end

local function server_metrics()
  return sync_request('workspace/executeCommand', { command = 'spark.status', arguments = {} })
end

local function buf_text()
  return table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\n')
end

-- LspRequest events: request id -> list of types seen ('pending', 'complete', 'cancel', 'error').
local req_events = {}
vim.api.nvim_create_autocmd('LspRequest', {
  callback = function(ev)
    local r = ev.data.request
    if r and r.method == 'textDocument/inlineCompletion' then
      local id = ev.data.request_id
      req_events[id] = req_events[id] or {}
      table.insert(req_events[id], r.type)
    end
  end,
})

local function pending_inline_ids()
  local ids = {}
  for id, r in pairs(client().requests) do
    if r.method == 'textDocument/inlineCompletion' and r.type == 'pending' then
      table.insert(ids, id)
    end
  end
  return ids
end

--- Type `chars` one at a time until a suggestion shows; returns it (or nil).
local function type_until_ghost(chars, per_char_ms)
  for i = 1, #chars do
    vim.api.nvim_input(chars:sub(i, i))
    local g = wait_for(function() return spark.current(0) end, per_char_ms)
    if g and g ~= '' then
      return g, i
    end
  end
  return nil
end

local SAMPLE_TEXT

-- A longer function for the streaming steps (the region the live edit rewrites).
local function long_doc()
  local lines = vim.split(SAMPLE_TEXT, '\n', { plain = true })
  local first = #lines + 2
  vim.list_extend(lines, { '', '', 'def table(rows):', '    out = []' })
  for i = 1, 24 do
    table.insert(lines, string.format('    out.append(rows[%d] * %d + len(str(rows[%d])))', i, i, i))
  end
  vim.list_extend(lines, { '    return out', '' })
  return lines, first, first + 26
end

-- workspace/applyEdit as Neovim handles it, except that while `hold` is set the reply to the first
-- edit the server streams is held back (the edit is applied first) until the step has done what
-- the user does and the server has seen it. The server waits for that reply before it writes
-- anything more, so the user's action lands while the edit is in flight however fast the model
-- finishes (tests/server/test_lsp.py types at the same moment, from its client's applyEdit).
-- Neovim runs a server request's handler in a coroutine and replies when the handler returns.
local hold
local default_apply_edit = vim.lsp.handlers['workspace/applyEdit']
vim.lsp.handlers['workspace/applyEdit'] = function(err, params, ctx)
  local reply = default_apply_edit(err, params, ctx)
  local h = hold
  if h and not h.co then
    hold = nil
    h.reply = reply
    h.co = coroutine.running()
    if h.co then
      coroutine.yield()
    end
  end
  return reply
end

-- Rewrites `def table` in a fresh long_doc() (a random test model's text can hold \x1c-\x1e or \f,
-- which pygls, not the LSP spec, counts as line breaks, so each attempt starts from the clean
-- sample). Once the first streamed edit is applied, with its reply held (see `hold`), runs
-- `interrupt()` (the user's action), then a request round trip: Client:request() sends the
-- buffer's pending didChange first and the server handles messages in order, so when the reply
-- comes the server has seen the action. Then lets the reply go, waits for the edit to end and
-- returns what the attempt showed.
local function interrupted_edit(interrupt)
  local doc, l1, l2 = long_doc()
  vim.api.nvim_buf_set_lines(0, 0, -1, false, doc)
  sleep(200)
  local buf = vim.api.nvim_get_current_buf()
  local result, done = nil, false
  local h = {}
  hold = h
  spark.edit('rewrite this in a different style', l1, l2, false, function(err, res)
    result, done = err or res, true
  end)
  wait_for(function() return h.co ~= nil or done end, 15000, 1)
  hold = nil
  local a = { doc = doc, l1 = l1, l2 = l2, held = h.co ~= nil,
    first_applied = type(h.reply) == 'table' and h.reply.applied == true }
  if a.held then
    local ok_i, err_i = pcall(interrupt)
    if not ok_i then
      a.interrupt_error = tostring(err_i)
    end
    local seen = sync_request('workspace/executeCommand', { command = 'spark.status', arguments = {} }, 10000, buf)
    a.server_saw_it = ok_i and seen ~= nil
    local ok_r, err_r = coroutine.resume(h.co)
    if not ok_r then
      a.reply_error = tostring(err_r)
    end
  end
  wait_for(function() return done end, 20000)
  local tick_done = vim.api.nvim_buf_get_changedtick(0)
  sleep(300)
  a.result = result
  a.quiet_after = vim.api.nvim_buf_get_changedtick(0) == tick_done
  return a
end

--- Whether an interrupted edit ended on its own before the interruption reached the server:
--- written in full ('done'), or its rewrite refused by the server's checks ('… was not applied: …').
local function ended_alone(result)
  local outcome = type(result) == 'table' and result.outcome or nil
  return outcome == 'done' or (type(outcome) == 'string' and outcome:find('was not applied', 1, true) ~= nil)
end

--- Whether the buffer is the attempt's document with `first_line` as its line 1 and the lines
--- around the edited region untouched, the region changed by what was streamed.
local function consistent(a, first_line)
  local now = vim.api.nvim_buf_get_lines(0, 0, -1, false)
  local doc, l1, l2 = a.doc, a.l1, a.l2
  if now[1] ~= first_line then
    return false, 'line 1: ' .. tostring(now[1])
  end
  for i = 2, l1 - 1 do
    if now[i] ~= doc[i] then
      return false, string.format('line %d before the region: %s', i, tostring(now[i]))
    end
  end
  local tail = #doc - l2 -- lines after the region
  for k = 0, tail - 1 do
    if now[#now - k] ~= doc[#doc - k] then
      return false, string.format('line %d after the region: %s', #now - k, tostring(now[#now - k]))
    end
  end
  local region = table.concat(vim.list_slice(now, l1, #now - tail), '\n')
  if region == table.concat(vim.list_slice(doc, l1, l2), '\n') then
    return false, 'the region shows nothing of the streamed edit'
  end
  return true
end

local function scenario()
  vim.cmd('edit ' .. vim.fn.fnameescape(file))
  SAMPLE_TEXT = buf_text()
  local buf = vim.api.nvim_get_current_buf()
  record('filetype', vim.bo.filetype == 'python', vim.bo.filetype)

  local c = wait_for(function() local x = client(); return x and x.initialized and x end, 30000)
  record('server_attached', c ~= nil, c and c.name)
  if not c then
    return
  end
  local loaded = wait_for(function()
    local m = server_metrics()
    return m and m.loaded and m
  end, 120000, 200)
  record('model_loaded', loaded ~= nil, loaded and loaded.model)
  if not loaded then
    return
  end
  record('mode', spark.mode == (os.getenv('SPARK_TEST_EXPECT_MODE') or spark.mode), spark.mode)

  -- 1. Typing shows ghost text from the server ------------------------------------------------
  local last = vim.api.nvim_buf_line_count(buf)
  vim.api.nvim_win_set_cursor(0, { last, 0 })
  vim.api.nvim_input('o<C-u>    ')
  sleep(50)
  local t0 = now_ms()
  local ghost, typed = type_until_ghost('return na', 3000)
  record('ghost_text', ghost ~= nil, { text = ghost, typed_chars = typed, ms = now_ms() - t0 })
  if not ghost then
    return
  end

  -- 2. Accepting inserts it -------------------------------------------------------------------
  local before = buf_text()
  vim.api.nvim_input('<Tab>')
  local accepted = wait_for(function() return buf_text() ~= before end, 3000)
  -- (a random test model's text may hold control characters, which extmarks show as ^X: compare
  -- the printable start of the suggestion)
  local probe = vim.split(ghost, '\n', { plain = true })[1]:match('^[%w%p ]*'):sub(1, 12)
  local after = buf_text()
  record('accept_inserts', accepted ~= nil and #probe > 0 and after:find(probe, 1, true) ~= nil,
    { ghost = ghost, line = vim.api.nvim_get_current_line() })

  -- 2b. Typing what the suggestion shows keeps it (trimmed) with no new request; accepting one
  -- word inserts just that word.
  vim.api.nvim_input('<Esc>o<C-u>    ')
  sleep(50)
  local g2 = type_until_ghost('value = ', 3000)
  if g2 then
    local n_req = vim.tbl_count(req_events)
    local ch = g2:sub(1, 1)
    if spark.mode == 'extmark' and ch:match('[%w%p ]') then
      vim.api.nvim_input(ch == '<' and '<lt>' or ch)
      local trimmed = wait_for(function() return spark.current(0) == g2:sub(2) end, 1000)
      record('typing_through', trimmed ~= nil and vim.tbl_count(req_events) == n_req,
        { ghost = g2, now = spark.current(0), new_requests = vim.tbl_count(req_events) - n_req })
      g2 = spark.current(0) or g2
    end
    local line0 = vim.api.nvim_get_current_line()
    local word = g2:match('^[ \t]*[%w_]+') or g2:match('^[ \t]*[^%w_%s]+') or g2
    vim.api.nvim_input('<C-Right>')
    local grown = wait_for(function() return vim.api.nvim_get_current_line() ~= line0 end, 2000)
    local line1 = vim.api.nvim_get_current_line()
    record('accept_word', grown ~= nil and line1 == line0 .. word:gsub('\n.*', ''),
      { before = line0, after = line1, word = word })
  else
    record('accept_word', false, 'no suggestion to accept a word of')
  end

  -- 3. Typing more cancels the request in flight ------------------------------------------------
  vim.api.nvim_input('<Esc>')
  sleep(400) -- let requests started by the accept settle
  spark.configure({ debounceMs = 600 }) -- keeps each automatic request in flight for 600 ms
  sleep(100)
  local m0 = server_metrics()
  -- (`ret` -> `return`: a word any code model completes, so the newer request has a suggestion;
  -- with token healing an unlikely partial word such as `xy` can rightly get an empty one)
  vim.api.nvim_input('o<C-u>    re')
  local first = wait_for(function() local ids = pending_inline_ids(); return #ids > 0 and ids[1] end, 3000)
  vim.api.nvim_input('t')
  -- cancelled before its answer arrived: events pending → cancel (→ complete when the -32800 comes)
  local cancelled = wait_for(function()
    return first and req_events[first] and req_events[first][2] == 'cancel'
  end, 1000)
  -- ...the newest request still completes and shows a suggestion,
  local newer_done = wait_for(function()
    for id, ev in pairs(req_events) do
      if first and id > first and vim.tbl_contains(ev, 'complete') then
        return true
      end
    end
  end, 5000)
  local later = newer_done and wait_for(function() return spark.current(0) end, 2000)
  record('suggestion_after_cancel', later ~= nil, later)
  -- ...and the cancelled one never reached the model: one model call for the two requests (the
  -- server may not even have started the cancelled one, so it need not count it as a request).
  local m1 = server_metrics()
  record('typing_cancels_inflight', first ~= nil and cancelled ~= nil
    and m1.modelCalls - m0.modelCalls == 1, {
      request = first, events = first and req_events[first],
      inline_requests = m1.inlineRequests - m0.inlineRequests, model_calls = m1.modelCalls - m0.modelCalls,
    })
  spark.configure({ debounceMs = 0 })
  vim.api.nvim_input('<Esc>')
  sleep(100)

  -- 4. A code action edits the buffer (vim.lsp.buf.code_action, as a user picks it) ------------
  vim.api.nvim_win_set_cursor(0, { 4, 4 }) -- inside `def add`
  local titles = {}
  local before_ca = vim.api.nvim_buf_get_lines(0, 0, -1, false)
  local refused_before = #refusals
  vim.lsp.buf.code_action({
    filter = function(a)
      table.insert(titles, a.title)
      return a.title == 'Spark: Add docstring'
    end,
    apply = true,
  })
  local changed = wait_for(function()
    return #vim.api.nvim_buf_get_lines(0, 0, -1, false) ~= #before_ca or #refusals > refused_before
  end, 15000)
  wait_for(function() return next(require('spark.status').progress) == nil end, 15000)
  sleep(200)
  local lines = vim.api.nvim_buf_get_lines(0, 0, -1, false)
  local documented = lines[4]:match('^def add') ~= nil and (lines[5] or ''):match('^%s+"""') ~= nil
  -- or the model's docstring failed the checks: refused with a message, the buffer untouched
  local refused = refused_cleanly(refused_before, table.concat(before_ca, '\n'))
  record('code_action_edits', changed ~= nil and (documented or refused),
    { titles = titles, lines = { unpack(lines, 3, 8) }, refusals = refusals })

  -- 5. A live edit stops when the user types -----------------------------------------------------
  -- The user types (on line 1, outside the region being written) once the first streamed edit is
  -- applied, and the server sees the keystroke before it can write anything more (interrupted_edit),
  -- so the edit is stopped in flight however fast the model is. Only an edit whose first streamed
  -- write was already the whole edit (a model that finished within one flush interval), or one the
  -- model ended before the keystroke came (its rewrite refused by the checks: 'was not applied'),
  -- proves nothing: that attempt is retried (up to 5 times) and reported.
  spark.configure({ maxEditTokens = 400, liveEditHz = 200 })
  sleep(100)
  local attempts = {}
  local ok_live = false
  for attempt = 1, 5 do
    local marker = '# typed by the user ' .. attempt
    local a = interrupted_edit(function()
      vim.api.nvim_win_set_cursor(0, { 1, 0 })
      vim.api.nvim_input('I' .. marker .. '<Esc>')
      -- the keys are typed once Neovim reads its input: wait for them to be in the buffer
      assert(wait_for(function() return buf_text():find(marker, 1, true) ~= nil end, 5000, 1),
        'the typed text did not reach the buffer')
    end)
    local result = a.result
    a.typed_kept = buf_text():find(marker, 1, true) ~= nil
    a.consistent, a.inconsistency = consistent(a, marker .. a.doc[1])
    a.doc = nil
    table.insert(attempts, a)
    local stopped = type(result) == 'table' and result.outcome == 'stopped by the user'
    if not (stopped and result.complete == true) and not ended_alone(result) then
      ok_live = stopped and result.complete == false and a.held and a.first_applied and a.server_saw_it
        and a.quiet_after and a.typed_kept and a.consistent
      break
    end
  end
  record('live_edit_stops_on_typing', ok_live, attempts)

  -- 5b. :SparkCancel stops a streaming edit, given the same way while the first streamed write
  -- waits for its reply. The server stops the generation; one that had already finished when the
  -- cancel came is still written in full ('done') or refused by the checks ('was not applied'):
  -- that attempt is retried, up to 5 times.
  local cancel_attempts = {}
  local ok_cancel = false
  for _ = 1, 5 do
    local a = interrupted_edit(function() vim.cmd('SparkCancel') end)
    local result = a.result
    a.consistent, a.inconsistency = consistent(a, a.doc[1])
    a.doc = nil
    table.insert(cancel_attempts, a)
    local outcome = type(result) == 'table' and result.outcome or nil
    if not ended_alone(result) then
      ok_cancel = outcome ~= nil and a.held and a.first_applied and a.server_saw_it and a.quiet_after
        and a.consistent and result.complete == false and outcome:match('cancel') ~= nil
      break
    end
  end
  record('cancel_command_stops_edit', ok_cancel, cancel_attempts)

  -- 5c. "Edit selection with instruction…" from vim.lsp.buf.code_action(): the plugin asks for the
  -- instruction with vim.ui.input (answered here as a user would type it).
  vim.api.nvim_buf_set_lines(0, 0, -1, false, vim.split(SAMPLE_TEXT, '\n', { plain = true }))
  sleep(200)
  local asked_prompt
  local orig_input = vim.ui.input
  vim.ui.input = function(o, on_confirm)
    asked_prompt = o.prompt
    on_confirm('add type hints')
  end
  vim.api.nvim_win_set_cursor(0, { 5, 4 })
  local before_instr = buf_text()
  local refused_before_instr = #refusals
  vim.lsp.buf.code_action({
    filter = function(a) return a.title == 'Spark: Edit selection with instruction…' end,
    apply = true,
  })
  local instr_changed = wait_for(function()
    return buf_text() ~= before_instr or #refusals > refused_before_instr
  end, 15000)
  wait_for(function() return next(require('spark.status').progress) == nil end, 15000)
  sleep(200)
  vim.ui.input = orig_input
  local instr_done = buf_text() ~= before_instr or refused_cleanly(refused_before_instr, before_instr)
  record('instruction_code_action', asked_prompt ~= nil and instr_changed ~= nil and instr_done,
    { prompt = asked_prompt, lines = vim.api.nvim_buf_get_lines(0, 2, 7, false), refusals = refusals })

  -- 5d. Code actions for a visual selection that ends on an empty line: Neovim sends the range end
  -- as {line = N, character = 1} on a line of length 0 (past its end), which the LSP specification
  -- reads as the line's end. The user selects `def add` charwise down to the empty line after it.
  vim.api.nvim_buf_set_lines(0, 0, -1, false, vim.split(SAMPLE_TEXT, '\n', { plain = true }))
  sleep(200)
  local sel_lines = vim.api.nvim_buf_get_lines(0, 0, -1, false)
  local def_row, blank_row
  for i, l in ipairs(sel_lines) do
    if not def_row and l:match('^def add') then def_row = i end
    if def_row and not blank_row and i > def_row and l == '' then blank_row = i end
  end
  local sent_range, offered
  local c = client()
  local orig_request = c.request
  c.request = function(self, method, params, ...)
    if method == 'textDocument/codeAction' then sent_range = vim.deepcopy(params.range) end
    return orig_request(self, method, params, ...)
  end
  local orig_select = vim.ui.select
  vim.ui.select = function(items, _, on_choice)
    offered = {}
    for _, it in ipairs(items) do
      table.insert(offered, (it.action or it[2] or it).title)
    end
    on_choice(nil)
  end
  vim.api.nvim_win_set_cursor(0, { def_row, 0 })
  vim.api.nvim_input('v' .. string.rep('j', blank_row - def_row))
  assert(wait_for(function() return vim.fn.mode() == 'v' and vim.fn.line('.') == blank_row end, 3000),
    'the visual selection did not reach the empty line')
  vim.lsp.buf.code_action()
  wait_for(function() return offered ~= nil end, 10000)
  vim.ui.select = orig_select
  c.request = orig_request
  vim.api.nvim_input('<Esc>')
  sleep(50)
  record('visual_selection_code_action', offered ~= nil and #offered > 0 and sent_range ~= nil
    and sent_range['end'].line == blank_row - 1 and sent_range['end'].character > 0,
    { range = sent_range, offered = offered, def_row = def_row, blank_row = blank_row })

  -- 6. The other commands ----------------------------------------------------------------------
  local on = spark.is_enabled()
  vim.cmd('SparkToggle')
  local off = spark.is_enabled()
  vim.cmd('SparkToggle')
  record('toggle', on and not off and spark.is_enabled(), { before = on, after = off })
  record('statusline', spark.statusline():match('tok/s') ~= nil, spark.statusline())
  local status_msg = spark_status_showing({ 'tokens/s', 'server:' })
  -- on the engine service, the status and the health check say where the model runs
  local on_service = (vim.json.decode(os.getenv('SPARK_TEST_SETTINGS') or '{}').engine or 'local') ~= 'local'
  record('status_command', status_msg ~= nil
    and status_msg:find(on_service and 'runs: engine service ws://' or 'runs: ', 1, true) ~= nil, status_msg)
  local ok_health, health_err = pcall(vim.cmd, 'checkhealth spark')
  local health = ok_health and table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\n') or health_err
  record('checkhealth', ok_health and health:find('server running', 1, true) ~= nil
    and not health:find('ERROR', 1, true)
    and (not on_service or health:find('engine service: ws://', 1, true) ~= nil), health)

  -- 6b. A backend that does not answer shows in the statusline and :SparkStatus until the server
  -- generates with one that does (here: its own engine again) ----------------------------------
  pcall(vim.cmd, 'tabclose')
  vim.api.nvim_set_current_buf(buf)
  local notify = vim.notify
  vim.notify = function() end -- the server's one error popup (window/showMessage) is expected
  spark.configure({ backend = 'openai', backendUrl = 'http://127.0.0.1:9' })
  local remote = wait_for(function()
    local m = server_metrics()
    return m and m.loaded and type(m.backend) == 'table' and m.backend.kind == 'openai' and m
  end, 30000, 100)
  sync_request('textDocument/inlineCompletion', {
    textDocument = { uri = vim.uri_from_bufnr(buf) },
    position = { line = 0, character = 0 },
    context = { triggerKind = 1 },
  }, 10000, buf)
  local shown = wait_for(function() return spark.statusline() == 'spark unavailable' end, 10000)
  local down_msg = spark_status_showing({ 'UNAVAILABLE: ', 'runs: openai http://127.0.0.1:9' })
  spark.configure({ backend = 'local' })
  local back = wait_for(function()
    local m = server_metrics()
    return m and m.loaded and spark.statusline() ~= 'spark unavailable' and m
  end, 60000, 100)
  vim.notify = notify
  record('backend_down_shown', remote and shown and down_msg ~= nil and back ~= nil,
    { remote = remote ~= nil, shown = shown, status = down_msg, now = spark.statusline() })

  -- 7. A server that stops on its own is started again for the buffers it served ----------------
  pcall(vim.cmd, 'tabclose')
  vim.api.nvim_set_current_buf(buf)
  local old = client()
  local old_id = old and old.id
  if old then
    -- `exit` without `shutdown`: the server ends with status 1 (with `shared`, the session host
    -- ends the session and the editor's process exits 1), as a crashed server would
    require('spark.compat').notify(old, 'exit', nil)
  end
  local again = wait_for(function()
    local x = client()
    return x and x.id ~= old_id and x.initialized and x
  end, 30000)
  local reloaded = again and wait_for(function()
    local m = server_metrics()
    return m and m.loaded and m
  end, 120000, 200)
  local g3
  if reloaded then
    vim.api.nvim_win_set_cursor(0, { vim.api.nvim_buf_line_count(buf), 0 })
    vim.api.nvim_input('<Esc>o<C-u>    ')
    sleep(50)
    g3 = type_until_ghost('return na', 3000)
  end
  record('restarts_after_exit', g3 ~= nil and #restarted == 1,
    { old = old_id, new = again and again.id, ghost = g3, messages = restarted })
end

co = coroutine.create(function()
  local ok, err = xpcall(scenario, debug.traceback)
  if not ok then
    record('scenario_error', false, err)
  end
  finish()
end)
vim.defer_fn(function()
  local ok, err = coroutine.resume(co)
  if not ok then
    record('scenario_error', false, err)
    finish()
  end
end, 10)
-- Hard stop, whatever happens.
vim.defer_fn(function()
  record('scenario_timeout', false, 'scenario did not finish in time')
  finish()
end, tonumber(os.getenv('SPARK_TEST_TIMEOUT_MS') or '240000'))
