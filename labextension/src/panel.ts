/**
 * The side panel: the host's VRAM ledger, the queue in admission order, the running runs with
 * their progress and latest metrics, and the recently finished runs. Plain DOM on a Lumino
 * widget, keyed by run id so that an open detail survives live updates.
 */
import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import { TranslationBundle } from '@jupyterlab/translation';
import {
  caretDownIcon,
  caretRightIcon,
  closeIcon,
  refreshIcon
} from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import {
  EvalSchedError,
  ILedger,
  ILedgerDevice,
  IRunRecord,
  ISummary,
  isTerminal
} from './api';
import { RunDetailView } from './detail';
import {
  colorSlot,
  executorOf,
  formatAgo,
  formatDuration,
  formatMB,
  formatNumber,
  h,
  isSlurm,
  parseTime,
  slurmLabel,
  splitReason
} from './format';
import { evalschedIcon } from './icon';
import { EvalSchedModel, latestMetrics } from './model';

/** The DOM id of the panel (public contract). */
export const PANEL_ID = 'jupyter-evalsched-panel';

/** Queued runs shown at most; the rest is counted. */
const MAX_QUEUED_SHOWN = 200;
/** Metrics shown on a row at most (all are in the detail). */
const MAX_ROW_METRICS = 4;
/** Colour slots of runs (CSS classes jp-EvalSched-c0 … c7). */
const COLOR_SLOTS = 8;

type Section = 'running' | 'queued' | 'finished';

export interface IPanelOptions {
  model: EvalSchedModel;
  trans: TranslationBundle;
  logTail: number;
  /** Open the detail of a run in a main-area tab. */
  openInTab: (id: string) => void;
}

