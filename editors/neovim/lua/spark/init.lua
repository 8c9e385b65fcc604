--- spark.nvim: AI inline suggestions and live code-action edits from the spark-lsp server.
---
---   require('spark').setup({ model = '~/models/coder', settings = { maxTokens = 48 } })
---
--- One server process serves every buffer of the configured filetypes (the model loads once).
--- Ghost text uses Neovim 0.12's native vim.lsp.inline_completion when present and extmarks
--- otherwise; code actions arrive through vim.lsp.buf.code_action() like any server's.
local compat = require('spark.compat')
local config = require('spark.config')
local status = require('spark.status')

local M = {}

M.opts = nil -- resolved options once setup() ran
M.mode = nil -- 'native' | 'extmark' | false
local augroup
M._attached = {} -- buffers the server was attached to (re-attached after a restart)
local restarts = {} -- when the server was restarted (vim.uv.now() ms), for the budget below

--- Restarts after the server stopped on its own: at most RESTARTS within RESTART_WINDOW_MS (VS
--- Code's language client allows 4 in 3 minutes), so a server that cannot start is not restarted
--- forever.
M.RESTARTS = 3
M.RESTART_WINDOW_MS = 180000

local function resolve(buf)
  return (buf == nil or buf == 0) and vim.api.nvim_get_current_buf() or buf
end

local function backend()
  if M.mode == 'native' then
    return require('spark.native')
  elseif M.mode == 'extmark' then
    return require('spark.ghost')
  end
  return nil
end

local function pick_mode(inline)
  if inline == false then
    return false
  end
  if inline == 'native' and not compat.has_native_inline then
    vim.notify("spark: inline = 'native' needs Neovim 0.12+; using extmarks", vim.log.levels.WARN)
    return 'extmark'
  end
  if inline == 'auto' then
    return compat.has_native_inline and 'native' or 'extmark'
  end
  return inline
end

local function buf_key(buf, key, fn, desc)
  if not key then
    return
  end
  vim.keymap.set('i', key, function()
    if not fn(buf) then
      -- Nothing to accept: behave like the key would without the plugin.
      vim.api.nvim_feedkeys(vim.api.nvim_replace_termcodes(key, true, false, true), 'n', false)
    end
  end, { buffer = buf, desc = desc, silent = true })
end

local function map_keys(buf)
  local k = M.opts.keys
  local b = backend()
  if not b then
    return
  end
  buf_key(buf, k.accept, b.accept, 'spark: accept suggestion')
  buf_key(buf, k.accept_word, b.accept_word, 'spark: accept one word')
  buf_key(buf, k.accept_line, b.accept_line, 'spark: accept one line')
  if k.dismiss then
    vim.keymap.set('i', k.dismiss, function() b.dismiss(buf) end, { buffer = buf, desc = 'spark: dismiss' })
  end
  if k.trigger then
    vim.keymap.set('i', k.trigger, function() b.trigger(buf) end, { buffer = buf, desc = 'spark: suggest now' })
  end
  if M.mode == 'native' then
    if k.next then
      vim.keymap.set('i', k.next, function() b.select(1) end, { buffer = buf, desc = 'spark: next suggestion' })
    end
    if k.prev then
      vim.keymap.set('i', k.prev, function() b.select(-1) end, { buffer = buf, desc = 'spark: previous suggestion' })
    end
  end
end

--- Client-side handler for the server's "Edit selection with instruction…" code action: the
--- server's command carries [uri, range, "", version]; ask for the instruction, then run it (the
--- version goes along, so a range taken from an older text is refused instead of misapplied).
local function instruction_command(command, ctx)
  local args = command.arguments or {}
  vim.ui.input({ prompt = 'Spark instruction: ' }, function(text)
    if not text or vim.trim(text) == '' then
      return
    end
    local client = vim.lsp.get_client_by_id(ctx.client_id)
    if client then
      compat.request(client, 'workspace/executeCommand', {
        command = 'spark.editWithInstruction', arguments = { args[1], args[2], vim.trim(text), args[4] },
      }, function(err)
        if err then
          vim.notify('spark: ' .. (err.message or ''), vim.log.levels.WARN)
        end
      end, ctx.bufnr)
    end
  end)
end

local function on_attach(client, buf)
  M._attached[buf] = true
  local b = backend()
  if b then
    if M.mode == 'native' then
      b.attach(buf, client)
    else
      b.attach(buf, M.opts)
    end
    map_keys(buf)
  end
end

--- The vim.lsp.start() config.
function M.client_config(buf)
  local o = M.opts
  local settings = config.server_settings(o)
  local root = vim.fs.root and vim.fs.root(buf, o.root_markers) or nil
  return {
    name = 'spark',
    cmd = config.server_cmd(o),
    root_dir = root or vim.fn.getcwd(),
    init_options = settings,
    settings = { spark = settings },
    flags = { debounce_text_changes = o.debounce_text_changes },
    handlers = {
      ['spark/status'] = status.handler,
      ['$/progress'] = status.progress_handler,
    },
    commands = { ['spark.editWithInstruction'] = instruction_command },
    on_attach = on_attach,
    on_exit = function(code, signal) M._on_exit(code, signal) end,
  }
end

