--- Partial acceptance of a suggestion, shared by the native and the extmark ghost-text paths so
--- that "accept word" / "accept line" take the same text in both.
local M = {}

--- A word (identifier, or a run of punctuation), or a line break with the next indentation.
M.WORD = { '^[ \t]*[%w_]+', '^[ \t]*[^%w_%s]+', '^[ \t]*\n[ \t]*' }
--- The rest of the current line, its newline included.
M.LINE = { '^[^\n]*\n', '^[^\n]+' }

--- The leading part of `text` matched by the first pattern that matches; all of `text` otherwise.
function M.leading(text, patterns)
  for _, pat in ipairs(patterns) do
    local part = text:match(pat)
    if part and part ~= '' then
      return part
    end
  end
  return text
end

return M