export class EvalSchedPanel extends Widget {
  constructor(options: IPanelOptions) {
    super();
    this.model = options.model;
    this._trans = options.trans;
    this._logTail = options.logTail;
    this._openInTab = options.openInTab;
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

    // Ledger
    this._gpus = h('div', {
      className: 'jp-EvalSched-gpus',
      attrs: { 'data-testid': 'evalsched-ledger' }
    });
    this._cpu = h('div', { className: 'jp-EvalSched-cpu' });
    const ledgerSection = this._section(trans.__('Resources'), 'ledger', [
      this._gpus,
      this._cpu
    ]);

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
    this._more = h('div', { className: 'jp-EvalSched-more' });
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
      running,
      queued,
      finished,
      this._form.node
    ]);
    this.node.append(header, this._banner, body);

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

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._stopTicker();
    for (const row of this._rows.values()) {
      row.dispose();
    }
    this._rows.clear();
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

    this._assignColors(model.ledger);
    this._renderLedger(model.ledger);
    this._renderRuns();
  }

  private _renderLedger(ledger: ILedger | null): void {
    const trans = this._trans;
    // Rebuild only when something shown changed (progress events re-render the panel often).
    const key = JSON.stringify([
      ledger,
      [...this._colors],
      (ledger?.devices ?? []).flatMap(d =>
        (d.runs ?? []).map(r => this.model.getRun(r.id)?.name)
      )
    ]);
    if (key === this._ledgerKey) {
      return;
    }
    this._ledgerKey = key;
    this._gpus.replaceChildren();
    this._cpu.replaceChildren();
    if (!ledger) {
      this._gpus.append(
        h('div', {
          className: 'jp-EvalSched-empty',
          text: trans.__('Loading…')
        })
      );
      return;
    }
    if (!ledger.devices.length) {
      this._gpus.append(
        h('div', {
          className: 'jp-EvalSched-empty',
          text: trans.__('No GPU on this host: runs use CPU slots.')
        })
      );
    }
    for (const device of ledger.devices) {
      this._gpus.append(this._renderDevice(device));
    }
    const cpu = ledger.cpu_slots;
    if (cpu) {
      const pct =
        cpu.total > 0 ? Math.min(100, (100 * cpu.allocated) / cpu.total) : 0;
      const fill = h('div', { className: 'jp-EvalSched-cpuFill' });
      fill.style.width = `${pct}%`;
      this._cpu.dataset.total = String(cpu.total);
      this._cpu.dataset.allocated = String(cpu.allocated);
      this._cpu.append(
        h('div', { className: 'jp-EvalSched-gpuHead' }, [
          h('span', {
            className: 'jp-EvalSched-gpuName',
            text: trans.__('CPU slots')
          }),
          h('span', {
            className: 'jp-EvalSched-gpuNums',
            text: trans.__('%1 / %2 in use', cpu.allocated, cpu.total)
          })
        ]),
        h('div', { className: 'jp-EvalSched-cpuBar' }, [fill])
      );
    }
  }

  private _renderDevice(device: ILedgerDevice): HTMLElement {
    const trans = this._trans;
    const unmanaged = Math.max(0, device.unmanaged_mb ?? 0);
    const baseline = Math.max(0, device.baseline_mb);
    const usable = Math.max(0, device.usable_mb);
    const free = Math.max(0, device.free_mb);
    const runs = device.runs ?? [];
    const runsSum = runs.reduce(
      (a, r) => a + Math.max(0, r.marginal_vram_mb),
      0
    );
    // An exclusive run allocates the whole usable memory, more than it declared.
    const allocated = Math.max(0, device.allocated_mb, runsSum);
    const scale = Math.max(
      device.total_mb,
      baseline + usable,
      baseline + allocated + unmanaged + free,
      1
    );
    const pct = (mb: number) => `${(100 * mb) / scale}%`;

    const bar = h('div', {
      className: 'jp-EvalSched-bar',
      attrs: {
        role: 'img',
        'aria-label': trans.__(
          'GPU %1: %2 allocated, %3 free of %4 usable',
          device.index,
          formatMB(device.allocated_mb),
          formatMB(free),
          formatMB(usable)
        )
      }
    });
    const seg = (
      kind: string,
      mb: number,
      title: string,
      attrs: Record<string, string> = {}
    ) => {
      if (mb <= 0) {
        return;
      }
      const el = h('div', {
        className: `jp-EvalSched-seg jp-EvalSched-seg-${kind}`,
        title,
        attrs: { 'data-kind': kind, 'data-mb': String(mb), ...attrs }
      });
      el.style.width = pct(mb);
      bar.append(el);
      return el;
    };
    seg(
      'baseline',
      baseline,
      trans.__('Shared models (baseline): %1', formatMB(baseline))
    );
    const exclusiveExtra = Math.max(0, allocated - runsSum);
    for (const run of runs) {
      const record = this.model.getRun(run.id);
      let mb = Math.max(0, run.marginal_vram_mb);
      if (device.exclusive === run.id) {
        mb += exclusiveExtra;
      }
      const label = record ? `${record.name} (${run.id})` : run.id;
      const el = seg(
        'run',
        mb,
        device.exclusive === run.id
          ? trans.__('%1: %2, exclusive', label, formatMB(mb))
          : trans.__('%1: %2', label, formatMB(mb)),
        { 'data-run-id': run.id }
      );
      el?.classList.add(
        `jp-EvalSched-c${this.colorOf(run.id) ?? colorSlot(run.id, COLOR_SLOTS)}`
      );
    }
    if (!runs.length && allocated > 0) {
      seg('run', allocated, trans.__('Allocated: %1', formatMB(allocated)));
    }
    seg(
      'unmanaged',
      unmanaged,
      trans.__(
        'Not managed by the scheduler (other processes): %1',
        formatMB(unmanaged)
      )
    );
    seg('free', free, trans.__('Free: %1', formatMB(free)));
    const rest = scale - baseline - allocated - unmanaged - free;
    seg(
      'reserved',
      rest,
      trans.__('Reserved or otherwise unusable: %1', formatMB(rest))
    );

    const legend = h('div', { className: 'jp-EvalSched-legend' }, [
      baseline > 0
        ? legendItem(
            'baseline',
            trans.__('shared models %1', formatMB(baseline))
          )
        : null,
      unmanaged > 0
        ? legendItem('unmanaged', trans.__('unmanaged %1', formatMB(unmanaged)))
        : null,
      device.exclusive
        ? h('span', {
            className: 'jp-EvalSched-tag',
            text: trans.__('exclusive')
          })
        : null,
      h('span', {
        className: 'jp-EvalSched-legendFree',
        text: trans.__('%1 free', formatMB(free)),
        attrs: { 'data-kind': 'free' }
      })
    ]);

    return h(
      'div',
      {
        className: 'jp-EvalSched-gpu',
        attrs: {
          'data-index': String(device.index),
          'data-total-mb': String(device.total_mb),
          'data-usable-mb': String(device.usable_mb),
          'data-baseline-mb': String(device.baseline_mb),
          'data-allocated-mb': String(device.allocated_mb),
          'data-free-mb': String(device.free_mb),
          'data-unmanaged-mb': String(unmanaged),
          'data-runs': runs.map(r => r.id).join(','),
          'data-testid': 'evalsched-gpu'
        }
      },
      [
        h('div', { className: 'jp-EvalSched-gpuHead' }, [
          h('span', {
            className: 'jp-EvalSched-gpuName',
            text: `GPU ${device.index}`,
            title: device.name
          }),
          h('span', {
            className: 'jp-EvalSched-gpuModel',
            text: device.name,
            title: device.name
          }),
          h('span', {
            className: 'jp-EvalSched-gpuNums',
            text: trans.__(
              '%1 / %2',
              formatMB(device.allocated_mb, false),
              formatMB(usable)
            )
          })
        ]),
        bar,
        legend
      ]
    );
  }

  private _renderRuns(): void {
    const model = this.model;
    const placed = new Map<string, [Section, IRunRecord, number]>();
    const order: Record<Section, string[]> = {
      running: [],
      queued: [],
      finished: []
    };
    const place = (record: IRunRecord, position: number) => {
      if (placed.has(record.id)) {
        return;
      }
      const current = model.getRun(record.id) ?? record;
      const section: Section =
        current.state === 'queued'
          ? 'queued'
          : current.state === 'running'
            ? 'running'
            : 'finished';
      if (section === 'queued' && order.queued.length >= MAX_QUEUED_SHOWN) {
        return;
      }
      placed.set(current.id, [section, current, position]);
      order[section].push(current.id);
    };
    model.running.forEach((r, i) => place(r, i));
    model.queued.forEach((r, i) => place(r, i));
    model.finished.forEach((r, i) => place(r, i));

    for (const [id, row] of this._rows) {
      if (!placed.has(id)) {
        row.dispose();
        this._rows.delete(id);
      }
    }
    for (const section of ['running', 'queued', 'finished'] as Section[]) {
      const list = this._lists[section];
      order[section].forEach((id, index) => {
        const [, record, position] = placed.get(id)!;
        let row = this._rows.get(id);
        if (!row) {
          row = new RunRow(id, this);
          this._rows.set(id, row);
        }
        row.update(record, section, position);
        if (list.children[index] !== row.node) {
          list.insertBefore(row.node, list.children[index] ?? null);
        }
      });
      while (list.children.length > order[section].length) {
        list.lastElementChild!.remove();
      }
      this._empty[section].hidden = order[section].length > 0 || !model.loaded;
    }
    this._counts.running.textContent = String(model.running.length);
    this._counts.queued.textContent = String(model.queued.length);
    this._counts.finished.textContent = String(order.finished.length);
    const hidden = model.queued.length - order.queued.length;
    this._more.hidden = hidden <= 0;
    this._more.textContent = this._trans.__('… and %1 more queued', hidden);
    this._tick();
  }

  /**
   * Give every run on a GPU a colour slot that no other run on the ledger holds (while there are
   * at most COLOR_SLOTS of them), and keep it for as long as the run holds memory.
   */
  private _assignColors(ledger: ILedger | null): void {
    const live = new Set<string>();
    for (const device of ledger?.devices ?? []) {
      for (const run of device.runs ?? []) {
        live.add(run.id);
      }
    }
    for (const id of [...this._colors.keys()]) {
      if (!live.has(id)) {
        this._colors.delete(id);
      }
    }
    const used = new Set(this._colors.values());
    for (const id of live) {
      if (this._colors.has(id)) {
        continue;
      }
      let slot = colorSlot(id, COLOR_SLOTS);
      for (let i = 0; i < COLOR_SLOTS; i++) {
        const candidate = (slot + i) % COLOR_SLOTS;
        if (!used.has(candidate)) {
          slot = candidate;
          break;
        }
      }
      this._colors.set(id, slot);
      used.add(slot);
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
  }

  // ---------------------------------------------------------------- used by rows

  /** @internal */
  get trans(): TranslationBundle {
    return this._trans;
  }

  /** @internal */
  openInTab(id: string): void {
    this._openInTab(id);
  }

  /** @internal Ask for confirmation, then cancel. */
  async confirmCancel(record: IRunRecord): Promise<void> {
    const trans = this._trans;
    const running = record.state === 'running';
    const result = await showDialog({
      title: trans.__('Cancel run?'),
      body: running
        ? trans.__(
            'Cancel “%1” (%2)? Its process group is signalled; the episodes done so far stay in its summary.',
            record.name,
            record.id
          )
        : trans.__('Remove “%1” (%2) from the queue?', record.name, record.id),
      buttons: [
        Dialog.cancelButton({ label: trans.__('Keep it') }),
        Dialog.warnButton({
          label: trans.__('Cancel run'),
          ariaLabel: trans.__('Cancel run')
        })
      ]
    });
    if (!result.button.accept) {
      return;
    }
    try {
      await this.model.cancel(record.id);
    } catch (reason) {
      const message =
        reason instanceof EvalSchedError && reason.status === 409
          ? trans.__('The run already finished.')
          : reason instanceof Error
            ? reason.message
            : String(reason);
      await showErrorMessage(trans.__('Cannot cancel %1', record.id), message);
    }
  }

  private _trans: TranslationBundle;
  private _logTail: number;
  private _openInTab: (id: string) => void;
  private _conn: HTMLElement;
  private _banner: HTMLElement;
  private _gpus: HTMLElement;
  private _cpu: HTMLElement;
  private _more: HTMLElement;
  private _form: SubmitForm;
  private _lists: Record<Section, HTMLElement>;
  private _empty: Record<Section, HTMLElement>;
  private _counts: Record<Section, HTMLElement>;
  private _rows = new Map<string, RunRow>();
  private _colors = new Map<string, number>();
  private _ledgerKey = '';
  private _ticker: ReturnType<typeof setInterval> | null = null;
}

