/**
 * Notifications (JupyterLab's notification centre) when a run or a sweep ends.
 *
 * Only ends this page sees happen: a run the model knew as queued or running that becomes
 * terminal (never the runs that were terminal when the panel loaded). Under `failures` (the
 * default) a failed or aborted run is an error notification; under `all` a succeeded run is a
 * success one and a cancelled run an info one too; `off` is silent. A run of a sweep does not
 * notify on its own: its sweep does, once, when its last run ends (an error when any of its runs
 * failed or was aborted).
 */
import { Notification } from '@jupyterlab/apputils';
import { TranslationBundle } from '@jupyterlab/translation';
import { IDisposable } from '@lumino/disposable';

import {
  ICompareTarget,
  IRunRecord,
  isTerminal,
  StateCounts,
  sweepIdOf
} from './api';
import { attemptOf } from './format';
import { sweepNameOf } from './sweeps';
import { countStates, EvalSchedModel, IRunEnd } from './model';

export type NotificationMode = 'off' | 'failures' | 'all';

/** The setting's value, `failures` for anything unknown. */
export function notificationMode(value: unknown): NotificationMode {
  return value === 'off' || value === 'all' ? value : 'failures';
}

/** How long a success or info toast stays (ms); errors stay until dismissed. */
const TOAST_MS = 6000;
/** Notifications of ours kept at most (the oldest are dismissed beyond). */
const MAX_LIVE = 5;
/** Run attempts remembered as notified at most. */
const MAX_SEEN = 5000;

const COUNT_ORDER = [
  'failed',
  'aborted',
  'cancelled',
  'succeeded',
  'running',
  'queued'
];

type Kind = 'error' | 'success' | 'info';

export interface IRunNotifierOptions {
  model: EvalSchedModel;
  trans: TranslationBundle;
  mode: NotificationMode;
  /** "Open" of a run: its detail tab. */
  openRun: (id: string) => void;
  /** "Open" of a sweep: its row in the panel. */
  revealSweep: (id: string) => void;
  /** "Compare" of a sweep. */
  openCompare?: (target: ICompareTarget) => void;
  /** Told what was decided for each end (`<id>:<error|success|info|suppressed|sweep>`). */
  note?: (entry: string) => void;
}

export class RunNotifier implements IDisposable {
  constructor(options: IRunNotifierOptions) {
    this._model = options.model;
    this._trans = options.trans;
    this._mode = options.mode;
    this._options = options;
    this._model.runEnded.connect(this._onRunEnded, this);
  }

  get mode(): NotificationMode {
    return this._mode;
  }
  set mode(value: NotificationMode) {
    this._mode = value;
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._model.runEnded.disconnect(this._onRunEnded, this);
  }

  private _onRunEnded(_: EvalSchedModel, end: IRunEnd): void {
    const record = end.record;
    const key = `${record.id}#${attemptOf(record)}`;
    const seen = this._seen.has(key); // a later read of the same end
    if (!seen) {
      this._seen.add(key);
      if (this._seen.size > MAX_SEEN) {
        this._seen.delete(this._seen.values().next().value as string);
      }
    }
    const sweepId = sweepIdOf(record);
    if (sweepId) {
      if (!seen) {
        this._note(`${record.id}:sweep`);
      }
      // Every time: a sibling read late (a stale read undone) may have held the check back.
      // The sweep notifies once per set of ends (its signature), whatever calls this.
      this._checkSweep(sweepId);
      return;
    }
    if (seen) {
      return;
    }
    const kind = kindOf({ [record.state]: 1 });
    if (!this._allowed(kind)) {
      this._note(`${record.id}:suppressed`);
      return;
    }
    this._emit(kind, this._runMessage(record), [
      {
        label: this._trans.__('Open'),
        caption: this._trans.__('Open the run %1', record.id),
        callback: () => this._options.openRun(record.id)
      }
    ]);
    this._note(`${record.id}:${kind}`);
  }

