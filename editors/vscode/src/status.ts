/**
 * The status bar item: server state plus the figures of the last generation from `spark/status`.
 * Clicking it toggles inline suggestions.
 */
import * as vscode from 'vscode';

/** The `spark/status` notification's params (see spark_lsp/status.py and state.py). */
export interface SparkStatus {
  model?: string;
  /** Where generations run: "in-process", "engine service ws://…", "llamacpp http://…". */
  engine?: string | null;
  /** kind "health": the engine service or backend stopped answering (null: answers again). */
  error?: string | null;
  tokensPerSecond?: number;
  ttftMs?: number;
  promptTokens?: number;
  reusedPromptTokens?: number;
  newTokens?: number;
  totalMs?: number;
  finishReason?: string;
  /** Projected decode speed on the emulated wafer (present once the wafer model exists). */
  waferDecodeTokensPerSecond?: number;
  kind?: string;
}

export type ServerState = 'starting' | 'loading' | 'ready' | 'stopped' | 'error';

function fmtRate(v: number): string {
  return v >= 1000 ? `${(v / 1000).toFixed(1)}k` : v >= 100 ? v.toFixed(0) : v.toFixed(1);
}

export class StatusItem implements vscode.Disposable {
  private readonly item: vscode.StatusBarItem;
  private state: ServerState = 'starting';
  private enabled = true;
  private generating = false;
  private last: SparkStatus | undefined;
  private engine: string | undefined;
  private error: string | undefined;

  constructor(toggleCommand: string) {
    this.item = vscode.window.createStatusBarItem('spark.status', vscode.StatusBarAlignment.Right, 100);
    this.item.name = 'Spark LSP';
    this.item.command = toggleCommand;
    this.render();
    this.item.show();
  }

  setState(state: ServerState): void {
    // a (re)started server has its own engine: what the last one said of its engine is void
    if (state === 'starting') { this.engine = undefined; this.error = undefined; }
    this.state = state;
    this.render();
  }
  setEnabled(on: boolean): void { this.enabled = on; this.render(); }
  setGenerating(on: boolean): void { this.generating = on; this.render(); }
  /** A generation's figures, or (kind "health") the engine service or backend going away or
   * coming back: shown until it answers again, whatever figures come meanwhile. */
  update(status: SparkStatus): void {
    if (status.engine) this.engine = status.engine;
    if (status.kind === 'health') this.error = status.error || undefined;
    else this.last = status;
    this.render();
  }

  /** The text currently shown (for tests and the log). */
  get text(): string { return this.item.text; }

  private render(): void {
    const icon = !this.enabled ? '$(circle-slash)'
      : this.generating ? '$(loading~spin)'
      : this.state === 'error' || this.state === 'stopped' ? '$(error)'
      : this.error ? '$(warning)'
      : this.state === 'ready' ? '$(sparkle)' : '$(sync~spin)';
    let text = `${icon} Spark`;
    const s = this.last;
    if (!this.enabled) text += ' off';
    else if (this.state !== 'ready') text += ` ${this.state}`;
    else if (this.error) text += ' unavailable';
    else if (s && typeof s.tokensPerSecond === 'number') {
      text += ` ${fmtRate(s.tokensPerSecond)} tok/s`;
      if (typeof s.ttftMs === 'number') text += ` · TTFT ${s.ttftMs.toFixed(0)} ms`;
      if (typeof s.waferDecodeTokensPerSecond === 'number') text += ` · wafer ${fmtRate(s.waferDecodeTokensPerSecond)} tok/s`;
    }
    this.item.text = text;

    const tip = new vscode.MarkdownString(undefined, true);
    tip.appendMarkdown(`**Spark LSP** — inline suggestions ${this.enabled ? 'on' : 'off'} (click to toggle)\n\n`);
    tip.appendMarkdown(`server: ${this.state}\n\n`);
    // server text, shown as text (appendText escapes Markdown)
    if (this.engine) { tip.appendText(`runs: ${this.engine}`); tip.appendMarkdown('\n\n'); }
    if (this.error) { tip.appendMarkdown('**unavailable**: '); tip.appendText(this.error); tip.appendMarkdown('\n\n'); }
    if (s) {
      if (s.model) tip.appendMarkdown(`model: \`${s.model}\`\n\n`);
      const rows: [string, unknown][] = [
        ['tokens/s', s.tokensPerSecond], ['time to first token (ms)', s.ttftMs],
        ['prompt tokens', s.promptTokens], ['reused prompt tokens', s.reusedPromptTokens],
        ['new tokens', s.newTokens], ['projected wafer tokens/s', s.waferDecodeTokensPerSecond],
      ];
      for (const [k, v] of rows) if (typeof v === 'number') tip.appendMarkdown(`${k}: ${Number.isInteger(v) ? v : v.toFixed(1)}\n\n`);
    }
    this.item.tooltip = tip;
    this.item.backgroundColor = this.state === 'error'
      ? new vscode.ThemeColor('statusBarItem.errorBackground')
      : this.error && this.enabled ? new vscode.ThemeColor('statusBarItem.warningBackground') : undefined;
  }

  dispose(): void { this.item.dispose(); }
}