function legendItem(kind: string, text: string): HTMLElement {
  return h(
    'span',
    { className: 'jp-EvalSched-legendItem', attrs: { 'data-kind': kind } },
    [
      h('span', { className: `jp-EvalSched-swatch jp-EvalSched-seg-${kind}` }),
      text
    ]
  );
}

/**
 * One run in one of the lists. Keeps its element (and its open detail) across updates.
 */
class RunRow {
  constructor(
    readonly id: string,
    private _panel: EvalSchedPanel
  ) {
    const trans = _panel.trans;
    this.logTail = _panel.logTail;
    this.node = h('div', {
      className: 'jp-EvalSched-run',
      attrs: { 'data-run-id': id, 'data-testid': 'evalsched-run' }
    });
    this._chip = h('span', { className: 'jp-EvalSched-colorChip' });
    this._position = h('span', {
      className: 'jp-EvalSched-position',
      attrs: { 'data-testid': 'evalsched-position' }
    });
    this._state = h('span', { className: 'jp-EvalSched-state' });
    this._name = h('button', {
      className: 'jp-EvalSched-runName',
      attrs: { type: 'button', 'data-testid': 'evalsched-run-name' }
    });
    this._name.addEventListener('click', () => this.toggle());
    this._caret = h('button', {
      className: 'jp-EvalSched-iconButton jp-EvalSched-toggle',
      title: trans.__('Show details and logs'),
      attrs: {
        type: 'button',
        'data-testid': 'evalsched-details',
        'aria-expanded': 'false'
      }
    });
    this._caret.append(caretRightIcon.element({ tag: 'span' }));
    this._caret.addEventListener('click', () => this.toggle());
    this._cancel = h('button', {
      className: 'jp-EvalSched-iconButton jp-EvalSched-cancel',
      title: trans.__('Cancel this run'),
      attrs: { type: 'button', 'data-testid': 'evalsched-cancel' }
    });
    this._cancel.append(closeIcon.element({ tag: 'span' }));
    this._cancel.addEventListener('click', () => {
      const record = this._record;
      if (record && !isTerminal(record.state)) {
        void this._panel.confirmCancel(record);
      }
    });
    this._meta = h('div', { className: 'jp-EvalSched-runMeta' });
    this._reason = h('div', {
      className: 'jp-EvalSched-reason',
      attrs: { 'data-testid': 'evalsched-reason' }
    });
    this._progressFill = h('div', { className: 'jp-EvalSched-progressFill' });
    this._progressLabel = h('span', {
      className: 'jp-EvalSched-progressLabel'
    });
    this._progress = h(
      'div',
      {
        className: 'jp-EvalSched-progress',
        attrs: {
          role: 'progressbar',
          'aria-valuemin': '0',
          'data-testid': 'evalsched-progress'
        }
      },
      [this._progressFill, this._progressLabel]
    );
    this._metrics = h('div', {
      className: 'jp-EvalSched-rowMetrics',
      attrs: { 'data-testid': 'evalsched-metrics' }
    });
    this._detailHost = h('div', { className: 'jp-EvalSched-detailHost' });
    this._detailHost.hidden = true;
    this.node.append(
      h('div', { className: 'jp-EvalSched-runHead' }, [
        this._caret,
        this._chip,
        this._position,
        this._name,
        this._state,
        this._cancel
      ]),
      this._meta,
      this._reason,
      this._progress,
      this._metrics,
      this._detailHost
    );
  }

