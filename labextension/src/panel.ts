/**
 * The side panel: the host's VRAM ledger (runs, leases and the VRAM of other processes, per
 * holder), the live leases, the queue in admission order, the running runs with their progress
 * and latest metrics, and the recently finished runs. Plain DOM on a Lumino widget, keyed by run
 * (and lease) id so that an open detail survives live updates.
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
  basename,
  EvalSchedError,
  ICompareTarget,
  ILeaseRecord,
  ILedger,
  ILedgerDevice,
  ILedgerLease,
  IRunRecord,
  ISummary,
  isTerminal,
  IUnmanagedProcess,
  leaseHolder,
  runWarnings,
  StateCounts,
  sweepIdOf
} from './api';
import {
  badgeLabels,
  readableReason,
  resumeRun,
  RunDetailView
} from './detail';
import {
  attemptOf,
  colorSlot,
  executorOf,
  formatAgo,
  formatDuration,
  formatMB,
  formatNumber,
  formatTimestamp,
  h,
  IBadgeLabels,
  isResumable,
  isSlurm,
  parseReason,
  parseTime,
  preemptionsOf,
  retryAtOf,
  retryInSeconds,
  runBadges,
  slurmLabel,
  splitReason,
  sweepBaseName,
  sweepPointLabel
} from './format';
import { evalschedIcon } from './icon';
import { countStates, EvalSchedModel, latestMetrics } from './model';

/** The DOM id of the panel (public contract). */
export const PANEL_ID = 'jupyter-evalsched-panel';

/** Queued runs shown at most; the rest is counted. */
const MAX_QUEUED_SHOWN = 200;
/** Metrics shown on a row at most (all are in the detail). */
const MAX_ROW_METRICS = 4;
/** Colour slots of runs (CSS classes jp-EvalSched-c0 … c7). */
const COLOR_SLOTS = 8;
/** A bar segment is labelled with its holder when it is at least this share of the bar. */
const LABEL_MIN_SHARE = 0.12;
/** Unmanaged holders of one kind named in a GPU's legend at most (the rest are summed). */
const MAX_LEGEND_HOLDERS = 3;
/** Runs of an expanded sweep shown at most; the rest is counted. */
const MAX_SWEEP_RUNS_SHOWN = 200;
/** Notification decisions kept in the panel's `data-notified` (a test hook). */
const MAX_NOTIFIED_KEPT = 30;
/** The order in which a sweep's counts are shown. */
const STATE_ORDER = [
  'running',
  'queued',
  'succeeded',
  'failed',
  'aborted',
  'cancelled'
];

type Section = 'running' | 'queued' | 'finished';

