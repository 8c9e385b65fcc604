/**
 * Spark LSP for VS Code: starts `spark-lsp serve` over stdio and wires its inline completions,
 * code actions, live edits and `spark/status` figures into the editor.
 *
 * Inline completions and code actions come straight from vscode-languageclient 11 (standard LSP
 * 3.18 `textDocument/inlineCompletion`); this file adds the on/off toggle, the instruction prompt
 * for "Edit selection with instruction…", cancellation of live edits and the status bar item.
 */
import * as vscode from 'vscode';
import {
  LanguageClient, LanguageClientOptions, ServerOptions, State, TransportKind,
  DidChangeConfigurationNotification, ExecuteCommandRequest,
} from 'vscode-languageclient/node';
import { ProgressTracker } from './progress';
import { resolveServerCommand } from './serverCommand';
import { documentSelector, inlineEnabled, needsRestart, serverSettings, setInlineEnabled } from './settings';
import { SparkStatus, StatusItem } from './status';

/** Server commands (spark_lsp/server.py) that the client handles specially. */
const EDIT_WITH_INSTRUCTION = 'spark.editWithInstruction';
const CANCEL = 'spark.cancel';
/** Server request: its copy of a document ({uri} -> {uri, version, text}). */
const DOCUMENT = 'spark/document';

let client: LanguageClient | undefined;
let progress: ProgressTracker | undefined;
let status: StatusItem;
let output: vscode.LogOutputChannel;

export async function activate(ctx: vscode.ExtensionContext): Promise<void> {
  output = vscode.window.createOutputChannel('Spark LSP', { log: true });
  status = new StatusItem('sparkLsp.toggle');
  status.setEnabled(inlineEnabled());
  ctx.subscriptions.push(output, status);

  const reg = (id: string, fn: (...args: any[]) => unknown) => ctx.subscriptions.push(vscode.commands.registerCommand(id, fn));
  reg('sparkLsp.toggle', async () => {
    const on = !inlineEnabled();
    await setInlineEnabled(on);
    status.setEnabled(on);
  });
  reg('sparkLsp.triggerSuggestion', () => vscode.commands.executeCommand('editor.action.inlineSuggest.trigger'));
  reg('sparkLsp.editSelection', () => editSelection());
  reg('sparkLsp.cancel', () => cancelGeneration());
  reg('sparkLsp.restartServer', async () => { await stopClient(); await startClient(ctx); });
  reg('sparkLsp.showLog', () => output.show(true));
  reg('sparkLsp.checkDocument', () => checkDocument());

  ctx.subscriptions.push(vscode.workspace.onDidChangeConfiguration(async (e) => {
    if (!e.affectsConfiguration('spark')) return;
    status.setEnabled(inlineEnabled());
    if (needsRestart(e)) {
      output.info('[client] server settings changed; restarting the server');
      await stopClient();
      await startClient(ctx);
    } else if (client?.isRunning()) {
      await client.sendNotification(DidChangeConfigurationNotification.type, { settings: { spark: serverSettings() } });
    }
  }));

  await startClient(ctx);
}

async function startClient(ctx: vscode.ExtensionContext): Promise<void> {
  const server = resolveServerCommand();
  output.info(`[client] starting ${server.command} ${server.args.join(' ')} --stdio (${server.source})`);
  const serverOptions: ServerOptions = {
    command: server.command,
    args: server.args,
    transport: TransportKind.stdio,
    options: { env: { ...process.env, PYTHONUNBUFFERED: '1' } },
  };
  const clientOptions: LanguageClientOptions = {
    documentSelector: documentSelector(),
    outputChannel: output,
    traceOutputChannel: vscode.window.createOutputChannel('Spark LSP Trace', { log: true }),
    initializationOptions: serverSettings(),
    middleware: {
      // The toggle silences automatic suggestions; an explicit trigger (Alt+\) still asks.
      provideInlineCompletionItems: (document, position, context, token, next) => {
        if (!inlineEnabled() && context.triggerKind !== vscode.InlineCompletionTriggerKind.Invoke) return null;
        return next(document, position, context, token);
      },
      // A code action whose command edits with an instruction needs the instruction first.
      executeCommand: async (command, args, next) => {
        if (command === EDIT_WITH_INSTRUCTION) {
          const withInstruction = await askInstruction(args);
          if (!withInstruction) return undefined;
          return next(command, withInstruction);
        }
        return next(command, args);
      },
    },
  };
  const c = new LanguageClient('spark', 'Spark LSP', serverOptions, clientOptions);
  client = c;
  c.onDidChangeState((e) => {
    status.setState(e.newState === State.Running ? 'ready' : e.newState === State.Starting ? 'starting' : 'stopped');
  });
  try {
    await c.start();
  } catch (err) {
    status.setState('error');
    output.info(`[client] the server failed to start: ${err}`);
    void vscode.window.showErrorMessage(
      `Spark LSP: could not start "${server.command}". Install it (pip install -e . in the spark-lsp clone, or pip install the wheel), or set spark.server.path.`,
      'Open Settings', 'Show Log',
    ).then((pick) => {
      if (pick === 'Open Settings') void vscode.commands.executeCommand('workbench.action.openSettings', 'spark.server');
      if (pick === 'Show Log') output.show(true);
    });
    return;
  }
  c.onNotification('spark/status', (s: SparkStatus) => status.update(s));
  progress = new ProgressTracker(c);
  progress.install();
  progress.onDidChange(({ generating, other }) => {
    status.setGenerating(generating > 0);
    status.setState(other > 0 ? 'loading' : 'ready');
    void vscode.commands.executeCommand('setContext', 'spark.generating', generating > 0);
  });
  ctx.subscriptions.push(progress);
}