  readonly node: HTMLElement;
  logTail: number;
  section: Section = 'queued';
  position = 0;

  update(record: IRunRecord, section: Section, position: number): void {
    const trans = this._panel.trans;
    const summary = this._panel.model.getSummary(record.id);
    const slot =
      section === 'running' ? this._panel.colorOf(record.id) : undefined;
    if (
      record === this._record &&
      summary === this._summary &&
      section === this.section &&
      position === this.position &&
      slot === this._slot
    ) {
      return; // records are replaced, never mutated: nothing changed
    }
    this._summary = summary;
    this._slot = slot;
    this._record = record;
    this.section = section;
    this.position = position;
    const node = this.node;
    node.dataset.state = record.state;
    node.dataset.section = section;
    node.dataset.priority = record.priority;
    const { code, text } = splitReason(record.reason);
    node.dataset.reasonCode = code;
    node.dataset.progressDone = String(record.progress?.done ?? 0);
    node.dataset.progressTotal = String(record.progress?.total ?? 0);
    node.dataset.executor = executorOf(record);

    // Colour chip: matches the run's segment in the ledger bar.
    for (let i = 0; i < COLOR_SLOTS; i++) {
      this._chip.classList.remove(`jp-EvalSched-c${i}`);
    }
    this._chip.hidden = slot === undefined;
    if (slot !== undefined) {
      this._chip.classList.add(`jp-EvalSched-c${slot}`);
      this._chip.title = this._panel.trans.__('Its colour in the GPU bar');
    }

    this._name.textContent = record.name || record.id;
    this._name.title = trans.__('%1 — show details and logs', record.id);
    this._state.textContent = record.state;
    this._state.dataset.state = record.state;
    this._cancel.hidden = isTerminal(record.state);

    // Meta line: position, id, priority, resources.
    this._position.hidden = section !== 'queued';
    this._position.textContent = `#${position + 1}`;
    this._position.title = trans.__(
      'Position %1 in the admission order',
      position + 1
    );
    const parts: (HTMLElement | string)[] = [];
    parts.push(
      h('span', {
        className: 'jp-EvalSched-runId',
        text: record.id,
        title: record.id
      })
    );
    if (record.priority && record.priority !== 'normal') {
      parts.push(
        h('span', {
          className: 'jp-EvalSched-priority',
          text: record.priority,
          attrs: { 'data-priority': record.priority }
        })
      );
    }
    if (isSlurm(record)) {
      // Not on this host's GPUs: the SLURM job and its state instead of VRAM and devices.
      const job =
        record.slurm_job_id === null || record.slurm_job_id === undefined
          ? ''
          : String(record.slurm_job_id);
      const slurmState =
        typeof record.slurm_state === 'string' ? record.slurm_state : '';
      parts.push(
        h('span', {
          className: 'jp-EvalSched-slurm',
          text: slurmLabel(record),
          title: job
            ? trans.__(
                'Runs under SLURM as job %1 (%2)',
                job,
                slurmState || trans.__('state unknown')
              )
            : trans.__('Runs under SLURM; sbatch has not answered yet'),
          attrs: { 'data-slurm-job-id': job, 'data-slurm-state': slurmState }
        })
      );
    } else if (record.marginal_vram_mb > 0) {
      const where =
        record.devices && record.devices.length
          ? ` · GPU ${record.devices.join(',')}`
          : '';
      parts.push(
        h('span', {
          className: 'jp-EvalSched-vram',
          text: `${formatMB(record.marginal_vram_mb)}${where}`
        })
      );
    } else if (section !== 'finished') {
      parts.push(
        h('span', { className: 'jp-EvalSched-vram', text: trans.__('CPU') })
      );
    }
    this._time = h('span', { className: 'jp-EvalSched-time' });
    parts.push(this._time);
    this._meta.replaceChildren(...parts);

    // Reason: the pending reason of a queued run, the end reason of a finished one.
    this._reason.hidden = !record.reason || section === 'running';
    if (record.reason) {
      this._reason.replaceChildren(
        h('span', { className: 'jp-EvalSched-reasonCode', text: code }),
        text ? h('span', { className: 'jp-EvalSched-reasonText', text }) : ''
      );
      this._reason.title = record.reason;
    }

    // Progress: running runs.
    const done = record.progress?.done ?? 0;
    const total = record.progress?.total ?? 0;
    this._progress.hidden = section !== 'running';
    const pct = total > 0 ? Math.min(100, (100 * done) / total) : 0;
    this._progressFill.style.width = `${pct}%`;
    this._progressLabel.textContent =
      total > 0 ? `${done} / ${total}` : trans.__('starting…');
    this._progress.setAttribute('aria-valuenow', String(done));
    this._progress.setAttribute('aria-valuemax', String(total));

    // Latest metrics (mean of each): from the record, else from the summary.
    const metrics = latestMetrics(record, summary);
    const names = Object.keys(metrics).sort();
    this._metrics.hidden = names.length === 0 || section === 'queued';
    this._metrics.replaceChildren(
      ...names.slice(0, MAX_ROW_METRICS).map(name => {
        const m = metrics[name] ?? {};
        return h(
          'span',
          {
            className: 'jp-EvalSched-metric',
            title: `${name}: mean ${formatNumber(m.mean)}, std ${formatNumber(m.std)}, min ${formatNumber(m.min)}, max ${formatNumber(m.max)}, n ${m.count ?? 0}`,
            attrs: { 'data-metric': name, 'data-value': String(m.mean ?? '') }
          },
          [
            h('span', { className: 'jp-EvalSched-metricName', text: name }),
            formatNumber(m.mean)
          ]
        );
      }),
      ...(names.length > MAX_ROW_METRICS
        ? [
            h('span', {
              className: 'jp-EvalSched-muted',
              text: `+${names.length - MAX_ROW_METRICS}`
            })
          ]
        : [])
    );
    if (summary?.error && section === 'finished') {
      this._metrics.hidden = false;
      this._metrics.append(
        h('span', {
          className: 'jp-EvalSched-errorLine',
          text: `${summary.error.type}: ${summary.error.message}`,
          title: summary.error.message
        })
      );
    }
    this.tick(Date.now());
  }

