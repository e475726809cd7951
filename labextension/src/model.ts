/**
 * The live state behind the panel: queue, running runs, ledger, recently finished runs and the
 * latest summaries.
 *
 * Fed by `WS /evalsched/events` (a snapshot, then one message per run or lease change, and
 * warnings). A `Poll` of the REST API (GET /evalsched/queue and the recently finished runs) runs
 * beside it: every few seconds (with exponential backoff on failures) while the socket is
 * unavailable, and only as a slow resynchronisation while the socket is live. While the socket is
 * live a second, light `Poll` reads the ledger (GET /evalsched/ledger) every few seconds: the VRAM
 * of processes the scheduler does not manage is observed, and no event says when it changes. Both
 * stand by while the page is hidden. A third reads the shared models' figures
 * (GET /evalsched/models) as often, live or not: requests and tokens/s change with no event.
 */
import { ServerConnection } from '@jupyterlab/services';
import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import {
  EvalSchedAPI,
  EvalSchedError,
  EventMessage,
  ExtensionMissingError,
  ILeaseRecord,
  ILedger,
  IModelInfo,
  IQueueView,
  IRunRecord,
  ISummary,
  ISweepView,
  isTerminal,
  RunState,
  sweepIdOf,
  TERMINAL_STATES
} from './api';
import { attemptOf } from './format';
import { hasMetrics, runWarnings, sameAttempt, sameUsage } from './records';
import { modelsOf, sameModels } from './modelFigures';
import { SweepBook } from './sweepBook';

/** How the model currently gets its data. */
export type ConnectionMode = 'connecting' | 'live' | 'polling' | 'offline';

export interface IModelError {
  /** `missing`: the server extension is not enabled; `error`: anything else. */
  kind: 'missing' | 'error';
  message: string;
}

export interface IModelOptions {
  /** Polling interval in seconds (when the socket is unavailable). */
  refreshInterval: number;
  /** Longest interval in seconds that polling backs off to after failures. */
  maxRefreshInterval: number;
  /** Use `WS /evalsched/events` for live updates. */
  useWebSocket: boolean;
  /** How many recently finished runs to keep. */
  finishedLimit: number;
  /**
   * How many queued runs (the head, in admission order) to read from the server; the rest are
   * counted (`queuedTotal`). A long queue then costs the server and the page this many.
   */
  queueLimit: number;
}

export const DEFAULT_OPTIONS: IModelOptions = {
  refreshInterval: 5,
  maxRefreshInterval: 60,
  useWebSocket: true,
  finishedLimit: 20,
  queueLimit: 1000
};

/** Resynchronise through REST this often while the socket is live (ms). */
const LIVE_RESYNC_MS = 30000;
/** Fetch a running run's summary at most this often (ms). */
const SUMMARY_THROTTLE_MS = 1500;
/** Coalesce ledger refetches after state changes (ms). */
const LEDGER_DEBOUNCE_MS = 100;
/** Coalesce queue refetches after state changes (ms); longer for long queues. */
const QUEUE_DEBOUNCE_MS = 150;
const QUEUE_DEBOUNCE_LONG_MS = 2000;
const LONG_QUEUE = 1000;
/** Reconnection delays of the event socket (ms). */
const RECONNECT_MIN_MS = 1000;
const RECONNECT_MAX_MS = 30000;

const PRIORITY_RANK: { [p: string]: number } = { high: 0, normal: 1, low: 2 };

/** Coalesce reads of a sweep (GET /evalsched/sweeps/{id}) after its runs appear (ms). */
const SWEEP_DEBOUNCE_MS = 200;

/** A run seen to end: it was queued or running, and now is terminal. */
export interface IRunEnd {
  record: IRunRecord;
  /** Its state before (queued or running). */
  previous: RunState;
}

// Runs per state: in ./sweeps (pure); re-exported for the modules that read it from here.
export { countStates } from './sweeps';
export { hasMetrics, latestMetrics } from './records';

export class EvalSchedModel implements IDisposable {
  constructor(api: EvalSchedAPI, options: Partial<IModelOptions> = {}) {
    this.api = api;
    this._options = { ...DEFAULT_OPTIONS, ...options };
    this._poll = new Poll({
      auto: false,
      factory: () => this._pollTick(),
      frequency: this._frequency(),
      name: 'jupyter-evalsched:queue',
      standby: 'when-hidden'
    });
    this._ledgerPoll = new Poll({
      auto: false,
      factory: () => this._ledgerTick(),
      frequency: this._ledgerFrequency(),
      name: 'jupyter-evalsched:ledger',
      standby: 'when-hidden'
    });
    this._modelsPoll = new Poll({
      auto: false,
      factory: () => this._modelsTick(),
      frequency: this._ledgerFrequency(),
      name: 'jupyter-evalsched:models',
      standby: 'when-hidden'
    });
  }

