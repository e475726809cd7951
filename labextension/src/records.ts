/**
 * The records of the REST API and the events, and the pure helpers that read them. The shapes come
 * from the server's OpenAPI document (./generated/api-types.ts, `scripts/gen_api_types.py`); this
 * module adds what the panel needs beside them. No `@jupyterlab/*` import: it runs in node (tests).
 */
import type * as api from './generated/api-types';

export type {
  IAttemptEnd as IAttemptHistoryEntry,
  ICompareRow,
  IComparison,
  ICpuSlots,
  IErrorBody,
  ILedger,
  ILedgerDevice,
  ILedgerLease,
  ILedgerRun,
  IMetricDelta as ICompareDelta,
  IModelInfo,
  IModelList,
  IMetricStat as ICompareStat,
  IObserved,
  IProgress,
  IServerStatus,
  IUnmanagedProcess
} from './generated/api-types';

/** Run states of the public contract. */
export type RunState = api.IRunRecord['state'];

export const TERMINAL_STATES: ReadonlyArray<RunState> = [
  'succeeded',
  'failed',
  'cancelled',
  'aborted'
];

export function isTerminal(state: string): boolean {
  return (TERMINAL_STATES as ReadonlyArray<string>).includes(state);
}

/** Who holds back a pending run or lease (an entry of `why.holders`). */
export type IWhyHolder = api.IHolder;

/** Why a run or lease is pending, as data: null when nothing is pending. */
export type IWhy = api.IWhy;

/** The run record (REST, events and `job.json`); more fields may be present. `why` and
 * `sweep_name` may be absent on a record from an older server. */
export interface IRunRecord extends Omit<api.IRunRecord, 'why' | 'sweep_name'> {
  why?: IWhy | null;
  sweep_name?: string | null;
  [key: string]: unknown;
}

/** The lease record (REST, events and the queue view's `leases`). */
export interface ILeaseRecord extends Omit<api.ILeaseRecord, 'why'> {
  why?: IWhy | null;
  [key: string]: unknown;
}

export type LeaseState = ILeaseRecord['state'];

/** The sweep of a run record, or null (not a sweep's run, or an older server). */
export function sweepIdOf(record: { sweep_id?: unknown }): string | null {
  return typeof record.sweep_id === 'string' && record.sweep_id
    ? record.sweep_id
    : null;
}

/** Runs per state (`{"succeeded": 4, "running": 2}`). */
export type StateCounts = { [state: string]: number };

/** `GET /evalsched/sweeps/{id}` (and the answer of its cancel). */
export interface ISweepView extends Omit<api.ISweepView, 'runs'> {
  runs: IRunRecord[];
}

/** An entry of `GET /evalsched/sweeps`. */
export type ISweepSummary = api.ISweepSummary;

/** What to compare: a sweep's runs, or runs by id (exactly one of them). */
export interface ICompareTarget {
  sweep?: string;
  runs?: string[];
  baseline?: string;
}

/** A stable key of a comparison target (its baseline aside): `sweep:<id>` or `runs:<a>,<b>`. */
export function compareKey(target: ICompareTarget): string {
  return target.sweep
    ? `sweep:${target.sweep}`
    : `runs:${(target.runs ?? []).join(',')}`;
}

// The content of a run's `summary.json` is the runner's file, not a model of the REST API.

export interface IMetricStats {
  mean?: number | null;
  std?: number | null;
  min?: number | null;
  max?: number | null;
  count?: number;
  skipped?: number;
}

export interface IRunError {
  type: string;
  message: string;
  traceback?: string;
}

/** The content of a run's `summary.json`. */
export interface ISummary {
  run_id?: string;
  status?: string;
  episodes_done?: number;
  episodes_total?: number;
  metrics?: { [name: string]: IMetricStats };
  started_at?: string | null;
  updated_at?: string | null;
  finished_at?: string | null;
  error?: IRunError | null;
}

