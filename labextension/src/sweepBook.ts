/**
 * What the model knows of sweeps: which runs each has (every run of it seen, and those of the last
 * read of the sweep), that read, and when it was made. Pure (no timers, no requests): the model
 * decides when to read a sweep from what this says. Runs in node.
 */
import { IRunRecord, ISweepView } from './records';

/** The runs of a sweep in submission order (seq, then submission time, then id). */
export function bySubmission(a: IRunRecord, b: IRunRecord): number {
  const sa = typeof a.seq === 'number' ? a.seq : Number.MAX_SAFE_INTEGER;
  const sb = typeof b.seq === 'number' ? b.seq : Number.MAX_SAFE_INTEGER;
  if (sa !== sb) {
    return sa - sb;
  }
  const ta = a.submitted_at ?? '';
  const tb = b.submitted_at ?? '';
  if (ta !== tb) {
    return ta < tb ? -1 : 1;
  }
  return a.id < b.id ? -1 : a.id > b.id ? 1 : 0;
}

export class SweepBook {
  /** Whether the book knows a sweep (a run of it was seen, or it was read). */
  has(id: string): boolean {
    return this._members.has(id);
  }

  /**
   * A run of a sweep was seen: remember it. True when the sweep should be read (this run is
   * news to it: not in its last read, or it was never read).
   */
  note(sweepId: string, runId: string): boolean {
    const members = this._membersOf(sweepId);
    if (members.has(runId)) {
      return false;
    }
    members.add(runId);
    const view = this._views.get(sweepId);
    return !view || !view.runs.some(r => r.id === runId);
  }

  /** A read of a sweep (GET /evalsched/sweeps/{id}); ignored when not in its shape. */
  apply(view: ISweepView, now = Date.now()): void {
    if (!view || typeof view.id !== 'string' || !Array.isArray(view.runs)) {
      return;
    }
    this._views.set(view.id, view);
    this._readAt.set(view.id, now);
    const members = this._membersOf(view.id);
    for (const record of view.runs) {
      members.add(record.id);
    }
  }

  /** The server does not know the sweep (404): no read to show, none due before a resync. */
  unknown(id: string, now = Date.now()): void {
    this._views.delete(id);
    this._readAt.set(id, now);
  }

  /**
   * The runs of a sweep, in submission order: `current(id)` where the caller has a record (its
   * own are fresher), else the record of the last read. Empty for an unknown sweep.
   */
  runs(
    id: string,
    current: (runId: string) => IRunRecord | undefined
  ): IRunRecord[] {
    const members = this._members.get(id);
    if (!members) {
      return [];
    }
    const fromView = new Map(
      (this._views.get(id)?.runs ?? []).map(r => [r.id, r])
    );
    const out: IRunRecord[] = [];
    for (const runId of members) {
      const record = current(runId) ?? fromView.get(runId);
      if (record) {
        out.push(record);
      }
    }
    return out.sort(bySubmission);
  }

  /**
   * Forget the sweeps not in `listed` (no run of theirs is in the lists any more); of the others,
   * those read longer than `every` ms ago (or never) are due for a read.
   */
  resync(
    listed: ReadonlySet<string>,
    every: number,
    now = Date.now()
  ): string[] {
    const due: string[] = [];
    for (const id of [...this._members.keys()]) {
      if (!listed.has(id)) {
        this._members.delete(id);
        this._views.delete(id);
        this._readAt.delete(id);
        continue;
      }
      if (now - (this._readAt.get(id) ?? 0) >= every) {
        due.push(id);
      }
    }
    return due;
  }

  private _membersOf(id: string): Set<string> {
    let members = this._members.get(id);
    if (!members) {
      members = new Set();
      this._members.set(id, members);
    }
    return members;
  }

  private _members = new Map<string, Set<string>>();
  private _views = new Map<string, ISweepView>();
  private _readAt = new Map<string, number>();
}