  readonly api: EvalSchedAPI;

  /** Emitted whenever the queue, ledger, finished list, connection or error changes. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Emitted with a run id when that run's summary was (re)fetched. */
  get summaryChanged(): ISignal<this, string> {
    return this._summaryChanged;
  }

  /** Emitted with a run record whenever the record of that run changes. */
  get runChanged(): ISignal<this, IRunRecord> {
    return this._runChanged;
  }

  /**
   * Emitted when a run this model knew as queued or running is seen terminal (live: never for
   * runs that were terminal when first seen).
   */
  get runEnded(): ISignal<this, IRunEnd> {
    return this._runEnded;
  }

  get queued(): ReadonlyArray<IRunRecord> {
    return this._queued;
  }

  /** How many runs are queued: those in `queued` and those beyond the head read. */
  get queuedTotal(): number {
    return Math.max(this._queuedTotal, this._queued.length);
  }

  get running(): ReadonlyArray<IRunRecord> {
    return this._running;
  }

  get finished(): ReadonlyArray<IRunRecord> {
    return this._finished;
  }

  get ledger(): ILedger | null {
    return this._ledger;
  }

  /**
   * This server's user on a host shared through a host ledger (`host_ledger.user` of
   * `GET /evalsched/status`), read once the ledger shows other users' holdings; null until then
   * and without a host ledger.
   */
  get hostUser(): string | null {
    return this._hostUser;
  }

  /** The live leases: granted first, then queued in admission order. */
  get leases(): ReadonlyArray<ILeaseRecord> {
    return this._leases;
  }

  /** True once the server showed that it knows leases (an older one does not). */
  get leasesSupported(): boolean {
    return this._leasesSupported;
  }

  /** The shared models of the host and their figures, as last read (empty: none configured). */
  get models(): ReadonlyArray<IModelInfo> {
    return this._models;
  }

  /** A live lease by id. */
  getLease(id: string): ILeaseRecord | undefined {
    return this._leases.find(l => l.id === id);
  }

  get mode(): ConnectionMode {
    return this._mode;
  }

  get error(): IModelError | null {
    return this._error;
  }

  /** True once the first queue view arrived. */
  get loaded(): boolean {
    return this._loaded;
  }