  /** Refresh the time shown on the row. */
  tick(now: number): void {
    const record = this._record;
    if (!record || !this._time) {
      return;
    }
    const trans = this._panel.trans;
    const started = parseTime(record.started_at);
    const finished = parseTime(record.finished_at);
    const submitted = parseTime(record.submitted_at);
    let text = '';
    if (record.state === 'running' && started !== null) {
      text = trans.__('elapsed %1', formatDuration(now - started));
    } else if (record.state === 'queued' && submitted !== null) {
      text = trans.__('waiting %1', formatDuration(now - submitted));
    } else if (isTerminal(record.state)) {
      const ran =
        started !== null && finished !== null
          ? formatDuration(finished - started)
          : null;
      const ago = formatAgo(finished ?? submitted, now);
      text = ran ? trans.__('ran %1 · %2', ran, ago) : ago;
    }
    if (this._time.textContent !== text) {
      this._time.textContent = text;
    }
  }

  /** Show or hide the inline detail (record, metrics, logs). */
  toggle(open?: boolean): void {
    const show = open ?? this._detailHost.hidden;
    this._detailHost.hidden = !show;
    this.node.classList.toggle('jp-mod-expanded', show);
    this._caret.setAttribute('aria-expanded', String(show));
    this._caret.replaceChildren(
      (show ? caretDownIcon : caretRightIcon).element({ tag: 'span' })
    );
    if (show && !this._detail) {
      this._detail = new RunDetailView({
        model: this._panel.model,
        id: this.id,
        trans: this._panel.trans,
        logTail: this.logTail,
        onOpenInTab: () => this._panel.openInTab(this.id)
      });
      this._detailHost.append(this._detail.node);
    }
    if (show && this._detail) {
      this._detail.logTail = this.logTail;
      void this._detail.load();
    }
    if (!show && this._detail) {
      this._detail.dispose();
      this._detail = null;
    }
  }

