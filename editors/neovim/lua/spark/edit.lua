--- :SparkEdit (edit a range following an instruction) and cancelling live edits.
---
--- The server streams the edit into the buffer with workspace/applyEdit under a work-done
--- progress; typing in the buffer stops it (the server sees the didChange), and cancel() stops it
--- explicitly through the progress token and the server's spark.cancel command.
local compat = require('spark.compat')
local status = require('spark.status')

local M = {}

local function spark_client(buf)
  return compat.get_clients({ bufnr = buf, name = 'spark' })[1]
end

--- LSP range of lines [l1, l2] (1-based, inclusive) or, for a charwise visual selection, of it.
local function range_of(buf, l1, l2, use_visual, enc)
  local function lsp_pos(row, bytecol)
    local line = vim.api.nvim_buf_get_lines(buf, row, row + 1, false)[1] or ''
    return { line = row, character = compat.lsp_col(line, math.min(bytecol, #line), enc) }
  end
  if use_visual and vim.fn.visualmode() == 'v' then
    local s, e = vim.fn.getpos("'<"), vim.fn.getpos("'>")
    local erow = e[2] - 1
    local eline = vim.api.nvim_buf_get_lines(buf, erow, erow + 1, false)[1] or ''
    -- '> is the last selected character (inclusive): include all its bytes.
    local ecol = math.min(e[3], #eline)
    local ch = vim.fn.strpart(eline, e[3] - 1, 1, true)
    if ch ~= '' then
      ecol = math.min(e[3] - 1 + #ch, #eline)
    end
    return { start = lsp_pos(s[2] - 1, s[3] - 1), ['end'] = lsp_pos(erow, ecol) }
  end
  local last = vim.api.nvim_buf_get_lines(buf, l2 - 1, l2, false)[1] or ''
  return { start = { line = l1 - 1, character = 0 }, ['end'] = lsp_pos(l2 - 1, #last) }
end

--- Edit lines l1..l2 of the current buffer following `instruction`; `cb(err, result)` when done.
function M.edit(instruction, l1, l2, use_visual, cb)
  local buf = vim.api.nvim_get_current_buf()
  local client = spark_client(buf)
  if not client then
    vim.notify('spark: no spark-lsp client attached to this buffer', vim.log.levels.WARN)
    return false
  end
  if type(instruction) ~= 'string' or vim.trim(instruction) == '' then
    vim.notify('spark: :SparkEdit needs an instruction, e.g. :SparkEdit add type hints', vim.log.levels.WARN)
    return false
  end
  local enc = client.offset_encoding or 'utf-16'
  local range = range_of(buf, l1, l2, use_visual, enc)
  local uri = vim.uri_from_bufnr(buf)
  compat.request(client, 'workspace/executeCommand', {
    command = 'spark.editWithInstruction',
    arguments = { uri, range, vim.trim(instruction) },
  }, function(err, result)
    if err then
      vim.notify('spark: ' .. (err.message or vim.inspect(err)), vim.log.levels.WARN)
    end
    if cb then
      cb(err, result)
    end
  end, buf)
  return true
end

--- Stop every running generation of the spark server (live edits and suggestions).
function M.cancel(buf)
  buf = buf or vim.api.nvim_get_current_buf()
  local n = 0
  for token, p in pairs(status.progress) do
    local client = vim.lsp.get_client_by_id(p.client_id)
    if client then
      compat.notify(client, 'window/workDoneProgress/cancel', { token = token })
      n = n + 1
    end
  end
  local client = spark_client(buf)
  if client then
    compat.request(client, 'workspace/executeCommand', {
      command = 'spark.cancel', arguments = { vim.uri_from_bufnr(buf) },
    }, function() end, buf)
  end
  return n
end

return M