  /** A run of a sweep ended: when it was the last one, the sweep notifies. */
  private _checkSweep(sweepId: string): void {
    if (this._pending.has(sweepId)) {
      return;
    }
    const known = this._model.sweepRuns(sweepId);
    if (known.some(r => !isTerminal(r.state))) {
      return; // still going
    }
    // Read the sweep: its runs this page does not know (beyond the finished list) count too.
    this._pending.add(sweepId);
    this._model
      .fetchSweep(sweepId)
      .catch(() => null)
      .then(() => {
        this._pending.delete(sweepId);
        const members = this._model.sweepRuns(sweepId);
        const runs = members.length ? members : known;
        if (this._isDisposed || runs.some(r => !isTerminal(r.state))) {
          return;
        }
        const signature = runs
          .map(r => `${r.id}#${attemptOf(r)}`)
          .sort()
          .join(',');
        if (this._sweepsDone.get(sweepId) === signature) {
          return;
        }
        this._sweepsDone.set(sweepId, signature);
        this._notifySweep(sweepId, runs);
      });
  }

  private _notifySweep(sweepId: string, runs: IRunRecord[]): void {
    const trans = this._trans;
    const counts = countStates(runs);
    const kind = kindOf(counts);
    if (!this._allowed(kind)) {
      this._note(`${sweepId}:suppressed`);
      return;
    }
    const name = sweepNameOf(sweepId, runs);
    const summary = COUNT_ORDER.filter(s => counts[s])
      .map(s => `${counts[s]} ${s}`)
      .join(', ');
    const actions: Notification.IAction[] = [
      {
        label: trans.__('Open'),
        caption: trans.__('Show the sweep %1 in the panel', sweepId),
        callback: () => this._options.revealSweep(sweepId)
      }
    ];
    if (this._options.openCompare) {
      const openCompare = this._options.openCompare;
      actions.push({
        label: trans.__('Compare'),
        caption: trans.__('Compare the runs of sweep %1', sweepId),
        callback: () => openCompare({ sweep: sweepId })
      });
    }
    this._emit(
      kind,
      trans.__('Sweep “%1” finished: %2', name, summary),
      actions
    );
    this._note(`${sweepId}:${kind}`);
  }

  private _runMessage(record: IRunRecord): string {
    const trans = this._trans;
    const name = record.name || record.id;
    const reason = record.reason ?? '';
    switch (record.state) {
      case 'failed':
        return reason
          ? trans.__('Run “%1” failed: %2', name, reason)
          : trans.__('Run “%1” failed', name);
      case 'aborted':
        return reason
          ? trans.__('Run “%1” was aborted: %2', name, reason)
          : trans.__('Run “%1” was aborted', name);
      case 'cancelled':
        return trans.__('Run “%1” was cancelled', name);
      default:
        return trans.__('Run “%1” succeeded', name);
    }
  }

  private _allowed(kind: Kind): boolean {
    return (
      this._mode === 'all' || (this._mode === 'failures' && kind === 'error')
    );
  }

  private _emit(
    kind: Kind,
    message: string,
    actions: Notification.IAction[]
  ): void {
    const options = {
      actions,
      autoClose: kind === 'error' ? (false as const) : TOAST_MS
    };
    const id =
      kind === 'error'
        ? Notification.error(message, options)
        : kind === 'success'
          ? Notification.success(message, options)
          : Notification.info(message, options);
    this._live.push(id);
    while (this._live.length > MAX_LIVE) {
      const oldest = this._live.shift();
      if (oldest) {
        // Never without an id: that would dismiss every notification of the page.
        Notification.dismiss(oldest);
      }
    }
  }

  private _note(entry: string): void {
    this._options.note?.(entry);
  }

  private _model: EvalSchedModel;
  private _trans: TranslationBundle;
  private _mode: NotificationMode;
  private _options: IRunNotifierOptions;
  private _seen = new Set<string>();
  private _pending = new Set<string>();
  private _sweepsDone = new Map<string, string>();
  private _live: string[] = [];
  private _isDisposed = false;
}

/** error when any run failed or was aborted, else info when any was cancelled, else success. */
function kindOf(counts: StateCounts): Kind {
  if ((counts.failed ?? 0) > 0 || (counts.aborted ?? 0) > 0) {
    return 'error';
  }
  if ((counts.cancelled ?? 0) > 0) {
    return 'info';
  }
  return 'success';
}