  dispose(): void {
    this._detail?.dispose();
    this._detail = null;
    this.node.remove();
  }

  private _record: IRunRecord | null = null;
  private _summary: ISummary | null | undefined = undefined;
  private _slot: number | undefined = undefined;
  private _chip: HTMLElement;
  private _position: HTMLElement;
  private _state: HTMLElement;
  private _name: HTMLButtonElement;
  private _caret: HTMLButtonElement;
  private _cancel: HTMLButtonElement;
  private _meta: HTMLElement;
  private _time: HTMLElement | null = null;
  private _reason: HTMLElement;
  private _progress: HTMLElement;
  private _progressFill: HTMLElement;
  private _progressLabel: HTMLElement;
  private _metrics: HTMLElement;
  private _detailHost: HTMLElement;
  private _detail: RunDetailView | null = null;
}

/**
 * A compact form to submit a run (entrypoint, episodes, params, VRAM, priority).
 */
class SubmitForm {
  constructor(
    private _model: EvalSchedModel,
    private _trans: TranslationBundle
  ) {
    const trans = _trans;
    const field = (label: string, input: HTMLElement, hint?: string) =>
      h('label', { className: 'jp-EvalSched-field' }, [
        h('span', { className: 'jp-EvalSched-fieldLabel', text: label }),
        input,
        hint ? h('span', { className: 'jp-EvalSched-hint', text: hint }) : null
      ]);
    const input = (
      name: string,
      type: string,
      attrs: Record<string, string> = {}
    ) =>
      h('input', {
        className: 'jp-mod-styled jp-EvalSched-input',
        attrs: {
          name,
          type,
          'data-testid': `evalsched-submit-${name}`,
          ...attrs
        }
      });
    this._entrypoint = input('entrypoint', 'text', {
      placeholder: trans.__('pkg.module:function'),
      required: 'true',
      spellcheck: 'false'
    });
    this._nameInput = input('name', 'text', {
      placeholder: trans.__('derived from the entrypoint')
    });
    this._episodes = input('episodes', 'number', { min: '0', value: '1' });
    this._vram = input('vram', 'number', { min: '0', value: '0', step: '256' });
    this._gpus = input('gpus', 'number', { min: '1', value: '1' });
    this._priority = h('select', {
      className: 'jp-mod-styled jp-EvalSched-input',
      attrs: { name: 'priority', 'data-testid': 'evalsched-submit-priority' }
    });
    for (const p of ['high', 'normal', 'low']) {
      const option = h('option', { text: p, attrs: { value: p } });
      option.selected = p === 'normal';
      this._priority.append(option);
    }
    this._exclusive = h('input', {
      attrs: { type: 'checkbox', name: 'exclusive' }
    });
    this._params = h('textarea', {
      className: 'jp-mod-styled jp-EvalSched-input jp-EvalSched-params',
      attrs: {
        name: 'params',
        rows: '2',
        placeholder: trans.__('{"sleep_s": 0.5}'),
        spellcheck: 'false',
        'data-testid': 'evalsched-submit-params'
      }
    });
    this._message = h('div', {
      className: 'jp-EvalSched-formMessage',
      attrs: { role: 'status' }
    });
    const submit = h('button', {
      className: 'jp-EvalSched-button jp-mod-accept',
      text: trans.__('Submit'),
      attrs: { type: 'submit', 'data-testid': 'evalsched-submit' }
    });
    this._form = h('form', { className: 'jp-EvalSched-form' }, [
      field(trans.__('Entrypoint'), this._entrypoint),
      field(trans.__('Name'), this._nameInput),
      h('div', { className: 'jp-EvalSched-fieldRow' }, [
        field(trans.__('Episodes'), this._episodes),
        field(trans.__('Priority'), this._priority)
      ]),
      h('div', { className: 'jp-EvalSched-fieldRow' }, [
        field(trans.__('VRAM per GPU (MB)'), this._vram),
        field(trans.__('GPUs'), this._gpus)
      ]),
      h('label', { className: 'jp-EvalSched-check' }, [
        this._exclusive,
        trans.__('Exclusive GPU')
      ]),
      field(trans.__('Params (JSON object)'), this._params),
      h('div', { className: 'jp-EvalSched-formActions' }, [
        submit,
        this._message
      ])
    ]);
    this._form.addEventListener('submit', event => {
      event.preventDefault();
      void this._submit();
    });
    this.node = h(
      'details',
      { className: 'jp-EvalSched-section jp-EvalSched-submit' },
      [
        h('summary', {
          className: 'jp-EvalSched-sectionTitle',
          text: trans.__('Submit a run')
        }),
        this._form
      ]
    );
  }

