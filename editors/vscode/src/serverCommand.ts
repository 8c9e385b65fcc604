/**
 * Finding the `spark-lsp` executable.
 *
 * Order: the `spark.server.path` setting, then a `.venv` in a workspace folder (where a developer
 * ran `pip install -e .`), then PATH, then `python3 -m spark_lsp.cli` as a last resort. The client
 * appends `--stdio` itself (vscode-languageclient 11 with TransportKind.stdio).
 */
import * as fs from 'fs';
import * as path from 'path';
import * as vscode from 'vscode';
import { expandHome } from './settings';

export interface ServerCommand {
  command: string;
  args: string[];
  /** How the command was found, for the log. */
  source: string;
}

const isWindows = process.platform === 'win32';

function isExecutable(file: string): boolean {
  try {
    fs.accessSync(file, fs.constants.X_OK);
    return fs.statSync(file).isFile();
  } catch {
    return false;
  }
}

/** `name` resolved against PATH, or undefined. */
export function which(name: string, envPath = process.env.PATH ?? ''): string | undefined {
  const exts = isWindows ? ['.exe', '.cmd', '.bat', ''] : [''];
  for (const dir of envPath.split(path.delimiter)) {
    if (!dir) continue;
    for (const ext of exts) {
      const candidate = path.join(dir, name + ext);
      if (isExecutable(candidate)) return candidate;
    }
  }
  return undefined;
}

export function resolveServerCommand(): ServerCommand {
  const cfg = vscode.workspace.getConfiguration('spark');
  const extra = cfg.get<string[]>('server.extraArgs', []);
  const shared = cfg.get<boolean>('server.shared', false) && !extra.includes('--shared');
  const serve = ['serve', ...(shared ? ['--shared'] : []), ...extra];

  const configured = cfg.get<string>('server.path', '').trim();
  if (configured) {
    const file = expandHome(configured);
    const resolved = file.includes(path.sep) ? file : (which(file) ?? file);
    return { command: resolved, args: serve, source: 'setting spark.server.path' };
  }

  const bin = isWindows ? path.join('.venv', 'Scripts', 'spark-lsp.exe') : path.join('.venv', 'bin', 'spark-lsp');
  for (const folder of vscode.workspace.workspaceFolders ?? []) {
    const candidate = path.join(folder.uri.fsPath, bin);
    if (isExecutable(candidate)) return { command: candidate, args: serve, source: `workspace ${folder.name}/.venv` };
  }

  const onPath = which('spark-lsp');
  if (onPath) return { command: onPath, args: serve, source: 'PATH' };

  const python = which('python3') ?? which('python') ?? 'python3';
  return { command: python, args: ['-m', 'spark_lsp.cli', ...serve], source: 'python -m fallback (spark-lsp not on PATH)' };
}
