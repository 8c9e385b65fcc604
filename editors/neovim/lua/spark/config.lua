--- Options of require('spark').setup() with their defaults, validated so that a typo names the
--- option instead of failing later inside a callback.
local M = {}

M.defaults = {
  -- Server command. nil: `spark-lsp serve --stdio` if spark-lsp is executable, else
  -- `python3 -m spark_lsp.cli serve --stdio`.
  cmd = nil,
  -- true: `spark-lsp serve --stdio --shared`, a small bridge to your session host (one process
  -- that runs every editor's session with one copy of each model; docs/service.md). Not used
  -- with `cmd`.
  shared = false,
  -- Model: a folder, a .gguf file, a catalogue name (`spark-lsp models list`) or
  -- 'hf:ORG/REPO[:FILE.gguf]' (downloaded on first use); nil/'' = the bundled default model
  -- (with `engine` a ws:// URL: the service's first model).
  -- Sent as the `model` setting.
  model = nil,
  -- Filetypes to attach to; '*' attaches to every normal file buffer.
  filetypes = { 'python', 'lua', 'javascript', 'typescript', 'javascriptreact', 'typescriptreact',
    'c', 'cpp', 'rust', 'go', 'java', 'sh', 'ruby', 'zig' },
  root_markers = { '.git', 'pyproject.toml', 'package.json', 'Cargo.toml', 'go.mod' },
  -- Ghost text: 'auto' (native vim.lsp.inline_completion on Neovim 0.12+, extmarks before),
  -- 'native', 'extmark', or false for none (code actions and :SparkEdit still work).
  inline = 'auto',
  -- Client-side debounce of automatic requests in the extmark path (ms).
  debounce_ms = 60,
  -- How long Neovim batches didChange notifications (ms); small so typing stops a live edit fast.
  debounce_text_changes = 20,
  -- Insert-mode keys; false disables one.
  keys = {
    accept = '<Tab>',
    accept_word = '<C-Right>',
    accept_line = '<C-Down>',
    dismiss = '<C-]>',
    trigger = '<M-\\>',
    next = '<M-]>',
    prev = '<M-[>',
  },
  -- Server settings (camelCase): see M.server_settings_spec below and docs/settings.md.
  settings = {},
  -- Called with each `spark/status` payload (e.g. to refresh a statusline).
  on_status = nil,
}

-- BEGIN server settings
-- Generated from spark_lsp/settings.py by `python -m spark_lsp.editor_settings --write`; do not edit.
-- The server's settings (`settings` above), their types and server-side defaults.
M.server_settings_spec = {
  { name = 'model', type = 'string' },
  { name = 'maxTokens', type = 'number', default = 64 },
  { name = 'maxEditTokens', type = 'number', default = 384 },
  { name = 'temperature', type = 'number', default = 0 },
  { name = 'contextTokens', type = 'number', default = 1024 },
  { name = 'debounceMs', type = 'number', default = 0 },
  { name = 'answerMs', type = 'number', default = 100 },
  { name = 'liveEdits', type = 'boolean', default = true },
  { name = 'liveEditHz', type = 'number', default = 20 },
  { name = 'multiline', type = 'boolean', default = true },
  { name = 'speculative', type = 'boolean', default = true },
  { name = 'maxLines', type = 'number', default = 12 },
  { name = 'minConfidence', type = 'number', default = 1e-06 },
  { name = 'loadTimeoutS', type = 'number', default = 120 },
  { name = 'waferChip', type = 'string' },
  { name = 'waferRegion', type = { 'string', 'table' } },
  { name = 'precision', type = 'string', default = 'auto' },
  { name = 'tunePrecision', type = 'boolean', default = true },
  { name = 'neighbourTokens', type = 'number', default = 0 },
  { name = 'fimFormat', type = 'string', default = 'auto' },
  { name = 'engine', type = 'string', default = 'local' },
  { name = 'backend', type = 'string', default = 'local' },
  { name = 'backendUrl', type = 'string' },
  { name = 'backendModel', type = 'string' },
  { name = 'backendApiKeyEnv', type = 'string' },
  { name = 'backendApiKeyFile', type = 'string' },
  { name = 'backendTimeoutS', type = 'number', default = 30 },
  { name = 'fimTemplate', type = 'string' },
}
-- END server settings

local function check(name, value, types, optional)
  if value == nil and optional then
    return
  end
  local t = type(value)
  for _, want in ipairs(type(types) == 'table' and types or { types }) do
    if t == want then
      return
    end
  end
  error(string.format('spark.setup: option %q must be %s, got %s', name,
    table.concat(type(types) == 'table' and types or { types }, ' or '), vim.inspect(value)), 0)
end

--- Merged and validated options (raises an error naming the bad option).
function M.resolve(opts)
  check('opts', opts, 'table', true)
  local o = vim.tbl_deep_extend('force', vim.deepcopy(M.defaults), opts or {})
  check('cmd', o.cmd, { 'table', 'string' }, true)
  check('model', o.model, 'string', true)
  check('shared', o.shared, 'boolean')
  check('filetypes', o.filetypes, { 'table', 'string' })
  check('root_markers', o.root_markers, 'table')
  check('debounce_ms', o.debounce_ms, 'number')
  check('debounce_text_changes', o.debounce_text_changes, 'number')
  check('keys', o.keys, 'table')
  check('settings', o.settings, 'table')
  for _, s in ipairs(M.server_settings_spec) do
    check('settings.' .. s.name, o.settings[s.name], s.type, true)
  end
  check('on_status', o.on_status, 'function', true)
  if not vim.tbl_contains({ 'auto', 'native', 'extmark', false }, o.inline) then
    error(string.format("spark.setup: option 'inline' must be 'auto', 'native', 'extmark' or false, got %s",
      vim.inspect(o.inline)), 0)
  end
  for k, v in pairs(o.keys) do
    if v ~= false then
      check('keys.' .. k, v, 'string')
    end
  end
  if type(o.filetypes) == 'string' then
    o.filetypes = { o.filetypes }
  end
  if type(o.cmd) == 'string' then
    o.cmd = { o.cmd }
  end
  return o
end

--- The settings object the server receives (initializationOptions / didChangeConfiguration).
function M.server_settings(o)
  local s = vim.deepcopy(o.settings)
  if o.model and o.model ~= '' then
    s.model = vim.fs.normalize(o.model)
  end
  return s
end

--- The server command line.
function M.server_cmd(o)
  local cmd
  if o.cmd then
    cmd = vim.deepcopy(o.cmd)
  elseif vim.fn.executable('spark-lsp') == 1 then
    cmd = { 'spark-lsp', 'serve', '--stdio' }
  else
    local py = vim.fn.executable('python3') == 1 and 'python3' or 'python'
    cmd = { py, '-m', 'spark_lsp.cli', 'serve', '--stdio' }
  end
  -- also with the `cmd` `spark-lsp editor neovim` prints: `shared` must not be lost beside it
  if o.shared and not vim.tbl_contains(cmd, '--shared') then
    table.insert(cmd, '--shared')
  end
  return cmd
end

return M