--- The server process ended. Neovim does not start a server again by itself, so one that stopped
--- on its own (a non-zero status: a crash, or `--shared`'s session host gone; or a signal other
--- than the SIGTERM of a deliberate :LspStop!) is started again for the buffers it served,
--- within the restart budget. A clean exit (after shutdown) or Neovim quitting is left alone.
function M._on_exit(code, signal)
  signal = signal or 0
  status.engine, status.error = nil, nil -- the next server has its own engine
  if (code == 0 and signal == 0) or signal == 15 then
    return
  end
  vim.schedule(function()
    if vim.v.exiting ~= vim.NIL or not M.opts then
      return
    end
    local now = (vim.uv or vim.loop).now()
    restarts = vim.tbl_filter(function(t) return now - t < M.RESTART_WINDOW_MS end, restarts)
    local why = signal ~= 0 and ('signal ' .. signal) or ('status ' .. code)
    if #restarts >= M.RESTARTS then
      vim.notify(string.format('spark: the server stopped (%s), %d times in %d minutes: not '
        .. 'restarting it (:edit a buffer to try again)', why, #restarts + 1,
        M.RESTART_WINDOW_MS / 60000), vim.log.levels.ERROR)
      return
    end
    table.insert(restarts, now)
    local bufs = vim.tbl_keys(M._attached)
    M._attached = {}
    for _, buf in ipairs(bufs) do
      if vim.api.nvim_buf_is_loaded(buf) then
        M.attach(buf)
      end
    end
    vim.notify('spark: the server stopped (' .. why .. '); started it again', vim.log.levels.WARN)
  end)
end

local function wants(buf)
  if vim.bo[buf].buftype ~= '' then
    return false
  end
  local ft = vim.bo[buf].filetype
  local fts = M.opts.filetypes
  return vim.tbl_contains(fts, '*') and ft ~= '' or vim.tbl_contains(fts, ft)
end

--- Start (or reuse) the server for `buf`; returns the client id or nil.
function M.attach(buf)
  buf = (buf == nil or buf == 0) and vim.api.nvim_get_current_buf() or buf
  if not M.opts or not wants(buf) then
    return nil
  end
  return vim.lsp.start(M.client_config(buf), {
    bufnr = buf,
    -- One server for every buffer: the model is loaded once (not one that has stopped: after
    -- a restart, Neovim 0.11 still lists it for a moment).
    reuse_client = function(client, cfg)
      return client.name == cfg.name and not compat.is_stopped(client)
    end,
  })
end

function M.setup(opts)
  M.opts = config.resolve(opts)
  M.mode = pick_mode(M.opts.inline)
  vim.api.nvim_set_hl(0, 'SparkGhost', { link = 'Comment', default = true })
  if M.opts.on_status then
    status.on_update(M.opts.on_status)
  end
  augroup = vim.api.nvim_create_augroup('spark', { clear = true })
  vim.api.nvim_create_autocmd('FileType', {
    group = augroup,
    callback = function(ev) M.attach(ev.buf) end,
  })
  -- Buffers already open when setup() runs.
  for _, buf in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(buf) then
      M.attach(buf)
    end
  end
  -- A later setup() call with new settings reaches a running server.
  if #compat.get_clients({ name = 'spark' }) > 0 then
    M.configure(M.opts.settings)
  end
  return M
end

--- Change server settings at run time (workspace/didChangeConfiguration).
function M.configure(settings)
  if not M.opts then
    error('spark: call require("spark").setup() first', 0)
  end
  M.opts.settings = vim.tbl_extend('force', M.opts.settings, settings or {})
  local s = config.server_settings(M.opts)
  for _, client in ipairs(compat.get_clients({ name = 'spark' })) do
    client.config.settings = { spark = s }
    compat.notify(client, 'workspace/didChangeConfiguration', { settings = { spark = s } })
  end
end

--- Inline suggestions on/off (code actions stay available).
function M.toggle(on)
  local b = backend()
  if not b then
    vim.notify('spark: inline suggestions are disabled in setup()', vim.log.levels.INFO)
    return false
  end
  if on == nil then
    on = not b.is_enabled()
  end
  b.set_enabled(on)
  vim.notify('spark: inline suggestions ' .. (on and 'on' or 'off'))
  return on
end

function M.is_enabled()
  local b = backend()
  return b ~= nil and b.is_enabled()
end

--- The suggestion shown in `buf`, or nil.
function M.current(buf)
  local b = backend()
  return b and b.current(resolve(buf)) or nil
end

function M.accept(buf)
  local b = backend()
  return b ~= nil and b.accept(resolve(buf))
end

function M.accept_word(buf)
  local b = backend()
  return b ~= nil and b.accept_word(resolve(buf))
end

function M.dismiss(buf)
  local b = backend()
  if b then
    b.dismiss(resolve(buf))
  end
end

function M.trigger(buf)
  local b = backend()
  if b then
    b.trigger(resolve(buf))
  end
end

function M.edit(instruction, l1, l2, use_visual, cb)
  return require('spark.edit').edit(instruction, l1, l2, use_visual, cb)
end

function M.cancel(buf)
  return require('spark.edit').cancel(buf)
end

--- Show the last generation's figures and the server's counters.
function M.status()
  local buf = vim.api.nvim_get_current_buf()
  local client = compat.get_clients({ bufnr = buf, name = 'spark' })[1]
    or compat.get_clients({ name = 'spark' })[1]
  local function show(metrics)
    local lines = status.describe(metrics)
    table.insert(lines, 1, string.format('spark: inline %s (%s)', M.is_enabled() and 'on' or 'off',
      M.mode or 'disabled'))
    vim.api.nvim_echo({ { table.concat(lines, '\n') } }, true, {})
  end
  if not client then
    show(nil)
    return
  end
  compat.request(client, 'workspace/executeCommand', { command = 'spark.status', arguments = {} },
    function(err, result) show(not err and result or nil) end, buf)
end

M.statusline = status.statusline

return M
