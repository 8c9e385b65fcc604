--- Small shims over the Neovim 0.10 / 0.11 / 0.12 API differences (method-style client calls,
--- str_byteindex signatures), so the rest of the plugin is written once.
local M = {}

M.has_011 = vim.fn.has('nvim-0.11') == 1
M.has_native_inline = vim.lsp.inline_completion ~= nil and vim.lsp.inline_completion.enable ~= nil

--- `client:name(...)` on 0.11+, `client.name(...)` before (0.11 made client calls methods).
local function call(client, name, ...)
  if M.has_011 then
    return client[name](client, ...)
  end
  return client[name](...)
end

function M.request(client, method, params, handler, bufnr)
  return call(client, 'request', method, params, handler, bufnr)
end

function M.request_sync(client, method, params, timeout_ms, bufnr)
  return call(client, 'request_sync', method, params, timeout_ms, bufnr)
end

function M.notify(client, method, params)
  return call(client, 'notify', method, params)
end

function M.is_stopped(client)
  return call(client, 'is_stopped')
end

function M.cancel_request(client, id)
  return call(client, 'cancel_request', id)
end

--- Byte column in `line` of an LSP character offset in `enc` units.
function M.byte_col(line, col, enc)
  if enc == 'utf-8' then
    return math.min(col, #line)
  end
  if M.has_011 then
    return vim.str_byteindex(line, enc, col, false)
  end
  local ok, b = pcall(vim.str_byteindex, line, col, enc == 'utf-16')
  return ok and b or #line
end

--- LSP character offset (in `enc` units) of byte column `bytecol` in `line`.
function M.lsp_col(line, bytecol, enc)
  if enc == 'utf-8' then
    return bytecol
  end
  if M.has_011 then
    return vim.str_utfindex(line, enc, bytecol, false)
  end
  local u32, u16 = vim.str_utfindex(line, bytecol)
  return enc == 'utf-16' and u16 or u32
end

function M.get_clients(filter)
  return (vim.lsp.get_clients or vim.lsp.get_active_clients)(filter)
end

return M
