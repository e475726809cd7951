/**
 * Which list each run goes to, and one row per sweep: the grouping behind the panel's Running,
 * Queued and Recently finished lists. Pure: runs in node.
 */
import { IRunRecord, StateCounts, sweepIdOf } from './records';

/** The panel's run lists. */
export type Section = 'running' | 'queued' | 'finished';

export const SECTIONS: ReadonlyArray<Section> = [
  'running',
  'queued',
  'finished'
];

/** The order in which a sweep's counts are shown. */
export const STATE_ORDER: ReadonlyArray<string> = [
  'running',
  'queued',
  'succeeded',
  'failed',
  'aborted',
  'cancelled'
];

/** The list a run of this state is shown in. */
export function sectionOf(state: string): Section {
  return state === 'queued'
    ? 'queued'
    : state === 'running'
      ? 'running'
      : 'finished';
}

/**
 * Where a sweep's row is listed: among the running while any of its runs runs, else among the
 * queued while any waits, else among the finished.
 */
export function sweepSection(counts: StateCounts): Section {
  return (counts.running ?? 0) > 0
    ? 'running'
    : (counts.queued ?? 0) > 0
      ? 'queued'
      : 'finished';
}

/**
 * One state for a whole sweep: running, queued, else how it ended (failed before aborted before
 * cancelled before succeeded: the worst of its runs).
 */
export function sweepState(counts: StateCounts): string {
  for (const state of ['running', 'queued', 'failed', 'aborted', 'cancelled']) {
    if ((counts[state] ?? 0) > 0) {
      return state;
    }
  }
  return 'succeeded';
}

/** Runs per state. */
export function countStates(records: ReadonlyArray<IRunRecord>): StateCounts {
  const counts: StateCounts = {};
  for (const r of records) {
    counts[r.state] = (counts[r.state] ?? 0) + 1;
  }
  return counts;
}

/** The name of a sweep: its runs' `sweep_name` (the first that has one), else its id. */
export function sweepNameOf(
  id: string,
  members: ReadonlyArray<{ sweep_name?: unknown }>
): string {
  for (const r of members) {
    if (typeof r.sweep_name === 'string' && r.sweep_name) {
      return r.sweep_name;
    }
  }
  return id;
}

/** An entry of a run list: a run, or a sweep with its runs. */
export type ListItem =
  | { kind: 'run'; record: IRunRecord; position: number }
  | { kind: 'sweep'; id: string; members: IRunRecord[]; counts: StateCounts };

/** What the grouping reads of the model. */
export interface IRunSource {
  readonly running: ReadonlyArray<IRunRecord>;
  readonly queued: ReadonlyArray<IRunRecord>;
  readonly finished: ReadonlyArray<IRunRecord>;
  getRun(id: string): IRunRecord | undefined;
  sweepRuns(id: string): IRunRecord[];
}

/** The lists' entries, and the runs they show (as rows or within a sweep's row). */
export interface IGrouping {
  items: Record<Section, ListItem[]>;
  covered: Set<string>;
}

/**
 * Place every run: a run without a sweep as its own entry, in its state's list; a sweep's runs as
 * one entry per sweep, listed where its liveliest run is. At most `maxQueued` entries are queued
 * (the rest is counted by the caller from `covered`).
 */
export function groupRuns(source: IRunSource, maxQueued: number): IGrouping {
  const items: Record<Section, ListItem[]> = {
    running: [],
    queued: [],
    finished: []
  };
  const placedRuns = new Set<string>();
  const placedSweeps = new Set<string>();
  const covered = new Set<string>();
  let queuedItems = 0;
  const place = (record: IRunRecord, position: number) => {
    if (placedRuns.has(record.id)) {
      return;
    }
    const current = source.getRun(record.id) ?? record;
    const sweepId = sweepIdOf(current);
    if (sweepId) {
      placedRuns.add(current.id);
      if (placedSweeps.has(sweepId)) {
        return;
      }
      let members = source.sweepRuns(sweepId);
      if (!members.some(r => r.id === current.id)) {
        members = [...members, current];
      }
      const counts = countStates(members);
      const section = sweepSection(counts);
      if (section === 'queued' && queuedItems >= maxQueued) {
        return;
      }
      if (section === 'queued') {
        queuedItems++;
      }
      placedSweeps.add(sweepId);
      for (const r of members) {
        covered.add(r.id);
      }
      items[section].push({ kind: 'sweep', id: sweepId, members, counts });
      return;
    }
    const section = sectionOf(current.state);
    if (section === 'queued' && queuedItems >= maxQueued) {
      return;
    }
    if (section === 'queued') {
      queuedItems++;
    }
    placedRuns.add(current.id);
    covered.add(current.id);
    items[section].push({ kind: 'run', record: current, position });
  };
  source.running.forEach((r, i) => place(r, i));
  source.queued.forEach((r, i) => place(r, i));
  source.finished.forEach((r, i) => place(r, i));
  return { items, covered };
}

/**
 * Queued runs that no entry shows: those of the head read (`queued`) that no entry covers, and
 * those beyond it (`total` counts every queued run) that no sweep's entry covers.
 */
export function queuedNotShown(
  queued: ReadonlyArray<IRunRecord>,
  total: number,
  grouping: IGrouping
): number {
  const inHead = new Set(queued.map(r => r.id));
  let coveredBeyond = 0;
  for (const section of SECTIONS) {
    for (const item of grouping.items[section]) {
      if (item.kind !== 'sweep') {
        continue;
      }
      for (const r of item.members) {
        if (r.state === 'queued' && !inHead.has(r.id)) {
          coveredBeyond++;
        }
      }
    }
  }
  const notCovered = queued.filter(r => !grouping.covered.has(r.id)).length;
  return notCovered + Math.max(0, total - queued.length - coveredBeyond);
}
