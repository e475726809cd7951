/**
 * The side panel: the host's VRAM ledger (runs, leases and the VRAM of other processes, per
 * holder), the live leases, the queue in admission order, the running runs with their progress
 * and latest metrics, and the recently finished runs. Plain DOM on a Lumino widget, keyed by run
 * (and lease) id so that an open detail survives live updates. This is the shell that wires the
 * components: LedgerView, RunRow, SweepRow, LeaseRow, SubmitForm (each in its own module).
 */
import { TranslationBundle } from '@jupyterlab/translation';
import { refreshIcon } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { ICompareTarget, ILeaseRecord, IRunRecord } from './api';
import { badgeLabels, resumeRun } from './detail';
import { confirmCancel, confirmCancelSweep, confirmRelease } from './dialogs';
import { reconcile } from './dom';
import { h, IBadgeLabels } from './format';
import { evalschedIcon } from './icon';
import { LeaseRow } from './leaseRow';
import { assignColors } from './ledgerGeometry';
import { LedgerView } from './ledgerView';
import { EvalSchedModel } from './model';
import { ModelRow } from './modelRow';
import { IRowHost } from './rowHost';
import { RunRow } from './runRow';
import { SubmitForm } from './submitForm';
import {
  groupRuns,
  queuedNotShown,
  Section,
  SECTIONS,
  sectionOf
} from './sweeps';
import { SweepRow } from './sweepRow';

/** The DOM id of the panel (public contract). */
export const PANEL_ID = 'jupyter-evalsched-panel';

/** Queued runs shown at most; the rest is counted. */
const MAX_QUEUED_SHOWN = 200;
/** Runs of an expanded sweep shown at most; the rest is counted. */
const MAX_SWEEP_RUNS_SHOWN = 200;
/** Notification decisions kept in the panel's `data-notified` (a test hook). */
const MAX_NOTIFIED_KEPT = 30;

export interface IPanelOptions {
  model: EvalSchedModel;
  trans: TranslationBundle;
  logTail: number;
  /** Open the detail of a run in a main-area tab. */
  openInTab: (id: string) => void;
  /** Open the comparison of runs (or of a sweep's runs) in a main-area tab. */
  openCompare?: (target: ICompareTarget) => void;
}