  readonly node: HTMLDetailsElement;

  private async _submit(): Promise<void> {
    const trans = this._trans;
    const entrypoint = this._entrypoint.value.trim();
    if (!entrypoint) {
      this._say(trans.__('An entrypoint is required.'), true);
      return;
    }
    let params: unknown = {};
    const raw = this._params.value.trim();
    if (raw) {
      try {
        params = JSON.parse(raw);
      } catch {
        this._say(trans.__('Params must be a JSON object.'), true);
        return;
      }
      if (!params || typeof params !== 'object' || Array.isArray(params)) {
        this._say(trans.__('Params must be a JSON object.'), true);
        return;
      }
    }
    const spec: Record<string, unknown> = {
      entrypoint,
      episodes: Number(this._episodes.value || 1),
      params,
      scheduling: {
        marginal_vram_mb: Number(this._vram.value || 0),
        gpus: Number(this._gpus.value || 1),
        exclusive_gpu: this._exclusive.checked,
        priority: this._priority.value
      }
    };
    const name = this._nameInput.value.trim();
    if (name) {
      spec.name = name;
    }
    this._say(trans.__('Submitting…'), false);
    try {
      const record = await this._model.submit(spec);
      this._say(trans.__('Submitted %1 (%2).', record.id, record.state), false);
    } catch (reason) {
      if (reason instanceof EvalSchedError) {
        const details = reason.details;
        this._say(
          details.length
            ? `${reason.message}\n${details.join('\n')}`
            : reason.message,
          true
        );
      } else {
        this._say(
          reason instanceof Error ? reason.message : String(reason),
          true
        );
      }
    }
  }

  private _say(text: string, error: boolean): void {
    this._message.textContent = text;
    this._message.classList.toggle('jp-mod-error', error);
  }

  private _form: HTMLFormElement;
  private _entrypoint: HTMLInputElement;
  private _nameInput: HTMLInputElement;
  private _episodes: HTMLInputElement;
  private _vram: HTMLInputElement;
  private _gpus: HTMLInputElement;
  private _priority: HTMLSelectElement;
  private _exclusive: HTMLInputElement;
  private _params: HTMLTextAreaElement;
  private _message: HTMLElement;
}
