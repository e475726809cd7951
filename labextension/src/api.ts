/**
 * The REST and WebSocket client of the jupyter_evalsched server extension.
 *
 * Every request goes through `ServerConnection.makeRequest`, so the base URL, the token and the
 * XSRF header are right behind proxies, JupyterHub and non-root base URLs alike.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** Run states of the public contract. */
export type RunState =
  'queued' | 'running' | 'succeeded' | 'failed' | 'cancelled' | 'aborted';

export const TERMINAL_STATES: ReadonlyArray<RunState> = [
  'succeeded',
  'failed',
  'cancelled',
  'aborted'
];

export function isTerminal(state: string): boolean {
  return (TERMINAL_STATES as ReadonlyArray<string>).includes(state);
}

export interface IProgress {
  done: number;
  total: number;
}

/** The run record (REST and `job.json` share these names; more fields may be present). */
export interface IRunRecord {
  id: string;
  name: string;
  state: RunState;
  reason: string | null;
  priority: string;
  submitted_at: string;
  started_at: string | null;
  finished_at: string | null;
  pid: number | null;
  devices: number[];
  exit_code: number | null;
  progress: IProgress;
  marginal_vram_mb: number;
  depends_on: string[];
  // Observed usage; every one may be missing (older servers).
  observed?: IObserved | null;
  /** Problems seen while it ran, each starting with a code (`over_vram: ...`). */
  warnings?: string[];
  /** `declared`, or `auto: ...` with the figures. */
  marginal_vram_source?: string;
  /** The host memory limit asked for. */
  memory_mb?: number | null;
  // Resume, retries and preemption; every one may be missing (older servers).
  /** 1 for the first attempt. */
  attempt?: number;
  /** Times the run was preempted. */
  preemptions?: number;
  preemptible?: boolean;
  /** Automatic retries allowed, and made so far. */
  retries?: number;
  retries_used?: number;
  /** A failed attempt in back-off (queued, reason `retrying`) is retried then. */
  retry_at?: string | null;
  /** The run does not die with the server. */
  detach?: boolean;
  /** How its current attempt started: forked from a zygote, or a fresh interpreter. */
  start?: 'warm' | 'cold' | null;
  /** Which zygote forked it, or why it started cold. */
  start_detail?: string | null;
  /** How each earlier attempt ended. */
  history?: IAttemptHistoryEntry[];
  /** The sweep the run belongs to (absent or null: not a sweep's run; older servers). */
  sweep_id?: string | null;
  /** The parameters its sweep set for this run. */
  sweep_point?: { [param: string]: unknown } | null;
  /** Submission counter: the queue's order. */
  seq?: number;
  [key: string]: unknown;
}

/** The sweep of a run record, or null (not a sweep's run, or an older server). */
export function sweepIdOf(record: { sweep_id?: unknown }): string | null {
  return typeof record.sweep_id === 'string' && record.sweep_id
    ? record.sweep_id
    : null;
}

/** Runs per state (`{"succeeded": 4, "running": 2}`). */
export type StateCounts = { [state: string]: number };

/** `GET /evalsched/sweeps/{id}` (and the answer of its cancel). */
export interface ISweepView {
  id: string;
  runs: IRunRecord[];
  counts: StateCounts;
}

/** An entry of `GET /evalsched/sweeps`. */
export interface ISweepSummary {
  id: string;
  name: string | null;
  runs: number;
  counts: StateCounts;
  submitted_at?: string | null;
  seq: number;
}

/** A metric of a run in a comparison: over the episodes where it is a finite number. */
export interface ICompareStat {
  mean: number | null;
  stderr: number | null;
  count: number;
}

/** The paired difference of a metric against the baseline (shared episode indices). */
export interface ICompareDelta {
  mean: number | null;
  ci95: [number, number] | null;
  paired: number;
}