export class EvalSchedPanel extends Widget implements IRowHost {
  constructor(options: IPanelOptions) {
    super();
    this.model = options.model;
    this._trans = options.trans;
    this._logTail = options.logTail;
    this._badgeLabels = badgeLabels(options.trans);
    this._openInTab = options.openInTab;
    this._openCompare = options.openCompare ?? null;
    const trans = this._trans;

    this.id = PANEL_ID;
    this.addClass('jp-EvalSched');
    this.title.icon = evalschedIcon;
    this.title.caption = trans.__('Evaluation scheduler');
    this.node.setAttribute('data-testid', 'evalsched-panel');

    // Header
    this._conn = h('span', {
      className: 'jp-EvalSched-conn',
      attrs: { 'data-testid': 'evalsched-connection' }
    });
    const refresh = h('button', {
      className: 'jp-EvalSched-iconButton',
      title: trans.__('Refresh'),
      attrs: { type: 'button', 'data-testid': 'evalsched-refresh' }
    });
    refresh.append(refreshIcon.element({ tag: 'span' }));
    refresh.addEventListener('click', () => {
      void this.model.refresh();
    });
    const header = h('div', { className: 'jp-EvalSched-header' }, [
      h('h2', {
        className: 'jp-EvalSched-title',
        text: trans.__('Eval scheduler')
      }),
      this._conn,
      h('span', { className: 'jp-EvalSched-spacer' }),
      refresh
    ]);

    this._banner = h('div', {
      className: 'jp-EvalSched-banner',
      attrs: { 'data-testid': 'evalsched-error', role: 'alert' }
    });
    this._banner.hidden = true;

    // Runs selected for a comparison
    this._selectionText = h('span', {
      className: 'jp-EvalSched-selectionText'
    });
    this._compareSelected = h('button', {
      className: 'jp-EvalSched-textButton jp-EvalSched-compareButton',
      attrs: { type: 'button', 'data-testid': 'evalsched-compare-selected' }
    });
    this._compareSelected.addEventListener('click', () => {
      if (this._selected.length >= 2) {
        this.openCompare({ runs: [...this._selected] });
      }
    });
    const clear = h('button', {
      className: 'jp-EvalSched-textButton',
      text: trans.__('Clear'),
      title: trans.__('Clear the selection'),
      attrs: { type: 'button', 'data-testid': 'evalsched-selection-clear' }
    });
    clear.addEventListener('click', () => this.clearSelection());
    this._selectionBar = h(
      'div',
      {
        className: 'jp-EvalSched-selection',
        attrs: { 'data-testid': 'evalsched-selection', 'data-count': '0' }
      },
      [
        this._selectionText,
        h('span', { className: 'jp-EvalSched-spacer' }),
        this._compareSelected,
        clear
      ]
    );
    this._selectionBar.hidden = true;

    // Ledger
    this._ledger = new LedgerView({
      trans,
      runName: id => this.model.getRun(id)?.name,
      colorOf: id => this.colorOf(id),
      colorKey: () => [...this._colors],
      me: () => this.model.hostUser
    });
    const ledgerSection = this._section(trans.__('Resources'), 'ledger', [
      this._ledger.gpus,
      this._ledger.cpu
    ]);

    // Shared models: shown when the host has some.
    this._modelList = h('div', {
      className: 'jp-EvalSched-list',
      attrs: { 'data-section': 'models', 'data-testid': 'evalsched-models' }
    });
    this._modelCount = h('span', { className: 'jp-EvalSched-count' });
    this._modelSection = this._section(
      trans.__('Shared models'),
      'models',
      [this._modelList],
      this._modelCount
    );
    this._modelSection.title = trans.__(
      'Models loaded once for the whole host, behind an OpenAI-compatible API'
    );
    this._modelSection.hidden = true;

    // Leases: shown once the server says it knows them (an older one does not).
    this._leaseList = h('div', {
      className: 'jp-EvalSched-list',
      attrs: { 'data-section': 'leases', 'data-testid': 'evalsched-leases' }
    });
    this._leaseEmpty = h('div', {
      className: 'jp-EvalSched-empty',
      text: trans.__('No VRAM is leased for interactive work.')
    });
    this._leaseCount = h('span', { className: 'jp-EvalSched-count' });
    this._leaseSection = this._section(
      trans.__('Leases'),
      'leases',
      [this._leaseList, this._leaseEmpty],
      this._leaseCount
    );
    this._leaseSection.title = trans.__(
      'VRAM held for interactive work (notebook kernels), admitted like runs'
    );
    this._leaseSection.hidden = true;

    // Run lists
    const makeList = (section: Section) =>
      h('div', {
        className: 'jp-EvalSched-list',
        attrs: {
          'data-section': section,
          'data-testid': `evalsched-${section}`
        }
      });
    this._lists = {
      running: makeList('running'),
      queued: makeList('queued'),
      finished: makeList('finished')
    };
    this._empty = {
      running: h('div', {
        className: 'jp-EvalSched-empty',
        text: trans.__('Nothing is running.')
      }),
      queued: h('div', {
        className: 'jp-EvalSched-empty',
        text: trans.__('The queue is empty.')
      }),
      finished: h('div', {
        className: 'jp-EvalSched-empty',
        text: trans.__('No finished runs yet.')
      })
    };
    this._counts = {
      running: h('span', { className: 'jp-EvalSched-count' }),
      queued: h('span', { className: 'jp-EvalSched-count' }),
      finished: h('span', { className: 'jp-EvalSched-count' })
    };
    this._more = h('div', {
      className: 'jp-EvalSched-more',
      attrs: { 'data-testid': 'evalsched-queued-more' }
    });
    const running = this._section(
      trans.__('Running'),
      'running',
      [this._lists.running, this._empty.running],
      this._counts.running
    );
    const queued = this._section(
      trans.__('Queued'),
      'queued',
      [this._lists.queued, this._more, this._empty.queued],
      this._counts.queued
    );
    const finished = this._section(
      trans.__('Recently finished'),
      'finished',
      [this._lists.finished, this._empty.finished],
      this._counts.finished
    );

    this._form = new SubmitForm(this.model, trans);

    const body = h('div', { className: 'jp-EvalSched-body' }, [
      ledgerSection,
      this._modelSection,
      this._leaseSection,
      running,
      queued,
      finished,
      this._form.node
    ]);
    this.node.append(header, this._banner, this._selectionBar, body);

    this.model.changed.connect(this._onModelChanged, this);
    this.model.summaryChanged.connect(this._onSummaryChanged, this);
    this.update();
  }

