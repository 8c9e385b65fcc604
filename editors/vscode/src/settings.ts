/**
 * VS Code settings → the server's configuration.
 *
 * Only the keys the server knows are sent (camelCase, under a "spark" section), so client-only
 * settings such as the executable path never show up as "unknown setting" warnings in the log.
 */
import * as vscode from 'vscode';

/** Settings the server reads from initializationOptions / workspace/didChangeConfiguration. */
// Generated from spark_lsp/settings.py by `python -m spark_lsp.editor_settings --write`.
const SERVER_KEYS = [
  'model', 'maxTokens', 'maxEditTokens', 'temperature', 'contextTokens', 'debounceMs', 'answerMs',
  'liveEdits', 'liveEditHz', 'multiline', 'speculative', 'maxLines', 'minConfidence',
  'loadTimeoutS', 'waferChip', 'waferRegion', 'precision', 'tunePrecision', 'neighbourTokens',
  'fimFormat', 'engine', 'backend', 'backendUrl', 'backendModel', 'backendApiKeyEnv',
  'backendApiKeyFile', 'backendTimeoutS', 'fimTemplate',
] as const;

export type ServerSettings = Record<string, unknown>;

/** The server part of the `spark.*` settings; empty strings mean "server default" and are left out. */
export function serverSettings(): ServerSettings {
  const cfg = vscode.workspace.getConfiguration('spark');
  const out: ServerSettings = {};
  for (const key of SERVER_KEYS) {
    const value = cfg.get<unknown>(key);
    if (value === undefined || value === null || value === '') continue;
    out[key] = key === 'model' ? expandHome(String(value)) : value;
  }
  return out;
}

export function inlineEnabled(): boolean {
  return vscode.workspace.getConfiguration('spark').get<boolean>('enableInlineCompletions', true);
}

export async function setInlineEnabled(on: boolean): Promise<void> {
  await vscode.workspace.getConfiguration('spark')
    .update('enableInlineCompletions', on, vscode.ConfigurationTarget.Global);
}

/** A document selector for the configured languages (files and untitled buffers). */
export function documentSelector(): { scheme: string; language?: string }[] {
  const langs = vscode.workspace.getConfiguration('spark').get<string[]>('languages', ['*']);
  const schemes = ['file', 'untitled'];
  if (langs.length === 0 || langs.includes('*')) return schemes.map((scheme) => ({ scheme }));
  return langs.flatMap((language) => schemes.map((scheme) => ({ scheme, language })));
}

/** Whether a configuration change touches something only a server restart applies. */
export function needsRestart(e: vscode.ConfigurationChangeEvent): boolean {
  return ['spark.server.path', 'spark.server.extraArgs', 'spark.server.shared', 'spark.languages']
    .some((s) => e.affectsConfiguration(s));
}

export function expandHome(p: string): string {
  const home = process.env.HOME ?? process.env.USERPROFILE;
  return home && (p === '~' || p.startsWith('~/')) ? home + p.slice(1) : p;
}