export interface ICompareRow {
  id: string;
  name: string | null;
  state?: string | null;
  /** The values of the parameters that differ between the compared runs. */
  params: { [param: string]: unknown };
  metrics: { [metric: string]: ICompareStat };
  delta: { [metric: string]: ICompareDelta };
  wall_s: number | null;
  peak_vram_mb: number | null;
  /** Why its spec or episodes could not be read. */
  error?: string | null;
}

/** `GET /evalsched/compare`. */
export interface IComparison {
  params: string[];
  metrics: string[];
  baseline: string | null;
  rows: ICompareRow[];
}

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

/** How one earlier attempt of a run ended (an entry of the record's `history`). */
export interface IAttemptHistoryEntry {
  attempt: number;
  state: 'failed' | 'cancelled' | 'aborted' | 'preempted' | string;
  reason: string | null;
  started_at: string | null;
  finished_at: string | null;
  episodes_done: number;
}

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

/** What a run was seen to use while it ran (peaks only); absent on older servers. */
export interface IObserved {
  peak_vram_mb?: { [gpu: string]: number };
  peak_rss_mb?: number | null;
  source?: string;
}

/** The warnings of a run record: [] when the server does not send any (or an older one). */
export function runWarnings(record: { [key: string]: unknown }): string[] {
  const warnings = record.warnings;
  return Array.isArray(warnings)
    ? warnings.filter((w): w is string => typeof w === 'string')
    : [];
}

export interface IRunDetail extends IRunRecord {
  summary: ISummary | null;
}

export interface ILedgerRun {
  id: string;
  marginal_vram_mb: number;
}

/** A granted lease as a ledger device lists it (what it holds on that GPU). */
export interface ILedgerLease {
  id: string;
  vram_mb: number;
  pid?: number | null;
  label?: string;
  kernel_id?: string | null;
  session_path?: string | null;
  /** What its process uses on this GPU now. */
  observed_mb?: number;
  /** Observed beyond the lease: counted in the device's unmanaged_mb. */
  over_lease_mb?: number;
}

/** A process seen on a GPU that no run holds. */
export interface IUnmanagedProcess {
  pid: number;
  gpu: number;
  used_mb: number;
  name?: string;
  kernel_id?: string | null;
  session_path?: string | null;
  /** The lease that covers it (only its excess is unmanaged then). */
  lease_id?: string | null;
}

export type LeaseState = 'queued' | 'granted' | 'ended';

/** The lease record (REST, events and the queue view's `leases`). */
export interface ILeaseRecord {
  id: string;
  state: LeaseState;
  reason?: string | null;
  vram_mb: number;
  gpus?: number;
  exclusive_gpu?: boolean;
  priority?: string;
  devices?: number[];
  cuda_visible_devices?: string | null;
  pid?: number | null;
  label?: string;
  kernel_id?: string | null;
  session_path?: string | null;
  ttl_s?: number | null;
  requested_at?: string;
  granted_at?: string | null;
  ended_at?: string | null;
  observed_mb?: { [gpu: string]: number };
  over_lease_mb?: number;
  [key: string]: unknown;
}