  readonly model: EvalSchedModel;

  /** Lines of log shown in a run's detail. */
  get logTail(): number {
    return this._logTail;
  }
  set logTail(value: number) {
    this._logTail = value;
    for (const row of this._rows.values()) {
      row.logTail = value;
    }
  }

  /** Expand (or collapse) the inline detail of a run. */
  toggleDetail(id: string, open?: boolean): void {
    this._rows.get(id)?.toggle(open);
  }

  /**
   * Expand a sweep's row and scroll it into view (briefly highlighted). False when the panel
   * does not list that sweep.
   */
  revealSweep(id: string): boolean {
    this._render();
    const row = this._sweepRows.get(id);
    if (!row) {
      return false;
    }
    row.toggle(true);
    row.node.scrollIntoView({ block: 'nearest' });
    row.highlight();
    return true;
  }

  /** The runs selected for a comparison, in the order they were selected. */
  get selection(): ReadonlyArray<string> {
    return this._selected;
  }

  /** @internal */
  isSelected(id: string): boolean {
    return this._selected.includes(id);
  }

  /** Select (or unselect) a run for a comparison. */
  setSelected(id: string, selected: boolean): void {
    const has = this._selected.includes(id);
    if (selected === has) {
      return;
    }
    this._selected = selected
      ? [...this._selected, id]
      : this._selected.filter(r => r !== id);
    this._syncSelection();
  }

  clearSelection(): void {
    if (this._selected.length) {
      this._selected = [];
      this._syncSelection();
    }
  }

  /**
   * @internal Record what was decided for a run or sweep that ended (`<id>:<kind>`, kind one of
   * error, success, info, off, sweep): the panel's `data-notified`, a test hook.
   */
  noteNotification(entry: string): void {
    this._notified = [...this._notified, entry].slice(-MAX_NOTIFIED_KEPT);
    this.node.dataset.notified = this._notified.join(' ');
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._stopTicker();
    for (const row of this._rows.values()) {
      row.dispose();
    }
    this._rows.clear();
    for (const row of this._sweepRows.values()) {
      row.dispose();
    }
    this._sweepRows.clear();
    for (const row of this._leaseRows.values()) {
      row.dispose();
    }
    this._leaseRows.clear();
    for (const row of this._modelRows.values()) {
      row.dispose();
    }
    this._modelRows.clear();
    this.model.changed.disconnect(this._onModelChanged, this);
    this.model.summaryChanged.disconnect(this._onSummaryChanged, this);
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this.model.start();
    this._startTicker();
    this.update();
  }

  protected onBeforeHide(msg: Message): void {
    super.onBeforeHide(msg);
    this._stopTicker();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    if (this.isVisible) {
      this.model.start();
      this._startTicker();
    }
  }

  protected onBeforeDetach(msg: Message): void {
    this._stopTicker();
    super.onBeforeDetach(msg);
  }

  protected onUpdateRequest(msg: Message): void {
    super.onUpdateRequest(msg);
    this._render();
  }

  private _onModelChanged(): void {
    this.update();
  }