/** The list a run of this state is shown in. */
function sectionOf(state: string): Section {
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
function sweepSection(counts: StateCounts): Section {
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

/** Put `nodes` into `list` in this order (moving, not rebuilding), and drop the rest. */
function reconcile(list: HTMLElement, nodes: HTMLElement[]): void {
  nodes.forEach((node, index) => {
    if (list.children[index] !== node) {
      list.insertBefore(node, list.children[index] ?? null);
    }
  });
  while (list.children.length > nodes.length) {
    list.lastElementChild!.remove();
  }
}

export interface IPanelOptions {
  model: EvalSchedModel;
  trans: TranslationBundle;
  logTail: number;
  /** Open the detail of a run in a main-area tab. */
  openInTab: (id: string) => void;
  /** Open the comparison of runs (or of a sweep's runs) in a main-area tab. */
  openCompare?: (target: ICompareTarget) => void;
}

export class EvalSchedPanel extends Widget {
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
    this._gpus = h('div', {
      className: 'jp-EvalSched-gpus',
      attrs: { 'data-testid': 'evalsched-ledger' }
    });
    this._cpu = h('div', { className: 'jp-EvalSched-cpu' });
    const ledgerSection = this._section(trans.__('Resources'), 'ledger', [
      this._gpus,
      this._cpu
    ]);

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
    this._renderLeases();
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
    const baseline = Math.max(0, device.baseline_mb);
    const usable = Math.max(0, device.usable_mb);
    const free = Math.max(0, device.free_mb);
    const runs = device.runs ?? [];
    const leases = Array.isArray(device.leases) ? device.leases : [];
    const runsSum = runs.reduce(
      (a, r) => a + Math.max(0, r.marginal_vram_mb),
      0
    );
    const leaseSum = leases.reduce((a, l) => a + Math.max(0, l.vram_mb), 0);
    // An exclusive holder allocates the whole usable memory, more than it declared.
    const allocated = Math.max(0, device.allocated_mb, runsSum + leaseSum);
    const exclusiveExtra = Math.max(0, allocated - runsSum - leaseSum);
    // Unmanaged VRAM, per holder: what leases' processes use beyond their lease (drawn beside
    // each lease), processes without a lease grouped by notebook (kernels) or by pid, and any
    // rest the server does not itemise (an older server).
    const overSum = leases.reduce(
      (a, l) => a + Math.max(0, l.over_lease_mb ?? 0),
      0
    );
    // A process within a lease on this GPU is the lease's (its excess is drawn beside it); one
    // whose lease is on other GPUs holds what it uses here outside of any lease.
    const leased = new Set(leases.map(l => l.id));
    const groups = unmanagedGroups(
      (Array.isArray(device.unmanaged_processes)
        ? device.unmanaged_processes
        : []
      ).filter(p => !p.lease_id || !leased.has(p.lease_id))
    );
    const groupSum = groups.reduce((a, g) => a + g.mb, 0);
    const reported = Math.max(0, device.unmanaged_mb ?? 0);
    const unmanagedRest = Math.max(0, reported - overSum - groupSum);
    const unmanaged = Math.max(reported, overSum + groupSum);
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
      attrs: Record<string, string> = {},
      label?: string
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
      if (label && mb / scale >= LABEL_MIN_SHARE) {
        el.append(
          h('span', { className: 'jp-EvalSched-segLabel', text: label })
        );
      }
      bar.append(el);
      return el;
    };
    seg(
      'baseline',
      baseline,
      trans.__('Shared models (baseline): %1', formatMB(baseline))
    );
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
    for (const lease of leases) {
      let mb = Math.max(0, lease.vram_mb);
      const exclusive = device.exclusive === lease.id;
      if (exclusive) {
        mb += exclusiveExtra;
      }
      const holder = leaseHolder(lease);
      seg(
        'lease',
        mb,
        this._leaseTitle(lease, mb, exclusive),
        {
          'data-lease-id': lease.id,
          'data-holder': holder
        },
        holder
      );
      const over = Math.max(0, lease.over_lease_mb ?? 0);
      seg(
        'over',
        over,
        trans.__(
          '%1 uses %2 more than its lease %3 (%4 in all on this GPU): the excess counts as unmanaged',
          holder,
          formatMB(over),
          lease.id,
          formatMB(lease.observed_mb ?? mb + over)
        ),
        { 'data-over-lease-id': lease.id, 'data-holder': holder }
      );
    }
    if (!runs.length && !leases.length && allocated > 0) {
      seg('run', allocated, trans.__('Allocated: %1', formatMB(allocated)));
    }
    for (const group of groups) {
      const attrs: Record<string, string> = {
        'data-holder': group.holder,
        'data-holder-kind': group.kind,
        'data-pids': group.pids.join(',')
      };
      if (group.sessionPath) {
        attrs['data-session-path'] = group.sessionPath;
      }
      if (group.kernelIds.length) {
        attrs['data-kernel-id'] = group.kernelIds.join(',');
      }
      seg(
        group.kind === 'kernel' ? 'kernel' : 'unmanaged',
        group.mb,
        this._groupTitle(group),
        { ...attrs, 'data-unmanaged': 'true' },
        group.holder
      );
    }
    seg(
      'unmanaged',
      unmanagedRest,
      trans.__(
        'Not managed by the scheduler (other processes): %1',
        formatMB(unmanagedRest)
      ),
      { 'data-unmanaged': 'true' }
    );
    seg('free', free, trans.__('Free: %1', formatMB(free)));
    const rest = scale - baseline - allocated - unmanaged - free;
    seg(
      'reserved',
      rest,
      trans.__('Reserved or otherwise unusable: %1', formatMB(rest))
    );

    // The legend: what each colour is.
    const kernelMb = groups
      .filter(g => g.kind === 'kernel')
      .reduce((a, g) => a + g.mb, 0);
    const otherMb = unmanaged - overSum - kernelMb;
    const legend = h('div', { className: 'jp-EvalSched-legend' }, [
      baseline > 0
        ? legendItem(
            'baseline',
            trans.__('shared models %1', formatMB(baseline))
          )
        : null,
      ...leases.map(lease =>
        legendItem(
          'lease',
          trans.__(
            'lease: %1 %2',
            leaseHolder(lease),
            formatMB(
              lease.vram_mb +
                (device.exclusive === lease.id ? exclusiveExtra : 0)
            )
          ),
          { 'data-legend-lease-id': lease.id },
          this._leaseTitle(lease, lease.vram_mb, device.exclusive === lease.id)
        )
      ),
      overSum > 0
        ? legendItem(
            'over',
            trans.__('over lease %1', formatMB(overSum)),
            {},
            trans.__(
              'What lease holders use beyond their leases (counted as unmanaged)'
            )
          )
        : null,
      ...this._unmanagedLegend(
        groups.filter(g => g.kind === 'kernel'),
        'kernel',
        kernelMb
      ),
      ...this._unmanagedLegend(
        groups.filter(g => g.kind === 'process'),
        'unmanaged',
        otherMb
      ),
      device.exclusive
        ? h('span', {
            className: 'jp-EvalSched-tag',
            text: trans.__('exclusive'),
            title: trans.__('Held exclusively by %1', device.exclusive)
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
          'data-unmanaged-mb': String(reported),
          'data-runs': runs.map(r => r.id).join(','),
          'data-leases': leases.map(l => l.id).join(','),
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

  /**
   * Legend items of unmanaged holders of one colour: one per holder (notebook or pid), the
   * smallest folded into one item beyond a few; `total` also counts VRAM the server does not
   * itemise.
   */
  private _unmanagedLegend(
    groups: IUnmanagedGroup[],
    kind: 'kernel' | 'unmanaged',
    total: number
  ): HTMLElement[] {
    const trans = this._trans;
    if (total <= 0) {
      return [];
    }
    const what =
      kind === 'kernel'
        ? trans.__(
            'A notebook kernel holding VRAM without a lease (not managed by the scheduler)'
          )
        : trans.__('A process holding VRAM that the scheduler does not manage');
    const shown =
      groups.length > MAX_LEGEND_HOLDERS + 1
        ? groups.slice(0, MAX_LEGEND_HOLDERS)
        : groups;
    const items = shown.map(g =>
      legendItem(
        kind,
        kind === 'kernel'
          ? trans.__('notebook: %1 %2', g.holder, formatMB(g.mb))
          : trans.__('process: %1 %2', g.holder, formatMB(g.mb)),
        { 'data-holder': g.holder },
        `${what}\n${this._groupTitle(g)}`
      )
    );
    const rest = total - shown.reduce((a, g) => a + g.mb, 0);
    if (rest > 0) {
      const more = groups.length - shown.length;
      items.push(
        legendItem(
          kind,
          more > 0
            ? kind === 'kernel'
              ? trans._n(
                  '%1 more notebook %2',
                  '%1 more notebooks %2',
                  more,
                  formatMB(rest)
                )
              : trans._n(
                  '%1 more process %2',
                  '%1 more processes %2',
                  more,
                  formatMB(rest)
                )
            : trans.__('other processes %1', formatMB(rest)),
          {},
          what
        )
      );
    }
    return items;
  }

  /** The tooltip of a lease's segment: id, holder, MB, notebook, pid. */
  private _leaseTitle(
    lease: ILedgerLease,
    mb: number,
    exclusive: boolean
  ): string {
    const trans = this._trans;
    const lines = [
      exclusive
        ? trans.__(
            'Lease %1 held by %2: %3, exclusive',
            lease.id,
            leaseHolder(lease),
            formatMB(mb)
          )
        : trans.__(
            'Lease %1 held by %2: %3',
            lease.id,
            leaseHolder(lease),
            formatMB(mb)
          )
    ];
    if (lease.session_path) {
      lines.push(trans.__('Notebook: %1', lease.session_path));
    }
    if (lease.kernel_id) {
      lines.push(trans.__('Kernel: %1', lease.kernel_id));
    }
    if (lease.pid !== null && lease.pid !== undefined) {
      lines.push(trans.__('Process: pid %1', lease.pid));
    }
    if (lease.observed_mb) {
      lines.push(trans.__('Uses now: %1', formatMB(lease.observed_mb)));
    }
    return lines.join('\n');
  }

  /** The tooltip of an unmanaged holder's segment. */
  private _groupTitle(group: IUnmanagedGroup): string {
    const trans = this._trans;
    const lines = [
      trans.__(
        '%1: %2, not managed by the scheduler',
        group.holder,
        formatMB(group.mb)
      )
    ];
    if (group.sessionPath) {
      lines.push(trans.__('Notebook: %1', group.sessionPath));
    }
    if (group.kernelIds.length) {
      lines.push(trans.__('Kernel: %1', group.kernelIds.join(', ')));
    }
    if (group.kind === 'kernel' || group.pids.length > 1) {
      lines.push(trans.__('Processes: pid %1', group.pids.join(', ')));
    }
    if (group.names.length) {
      lines.push(trans.__('Command: %1', group.names.join(', ')));
    }
    if (group.leaseIds.length) {
      lines.push(
        trans.__(
          'Its lease %1 is on other GPUs: what it uses here is outside of it',
          group.leaseIds.join(', ')
        )
      );
    }
    return lines.join('\n');
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
    type Item =
      | { kind: 'run'; record: IRunRecord; position: number }
      | {
          kind: 'sweep';
          id: string;
          members: IRunRecord[];
          counts: StateCounts;
        };
    const items: Record<Section, Item[]> = {
      running: [],
      queued: [],
      finished: []
    };
    const placedRuns = new Set<string>();
    const placedSweeps = new Set<string>();
    // Runs shown (as rows or within a sweep's row): what the section counts and "… more" count.
    const covered = new Set<string>();
    let queuedItems = 0;
    const place = (record: IRunRecord, position: number) => {
      if (placedRuns.has(record.id)) {
        return;
      }
      const current = model.getRun(record.id) ?? record;
      const sweepId = sweepIdOf(current);
      if (sweepId) {
        // One row per sweep, listed where its liveliest run is.
        placedRuns.add(current.id);
        if (placedSweeps.has(sweepId)) {
          return;
        }
        let members = model.sweepRuns(sweepId);
        if (!members.some(r => r.id === current.id)) {
          members = [...members, current];
        }
        const counts = countStates(members);
        const section = sweepSection(counts);
        if (section === 'queued' && queuedItems >= MAX_QUEUED_SHOWN) {
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
      if (section === 'queued' && queuedItems >= MAX_QUEUED_SHOWN) {
        return;
      }
      if (section === 'queued') {
        queuedItems++;
      }
      placedRuns.add(current.id);
      covered.add(current.id);
      items[section].push({ kind: 'run', record: current, position });
    };
    model.running.forEach((r, i) => place(r, i));
    model.queued.forEach((r, i) => place(r, i));
    model.finished.forEach((r, i) => place(r, i));

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
    let finishedRuns = 0;
    for (const section of ['running', 'queued', 'finished'] as Section[]) {
      const nodes: HTMLElement[] = [];
      items[section].forEach((item, index) => {
        if (item.kind === 'run') {
          nodes.push(runRow(item.record, section, item.position));
          if (section === 'finished') {
            finishedRuns++;
          }
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
        if (section === 'finished') {
          finishedRuns += item.members.length;
        }
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
    this._counts.running.textContent = String(model.running.length);
    this._counts.queued.textContent = String(model.queued.length);
    this._counts.finished.textContent = String(finishedRuns);
    const hidden = model.queued.filter(r => !covered.has(r.id)).length;
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
  async confirmCancelSweep(
    id: string,
    name: string,
    unfinished: number
  ): Promise<void> {
    const trans = this._trans;
    const result = await showDialog({
      title: trans.__('Cancel sweep?'),
      body: trans._n(
        'Cancel the %1 unfinished run of “%2” (%3)? Its finished runs stay as they are.',
        'Cancel the %1 unfinished runs of “%2” (%3)? Its finished runs stay as they are.',
        unfinished,
        name,
        id
      ),
      buttons: [
        Dialog.cancelButton({ label: trans.__('Keep it') }),
        Dialog.warnButton({
          label: trans.__('Cancel sweep'),
          ariaLabel: trans.__('Cancel sweep')
        })
      ]
    });
    if (!result.button.accept) {
      return;
    }
    try {
      await this.model.cancelSweep(id);
    } catch (reason) {
      await showErrorMessage(
        trans.__('Cannot cancel sweep %1', id),
        reason instanceof Error ? reason.message : String(reason)
      );
    }
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

  /** @internal Resume a run that ended without succeeding (no confirmation: nothing is lost). */
  async resume(record: IRunRecord): Promise<void> {
    await resumeRun(this.model, record.id, this._trans);
  }

  /** @internal Ask for confirmation, then release a lease (DELETE /evalsched/leases/{id}). */
  async confirmRelease(lease: ILeaseRecord): Promise<void> {
    const trans = this._trans;
    const holder = leaseHolder(lease);
    const size = leaseSize(lease, trans);
    const result = await showDialog({
      title: trans.__('Release lease?'),
      body:
        lease.state === 'granted'
          ? trans.__(
              'Release the %1 that “%2” holds (%3)? Its process keeps running, but the scheduler no longer keeps that VRAM for it: queued runs may take it.',
              size,
              holder,
              lease.id
            )
          : trans.__(
              'Withdraw the request of “%1” (%2) for %3?',
              holder,
              lease.id,
              size
            ),
      buttons: [
        Dialog.cancelButton({ label: trans.__('Keep it') }),
        Dialog.warnButton({
          label: trans.__('Release'),
          ariaLabel: trans.__('Release lease')
        })
      ]
    });
    if (!result.button.accept) {
      return;
    }
    try {
      await this.model.release(lease.id);
    } catch (reason) {
      if (reason instanceof EvalSchedError && reason.status === 404) {
        // It ended meanwhile (or is unknown to this server): show what is.
        void this.model.refresh();
        return;
      }
      await showErrorMessage(
        trans.__('Cannot release %1', lease.id),
        reason instanceof Error ? reason.message : String(reason)
      );
    }
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
  private _gpus: HTMLElement;
  private _cpu: HTMLElement;
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
  private _colors = new Map<string, number>();
  private _ledgerKey = '';
  private _ticker: ReturnType<typeof setInterval> | null = null;
}

function legendItem(
  kind: string,
  text: string,
  attrs: Record<string, string> = {},
  title?: string
): HTMLElement {
  return h(
    'span',
    {
      className: 'jp-EvalSched-legendItem',
      title,
      attrs: { 'data-kind': kind, ...attrs }
    },
    [
      h('span', { className: `jp-EvalSched-swatch jp-EvalSched-seg-${kind}` }),
      text
    ]
  );
}

/** VRAM of processes without a lease, by holder: one notebook (kernel) or one process. */
interface IUnmanagedGroup {
  kind: 'kernel' | 'process';
  holder: string;
  mb: number;
  pids: number[];
  names: string[];
  sessionPath: string | null;
  kernelIds: string[];
  /** Leases (on other GPUs) of its processes. */
  leaseIds: string[];
}

/**
 * Group a device's unmanaged processes by who holds them: a notebook kernel's processes by its
 * notebook (the basename of session_path; by kernel id when there is no path), every other
 * process by its pid. Notebooks first, then the largest holders.
 */
export function unmanagedGroups(
  processes: ReadonlyArray<IUnmanagedProcess>
): IUnmanagedGroup[] {
  const groups = new Map<string, IUnmanagedGroup>();
  for (const p of processes) {
    const used = Math.max(0, Number(p.used_mb) || 0);
    const kernel = !!(p.session_path || p.kernel_id);
    const key = p.session_path
      ? `notebook:${p.session_path}`
      : p.kernel_id
        ? `kernel:${p.kernel_id}`
        : `pid:${p.pid}`;
    let group = groups.get(key);
    if (!group) {
      group = {
        kind: kernel ? 'kernel' : 'process',
        holder: p.session_path
          ? basename(p.session_path)
          : p.kernel_id
            ? `kernel ${p.kernel_id.slice(0, 8)}`
            : `pid ${p.pid}`,
        mb: 0,
        pids: [],
        names: [],
        sessionPath: p.session_path || null,
        kernelIds: [],
        leaseIds: []
      };
      groups.set(key, group);
    }
    group.mb += used;
    if (!group.pids.includes(p.pid)) {
      group.pids.push(p.pid);
    }
    if (p.name && !group.names.includes(p.name)) {
      group.names.push(p.name);
    }
    if (p.kernel_id && !group.kernelIds.includes(p.kernel_id)) {
      group.kernelIds.push(p.kernel_id);
    }
    if (p.lease_id && !group.leaseIds.includes(p.lease_id)) {
      group.leaseIds.push(p.lease_id);
    }
  }
  return [...groups.values()]
    .filter(g => g.mb > 0)
    .sort(
      (a, b) =>
        (a.kind === 'kernel' ? 0 : 1) - (b.kind === 'kernel' ? 0 : 1) ||
        b.mb - a.mb ||
        (a.holder < b.holder ? -1 : a.holder > b.holder ? 1 : 0)
    );
}

/** `14,000 MB × 1 GPU`, `exclusive` marked. */
export function leaseSize(
  lease: ILeaseRecord,
  trans: TranslationBundle
): string {
  const gpus = lease.gpus ?? 1;
  const perGpu =
    lease.vram_mb > 0
      ? trans._n('%2 × %1 GPU', '%2 × %1 GPUs', gpus, formatMB(lease.vram_mb))
      : trans._n('%1 GPU', '%1 GPUs', gpus);
  return lease.exclusive_gpu ? trans.__('%1, exclusive', perGpu) : perGpu;
}

/**
 * One sweep in one of the lists: its name, runs per state, the episodes done over all its runs,
 * Compare and Cancel sweep; expanded, its runs as ordinary run rows labelled with their points.
 */
class SweepRow {
  constructor(
    readonly id: string,
    private _panel: EvalSchedPanel
  ) {
    const trans = _panel.trans;
    this.node = h('div', {
      className: 'jp-EvalSched-sweep',
      attrs: {
        'data-sweep-id': id,
        'data-testid': 'evalsched-sweep',
        'data-expanded': 'false'
      }
    });
    this._caret = h('button', {
      className: 'jp-EvalSched-iconButton jp-EvalSched-toggle',
      title: trans.__('Show the runs of this sweep'),
      attrs: {
        type: 'button',
        'data-testid': 'evalsched-sweep-toggle',
        'aria-expanded': 'false'
      }
    });
    this._caret.append(caretRightIcon.element({ tag: 'span' }));
    this._caret.addEventListener('click', () => this.toggle());
    this._name = h('button', {
      className: 'jp-EvalSched-runName',
      attrs: { type: 'button', 'data-testid': 'evalsched-sweep-name' }
    });
    this._name.addEventListener('click', () => this.toggle());
    this._state = h('span', { className: 'jp-EvalSched-state' });
    this._compare = h('button', {
      className: 'jp-EvalSched-textButton jp-EvalSched-compareButton',
      text: trans.__('Compare'),
      title: trans.__('Compare the runs of this sweep side by side'),
      attrs: { type: 'button', 'data-testid': 'evalsched-sweep-compare' }
    });
    this._compare.hidden = !_panel.canCompare;
    this._compare.addEventListener('click', () =>
      this._panel.openCompare({ sweep: this.id })
    );
    this._cancel = h('button', {
      className: 'jp-EvalSched-iconButton jp-EvalSched-cancel',
      title: trans.__('Cancel the unfinished runs of this sweep'),
      attrs: { type: 'button', 'data-testid': 'evalsched-sweep-cancel' }
    });
    this._cancel.append(closeIcon.element({ tag: 'span' }));
    this._cancel.addEventListener('click', () => {
      const unfinished = this._unfinished();
      if (unfinished > 0) {
        void this._panel.confirmCancelSweep(this.id, this._label, unfinished);
      }
    });
    this._counts = h('div', {
      className: 'jp-EvalSched-sweepCounts',
      attrs: { 'data-testid': 'evalsched-sweep-counts' }
    });
    this._meta = h('div', { className: 'jp-EvalSched-runMeta' });
    this._time = h('span', { className: 'jp-EvalSched-time' });
    this._bar = new ProgressBar('evalsched-sweep-progress');
    this._progress = this._bar.node;
    this._runs = h('div', {
      className: 'jp-EvalSched-list jp-EvalSched-sweepRuns',
      attrs: { 'data-testid': 'evalsched-sweep-runs' }
    });
    this._more = h('div', { className: 'jp-EvalSched-more' });
    this._runsHost = h('div', { className: 'jp-EvalSched-sweepRunsHost' }, [
      this._runs,
      this._more
    ]);
    this._runsHost.hidden = true;
    this._sweepTag = h('span', {
      className: 'jp-EvalSched-sweepTag',
      text: trans.__('sweep'),
      title: trans.__('One submission, one run per point')
    });
    this.node.append(
      h('div', { className: 'jp-EvalSched-runHead' }, [
        this._caret,
        this._name,
        this._state,
        this._cancel
      ]),
      this._meta,
      h('div', { className: 'jp-EvalSched-sweepLine' }, [
        this._counts,
        h('span', { className: 'jp-EvalSched-spacer' }),
        this._compare
      ]),
      this._progress,
      this._runsHost
    );
  }

  readonly node: HTMLElement;

  get expanded(): boolean {
    return this._expanded;
  }

  update(
    members: IRunRecord[],
    counts: StateCounts,
    section: Section,
    position: number
  ): void {
    const same =
      members.length === this._members.length &&
      members.every((r, i) => r === this._members[i]);
    if (same && section === this._section && position === this._position) {
      return; // records are replaced, never mutated: nothing changed
    }
    this._members = members;
    this._section = section;
    this._position = position;
    const trans = this._panel.trans;
    const node = this.node;
    const first = members[0];
    this._label = first ? sweepBaseName(first) || this.id : this.id;
    const state = sweepState(counts);
    node.dataset.section = section;
    node.dataset.state = state;
    node.dataset.runs = String(members.length);
    const shownCounts: StateCounts = {};
    for (const s of STATE_ORDER) {
      node.setAttribute(`data-count-${s}`, String(counts[s] ?? 0));
      if (counts[s]) {
        shownCounts[s] = counts[s];
      }
    }
    for (const [s, n] of Object.entries(counts)) {
      if (!STATE_ORDER.includes(s)) {
        shownCounts[s] = n;
      }
    }
    node.dataset.counts = JSON.stringify(shownCounts);
    this._name.textContent = this._label;
    this._name.title = trans.__('Sweep %1 — show its runs', this.id);
    this._state.textContent = state;
    this._state.dataset.state = state;
    this._cancel.hidden = this._unfinished() === 0;

    this._counts.replaceChildren(
      ...Object.entries(shownCounts).map(([s, n]) =>
        h('span', {
          className: 'jp-EvalSched-sweepCount',
          text: `${n} ${s}`,
          attrs: { 'data-state': s, 'data-count': String(n) }
        })
      )
    );
    this._meta.replaceChildren(
      this._sweepTag,
      h('span', {
        className: 'jp-EvalSched-runId',
        text: this.id,
        title: this.id
      }),
      h('span', {
        text: trans._n('%1 run', '%1 runs', members.length)
      }),
      this._time
    );

    // Progress: episodes done over all its runs.
    let done = 0;
    let total = 0;
    for (const r of members) {
      done += r.progress?.done ?? 0;
      total += r.progress?.total ?? 0;
    }
    node.dataset.progressDone = String(done);
    node.dataset.progressTotal = String(total);
    this._bar.set(
      done,
      total,
      total > 0
        ? trans.__('%1 / %2 episodes', done, total)
        : trans.__('starting…')
    );
    this.tick(Date.now());
  }

  /** Its runs' rows (shown while it is expanded); `more` runs are not shown. */
  setRuns(rows: HTMLElement[], more: number): void {
    reconcile(this._runs, rows);
    this._more.hidden = more <= 0;
    this._more.textContent =
      more > 0 ? this._panel.trans.__('… and %1 more runs', more) : '';
  }

  /** Expand (or collapse) it: its runs as run rows. */
  toggle(open?: boolean): void {
    const show = open ?? !this._expanded;
    if (show === this._expanded) {
      return;
    }
    this._expanded = show;
    this._runsHost.hidden = !show;
    this.node.dataset.expanded = String(show);
    this.node.classList.toggle('jp-mod-expanded', show);
    this._caret.setAttribute('aria-expanded', String(show));
    this._caret.replaceChildren(
      (show ? caretDownIcon : caretRightIcon).element({ tag: 'span' })
    );
    this._panel.update();
  }

  /** Draw attention to it for a moment (after a notification's Open). */
  highlight(): void {
    this.node.classList.add('jp-mod-highlight');
    if (this._highlightTimer !== null) {
      clearTimeout(this._highlightTimer);
    }
    this._highlightTimer = setTimeout(() => {
      this._highlightTimer = null;
      this.node.classList.remove('jp-mod-highlight');
    }, 2000);
  }

  /** How long it has run (while active), or when it finished. */
  tick(now: number): void {
    const trans = this._panel.trans;
    let started: number | null = null;
    let finished: number | null = null;
    for (const r of this._members) {
      const s = parseTime(r.started_at);
      const f = parseTime(r.finished_at);
      if (s !== null && (started === null || s < started)) {
        started = s;
      }
      if (f !== null && (finished === null || f > finished)) {
        finished = f;
      }
    }
    let text = '';
    if (this._section !== 'finished') {
      text =
        started !== null
          ? trans.__('elapsed %1', formatDuration(now - started))
          : '';
    } else {
      text = formatAgo(finished, now);
    }
    if (this._time.textContent !== text) {
      this._time.textContent = text;
    }
  }

  dispose(): void {
    if (this._highlightTimer !== null) {
      clearTimeout(this._highlightTimer);
    }
    this.node.remove();
  }

  private _unfinished(): number {
    return this._members.filter(r => !isTerminal(r.state)).length;
  }

  private _members: IRunRecord[] = [];
  private _section: Section | null = null;
  private _position = -1;
  private _expanded = false;
  private _label = '';
  private _highlightTimer: ReturnType<typeof setTimeout> | null = null;
  private _caret: HTMLButtonElement;
  private _name: HTMLButtonElement;
  private _state: HTMLElement;
  private _sweepTag: HTMLElement;
  private _compare: HTMLButtonElement;
  private _cancel: HTMLButtonElement;
  private _counts: HTMLElement;
  private _meta: HTMLElement;
  private _time: HTMLElement;
  private _progress: HTMLElement;
  private _bar: ProgressBar;
  private _runs: HTMLElement;
  private _more: HTMLElement;
  private _runsHost: HTMLElement;
}

/**
 * One run in one of the lists. Keeps its element (and its open detail) across updates.
 */
/** A progress bar: a fill, a label, and the ARIA values of a progressbar. */
class ProgressBar {
  constructor(testid: string) {
    this._fill = h('div', { className: 'jp-EvalSched-progressFill' });
    this._label = h('span', { className: 'jp-EvalSched-progressLabel' });
    this.node = h(
      'div',
      {
        className: 'jp-EvalSched-progress',
        attrs: {
          role: 'progressbar',
          'aria-valuemin': '0',
          'data-testid': testid
        }
      },
      [this._fill, this._label]
    );
  }

  readonly node: HTMLElement;

  set(done: number, total: number, label: string): void {
    const pct = total > 0 ? Math.min(100, (100 * done) / total) : 0;
    this._fill.style.width = `${pct}%`;
    this._label.textContent = label;
    this.node.setAttribute('aria-valuenow', String(done));
    this.node.setAttribute('aria-valuemax', String(total));
  }

  private _fill: HTMLElement;
  private _label: HTMLElement;
}

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
    this._warn = h('span', {
      className: 'jp-EvalSched-warnBadge',
      attrs: { 'data-testid': 'evalsched-warning' }
    });
    this._warn.hidden = true;
    this._name = h('button', {
      className: 'jp-EvalSched-runName',
      attrs: { type: 'button', 'data-testid': 'evalsched-run-name' }
    });
    this._name.addEventListener('click', () => this.toggle());
    this._select = h('input', {
      className: 'jp-EvalSched-select',
      title: trans.__('Select for a comparison'),
      attrs: {
        type: 'checkbox',
        'data-testid': 'evalsched-select',
        'aria-label': trans.__('Select %1 for a comparison', id)
      }
    });
    this._select.hidden = !_panel.canCompare;
    this._select.addEventListener('change', () => {
      this._panel.setSelected(this.id, this._select.checked);
    });
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
    this._resume = h('button', {
      className: 'jp-EvalSched-textButton jp-EvalSched-resume',
      text: trans.__('Resume'),
      title: trans.__(
        'Resume this run: queued again under the same id, skipping the episodes already done'
      ),
      attrs: { type: 'button', 'data-testid': 'evalsched-resume' }
    });
    this._resume.hidden = true;
    this._resume.addEventListener('click', () => {
      const record = this._record;
      if (record && isResumable(record.state) && !this._resume.disabled) {
        this._resume.disabled = true;
        void this._panel.resume(record).finally(() => {
          this._resume.disabled = false;
        });
      }
    });
    this._meta = h('div', { className: 'jp-EvalSched-runMeta' });
    this._reason = h('div', {
      className: 'jp-EvalSched-reason',
      attrs: { 'data-testid': 'evalsched-reason' }
    });
    this._bar = new ProgressBar('evalsched-progress');
    this._progress = this._bar.node;
    this._metrics = h('div', {
      className: 'jp-EvalSched-rowMetrics',
      attrs: { 'data-testid': 'evalsched-metrics' }
    });
    this._detailHost = h('div', { className: 'jp-EvalSched-detailHost' });
    this._detailHost.hidden = true;
    this.node.append(
      h('div', { className: 'jp-EvalSched-runHead' }, [
        this._caret,
        this._select,
        this._chip,
        this._position,
        this._name,
        this._state,
        this._resume,
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

  /** Check (or uncheck) its selection box. */
  setSelected(selected: boolean): void {
    if (this._select.checked !== selected) {
      this._select.checked = selected;
    }
    this.node.classList.toggle('jp-mod-selected', selected);
  }

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
    const { code, arg, head, text } = parseReason(record.reason);
    node.dataset.reasonCode = code;
    node.dataset.reasonArg = arg;
    node.dataset.attempt = String(attemptOf(record));
    node.dataset.preemptions = String(preemptionsOf(record));
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

    // A sweep's run is told apart from its siblings by its point (its sweep's row has the name).
    const sweepId = sweepIdOf(record);
    if (sweepId) {
      const point = sweepPointLabel(record);
      node.dataset.sweepId = sweepId;
      node.dataset.point = point;
      this._name.textContent = point || record.name || record.id;
      this._name.title = trans.__(
        '%1 (%2) — show details and logs',
        record.name || record.id,
        record.id
      );
    } else {
      delete node.dataset.sweepId;
      delete node.dataset.point;
      this._name.textContent = record.name || record.id;
      this._name.title = trans.__('%1 — show details and logs', record.id);
    }
    this._state.textContent = record.state;
    this._state.dataset.state = record.state;
    this._cancel.hidden = isTerminal(record.state);
    this._resume.hidden = !isResumable(record.state);

    // Warnings (over_vram, …): a badge with the first code; the full texts as its tooltip.
    const warnings = runWarnings(record);
    const codes = [...new Set(warnings.map(w => splitReason(w).code))];
    this._warn.hidden = warnings.length === 0;
    node.dataset.warnings = codes.join(',');
    if (warnings.length) {
      this._warn.textContent =
        codes.length > 1
          ? `⚠ ${codes[0]} +${codes.length - 1}`
          : `⚠ ${codes[0]}`;
      this._warn.title = warnings.join('\n');
      this._warn.setAttribute(
        'aria-label',
        trans.__('Warnings: %1', warnings.join('; '))
      );
    }

    // Meta line: position, id, priority, resources.
    this._position.hidden = section !== 'queued';
    this._position.textContent = `#${position + 1}`;
    this._position.title = trans.__(
      'Position %1 in the admission order',
      position + 1
    );
    const parts: (HTMLElement | string)[] = [];
    if (!this._warn.hidden) {
      parts.push(this._warn);
    }
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
    // Attempt, preemptions, automatic retries, detached: only what sets the run apart.
    for (const badge of runBadges(record, this._panel.badgeLabels)) {
      parts.push(
        h('span', {
          className: `jp-EvalSched-badge jp-EvalSched-badge-${badge.kind}`,
          text: badge.text,
          title: badge.title,
          attrs: { 'data-testid': `evalsched-${badge.kind}` }
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

    // Reason: the pending reason of a queued run, the end reason of a finished one; of a running
    // run only that it is being preempted.
    this._reason.hidden =
      !record.reason || (section === 'running' && code !== 'preempting');
    this._retry = null;
    if (record.reason) {
      const readable = readableReason(code, arg, text, trans);
      const retryAt = code === 'retrying' ? retryAtOf(record) : null;
      if (retryAt) {
        this._retry = h('span', {
          className: 'jp-EvalSched-retryAt',
          title: trans.__('Retry at %1', formatTimestamp(retryAt) ?? retryAt),
          attrs: {
            'data-testid': 'evalsched-retry-at',
            'data-retry-at': retryAt
          }
        });
      }
      this._reason.replaceChildren(
        h('span', { className: 'jp-EvalSched-reasonCode', text: head }),
        this._retry ?? '',
        readable
          ? h('span', {
              className: 'jp-EvalSched-reasonText',
              text: readable,
              attrs: { 'data-readable': 'true' }
            })
          : text
            ? h('span', { className: 'jp-EvalSched-reasonText', text })
            : ''
      );
      this._reason.title = record.reason;
    }

    // Progress: running runs.
    const done = record.progress?.done ?? 0;
    const total = record.progress?.total ?? 0;
    this._progress.hidden = section !== 'running';
    this._bar.set(
      done,
      total,
      total > 0 ? `${done} / ${total}` : trans.__('starting…')
    );

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
    if (this._retry) {
      const seconds = retryInSeconds(this._retry.dataset.retryAt, now);
      const when =
        seconds === null
          ? ''
          : seconds > 0
            ? this._panel.trans.__(
                'retry in %1',
                formatDuration(seconds * 1000)
              )
            : this._panel.trans.__('retrying now');
      if (this._retry.textContent !== when) {
        this._retry.textContent = when;
      }
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
  private _warn: HTMLElement;
  private _name: HTMLButtonElement;
  private _select: HTMLInputElement;
  private _caret: HTMLButtonElement;
  private _cancel: HTMLButtonElement;
  private _resume: HTMLButtonElement;
  private _meta: HTMLElement;
  private _time: HTMLElement | null = null;
  private _retry: HTMLElement | null = null;
  private _reason: HTMLElement;
  private _progress: HTMLElement;
  private _bar: ProgressBar;
  private _metrics: HTMLElement;
  private _detailHost: HTMLElement;
  private _detail: RunDetailView | null = null;
}

/**
 * One live lease in the Leases list: holder, state (and why it waits), size, GPUs, pid, notebook
 * and what its process uses, with a Release button.
 */
class LeaseRow {
  constructor(
    readonly id: string,
    private _panel: EvalSchedPanel
  ) {
    const trans = _panel.trans;
    this.node = h('div', {
      className: 'jp-EvalSched-lease',
      attrs: { 'data-lease-id': id, 'data-testid': 'evalsched-lease-row' }
    });
    this._holder = h('span', {
      className: 'jp-EvalSched-leaseHolder',
      attrs: { 'data-testid': 'evalsched-lease-holder' }
    });
    this._state = h('span', { className: 'jp-EvalSched-state' });
    this._release = h('button', {
      className: 'jp-EvalSched-textButton jp-EvalSched-release',
      text: trans.__('Release'),
      title: trans.__(
        'Release this lease: its VRAM goes back to the scheduler'
      ),
      attrs: { type: 'button', 'data-testid': 'evalsched-lease-release' }
    });
    this._release.addEventListener('click', () => {
      const lease = this._lease;
      if (lease && lease.state !== 'ended') {
        void this._panel.confirmRelease(lease);
      }
    });
    this._meta = h('div', { className: 'jp-EvalSched-runMeta' });
    this._notebook = h('div', {
      className: 'jp-EvalSched-leaseNotebook',
      attrs: { 'data-testid': 'evalsched-lease-notebook' }
    });
    this._reason = h('div', {
      className: 'jp-EvalSched-reason',
      attrs: { 'data-testid': 'evalsched-reason' }
    });
    this._usage = h('div', { className: 'jp-EvalSched-leaseUsage' });
    this.node.append(
      h('div', { className: 'jp-EvalSched-runHead' }, [
        h('span', {
          className: 'jp-EvalSched-colorChip jp-EvalSched-seg-lease',
          title: trans.__('Its colour in the GPU bar')
        }),
        this._holder,
        this._state,
        this._release
      ]),
      this._meta,
      this._notebook,
      this._reason,
      this._usage
    );
  }

  readonly node: HTMLElement;

  update(lease: ILeaseRecord): void {
    if (lease === this._lease) {
      return; // records are replaced, never mutated
    }
    this._lease = lease;
    const trans = this._panel.trans;
    const node = this.node;
    const holder = leaseHolder(lease);
    const { code, head, text } = parseReason(lease.reason);
    node.dataset.state = lease.state;
    node.dataset.reasonCode = code;
    node.dataset.holder = holder;
    node.dataset.vramMb = String(lease.vram_mb);
    node.dataset.devices = (lease.devices ?? []).join(',');
    this._holder.textContent = holder;
    this._holder.title = holder;
    this._state.textContent = lease.state;
    this._state.dataset.state = lease.state;

    const parts: HTMLElement[] = [
      h('span', {
        className: 'jp-EvalSched-vram',
        text: leaseSize(lease, trans),
        attrs: { 'data-field': 'size' }
      })
    ];
    if (lease.exclusive_gpu) {
      parts.push(
        h('span', {
          className: 'jp-EvalSched-tag',
          text: trans.__('exclusive')
        })
      );
    }
    if (lease.devices && lease.devices.length) {
      parts.push(
        h('span', {
          text: `GPU ${lease.devices.join(',')}`,
          title: lease.cuda_visible_devices
            ? `CUDA_VISIBLE_DEVICES=${lease.cuda_visible_devices}`
            : undefined,
          attrs: { 'data-field': 'devices' }
        })
      );
    }
    if (lease.pid !== null && lease.pid !== undefined) {
      parts.push(
        h('span', {
          text: trans.__('pid %1', lease.pid),
          title: trans.__('The lease ends when this process exits'),
          attrs: { 'data-field': 'pid' }
        })
      );
    }
    if (
      lease.priority &&
      lease.priority !== 'high' &&
      lease.state === 'queued'
    ) {
      parts.push(
        h('span', {
          className: 'jp-EvalSched-priority',
          text: lease.priority,
          attrs: { 'data-priority': lease.priority }
        })
      );
    }
    parts.push(
      h('span', {
        className: 'jp-EvalSched-runId',
        text: lease.id,
        title: lease.id
      })
    );
    this._time = h('span', { className: 'jp-EvalSched-time' });
    parts.push(this._time);
    this._meta.replaceChildren(...parts);

    this._notebook.hidden = !lease.session_path;
    if (lease.session_path) {
      this._notebook.textContent = lease.session_path;
      this._notebook.title = lease.kernel_id
        ? trans.__(
            'Notebook %1 (kernel %2)',
            lease.session_path,
            lease.kernel_id
          )
        : trans.__('Notebook %1', lease.session_path);
    }

    this._reason.hidden = lease.state !== 'queued' || !lease.reason;
    if (lease.reason) {
      this._reason.replaceChildren(
        h('span', { className: 'jp-EvalSched-reasonCode', text: head }),
        text ? h('span', { className: 'jp-EvalSched-reasonText', text }) : ''
      );
      this._reason.title = lease.reason;
    }

    const observed = Object.entries(lease.observed_mb ?? {}).filter(
      ([, mb]) => mb > 0
    );
    const over = Math.max(0, lease.over_lease_mb ?? 0);
    this._usage.hidden = observed.length === 0 && over === 0;
    this._usage.replaceChildren(
      observed.length
        ? h('span', {
            text: trans.__(
              'uses %1',
              observed
                .map(([gpu, mb]) => trans.__('%1 on GPU %2', formatMB(mb), gpu))
                .join(', ')
            )
          })
        : '',
      over > 0
        ? h('span', {
            className: 'jp-EvalSched-warnBadge',
            text: trans.__('⚠ %1 over its lease', formatMB(over)),
            title: trans.__(
              'Its process uses %1 more than it leased: the excess counts as unmanaged VRAM',
              formatMB(over)
            ),
            attrs: { 'data-testid': 'evalsched-lease-over' }
          })
        : ''
    );
    this.tick(Date.now());
  }

  /** Refresh the time shown on the row: how long it has been held or has waited. */
  tick(now: number): void {
    const lease = this._lease;
    if (!lease || !this._time) {
      return;
    }
    const trans = this._panel.trans;
    const granted = parseTime(lease.granted_at);
    const requested = parseTime(lease.requested_at);
    let text = '';
    if (lease.state === 'granted' && granted !== null) {
      text = trans.__('held %1', formatDuration(now - granted));
      if (lease.ttl_s) {
        text +=
          ' · ' +
          trans.__(
            'ends in %1',
            formatDuration(granted + lease.ttl_s * 1000 - now)
          );
      }
    } else if (lease.state === 'queued' && requested !== null) {
      text = trans.__('waiting %1', formatDuration(now - requested));
    }
    if (this._time.textContent !== text) {
      this._time.textContent = text;
    }
  }

  dispose(): void {
    this.node.remove();
  }

  private _lease: ILeaseRecord | null = null;
  private _holder: HTMLElement;
  private _state: HTMLElement;
  private _release: HTMLButtonElement;
  private _meta: HTMLElement;
  private _notebook: HTMLElement;
  private _reason: HTMLElement;
  private _usage: HTMLElement;
  private _time: HTMLElement | null = null;
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
