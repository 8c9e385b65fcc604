-- spark.nvim commands. The server starts only after require('spark').setup({...}).
if vim.g.loaded_spark then
  return
end
vim.g.loaded_spark = true

local function spark()
  local s = require('spark')
  if not s.opts then
    vim.notify('spark: call require("spark").setup() first', vim.log.levels.WARN)
    return nil
  end
  return s
end

vim.api.nvim_create_user_command('SparkEdit', function(a)
  local s = spark()
  if s then
    s.edit(a.args, a.line1, a.line2, a.range == 2)
  end
end, { nargs = '+', range = true, desc = 'spark: edit the range/selection following an instruction' })

vim.api.nvim_create_user_command('SparkToggle', function()
  local s = spark()
  if s then
    s.toggle()
  end
end, { desc = 'spark: inline suggestions on/off' })

vim.api.nvim_create_user_command('SparkStatus', function()
  local s = spark()
  if s then
    s.status()
  end
end, { desc = 'spark: last generation figures and server counters' })

vim.api.nvim_create_user_command('SparkCancel', function()
  local s = spark()
  if s then
    s.cancel()
  end
end, { desc = 'spark: stop the running generation / live edit' })