  private _onSummaryChanged(_: EvalSchedModel, id: string): void {
    const row = this._rows.get(id);
    const record = this.model.getRun(id);
    if (row && record) {
      row.update(record, row.section, row.position);
    }
  }

  private _section(
    title: string,
    key: string,
    children: HTMLElement[],
    count?: HTMLElement
  ): HTMLElement {
    return h(
      'section',
      { className: 'jp-EvalSched-section', attrs: { 'data-section': key } },
      [
        h('h3', { className: 'jp-EvalSched-sectionTitle' }, [
          title,
          count ?? null
        ]),
        ...children
      ]
    );
  }

  // ---------------------------------------------------------------- render

  private _render(): void {
    const model = this.model;
    const trans = this._trans;

    // Connection and errors
    const mode = model.mode;
    this._conn.dataset.mode = mode;
    this._conn.textContent =
      mode === 'live'
        ? trans.__('live')
        : mode === 'polling'
          ? trans.__('polling')
          : mode === 'offline'
            ? trans.__('offline')
            : trans.__('connecting…');
    this._conn.title =
      mode === 'live'
        ? trans.__('Live updates through the event socket')
        : mode === 'polling'
          ? trans.__('The event socket is unavailable: polling the REST API')
          : '';
    const error = model.error;
    this._banner.hidden = !error;
    this.node.dataset.error = error ? error.kind : '';
    if (error) {
      this._banner.dataset.kind = error.kind;
      this._banner.replaceChildren(
        h('strong', {
          text:
            error.kind === 'missing'
              ? trans.__('jupyter_evalsched server extension is not enabled')
              : trans.__('Cannot reach the scheduler')
        }),
        h('div', {
          text:
            error.kind === 'missing'
              ? trans.__(
                  'The Jupyter server does not serve /evalsched/. Install jupyter_evalsched in the server’s environment and enable it: jupyter server extension enable jupyter_evalsched'
                )
              : error.message
        })
      );
    }
    this.node.dataset.loaded = String(model.loaded);

    assignColors(this._colors, model.ledger);
    this._ledger.render(model.ledger);
    this._renderModels();
    this._renderLeases();
    this._renderRuns();
  }

  /** The shared models, keyed by name, in the server's order. */
  private _renderModels(): void {
    const models = this.model.models;
    this._modelSection.hidden = models.length === 0;
    const names = new Set(models.map(m => m.name));
    for (const [name, row] of this._modelRows) {
      if (!names.has(name)) {
        row.dispose();
        this._modelRows.delete(name);
      }
    }
    const nodes = models.map(info => {
      let row = this._modelRows.get(info.name);
      if (!row) {
        row = new ModelRow(
          info.name,
          this._trans,
          this.model.api.serverSettings.baseUrl
        );
        this._modelRows.set(info.name, row);
      }
      row.update(info);
      return row.node;
    });
    reconcile(this._modelList, nodes);
    this._modelCount.textContent = String(models.length);
  }

  /** The live leases, keyed by id (granted first, then queued in admission order). */
  private _renderLeases(): void {
    const model = this.model;
    this._leaseSection.hidden = !model.leasesSupported;
    const leases = model.leases;
    const live = new Set(leases.map(l => l.id));
    for (const [id, row] of this._leaseRows) {
      if (!live.has(id)) {
        row.dispose();
        this._leaseRows.delete(id);
      }
    }
    const list = this._leaseList;
    leases.forEach((lease, index) => {
      let row = this._leaseRows.get(lease.id);
      if (!row) {
        row = new LeaseRow(lease.id, this);
        this._leaseRows.set(lease.id, row);
      }
      row.update(lease);
      if (list.children[index] !== row.node) {
        list.insertBefore(row.node, list.children[index] ?? null);
      }
    });
    while (list.children.length > leases.length) {
      list.lastElementChild!.remove();
    }
    this._leaseEmpty.hidden = leases.length > 0 || !model.loaded;
    this._leaseCount.textContent = String(leases.length);
  }