async function stopClient(): Promise<void> {
  const c = client;
  client = undefined;
  progress?.dispose();
  progress = undefined;
  if (c) {
    try { await c.stop(2000); } catch (err) { output.info(`[client] stop: ${err}`); }
  }
}

/**
 * The args of spark.editWithInstruction, `[uri, range, instruction, version]`: the server's code
 * action carries `[uri, range, "", version]`, so the instruction is asked for here (the version of
 * the text the range was taken from goes along: the user may type while the box is open, and the
 * server then refuses the stale range). Undefined when the user gives up.
 */
async function askInstruction(args: any[]): Promise<any[] | undefined> {
  if (args?.length >= 3 && typeof args[2] === 'string' && args[2].trim()) return args;
  const instruction = await vscode.window.showInputBox({
    title: 'Spark: Edit selection with instruction',
    prompt: 'What should change? (e.g. "use a list comprehension", "add type hints")',
    placeHolder: 'instruction',
    ignoreFocusOut: true,
  });
  if (!instruction?.trim()) return undefined;
  return [args[0], args[1], instruction.trim(), ...args.slice(3, 4)];
}

async function editSelection(): Promise<void> {
  const editor = vscode.window.activeTextEditor;
  if (!editor || !client?.isRunning()) {
    void vscode.window.showWarningMessage('Spark: open a file and wait for the server to start.');
    return;
  }
  const args = await askInstruction([
    client.code2ProtocolConverter.asUri(editor.document.uri),
    client.code2ProtocolConverter.asRange(editor.selection),
    '',
    editor.document.version,
  ]);
  if (!args) return;
  try {
    await client.sendRequest(ExecuteCommandRequest.type, { command: EDIT_WITH_INSTRUCTION, arguments: args });
  } catch (err: any) {
    void vscode.window.showErrorMessage(`Spark: ${err?.message ?? err}`);
  }
}

let documentChecks = 0;

/**
 * Compare the server's copy of the active document with the editor's (text and version): they
 * must always agree, or the server's edits land in the wrong place. Says which line differs.
 */
async function checkDocument(): Promise<void> {
  const doc = vscode.window.activeTextEditor?.document;
  if (!doc || !client?.isRunning()) {
    void vscode.window.showWarningMessage('Spark: open a file and wait for the server to start.');
    return;
  }
  const n = ++documentChecks;
  const name = doc.uri.path.split('/').pop();
  try {
    const server: { version: number | null; text: string } = await client.sendRequest(
      DOCUMENT, { uri: client.code2ProtocolConverter.asUri(doc.uri) });
    const text = doc.getText();
    if (server.text === text && server.version === doc.version) {
      void vscode.window.showInformationMessage(`Spark: document check ${n}: the server's copy of ${name} matches the editor's (version ${doc.version}).`);
      return;
    }
    const a = text.split(/\r\n|\r|\n/);
    const b = server.text.split(/\r\n|\r|\n/);
    let i = 0;
    while (i < a.length && i < b.length && a[i] === b[i]) i++;
    const where = server.text === text ? 'same text' : `line ${i + 1}: editor ${JSON.stringify(a[i] ?? '')}, server ${JSON.stringify(b[i] ?? '')}`;
    const msg = `the server's copy of ${name} differs from the editor's (${where}; version ${doc.version} in the editor, ${server.version} in the server)`;
    output.error(`[client] document check ${n}: ${msg}`);
    void vscode.window.showErrorMessage(`Spark: document check ${n}: ${msg}. Please report this.`);
  } catch (err: any) {
    void vscode.window.showErrorMessage(`Spark: document check ${n}: ${err?.message ?? err}`);
  }
}

async function cancelGeneration(): Promise<void> {
  if (!client?.isRunning()) return;
  const n = progress?.cancelAll() ?? 0;
  const doc = vscode.window.activeTextEditor?.document;
  const uris = doc ? [client.code2ProtocolConverter.asUri(doc.uri)] : [];
  try {
    await client.sendRequest(ExecuteCommandRequest.type, { command: CANCEL, arguments: uris });
  } catch (err: any) {
    if (n === 0) output.info(`[client] cancel: ${err?.message ?? err}`);
  }
  void vscode.window.setStatusBarMessage('$(debug-stop) generation cancelled', 2000);
}

export async function deactivate(): Promise<void> {
  await stopClient();
}
