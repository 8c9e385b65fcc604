-- A user's init.lua, as the tests load it: the lines `spark-lsp editor neovim` printed (the plugin
-- on the runtimepath, setup() with this installation's absolute server command), then the tests'
-- own options (the model, which ghost-text path to use, a server log) added to that setup().
local snippet = assert(os.getenv('SPARK_SETUP_SNIPPET'), 'SPARK_SETUP_SNIPPET is not set')
vim.opt.swapfile = false
vim.opt.shortmess:append('I')

-- run the printed lines as written, keeping the options they pass to setup()
local printed
package.loaded['spark'] = { setup = function(opts) printed = opts end }
dofile(snippet)
package.loaded['spark'] = nil
assert(printed and printed.cmd, 'the printed lines did not call setup() with a cmd')

local cmd = vim.deepcopy(printed.cmd)
vim.list_extend(cmd, vim.json.decode(os.getenv('SPARK_TEST_CMD_EXTRA') or '[]'))
local settings = vim.json.decode(os.getenv('SPARK_TEST_SETTINGS') or '{}')
-- every suggestion, however unsure: the scenario needs ghost text from a small or random model
if settings.minConfidence == nil then
  settings.minConfidence = 0
end
require('spark').setup({
  cmd = cmd,
  model = os.getenv('SPARK_TEST_MODEL') ~= '' and os.getenv('SPARK_TEST_MODEL') or nil,
  filetypes = { 'python' },
  inline = os.getenv('SPARK_TEST_INLINE') or 'auto',
  shared = os.getenv('SPARK_TEST_SHARED') == '1',
  settings = settings,
})