  private _renderRuns(): void {
    const model = this.model;
    const { items, covered } = groupRuns(model, MAX_QUEUED_SHOWN);

    // A sweep's queued runs show their place in the admission order.
    const queuedAt = new Map<string, number>();
    model.queued.forEach((r, i) => queuedAt.set(r.id, i));

    const shownRuns = new Set<string>();
    const shownSweeps = new Set<string>();
    const runRow = (record: IRunRecord, section: Section, position: number) => {
      let row = this._rows.get(record.id);
      if (!row) {
        row = new RunRow(record.id, this);
        this._rows.set(record.id, row);
      }
      row.update(record, section, position);
      shownRuns.add(record.id);
      return row.node;
    };
    // What each section's count says: its rows as shown (a sweep is one row), and how many runs
    // they hold where that differs.
    const runsIn: Record<Section, number> = {
      running: 0,
      queued: 0,
      finished: 0
    };
    for (const section of SECTIONS) {
      const nodes: HTMLElement[] = [];
      items[section].forEach((item, index) => {
        if (item.kind === 'run') {
          nodes.push(runRow(item.record, section, item.position));
          runsIn[section]++;
          return;
        }
        let sweep = this._sweepRows.get(item.id);
        if (!sweep) {
          sweep = new SweepRow(item.id, this);
          this._sweepRows.set(item.id, sweep);
        }
        sweep.update(item.members, item.counts, section, index);
        shownSweeps.add(item.id);
        nodes.push(sweep.node);
        runsIn[section] += item.members.length;
        if (sweep.expanded) {
          const shown = item.members.slice(0, MAX_SWEEP_RUNS_SHOWN);
          sweep.setRuns(
            shown.map((record, i) => {
              const own = sectionOf(record.state);
              return runRow(
                record,
                own,
                own === 'queued' ? (queuedAt.get(record.id) ?? i) : i
              );
            }),
            item.members.length - shown.length
          );
        } else {
          sweep.setRuns([], 0);
        }
      });
      reconcile(this._lists[section], nodes);
      this._empty[section].hidden = nodes.length > 0 || !model.loaded;
    }
    for (const [id, row] of this._rows) {
      if (!shownRuns.has(id)) {
        row.dispose();
        this._rows.delete(id);
      }
    }
    for (const [id, row] of this._sweepRows) {
      if (!shownSweeps.has(id)) {
        row.dispose();
        this._sweepRows.delete(id);
      }
    }
    const hidden = queuedNotShown(model.queued, model.queuedTotal, {
      items,
      covered
    });
    for (const section of SECTIONS) {
      // Queued runs beyond those shown are rows too ("… and N more queued").
      const more = section === 'queued' ? hidden : 0;
      const rows = items[section].length + more;
      const runs = runsIn[section] + more;
      const count = this._counts[section];
      // The rows as shown; the runs they hold in the tooltip where a sweep's row holds several.
      count.textContent = String(rows);
      count.dataset.rows = String(rows);
      count.dataset.runs = String(runs);
      count.title =
        runs === rows
          ? this._trans._n('%1 run', '%1 runs', runs)
          : this._trans.__('%1 runs in %2 rows', runs, rows);
    }
    this._more.hidden = hidden <= 0;
    this._more.textContent = this._trans.__('… and %1 more queued', hidden);
    this._syncSelection();
    this._tick();
  }

  /** The selection bar and the rows' checkboxes. */
  private _syncSelection(): void {
    const trans = this._trans;
    const n = this._selected.length;
    this._selectionBar.hidden = n === 0;
    this._selectionBar.dataset.count = String(n);
    this._selectionText.textContent = trans._n(
      '%1 run selected',
      '%1 runs selected',
      n
    );
    this._compareSelected.textContent = trans.__('Compare (%1)', n);
    this._compareSelected.disabled = n < 2 || !this._openCompare;
    this._compareSelected.title =
      n < 2
        ? trans.__('Select at least two runs to compare them')
        : trans.__(
            'Compare the selected runs side by side (the first selected is the baseline)'
          );
    for (const row of this._rows.values()) {
      row.setSelected(this._selected.includes(row.id));
    }
  }

