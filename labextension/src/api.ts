/**
 * The REST and WebSocket client of the jupyter_evalsched server extension.
 *
 * Every request goes through `ServerConnection.makeRequest`, so the base URL, the token and the
 * XSRF header are right behind proxies, JupyterHub and non-root base URLs alike.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import {
  ICompareTarget,
  IErrorBody,
  ILeaseList,
  ILeaseRecord,
  ILedger,
  IModelList,
  IQueueView,
  IRunDetail,
  IRunList,
  IRunRecord,
  IServerStatus,
  ISweepSummary,
  ISweepView,
  IComparison,
  LogStream
} from './records';

// The record types and their pure helpers live in ./records (no JupyterLab import, unit-tested).
export * from './records';

/**
 * An error answered by the server (or the absence of the server extension).
 */
export class EvalSchedError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly body: Partial<IErrorBody> | null = null
  ) {
    super(message);
    this.name = 'EvalSchedError';
  }

  /** Field errors of a 422 answer, as "loc: msg" lines. */
  get details(): string[] {
    const detail = this.body?.detail;
    if (!Array.isArray(detail)) {
      return [];
    }
    return detail.map(d => {
      const loc = Array.isArray(d?.loc) ? d.loc.join('.') : '';
      const msg = String(d?.msg ?? JSON.stringify(d));
      return loc ? `${loc}: ${msg}` : msg;
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

  /**
   * The URL of the event WebSocket, with the token appended where Jupyter appends it;
   * `queueLimit`: how many queued runs its first message (the queue view) lists.
   */
  eventsUrl(queueLimit?: number): string {
    const settings = this.serverSettings;
    const url = URLExt.join(settings.wsUrl, 'evalsched', 'events');
    const query: string[] = [];
    if (queueLimit !== undefined) {
      query.push(`limit=${encodeURIComponent(String(queueLimit))}`);
    }
    // Same rule as @jupyterlab/services' kernel and terminal sockets: same-origin sockets
    // authenticate with the cookie; otherwise (or when configured) the token rides along.
    if (settings.appendToken && settings.token !== '') {
      query.push(`token=${encodeURIComponent(settings.token)}`);
    }
    return query.length ? `${url}?${query.join('&')}` : url;
  }

  /** Open the event socket (`WS /evalsched/events`). */
  openEvents(queueLimit?: number): WebSocket {
    return new this.serverSettings.WebSocket(this.eventsUrl(queueLimit));
  }

  /**
   * The queue view; with `limit`, its `queued` lists the first `limit` queued runs only
   * (`queued_total` counts them all).
   */
  getQueue(limit?: number): Promise<IQueueView> {
    return this._json<IQueueView>(['queue'], { limit }, {}, true);
  }

  getLedger(): Promise<ILedger> {
    return this._json<ILedger>(['ledger'], undefined, {}, true);
  }

  /** This server's own view (`GET /evalsched/status`): its role, its host ledger link. */
  getStatus(): Promise<IServerStatus> {
    return this._json<IServerStatus>(['status'], undefined, {}, true);
  }

  /** The shared models and their figures (`GET /evalsched/models`). */
  getModels(): Promise<IModelList> {
    return this._json<IModelList>(['models']);
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
    return this._json<IRunRecord>(
      ['runs', id, 'cancel'],
      { by: 'panel' },
      {
        method: 'POST'
      }
    );
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
    return this._json<ISweepView>(
      ['sweeps', id, 'cancel'],
      { by: 'panel' },
      {
        method: 'POST'
      }
    );
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
      // What the server answers is an ErrorBody when it is our handler's; anything else is not.
      let body: Partial<IErrorBody> | null = null;
      const text = await response.text().catch(() => '');
      try {
        body = JSON.parse(text);
      } catch {
        body = null;
      }
      const jsonError = !!body && typeof body.message === 'string';
      if (response.status === 404 && collection) {
        // The collection routes exist whenever the extension is loaded: a 404 there is
        // Jupyter's own "page not found", so no handler is mounted under /evalsched/.
        throw new ExtensionMissingError();
      }
      const message =
        (jsonError && body?.message) ||
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
