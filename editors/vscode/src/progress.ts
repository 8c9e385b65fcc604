/**
 * Server-initiated work-done progress (live edits, model loading), shown as a cancellable
 * notification and tracked so that `Spark: Cancel Running Generation` (and Escape) can stop it.
 *
 * vscode-languageclient has its own progress UI but gives no handle on the running tokens, so this
 * replaces its `window/workDoneProgress/create` handler after the client has started.
 */
import * as vscode from 'vscode';
import {
  LanguageClient, WorkDoneProgress, WorkDoneProgressBegin, WorkDoneProgressCancelNotification,
  WorkDoneProgressCreateRequest, WorkDoneProgressReport, WorkDoneProgressEnd, ProgressToken,
} from 'vscode-languageclient/node';

type Value = WorkDoneProgressBegin | WorkDoneProgressReport | WorkDoneProgressEnd;

export interface ProgressCounts { generating: number; other: number }

interface Running {
  cancellable: boolean;
  resolve(): void;
  report(message?: string, percentage?: number): void;
  dispose(): void;
  title: string;
}

export class ProgressTracker implements vscode.Disposable {
  private readonly running = new Map<ProgressToken, Running>();
  private readonly changed = new vscode.EventEmitter<ProgressCounts>();
  /** Fires with what is running whenever it changes. */
  readonly onDidChange = this.changed.event;

  constructor(private readonly client: LanguageClient) {}

  /** Call once the client is running. */
  install(): void {
    this.client.onRequest(WorkDoneProgressCreateRequest.type, ({ token }) => {
      const sub: vscode.Disposable = this.client.onProgress(WorkDoneProgress.type, token, (value: Value): void => this.onValue(token, value, sub));
    });
  }

  /** Cancellable progresses are generations (live edits); the others are background work (loading). */
  get counts(): ProgressCounts {
    let generating = 0;
    for (const r of this.running.values()) if (r.cancellable) generating++;
    return { generating, other: this.running.size - generating };
  }

  /** Asks the server to stop every running progress; returns how many were cancelled. */
  cancelAll(): number {
    const tokens = [...this.running.keys()];
    for (const token of tokens) void this.client.sendNotification(WorkDoneProgressCancelNotification.type, { token });
    return tokens.length;
  }

  private onValue(token: ProgressToken, value: Value, sub: vscode.Disposable): void {
    if (value.kind === 'begin') {
      let resolve!: () => void;
      const done = new Promise<void>((r) => { resolve = r; });
      let progress: vscode.Progress<{ message?: string; increment?: number }> | undefined;
      let lastPct = 0;
      const entry: Running = {
        cancellable: !!value.cancellable,
        title: value.title,
        resolve,
        report: (message, percentage) => {
          let increment: number | undefined;
          if (typeof percentage === 'number') { increment = Math.max(0, percentage - lastPct); lastPct = percentage; }
          progress?.report({ message, increment });
        },
        dispose: () => sub.dispose(),
      };
      this.running.set(token, entry);
      this.changed.fire(this.counts);
      void vscode.window.withProgress(
        {
          // A cancellable edit gets a notification with a Cancel button; model loading just the status bar.
          location: value.cancellable ? vscode.ProgressLocation.Notification : vscode.ProgressLocation.Window,
          title: `Spark: ${value.title}`,
          cancellable: !!value.cancellable,
        },
        (p, cancel) => {
          progress = p;
          entry.report(value.message, value.percentage);
          cancel.onCancellationRequested(() => {
            void this.client.sendNotification(WorkDoneProgressCancelNotification.type, { token });
          });
          return done;
        },
      );
    } else if (value.kind === 'report') {
      this.running.get(token)?.report(value.message, value.percentage);
    } else {
      const entry = this.running.get(token);
      if (entry) {
        entry.resolve();
        entry.dispose();
        this.running.delete(token);
        this.changed.fire(this.counts);
      } else {
        sub.dispose();
      }
    }
  }

  dispose(): void {
    for (const entry of this.running.values()) { entry.resolve(); entry.dispose(); }
    this.running.clear();
    this.changed.dispose();
  }
}
