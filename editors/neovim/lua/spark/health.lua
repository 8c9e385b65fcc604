--- :checkhealth spark
local M = {}

function M.check()
  local h = vim.health
  h.start('spark: Neovim')
  local v = vim.version()
  local vs = string.format('%d.%d.%d', v.major, v.minor, v.patch)
  if vim.fn.has('nvim-0.10') == 0 then
    h.error('Neovim ' .. vs .. ' is too old: spark needs 0.10+ (inline virtual text)')
  elseif require('spark.compat').has_native_inline then
    h.ok('Neovim ' .. vs .. ': native vim.lsp.inline_completion available')
  else
    h.ok('Neovim ' .. vs .. ': ghost text drawn with extmarks (0.12+ would use the native API)')
  end

  h.start('spark: setup')
  local spark = require('spark')
  if not spark.opts then
    h.warn('require("spark").setup() has not been called', { 'Add require("spark").setup({}) to your init.lua' })
    return
  end
  h.ok('inline suggestions: ' .. tostring(spark.mode) .. (spark.is_enabled() and ' (on)' or ' (off)'))
  h.info('filetypes: ' .. table.concat(spark.opts.filetypes, ', '))

  h.start('spark: server')
  local cmd = require('spark.config').server_cmd(spark.opts)
  if vim.fn.executable(cmd[1]) == 1 then
    h.ok('server command: ' .. table.concat(cmd, ' '))
    if cmd[1]:match('python') then
      local out = vim.fn.system({ cmd[1], '-c', 'import spark_lsp, pygls; print(spark_lsp.__version__)' })
      if vim.v.shell_error == 0 then
        h.ok('spark_lsp ' .. vim.trim(out) .. ' importable by ' .. cmd[1])
      else
        h.error('spark_lsp is not importable by ' .. cmd[1], { 'install it into that Python: pip install -e . in the spark-lsp clone (or pip install the wheel),',
          'or use the cmd that `spark-lsp editor neovim` prints' })
      end
    end
  else
    h.error('server command not found: ' .. cmd[1],
      { 'run `spark-lsp editor neovim` where spark-lsp is installed (pip install -e . in the clone) and',
        'copy the setup{} it prints: its cmd is that installation\'s absolute command' })
  end
  local model = spark.opts.model
  if model and model ~= '' then
    local path = vim.fs.normalize(model)
    if vim.fn.filereadable(path .. '/config.json') == 1 then
      h.ok('model folder: ' .. path)
    elseif path:match('%.gguf$') and vim.fn.filereadable(path) == 1 then
      h.ok('model file (GGUF): ' .. path)
    elseif model:match('^hf:') or (not model:find('^[/~.]') and vim.fn.isdirectory(path) == 0) then
      h.info('model from the Hugging Face Hub (downloaded on first use): ' .. model
        .. '; `spark-lsp models info ' .. model .. '` shows its size')
    else
      h.error('model is neither a folder with config.json nor a .gguf file: ' .. path)
    end
  else
    h.info('model: the bundled default')
  end
  local clients = require('spark.compat').get_clients({ name = 'spark' })
  if #clients > 0 then
    local c = clients[1]
    h.ok(string.format('server running (client id %d)', c.id))
    local caps = c.server_capabilities or {}
    h.info('inlineCompletionProvider: ' .. tostring(caps.inlineCompletionProvider ~= nil)
      .. ', codeActionProvider: ' .. tostring(caps.codeActionProvider ~= nil))
    local compat = require('spark.compat')
    local res = compat.request_sync(c, 'workspace/executeCommand',
      { command = 'spark.status', arguments = {} }, 3000, 0)
    local e = res and res.result and res.result.engine
    if type(e) == 'table' and e.target ~= nil then -- the engine service (`engine` auto or ws://)
      if e.connected then
        h.ok(string.format('engine service: %s (%s; setting %s)', tostring(e.engine),
          tostring(res.result.model), tostring(e.target)))
      else
        h.warn(string.format('engine service %s not connected (%s failure(s) in a row)',
          tostring(e.engine), tostring(e.failures)),
          { '`spark-lsp engine list` shows your daemons; `spark-lsp engine list URL` asks a given one' })
      end
    elseif type(e) == 'table' and e.engine == 'local (fallback)' then
      h.warn('engine: in-process fallback (the engine service could not be reached)')
    end
  else
    h.info('server not running yet (starts when a buffer of a configured filetype opens)')
  end
end

return M