/** The warnings of a run record: [] when the server does not send any (or an older one). */
export function runWarnings(record: { [key: string]: unknown }): string[] {
  const warnings = record.warnings;
  return Array.isArray(warnings)
    ? warnings.filter((w): w is string => typeof w === 'string')
    : [];
}

/** `GET /evalsched/runs/{id}`: the record and its summary. */
export interface IRunDetail extends IRunRecord {
  summary: ISummary | null;
}

export interface ILeaseList extends Omit<api.ILeaseList, 'leases'> {
  leases: ILeaseRecord[];
}

/** Who holds a lease: its label, else the basename of its notebook, else its pid. */
export function leaseHolder(lease: {
  id?: string;
  label?: string;
  session_path?: string | null;
  pid?: number | null;
}): string {
  if (lease.label) {
    return lease.label;
  }
  if (lease.session_path) {
    return basename(lease.session_path);
  }
  if (lease.pid !== null && lease.pid !== undefined) {
    return `pid ${lease.pid}`;
  }
  return lease.id ?? '';
}

/** The last part of a path (`work/analysis.ipynb` → `analysis.ipynb`). */
export function basename(path: string): string {
  const parts = path.split('/').filter(Boolean);
  return parts.length ? parts[parts.length - 1] : path;
}

export interface IQueueView extends Omit<
  api.IQueueView,
  'queued' | 'queued_total' | 'running' | 'leases'
> {
  queued: IRunRecord[];
  /** Every queued run, listed or not (an older server lists them all and does not count). */
  queued_total?: number;
  running: IRunRecord[];
  leases?: ILeaseRecord[];
}

export interface IRunList extends Omit<api.IRunList, 'runs'> {
  runs: IRunRecord[];
}

/** Messages of `WS /evalsched/events`. */
export type EventMessage =
  | { type: 'snapshot'; queue: IQueueView }
  | { type: 'run'; run: IRunRecord }
  | { type: 'lease'; lease: ILeaseRecord }
  | { type: 'warning'; run_id: string; code: string; message: string }
  | { type: string; [key: string]: unknown };

export type LogStream = 'stdout' | 'stderr';

/** True when the server puts the latest metrics into the run record (no summary read needed). */
export function hasMetrics(record: IRunRecord): boolean {
  const metrics = record.metrics;
  return !!metrics && typeof metrics === 'object' && !Array.isArray(metrics);
}

/** The latest metrics of a run: from its record when present, else from its summary. */
export function latestMetrics(
  record: IRunRecord | undefined,
  summary: ISummary | null | undefined
): { [name: string]: IMetricStats } {
  const fromRecord =
    record && hasMetrics(record)
      ? (record.metrics as { [name: string]: IMetricStats })
      : null;
  const fromSummary = summary?.metrics ?? null;
  if (fromRecord && fromSummary) {
    // Whichever saw more episodes.
    const done = summary?.episodes_done ?? -1;
    return done >= (record?.progress?.done ?? 0) ? fromSummary : fromRecord;
  }
  return fromRecord ?? fromSummary ?? {};
}

/** Whether two records of a run show the same observed usage and warnings. */
export function sameUsage(a: IRunRecord, b: IRunRecord): boolean {
  return (
    JSON.stringify(runWarnings(a)) === JSON.stringify(runWarnings(b)) &&
    JSON.stringify(a.observed ?? null) === JSON.stringify(b.observed ?? null) &&
    a.marginal_vram_source === b.marginal_vram_source &&
    a.memory_mb === b.memory_mb
  );
}

/** True when two records of a run agree on its attempt, retries, preemptions and history. */
export function sameAttempt(a: IRunRecord, b: IRunRecord): boolean {
  return (
    a.attempt === b.attempt &&
    a.preemptions === b.preemptions &&
    a.retries_used === b.retries_used &&
    a.retry_at === b.retry_at &&
    (a.history?.length ?? 0) === (b.history?.length ?? 0)
  );
}