  get options(): Readonly<IModelOptions> {
    return this._options;
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  /** The known record of a run (queued, running or recently finished). */
  getRun(id: string): IRunRecord | undefined {
    return this._records.get(id);
  }

  /**
   * The runs of a sweep, in submission order: every run of it that this model knows (their
   * records are the freshest) and the others from the last read of the sweep
   * (GET /evalsched/sweeps/{id}). Empty for an unknown sweep.
   */
  sweepRuns(id: string): IRunRecord[] {
    return this._sweeps.runs(id, runId => this._records.get(runId));
  }

  /**
   * Read a sweep now (GET /evalsched/sweeps/{id}); null when the server does not know it (404).
   * Its runs the model does not know yet are kept aside (they are not put into the lists).
   */
  async fetchSweep(id: string): Promise<ISweepView | null> {
    try {
      const view = await this.api.getSweep(id);
      this._sweeps.apply(view);
      this._changed.emit();
      return view;
    } catch (reason) {
      if (reason instanceof EvalSchedError && reason.status === 404) {
        // Unknown (deleted, or a server without sweeps): not asked again before the next
        // resynchronisation.
        this._sweeps.unknown(id);
        this._changed.emit();
        return null;
      }
      throw reason;
    }
  }

  /**
   * Cancel a sweep's unfinished runs (POST /evalsched/sweeps/{id}/cancel); the records of its
   * runs come back at once (and through the event stream).
   */
  async cancelSweep(id: string): Promise<ISweepView> {
    const view = await this.api.cancelSweep(id);
    let changed = false;
    for (const record of view.runs ?? []) {
      if (this._records.has(record.id) && this._upsert(record, true)) {
        changed = true;
      }
    }
    this._sweeps.apply(view);
    if (changed) {
      this._onStateChange();
    }
    this._changed.emit();
    return view;
  }

  /** The latest fetched summary of a run: undefined when never fetched, null when none. */
  getSummary(id: string): ISummary | null | undefined {
    return this._summaries.get(id);
  }

  /** Start fetching: a first REST read at once, and the event socket. Idempotent. */
  start(): void {
    if (this._started || this._isDisposed) {
      return;
    }
    this._started = true;
    this._setMode(this._options.useWebSocket ? 'connecting' : 'polling');
    void this._poll.start();
    void this._ledgerPoll.start();
    void this._modelsPoll.start();
    if (this._options.useWebSocket) {
      this._connect();
    }
  }

  /** Apply new settings. */
  configure(options: Partial<IModelOptions>): void {
    const before = this._options;
    this._options = { ...this._options, ...options };
    this._poll.frequency = this._frequency();
    this._ledgerPoll.frequency = this._ledgerFrequency();
    this._modelsPoll.frequency = this._ledgerFrequency();
    if (this._options.finishedLimit !== before.finishedLimit) {
      this._trimFinished();
      this._changed.emit();
    }
    if (!this._started) {
      return;
    }
    if (before.useWebSocket && !this._options.useWebSocket) {
      this._closeSocket();
      this._clearReconnect();
      this._setMode('polling');
      this._poll.frequency = this._frequency();
      void this._poll.refresh();
    } else if (!before.useWebSocket && this._options.useWebSocket) {
      this._connect();
    }
    if (this._options.queueLimit !== before.queueLimit) {
      this._scheduleQueueFetch(); // the head as now asked for
    }
  }

  /** Refetch everything now (the refresh button). */
  async refresh(): Promise<void> {
    if (this._isDisposed) {
      return;
    }
    if (!this._started) {
      this.start();
    } else if (this._options.useWebSocket && !this._socket) {
      this._clearReconnect();
      this._reconnectDelay = RECONNECT_MIN_MS;
      this._connect();
    }
    await this._poll.refresh();
    await this._poll.tick.catch(() => undefined);
  }

  /** Fetch (again) the record and summary of a run. */
  async fetchSummary(id: string): Promise<ISummary | null> {
    const detail = await this.api.getRun(id);
    this._lastSummaryFetch.set(id, Date.now());
    const summary = detail.summary ?? null;
    this._summaries.set(id, summary);
    const record = { ...detail } as IRunRecord;
    delete record.summary;
    if (this._upsert(record, true)) {
      this._changed.emit();
    }
    this._summaryChanged.emit(id);
    return summary;
  }

  /** Cancel a run; the new record comes back at once and through the event stream. */
  async cancel(id: string): Promise<IRunRecord> {
    const record = await this.api.cancelRun(id);
    if (this._upsert(record, true)) {
      this._onStateChange();
    }
    this._changed.emit();
    return record;
  }

  /**
   * Resume a run that failed, was aborted or cancelled: the answer (the run queued again, its
   * attempt one more) moves it from the finished runs to the queue at once; the rest comes through
   * the event stream.
   */
  async resume(id: string): Promise<IRunRecord> {
    const record = await this.api.resumeRun(id);
    if (this._upsert(record, true)) {
      this._onStateChange();
    }
    this._changed.emit();
    return record;
  }

  /**
   * Release a lease (DELETE, idempotent): it leaves the list at once; the ledger and the runs it
   * held back follow with the next read of the queue view (and through the event stream).
   */
  async release(id: string): Promise<void> {
    await this.api.releaseLease(id);
    const before = this._leases.length;
    this._leases = this._leases.filter(l => l.id !== id);
    if (this._leases.length !== before) {
      this._changed.emit();
    }
    this._scheduleQueueFetch();
  }

  /** Submit a spec; the new run appears at once (and through the event stream). */
  async submit(spec: Record<string, unknown>): Promise<IRunRecord> {
    const record = await this.api.submitRun(spec);
    if (this._upsert(record, true)) {
      this._onStateChange();
    }
    this._changed.emit();
    return record;
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._closeSocket();
    this._clearReconnect();
    for (const timer of [this._queueTimer, this._ledgerTimer]) {
      if (timer !== null) {
        clearTimeout(timer);
      }
    }
    for (const timer of this._summaryTimers.values()) {
      clearTimeout(timer);
    }
    this._summaryTimers.clear();
    for (const timer of this._sweepTimers.values()) {
      clearTimeout(timer);
    }
    this._sweepTimers.clear();
    this._poll.dispose();
    this._ledgerPoll.dispose();
    this._modelsPoll.dispose();
    Signal.clearData(this);
  }

  // ---------------------------------------------------------------- socket

  private _connect(): void {
    if (this._isDisposed || this._socket) {
      return;
    }
    let socket: WebSocket;
    try {
      socket = this.api.openEvents(this._queueLimit());
    } catch (reason) {
      console.warn('jupyter-evalsched: cannot open the event socket', reason);
      this._onSocketLost();
      return;
    }
    this._socket = socket;
    let gotSnapshot = false;
    socket.onmessage = (event: MessageEvent) => {
      let message: EventMessage;
      try {
        message = JSON.parse(String(event.data));
      } catch {
        console.warn('jupyter-evalsched: unparsable event', event.data);
        return;
      }
      if (!gotSnapshot && message.type === 'snapshot') {
        gotSnapshot = true;
        this._reconnectDelay = RECONNECT_MIN_MS;
        this._setMode('live');
        // Polling becomes a slow resynchronisation while the socket is live.
        this._poll.frequency = this._frequency();
      }
      this._onMessage(message);
    };
    socket.onclose = () => {
      if (this._socket !== socket) {
        return;
      }
      this._socket = null;
      this._onSocketLost();
    };
    socket.onerror = () => {
      // onclose follows.
    };
  }

  private _onSocketLost(): void {
    if (this._isDisposed) {
      return;
    }
    // Poll the REST API until the socket is back.
    const wasLive = this._mode === 'live';
    if (this._mode !== 'offline') {
      this._setMode('polling');
    }
    this._poll.frequency = this._frequency();
    if (wasLive) {
      void this._poll.refresh();
    }
    // Without the server extension there is no socket to come back to: the poll (backing off)
    // notices when the extension appears and reconnects then.
    if (this._options.useWebSocket && this._error?.kind !== 'missing') {
      this._clearReconnect();
      const delay = this._reconnectDelay;
      this._reconnectDelay = Math.min(delay * 2, RECONNECT_MAX_MS);
      this._reconnectTimer = setTimeout(() => {
        this._reconnectTimer = null;
        this._connect();
      }, delay);
    }
  }

  private _closeSocket(): void {
    const socket = this._socket;
    this._socket = null;
    if (socket) {
      socket.onmessage = null;
      socket.onclose = null;
      socket.onerror = null;
      socket.close();
    }
  }

  private _clearReconnect(): void {
    if (this._reconnectTimer !== null) {
      clearTimeout(this._reconnectTimer);
      this._reconnectTimer = null;
    }
  }

  private _onMessage(message: EventMessage): void {
    switch (message.type) {
      case 'snapshot': {
        const queue = (message as { queue: IQueueView }).queue;
        if (this._applyQueue(queue)) {
          this._setError(null);
          this._changed.emit();
        }
        break;
      }
      case 'run': {
        const record = (message as { run: IRunRecord }).run;
        if (record && typeof record.id === 'string') {
          if (this._upsert(record, true)) {
            this._onStateChange();
          }
          this._changed.emit();
        }
        break;
      }
      case 'lease': {
        const lease = (message as { lease?: ILeaseRecord }).lease;
        if (lease && typeof lease.id === 'string') {
          this._leasesSupported = true;
          this._upsertLease(lease);
          this._changed.emit();
        }
        break;
      }
      case 'warning': {
        const { run_id: id, message: text } = message as {
          run_id?: unknown;
          message?: unknown;
        };
        if (typeof id === 'string' && typeof text === 'string') {
          this._addWarning(id, text);
        }
        break;
      }
      case 'ledger': {
        const ledger = (message as { ledger?: ILedger }).ledger;
        if (ledger && Array.isArray(ledger.devices)) {
          this._setLedger(ledger);
          this._changed.emit();
        }
        break;
      }
      default:
        break;
    }
  }

  /**
   * A lease changed. Granted leases come first, then the queued ones (placed at the end here;
   * their admission order comes with the next read of the queue view). A state change (new,
   * granted, ended) changes the ledger and the reasons of the runs it holds back: re-read the
   * queue view; a change of what its process uses changes the ledger only.
   */
  private _upsertLease(lease: ILeaseRecord): void {
    const at = this._leases.findIndex(l => l.id === lease.id);
    const before = at >= 0 ? this._leases[at] : undefined;
    if (lease.state === 'ended') {
      if (before) {
        this._leases = this._leases.filter(l => l.id !== lease.id);
      }
      this._scheduleQueueFetch();
      return;
    }
    if (before && before.state === lease.state) {
      const list = this._leases.slice();
      list[at] = lease;
      this._leases = list;
      this._scheduleLedgerFetch();
      return;
    }
    const rest = this._leases.filter(l => l.id !== lease.id);
    if (lease.state === 'granted') {
      const firstQueued = rest.findIndex(l => l.state !== 'granted');
      const i = firstQueued < 0 ? rest.length : firstQueued;
      rest.splice(i, 0, lease);
    } else {
      rest.push(lease);
    }
    this._leases = rest;
    this._scheduleQueueFetch();
  }

  /** A `warning` event: the run's record shows it at once (its next record carries it too). */
  private _addWarning(id: string, text: string): void {
    const known = this._records.get(id);
    if (!known) {
      // Not a run we show yet: read it (a re-read brings its warnings along).
      this._queueSummaryFetch(id, 0);
      return;
    }
    const warnings = runWarnings(known);
    if (warnings.includes(text)) {
      return;
    }
    this._upsert({ ...known, warnings: [...warnings, text] }, false);
    this._changed.emit();
  }

  // ---------------------------------------------------------------- REST

  private async _pollTick(): Promise<void> {
    try {
      const [queue] = await Promise.all([
        this.api.getQueue(this._queueLimit()),
        this._fetchFinished()
      ]);
      this._applyQueue(queue);
      this._setError(null);
      this._resyncSweeps();
      this._changed.emit();
      if (
        this._options.useWebSocket &&
        !this._socket &&
        this._reconnectTimer === null
      ) {
        this._connect();
      }
    } catch (reason) {
      this._handleError(reason);
      throw reason; // makes the poll back off
    }
  }

  /** While the socket is live: the ledger, for the VRAM no event reports (unmanaged processes). */
  private async _ledgerTick(): Promise<void> {
    if (this._mode !== 'live' || !this._socket) {
      return; // the queue poll reads the ledger with the queue view
    }
    const epoch = this._ledgerEpoch;
    const ledger = await this.api.getLedger();
    if (
      epoch === this._ledgerEpoch && // else a newer one came meanwhile
      ledger &&
      Array.isArray(ledger.devices) &&
      JSON.stringify(ledger) !== JSON.stringify(this._ledger)
    ) {
      this._setLedger(ledger);
      this._changed.emit();
    }
  }

  /**
   * The shared models' figures. A server that cannot list them (an older one: 404) shows none;
   * other failures make the poll back off (the queue poll reports the server's errors).
   */
  private async _modelsTick(): Promise<void> {
    let models: IModelInfo[];
    try {
      models = modelsOf(await this.api.getModels()) ?? [];
    } catch (reason) {
      if (reason instanceof EvalSchedError && reason.status === 404) {
        models = [];
      } else {
        throw reason;
      }
    }
    if (!sameModels(models, this._models)) {
      this._models = models;
      this._changed.emit();
    }
  }

  /**
   * Replace the ledger. Reads of the ledger alone are dropped when another ledger arrived while
   * they were under way (a queue view read after a lease ended must not be undone by a ledger
   * read sent before).
   */
  private _setLedger(ledger: ILedger): void {
    this._ledger = ledger;
    this._ledgerEpoch++;
    this._readHostUser(ledger);
  }

  /**
   * A ledger of a host shared through a host ledger (its devices list `users`) tells other users'
   * processes apart from this user's by this server's user: read it from the status once (again
   * every few seconds while the link has not said it yet).
   */
  private _readHostUser(ledger: ILedger): void {
    if (
      this._hostUser !== null ||
      this._hostUserReading ||
      Date.now() - this._hostUserReadAt < 5000 ||
      !ledger.devices.some(d => Array.isArray(d.users))
    ) {
      return;
    }
    this._hostUserReading = true;
    this._hostUserReadAt = Date.now();
    this.api
      .getStatus()
      .then(status => {
        const user = status?.host_ledger?.user;
        if (typeof user === 'string' && user && !this.isDisposed) {
          this._hostUser = user;
          this._changed.emit();
        }
      })
      .catch(() => undefined) // an older server, or a moment without it: read again later
      .finally(() => {
        this._hostUserReading = false;
      });
  }

  /** Read the recently finished runs (the event stream's snapshot holds the queue only). */
  private async _fetchFinished(): Promise<void> {
    const limit = this._options.finishedLimit;
    if (limit <= 0) {
      this._finished = [];
      return;
    }
    const list = await this.api.listRuns({
      states: TERMINAL_STATES as string[],
      limit
    });
    if (!list || !Array.isArray(list.runs)) {
      return;
    }
    for (const record of list.runs) {
      this._merge(record);
    }
    // Runs that ended since the list was read (seen through events) stay in.
    const listed = new Set(list.runs.map(r => r.id));
    const extra = this._finished.filter(r => !listed.has(r.id));
    this._finished = [...extra, ...list.runs]
      .map(r => this._records.get(r.id) ?? r)
      .filter(r => isTerminal(r.state));
    this._sortFinished();
    this._trimFinished();
    for (const record of this._finished) {
      if (!this._summaries.has(record.id) && !hasMetrics(record)) {
        this._queueSummaryFetch(record.id, 0);
      }
    }
  }

  /**
   * A run changed state: allocations, the admission order and the pending reasons of the other
   * queued runs may all have changed, and run events do not carry those. Re-read the queue view
   * (coalesced); with a long queue, read the small ledger at once and the view less often.
   */
  private _onStateChange(): void {
    if (this.queuedTotal > LONG_QUEUE) {
      this._scheduleLedgerFetch();
    }
    this._scheduleQueueFetch();
  }

  private _scheduleLedgerFetch(): void {
    if (this._ledgerTimer !== null) {
      return;
    }
    this._ledgerTimer = setTimeout(() => {
      this._ledgerTimer = null;
      const epoch = this._ledgerEpoch;
      this.api
        .getLedger()
        .then(ledger => {
          if (
            epoch === this._ledgerEpoch &&
            ledger &&
            Array.isArray(ledger.devices)
          ) {
            this._setLedger(ledger);
            this._changed.emit();
          }
        })
        .catch(reason => this._handleError(reason));
    }, LEDGER_DEBOUNCE_MS);
  }

  /** Refetch the queue view (authoritative admission order), coalescing bursts. */
  private _scheduleQueueFetch(): void {
    if (this._queueTimer !== null) {
      return;
    }
    const delay =
      this.queuedTotal > LONG_QUEUE
        ? QUEUE_DEBOUNCE_LONG_MS
        : QUEUE_DEBOUNCE_MS;
    this._queueTimer = setTimeout(() => {
      this._queueTimer = null;
      this.api
        .getQueue(this._queueLimit())
        .then(queue => {
          if (this._applyQueue(queue)) {
            this._changed.emit();
          }
        })
        .catch(reason => this._handleError(reason));
    }, delay);
  }

  private _handleError(reason: unknown): void {
    if (reason instanceof ExtensionMissingError) {
      this._setError({ kind: 'missing', message: reason.message });
    } else if (reason instanceof EvalSchedError) {
      this._setError({
        kind: 'error',
        message: `${reason.message} (HTTP ${reason.status})`
      });
    } else if (reason instanceof ServerConnection.NetworkError) {
      this._setError({
        kind: 'error',
        message: 'The Jupyter server cannot be reached.'
      });
      this._setMode('offline');
    } else {
      this._setError({
        kind: 'error',
        message: reason instanceof Error ? reason.message : String(reason)
      });
    }
    this._changed.emit();
  }

  // ---------------------------------------------------------------- state

  /** Replace queue, running and ledger with a queue view. O(n). */
  private _applyQueue(queue: IQueueView): boolean {
    if (
      !queue ||
      !Array.isArray(queue.queued) ||
      !Array.isArray(queue.running)
    ) {
      return false;
    }
    const previous = new Set<string>();
    // Where each queued run was listed: one that was listed early enough must still be within
    // a head read now unless it left the queue (only newcomers can go ahead of it).
    const wasAt = new Map<string, number>();
    this._queued.forEach((r, i) => {
      previous.add(r.id);
      wasAt.set(r.id, i);
    });
    for (const r of this._running) {
      previous.add(r.id);
    }
    const newcomers = queue.queued.filter(r => !wasAt.has(r.id)).length;
    for (const record of queue.queued) {
      this._merge(record);
      previous.delete(record.id);
    }
    for (const record of queue.running) {
      this._merge(record);
      previous.delete(record.id);
    }
    this._queued = queue.queued.map(r => this._records.get(r.id) ?? r);
    this._queuedTotal =
      typeof queue.queued_total === 'number'
        ? Math.max(queue.queued_total, queue.queued.length)
        : queue.queued.length;
    // The head of a longer queue: a queued run missing from it may be beyond it, not ended.
    const head = this._queuedTotal > queue.queued.length;
    this._running = queue.running.map(r => this._records.get(r.id) ?? r);
    this._finished = this._finished.map(r => this._records.get(r.id) ?? r);
    if (queue.ledger && Array.isArray(queue.ledger.devices)) {
      this._setLedger(queue.ledger);
    }
    if (Array.isArray(queue.leases)) {
      this._leasesSupported = true;
      this._leases = queue.leases.filter(
        l => l && typeof l.id === 'string' && l.state !== 'ended'
      );
    } else {
      this._leases = []; // an older server: no leases
    }
    this._loaded = true;
    // Runs that left the queue without an event we saw: they ended; read their final record.
    // From the head of a longer queue, a queued run may instead have been pushed beyond it by
    // newcomers ahead of it: read only those that could not have been.
    for (const id of previous) {
      const known = this._records.get(id);
      const at = wasAt.get(id);
      const pushedOut =
        head &&
        known?.state === 'queued' &&
        (at === undefined || at + newcomers >= queue.queued.length);
      if (known && !isTerminal(known.state) && !pushedOut) {
        this._queueSummaryFetch(id, 0);
      }
    }
    for (const record of this._running) {
      this._maybeFetchRunningSummary(record);
    }
    return true;
  }

  /** Merge a record into the known records, without touching the lists. */
  private _merge(record: IRunRecord): {
    merged: IRunRecord;
    before?: IRunRecord;
  } {
    const before = this._records.get(record.id);
    if (before && attemptOf(record) < attemptOf(before)) {
      // A read made before the run was resumed or retried (attempts only grow): stale.
      return { merged: before, before };
    }
    const merged = before ? { ...before, ...record } : record;
    if (before && !('why' in record) && record.reason !== before.reason) {
      // `why` explains the reason it came with: a record without one (an older server, a
      // partial answer) must not keep the earlier why under a new reason.
      merged.why = null;
    }
    this._records.set(record.id, merged);
    const sweepId = sweepIdOf(merged);
    if (sweepId) {
      this._noteSweepMember(sweepId, merged.id);
    }
    if (before && !isTerminal(before.state) && isTerminal(merged.state)) {
      this._runEnded.emit({ record: merged, previous: before.state });
    }
    if (before) {
      if (
        before.state !== merged.state ||
        before.progress?.done !== merged.progress?.done ||
        before.reason !== merged.reason ||
        before.finished_at !== merged.finished_at ||
        !sameUsage(before, merged) ||
        !sameAttempt(before, merged)
      ) {
        this._runChanged.emit(merged);
      }
    }
    return { merged, before };
  }

  /**
   * Merge a record from an event (or an answer) and move it to the list of its state.
   * Returns true when the run is new or its state changed.
   */
  private _upsert(record: IRunRecord, place: boolean): boolean {
    const { merged, before } = this._merge(record);
    const stateChanged = !before || before.state !== merged.state;
    const progressChanged =
      !before ||
      before.progress?.done !== merged.progress?.done ||
      before.progress?.total !== merged.progress?.total;
    const replace = (list: IRunRecord[]) => {
      const i = list.findIndex(r => r.id === record.id);
      if (i >= 0) {
        list = list.slice();
        list[i] = merged;
      }
      return list;
    };
    this._queued = replace(this._queued);
    this._running = replace(this._running);
    this._finished = replace(this._finished);
    if (place && stateChanged) {
      // The count follows the events until the next read of the queue view sets it. With the
      // whole queue listed, a queued run not among it is new to the queue; with its head only,
      // it may be one beyond the head (its reason changed, say): counted only if it was known
      // elsewhere (a resumed run), listed only within the head.
      const listed = this._queued.some(r => r.id === record.id);
      const complete = this._queuedTotal <= this._queued.length;
      if (listed) {
        this._queuedTotal = Math.max(0, this._queuedTotal - 1);
      }
      const newlyQueued =
        merged.state === 'queued' &&
        (complete || (before !== undefined && before.state !== 'queued'));
      if (newlyQueued) {
        this._queuedTotal++;
      }
      this._queued = this._queued.filter(r => r.id !== record.id);
      this._running = this._running.filter(r => r.id !== record.id);
      this._finished = this._finished.filter(r => r.id !== record.id);
      if (newlyQueued) {
        // Placed by lane now; the scheduler's order (aging, reservations) comes with the next
        // read of the queue view.
        this._insertQueued(
          merged,
          !complete || this._queued.length >= this._queueLimit()
        );
      } else if (merged.state === 'running') {
        this._running.push(merged);
      } else if (isTerminal(merged.state)) {
        this._finished.unshift(merged);
        this._sortFinished();
        this._trimFinished();
      }
    }
    if (isTerminal(merged.state)) {
      // The final summary: read once when we see the run end (unless the record has metrics).
      if (stateChanged && before && !hasMetrics(merged)) {
        this._queueSummaryFetch(record.id, 0);
      }
    } else if (
      merged.state === 'running' &&
      (progressChanged || stateChanged)
    ) {
      this._maybeFetchRunningSummary(merged);
    }
    return stateChanged;
  }

  /**
   * Insert a queued run after the last one of its priority lane or a higher one; where that is
   * the end of the head of a longer queue (`head`), it is beyond the head: not listed.
   */
  private _insertQueued(record: IRunRecord, head: boolean): void {
    const rank = PRIORITY_RANK[record.priority] ?? 1;
    let at = this._queued.length;
    while (
      at > 0 &&
      (PRIORITY_RANK[this._queued[at - 1].priority] ?? 1) > rank
    ) {
      at--;
    }
    if (head && at === this._queued.length) {
      return;
    }
    this._queued.splice(at, 0, record);
  }

  /** The head of the queue to read (the setting, as a whole number of runs, at least 1). */
  private _queueLimit(): number {
    return Math.max(1, Math.floor(this._options.queueLimit));
  }

  private _sortFinished(): void {
    const key = (r: IRunRecord) => r.finished_at ?? r.submitted_at ?? '';
    this._finished.sort((a, b) =>
      key(a) < key(b) ? 1 : key(a) > key(b) ? -1 : 0
    );
  }

  private _trimFinished(): void {
    const limit = Math.max(0, this._options.finishedLimit);
    if (this._finished.length > limit) {
      this._finished = this._finished.slice(0, limit);
    }
  }

  private _maybeFetchRunningSummary(record: IRunRecord): void {
    if (!record.progress || record.progress.done <= 0 || hasMetrics(record)) {
      // Nothing yet, or the server already puts the latest metrics into the record.
      return;
    }
    const summary = this._summaries.get(record.id);
    if (summary && (summary.episodes_done ?? -1) >= record.progress.done) {
      return;
    }
    const last = this._lastSummaryFetch.get(record.id) ?? 0;
    const wait = Math.max(0, last + SUMMARY_THROTTLE_MS - Date.now());
    this._queueSummaryFetch(record.id, wait);
  }

  private _queueSummaryFetch(id: string, delay: number): void {
    if (this._summaryTimers.has(id) || this._isDisposed) {
      return;
    }
    const timer = setTimeout(() => {
      this._summaryTimers.delete(id);
      this.fetchSummary(id).catch(reason => {
        if (reason instanceof EvalSchedError && reason.status === 404) {
          // Deleted meanwhile: forget it.
          this._forget(id);
          this._changed.emit();
        } else {
          console.warn(`jupyter-evalsched: cannot read run ${id}`, reason);
        }
      });
    }, delay);
    this._summaryTimers.set(id, timer);
  }

  // ---------------------------------------------------------------- sweeps

  /** A run of a sweep: remember it, and read the sweep when this run is news to it. */
  private _noteSweepMember(sweepId: string, runId: string): void {
    if (this._sweeps.note(sweepId, runId)) {
      this._scheduleSweepFetch(sweepId);
    }
  }

  private _scheduleSweepFetch(id: string, delay = SWEEP_DEBOUNCE_MS): void {
    if (this._sweepTimers.has(id) || this._isDisposed || !this._started) {
      return;
    }
    const timer = setTimeout(() => {
      this._sweepTimers.delete(id);
      this.fetchSweep(id).catch(reason =>
        console.warn(`jupyter-evalsched: cannot read sweep ${id}`, reason)
      );
    }, delay);
    this._sweepTimers.set(id, timer);
  }

  /**
   * With each resynchronisation: re-read the sweeps that have runs in the lists (not more often
   * than the live resynchronisation), and forget those that have none.
   */
  private _resyncSweeps(): void {
    const listed = new Set<string>();
    for (const list of [this._queued, this._running, this._finished]) {
      for (const record of list) {
        const sweepId = sweepIdOf(record);
        if (sweepId) {
          listed.add(sweepId);
        }
      }
    }
    for (const id of this._sweeps.resync(listed, LIVE_RESYNC_MS)) {
      this._scheduleSweepFetch(id, 0);
    }
  }

  private _forget(id: string): void {
    this._records.delete(id);
    this._summaries.delete(id);
    this._lastSummaryFetch.delete(id);
    this._queued = this._queued.filter(r => r.id !== id);
    this._running = this._running.filter(r => r.id !== id);
    this._finished = this._finished.filter(r => r.id !== id);
  }

  private _setMode(mode: ConnectionMode): void {
    if (this._mode !== mode) {
      this._mode = mode;
      this._changed.emit();
    }
  }

  private _setError(error: IModelError | null): void {
    this._error = error;
    if (error === null && this._mode === 'offline') {
      this._mode = this._socket ? 'live' : 'polling';
    }
  }

  private _ledgerFrequency(): {
    interval: number;
    max: number;
    backoff: boolean;
  } {
    const interval = Math.max(1, this._options.refreshInterval) * 1000;
    const max = Math.max(interval, this._options.maxRefreshInterval * 1000);
    return { interval, max, backoff: true };
  }

  private _frequency(): { interval: number; max: number; backoff: boolean } {
    const fast = Math.max(0.5, this._options.refreshInterval) * 1000;
    const max = Math.max(
      fast,
      LIVE_RESYNC_MS,
      this._options.maxRefreshInterval * 1000
    );
    const interval = this._mode === 'live' ? LIVE_RESYNC_MS : fast;
    return { interval, max, backoff: true };
  }

  private _options: IModelOptions;
  private _poll: Poll;
  private _ledgerPoll: Poll;
  private _modelsPoll: Poll;
  private _models: IModelInfo[] = [];
  private _socket: WebSocket | null = null;
  private _reconnectTimer: ReturnType<typeof setTimeout> | null = null;
  private _reconnectDelay = RECONNECT_MIN_MS;
  private _queueTimer: ReturnType<typeof setTimeout> | null = null;
  private _ledgerTimer: ReturnType<typeof setTimeout> | null = null;
  private _summaryTimers = new Map<string, ReturnType<typeof setTimeout>>();
  private _lastSummaryFetch = new Map<string, number>();
  private _records = new Map<string, IRunRecord>();
  private _summaries = new Map<string, ISummary | null>();
  private _sweeps = new SweepBook();
  private _sweepTimers = new Map<string, ReturnType<typeof setTimeout>>();
  private _queued: IRunRecord[] = [];
  private _queuedTotal = 0;
  private _running: IRunRecord[] = [];
  private _finished: IRunRecord[] = [];
  private _ledger: ILedger | null = null;
  private _ledgerEpoch = 0;
  private _hostUser: string | null = null;
  private _hostUserReading = false;
  private _hostUserReadAt = 0;
  private _leases: ILeaseRecord[] = [];
  private _leasesSupported = false;
  private _mode: ConnectionMode = 'connecting';
  private _error: IModelError | null = null;
  private _loaded = false;
  private _started = false;
  private _isDisposed = false;
  private _changed = new Signal<this, void>(this);
  private _summaryChanged = new Signal<this, string>(this);
  private _runChanged = new Signal<this, IRunRecord>(this);
  private _runEnded = new Signal<this, IRunEnd>(this);
}