  /** @internal The colour slot of a run holding GPU memory. */
  colorOf(id: string): number | undefined {
    return this._colors.get(id);
  }

  // ---------------------------------------------------------------- elapsed-time ticker

  private _startTicker(): void {
    if (this._ticker === null) {
      this._ticker = setInterval(() => this._tick(), 1000);
    }
  }

  private _stopTicker(): void {
    if (this._ticker !== null) {
      clearInterval(this._ticker);
      this._ticker = null;
    }
  }

  private _tick(): void {
    const now = Date.now();
    for (const row of this._rows.values()) {
      row.tick(now);
    }
    for (const row of this._leaseRows.values()) {
      row.tick(now);
    }
    for (const row of this._sweepRows.values()) {
      row.tick(now);
    }
  }

  // ---------------------------------------------------------------- used by rows

  /** @internal */
  get trans(): TranslationBundle {
    return this._trans;
  }

  /** @internal The badge words of run rows, translated. */
  get badgeLabels(): IBadgeLabels {
    return this._badgeLabels;
  }

  /** @internal */
  openInTab(id: string): void {
    this._openInTab(id);
  }

  /** Open the comparison of runs, or of a sweep's runs, in a main-area tab. */
  openCompare(target: ICompareTarget): void {
    this._openCompare?.(target);
  }

  /** @internal Whether a comparison can be opened (the panel was given a way to). */
  get canCompare(): boolean {
    return this._openCompare !== null;
  }

  /** @internal Ask for confirmation, then cancel a sweep's unfinished runs. */
  confirmCancelSweep(
    id: string,
    name: string,
    unfinished: number
  ): Promise<void> {
    return confirmCancelSweep(this.model, this._trans, id, name, unfinished);
  }

  /** @internal Ask for confirmation, then cancel. */
  confirmCancel(record: IRunRecord): Promise<void> {
    return confirmCancel(this.model, this._trans, record);
  }

  /** @internal Resume a run that ended without succeeding (no confirmation: nothing is lost). */
  async resume(record: IRunRecord): Promise<void> {
    await resumeRun(this.model, record.id, this._trans);
  }

  /** @internal Ask for confirmation, then release a lease (DELETE /evalsched/leases/{id}). */
  confirmRelease(lease: ILeaseRecord): Promise<void> {
    return confirmRelease(this.model, this._trans, lease);
  }

  private _trans: TranslationBundle;
  private _badgeLabels: IBadgeLabels;
  private _logTail: number;
  private _openInTab: (id: string) => void;
  private _openCompare: ((target: ICompareTarget) => void) | null;
  private _selected: string[] = [];
  private _selectionBar: HTMLElement;
  private _selectionText: HTMLElement;
  private _compareSelected: HTMLButtonElement;
  private _sweepRows = new Map<string, SweepRow>();
  private _notified: string[] = [];
  private _conn: HTMLElement;
  private _banner: HTMLElement;
  private _ledger: LedgerView;
  private _more: HTMLElement;
  private _form: SubmitForm;
  private _lists: Record<Section, HTMLElement>;
  private _empty: Record<Section, HTMLElement>;
  private _counts: Record<Section, HTMLElement>;
  private _rows = new Map<string, RunRow>();
  private _leaseSection: HTMLElement;
  private _leaseList: HTMLElement;
  private _leaseEmpty: HTMLElement;
  private _leaseCount: HTMLElement;
  private _leaseRows = new Map<string, LeaseRow>();
  private _modelSection: HTMLElement;
  private _modelList: HTMLElement;
  private _modelCount: HTMLElement;
  private _modelRows = new Map<string, ModelRow>();
  private _colors = new Map<string, number>();
  private _ticker: ReturnType<typeof setInterval> | null = null;
}
