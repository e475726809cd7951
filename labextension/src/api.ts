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
  [key: string]: unknown;
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

export interface IRunDetail extends IRunRecord {
  summary: ISummary | null;
}

export interface ILedgerRun {
  id: string;
  marginal_vram_mb: number;
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
  exclusive?: string | null;
  runs: ILedgerRun[];
}

export interface ILedger {
  devices: ILedgerDevice[];
  cpu_slots: { total: number; allocated: number };
}

export interface IQueueView {
  queued: IRunRecord[];
  running: IRunRecord[];
  ledger: ILedger;
}

export interface IRunList {
  runs: IRunRecord[];
  total: number;
}

/** Messages of `WS /evalsched/events`. */
export type EventMessage =
  | { type: 'snapshot'; queue: IQueueView }
  | { type: 'run'; run: IRunRecord }
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

  submitRun(spec: Record<string, unknown>): Promise<IRunRecord> {
    return this._json<IRunRecord>(['runs'], undefined, {
      method: 'POST',
      body: JSON.stringify(spec),
      headers: { 'Content-Type': 'application/json' }
    });
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