export interface ILeaseList {
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

export interface ILedgerDevice {
  index: number;
  name: string;
  total_mb: number;
  baseline_mb: number;
  usable_mb: number;
  allocated_mb: number;
  free_mb: number;
  unmanaged_mb?: number;
  /** A run id or a lease id. */
  exclusive?: string | null;
  runs: ILedgerRun[];
  /** Granted leases on this GPU (absent on older servers). */
  leases?: ILedgerLease[];
  unmanaged_processes?: IUnmanagedProcess[];
}

export interface ILedger {
  devices: ILedgerDevice[];
  cpu_slots: { total: number; allocated: number };
}

export interface IQueueView {
  queued: IRunRecord[];
  running: IRunRecord[];
  ledger: ILedger;
  /** Live leases, granted first then queued in admission order (absent on older servers). */
  leases?: ILeaseRecord[];
}

export interface IRunList {
  runs: IRunRecord[];
  total: number;
}

/** Messages of `WS /evalsched/events`. */
export type EventMessage =
  | { type: 'snapshot'; queue: IQueueView }
  | { type: 'run'; run: IRunRecord }
  | { type: 'lease'; lease: ILeaseRecord }
  | { type: 'warning'; run_id: string; code: string; message: string }
  | { type: string; [key: string]: unknown };

export type LogStream = 'stdout' | 'stderr';

/**
 * An error answered by the server (or the absence of the server extension).
 */
export class EvalSchedError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly body: any = null
  ) {
    super(message);
    this.name = 'EvalSchedError';
  }

  /** Field errors of a 422 answer, as "loc: msg" lines. */
  get details(): string[] {
    const detail = this.body && this.body.detail;
    if (!Array.isArray(detail)) {
      return [];
    }
    return detail.map((d: any) => {
      const loc = Array.isArray(d?.loc) ? d.loc.join('.') : '';
      const msg = d?.msg ?? JSON.stringify(d);
      return loc ? `${loc}: ${msg}` : String(msg);
    });
  }
}

/** Thrown when the server answers 404 on the extension's own collection routes. */
export class ExtensionMissingError extends EvalSchedError {
  constructor() {
    super('jupyter_evalsched server extension is not enabled', 404);
    this.name = 'ExtensionMissingError';
  }
}

/**
 * A thin typed client of `/evalsched/`.
 */
export class EvalSchedAPI {
  constructor(
    readonly serverSettings: ServerConnection.ISettings = ServerConnection.makeSettings()
  ) {}

  /** The URL of an extension route; path parts are URL-encoded. */
  url(
    parts: string[],
    query?: Record<string, string | number | undefined>
  ): string {
    let url = URLExt.join(
      this.serverSettings.baseUrl,
      'evalsched',
      ...parts.map(p => encodeURIComponent(p))
    );
    if (query) {
      const q = Object.entries(query)
        .filter(([, v]) => v !== undefined && v !== '')
        .map(
          ([k, v]) =>
            `${encodeURIComponent(k)}=${encodeURIComponent(String(v))}`
        )
        .join('&');
      if (q) {
        url += `?${q}`;
      }
    }
    return url;
  }

  /** The URL of the event WebSocket, with the token appended where Jupyter appends it. */
  eventsUrl(): string {
    const settings = this.serverSettings;
    let url = URLExt.join(settings.wsUrl, 'evalsched', 'events');
    // Same rule as @jupyterlab/services' kernel and terminal sockets: same-origin sockets
    // authenticate with the cookie; otherwise (or when configured) the token rides along.
    if (settings.appendToken && settings.token !== '') {
      url += `?token=${encodeURIComponent(settings.token)}`;
    }
    return url;
  }

  /** Open the event socket (`WS /evalsched/events`). */
  openEvents(): WebSocket {
    return new this.serverSettings.WebSocket(this.eventsUrl());
  }

  getQueue(): Promise<IQueueView> {
    return this._json<IQueueView>(['queue'], undefined, {}, true);
  }

  getLedger(): Promise<ILedger> {
    return this._json<ILedger>(['ledger'], undefined, {}, true);
  }

  listRuns(
    options: { states?: string[]; limit?: number } = {}
  ): Promise<IRunList> {
    return this._json<IRunList>(
      ['runs'],
      {
        state: options.states?.join(','),
        limit: options.limit
      },
      {},
      true
    );
  }

  getRun(id: string): Promise<IRunDetail> {
    return this._json<IRunDetail>(['runs', id]);
  }

  cancelRun(id: string): Promise<IRunRecord> {
    return this._json<IRunRecord>(['runs', id, 'cancel'], undefined, {
      method: 'POST'
    });
  }

  /**
   * Resume a run that failed, was aborted or cancelled (`POST /evalsched/runs/{id}/resume`): it is
   * queued again under the same id, its attempt one more, skipping the episodes already done.
   * 409 when the run is in another state, 404 for an unknown id.
   */
  resumeRun(id: string): Promise<IRunRecord> {
    return this._json<IRunRecord>(['runs', id, 'resume'], undefined, {
      method: 'POST'
    });
  }

