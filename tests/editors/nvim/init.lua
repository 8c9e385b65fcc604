-- A user's init.lua, as the tests load it: the plugin on the runtimepath, setup() with options
-- from the environment (the server command, the model, and which ghost-text path to use).
local plugin = assert(os.getenv('SPARK_PLUGIN_DIR'), 'SPARK_PLUGIN_DIR is not set')
vim.opt.runtimepath:prepend(plugin)
vim.opt.swapfile = false
vim.opt.shortmess:append('I')

local settings = vim.json.decode(os.getenv('SPARK_TEST_SETTINGS') or '{}')
require('spark').setup({
  cmd = vim.json.decode((assert(os.getenv('SPARK_TEST_CMD'), 'SPARK_TEST_CMD is not set'))),
  model = os.getenv('SPARK_TEST_MODEL') ~= '' and os.getenv('SPARK_TEST_MODEL') or nil,
  filetypes = { 'python' },
  inline = os.getenv('SPARK_TEST_INLINE') or 'auto',
  settings = settings,
})