  submitRun(spec: Record<string, unknown>): Promise<IRunRecord> {
    return this._json<IRunRecord>(['runs'], undefined, {
      method: 'POST',
      body: JSON.stringify(spec),
      headers: { 'Content-Type': 'application/json' }
    });
  }

  /** Submit a sweep: a spec plus `sweep` (a grid or a list of points). */
  submitSweep(spec: Record<string, unknown>): Promise<ISweepView> {
    return this._json<ISweepView>(['sweeps'], undefined, {
      method: 'POST',
      body: JSON.stringify(spec),
      headers: { 'Content-Type': 'application/json' }
    });
  }

  listSweeps(limit?: number): Promise<{ sweeps: ISweepSummary[] }> {
    return this._json<{ sweeps: ISweepSummary[] }>(['sweeps'], { limit });
  }

  /** A sweep's runs and counts; 404 for an unknown sweep. */
  getSweep(id: string): Promise<ISweepView> {
    return this._json<ISweepView>(['sweeps', id]);
  }

  /** Cancel a sweep's unfinished runs; answers the sweep as it is then. */
  cancelSweep(id: string): Promise<ISweepView> {
    return this._json<ISweepView>(['sweeps', id, 'cancel'], undefined, {
      method: 'POST'
    });
  }

  /**
   * Compare runs (`GET /evalsched/compare?runs=a,b` or `?sweep=ID`, `&baseline=`): 404 for an
   * unknown run or sweep, 422 for a bad combination.
   */
  compare(target: ICompareTarget): Promise<IComparison> {
    return this._json<IComparison>(['compare'], {
      runs: target.sweep ? undefined : (target.runs ?? []).join(','),
      sweep: target.sweep,
      baseline: target.baseline
    });
  }

  listLeases(): Promise<ILeaseList> {
    return this._json<ILeaseList>(['leases']);
  }

  getLease(id: string): Promise<ILeaseRecord> {
    return this._json<ILeaseRecord>(['leases', id]);
  }

  /** End a lease (`DELETE /evalsched/leases/{id}`: 204, idempotent). */
  async releaseLease(id: string): Promise<void> {
    await this._request(['leases', id], undefined, { method: 'DELETE' });
  }

  async getLogs(
    id: string,
    stream: LogStream = 'stdout',
    tail?: number
  ): Promise<string> {
    const response = await this._request(['runs', id, 'logs'], {
      stream,
      tail
    });
    return response.text();
  }

  private async _request(
    parts: string[],
    query?: Record<string, string | number | undefined>,
    init: RequestInit = {},
    collection = false
  ): Promise<Response> {
    const url = this.url(parts, query);
    // makeRequest rejects with ServerConnection.NetworkError when the server is unreachable.
    const response = await ServerConnection.makeRequest(
      url,
      init,
      this.serverSettings
    );
    if (!response.ok) {
      let body: any = null;
      const text = await response.text().catch(() => '');
      try {
        body = JSON.parse(text);
      } catch {
        body = null;
      }
      const jsonError = body && typeof body.message === 'string';
      if (response.status === 404 && collection) {
        // The collection routes exist whenever the extension is loaded: a 404 there is
        // Jupyter's own "page not found", so no handler is mounted under /evalsched/.
        throw new ExtensionMissingError();
      }
      const message =
        (jsonError && body.message) ||
        response.statusText ||
        `HTTP ${response.status}`;
      throw new EvalSchedError(message, response.status, body);
    }
    return response;
  }

  private async _json<T>(
    parts: string[],
    query?: Record<string, string | number | undefined>,
    init: RequestInit = {},
    collection = false
  ): Promise<T> {
    const response = await this._request(parts, query, init, collection);
    return (await response.json()) as T;
  }
}
