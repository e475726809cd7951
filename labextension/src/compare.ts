/**
 * Runs side by side (`GET /evalsched/compare`): a table with one row per run (its name, the
 * parameters that differ, each metric's mean ± standard error and its paired difference against
 * the baseline with a 95 % interval, wall time and VRAM peak), a baseline and a metric selector,
 * and a small chart drawn as inline SVG: the selected metric against the first differing
 * parameter, one line per combination of the others. Shown in a main-area tab.
 */
import { MainAreaWidget } from '@jupyterlab/apputils';
import { TranslationBundle } from '@jupyterlab/translation';
import { refreshIcon } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import {
  compareKey,
  EvalSchedError,
  ICompareRow,
  ICompareTarget,
  IComparison,
  IRunRecord,
  sweepIdOf
} from './api';
import {
  formatDuration,
  formatMB,
  formatNumber,
  h,
  paramText,
  shortId,
  sweepPointLabel
} from './format';
import { renderChart } from './compareChart';
import { sweepNameOf } from './sweeps';
import { evalschedIcon } from './icon';
import { EvalSchedModel } from './model';

/** Re-read a comparison at most this often while its runs change (ms). */
const REFRESH_THROTTLE_MS = 2000;

/** A DOM-id-safe suffix for a target (sweep ids are; run lists are hashed). */
function domSuffix(target: ICompareTarget): string {
  if (target.sweep && /^[A-Za-z0-9._-]+$/.test(target.sweep)) {
    return target.sweep;
  }
  const key = compareKey(target);
  let hash = 0;
  for (let i = 0; i < key.length; i++) {
    hash = (hash * 31 + key.charCodeAt(i)) | 0;
  }
  return `runs-${(hash >>> 0).toString(36)}`;
}

/** A signed number: `+0.25`, `-0.1`, `0`. */
function signed(value: number | null | undefined): string {
  const text = formatNumber(value);
  return typeof value === 'number' && value > 0 ? `+${text}` : text;
}

/** Wall time: seconds below a minute (`4.2 s`), else `m:ss`. */
function formatWall(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return '–';
  }
  return seconds < 60
    ? `${formatNumber(Number(seconds.toFixed(seconds < 10 ? 2 : 1)))} s`
    : formatDuration(seconds * 1000);
}

export interface ICompareViewOptions {
  model: EvalSchedModel;
  trans: TranslationBundle;
  target: ICompareTarget;
  /** Open a run's detail (its name in the table is a link). */
  openRun?: (id: string) => void;
}

/**
 * The comparison of runs (or of a sweep's runs). Errors of the server (404: an unknown run or
 * sweep, 422: a bad combination) are shown as a message in the view.
 */
export class CompareView extends Widget {
  constructor(options: ICompareViewOptions) {
    super();
    this._model = options.model;
    this._trans = options.trans;
    this._openRun = options.openRun ?? null;
    this.target = {
      sweep: options.target.sweep,
      runs: options.target.runs ? [...options.target.runs] : undefined
    };
    this._baseline = options.target.baseline ?? null;
    const trans = this._trans;
    this.addClass('jp-EvalSched-compareWidget');
    const node = this.node;
    node.setAttribute('data-testid', 'evalsched-compare');
    node.dataset.status = 'loading';
    if (this.target.sweep) {
      node.dataset.sweepId = this.target.sweep;
    } else {
      node.dataset.runs = (this.target.runs ?? []).join(',');
    }

    this._title = h('h2', { className: 'jp-EvalSched-compareTitle' });
    this._baselineSelect = h('select', {
      className: 'jp-mod-styled jp-EvalSched-input',
      attrs: { 'data-testid': 'evalsched-compare-baseline' }
    });
    this._baselineSelect.addEventListener('change', () => {
      this._baseline = this._baselineSelect.value || null;
      void this.load();
    });
    this._metricSelect = h('select', {
      className: 'jp-mod-styled jp-EvalSched-input',
      attrs: { 'data-testid': 'evalsched-compare-metric' }
    });
    this._metricSelect.addEventListener('change', () => {
      this._metric = this._metricSelect.value || null;
      this._render();
    });
    const refresh = h('button', {
      className: 'jp-EvalSched-iconButton',
      title: trans.__('Refresh'),
      attrs: { type: 'button', 'data-testid': 'evalsched-compare-refresh' }
    });
    refresh.append(refreshIcon.element({ tag: 'span' }));
    refresh.addEventListener('click', () => void this.load());
    const toolbar = h('div', { className: 'jp-EvalSched-compareToolbar' }, [
      this._title,
      h('span', { className: 'jp-EvalSched-spacer' }),
      h('label', { className: 'jp-EvalSched-compareField' }, [
        h('span', { text: trans.__('Baseline') }),
        this._baselineSelect
      ]),
      h('label', { className: 'jp-EvalSched-compareField' }, [
        h('span', { text: trans.__('Metric') }),
        this._metricSelect
      ]),
      refresh
    ]);
    this._message = h('div', {
      className: 'jp-EvalSched-compareMessage',
      attrs: { 'data-testid': 'evalsched-compare-message', role: 'alert' }
    });
    this._message.hidden = true;
    this._chartHost = h('div', { className: 'jp-EvalSched-compareChart' });
    this._table = h('table', {
      className: 'jp-EvalSched-compareTable',
      attrs: { 'data-testid': 'evalsched-compare-table' }
    });
    this._note = h('div', {
      className: 'jp-EvalSched-muted jp-EvalSched-compareNote',
      text: trans.__(
        'Mean ± standard error over the episodes; Δ: the mean paired difference against the baseline over the episodes both runs have, with its 95 % interval and the number of pairs.'
      )
    });
    node.append(
      toolbar,
      this._message,
      this._chartHost,
      h('div', { className: 'jp-EvalSched-compareTableHost' }, [this._table]),
      this._note
    );
    this._renderTitle();
    this._model.runChanged.connect(this._onRunChanged, this);
  }

  readonly target: ICompareTarget;

  /** The comparison shown (null before the first answer and after an error). */
  get comparison(): IComparison | null {
    return this._comparison;
  }

  get baseline(): string | null {
    return this._baseline;
  }

  /** Choose the baseline run (re-reads the comparison). */
  setBaseline(id: string | null): Promise<void> {
    this._baseline = id;
    return this.load();
  }

  /** Read the comparison (again). Never throws: errors are shown in the view. */
  async load(): Promise<void> {
    if (this.isDisposed) {
      return;
    }
    const request = ++this._request;
    this._lastLoad = Date.now();
    this.node.dataset.status = this._comparison ? 'refreshing' : 'loading';
    let comparison: IComparison;
    try {
      comparison = await this._model.api.compare({
        ...this.target,
        baseline: this._baseline ?? undefined
      });
    } catch (reason) {
      if (request !== this._request || this.isDisposed) {
        return;
      }
      this._showError(reason);
      return;
    }
    if (request !== this._request || this.isDisposed) {
      return; // a newer read is under way
    }
    if (!comparison || !Array.isArray(comparison.rows)) {
      this._showError(new Error(this._trans.__('Unexpected answer')));
      return;
    }
    this._comparison = comparison;
    this._baseline = comparison.baseline;
    this._message.hidden = true;
    this._message.textContent = '';
    delete this.node.dataset.error;
    this.node.dataset.status = 'ready';
    this._render();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    if (this._refreshTimer !== null) {
      clearTimeout(this._refreshTimer);
      this._refreshTimer = null;
    }
    this._model.runChanged.disconnect(this._onRunChanged, this);
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    if (this._stale) {
      this._scheduleRefresh();
    }
  }

  /** A run of the comparison changed (state, progress): re-read, throttled, while shown. */
  private _onRunChanged(_: EvalSchedModel, record: IRunRecord): void {
    const inIt = this.target.sweep
      ? sweepIdOf(record) === this.target.sweep
      : (this.target.runs ?? []).includes(record.id);
    if (!inIt) {
      return;
    }
    this._stale = true;
    if (this.isVisible) {
      this._scheduleRefresh();
    }
  }

  private _scheduleRefresh(): void {
    if (this._refreshTimer !== null || this.isDisposed) {
      return;
    }
    const wait = Math.max(0, this._lastLoad + REFRESH_THROTTLE_MS - Date.now());
    this._refreshTimer = setTimeout(() => {
      this._refreshTimer = null;
      this._stale = false;
      void this.load();
    }, wait);
  }

  private _showError(reason: unknown): void {
    const trans = this._trans;
    let text: string;
    let status = '';
    if (reason instanceof EvalSchedError) {
      status = String(reason.status);
      text =
        reason.status === 404
          ? trans.__('Not found: %1', reason.message)
          : reason.status === 422
            ? trans.__('Cannot compare these runs: %1', reason.message)
            : trans.__('%1 (HTTP %2)', reason.message, reason.status);
    } else {
      text = reason instanceof Error ? reason.message : String(reason);
    }
    this._comparison = null;
    this.node.dataset.status = 'error';
    this.node.dataset.error = status || 'error';
    this._message.hidden = false;
    this._message.textContent = text;
    this._render();
  }

  private _renderTitle(): void {
    const trans = this._trans;
    let text: string;
    if (this.target.sweep) {
      // '' when its runs carry no sweep_name (an older server): the id alone then.
      const name = sweepNameOf('', this._model.sweepRuns(this.target.sweep));
      text = name
        ? trans.__('Sweep %1 (%2)', name, this.target.sweep)
        : trans.__('Sweep %1', this.target.sweep);
    } else {
      text = trans._n(
        'Comparing %1 run',
        'Comparing %1 runs',
        (this.target.runs ?? []).length
      );
    }
    this._title.textContent = text;
  }

  /** The label of a run in the table and the chart: its name (in a sweep's comparison: its point). */
  private _runLabel(row: ICompareRow): string {
    const sweep = this.target.sweep;
    if (sweep) {
      const record =
        this._model.getRun(row.id) ??
        this._model.sweepRuns(sweep).find(r => r.id === row.id);
      if (record && sweepIdOf(record) === sweep) {
        return sweepPointLabel(record) || row.name || row.id;
      }
    }
    return row.name ?? row.id;
  }

  private _render(): void {
    this._renderTitle();
    const comparison = this._comparison;
    if (!comparison) {
      this._table.replaceChildren();
      this._chartHost.replaceChildren();
      this._baselineSelect.replaceChildren();
      this._metricSelect.replaceChildren();
      this.node.dataset.baseline = '';
      this.node.dataset.metric = '';
      return;
    }
    const trans = this._trans;
    const metrics = comparison.metrics ?? [];
    if (!this._metric || !metrics.includes(this._metric)) {
      this._metric = metrics[0] ?? null;
    }
    this.node.dataset.baseline = comparison.baseline ?? '';
    this.node.dataset.metric = this._metric ?? '';
    this.node.dataset.params = comparison.params.join(',');

    // Selectors
    this._baselineSelect.replaceChildren(
      ...comparison.rows.map(row =>
        h('option', {
          text: `${this._runLabel(row)} (${shortId(row.id)})`,
          title: `${this._runLabel(row)} (${row.id})`,
          attrs: { value: row.id }
        })
      )
    );
    this._baselineSelect.value = comparison.baseline ?? '';
    // The whole label of the chosen baseline, where the select is too narrow for it.
    const chosen = comparison.rows.find(r => r.id === comparison.baseline);
    this._baselineSelect.title = chosen
      ? `${this._runLabel(chosen)} (${chosen.id})`
      : '';
    this._metricSelect.replaceChildren(
      ...metrics.map(m => h('option', { text: m, attrs: { value: m } }))
    );
    this._metricSelect.value = this._metric ?? '';
    this._metricSelect.disabled = metrics.length === 0;

    // Table
    const head = h('tr', {}, [
      h('th', { text: trans.__('Run') }),
      ...comparison.params.map(p =>
        h('th', {
          className: 'jp-EvalSched-compareParam',
          text: p,
          attrs: { 'data-param': p }
        })
      ),
      ...metrics.flatMap(m => [
        h('th', {
          className: this._metricClass(m),
          text: m,
          title: trans.__('%1: mean ± standard error', m),
          attrs: { 'data-metric': m, 'data-field': 'mean' }
        }),
        h('th', {
          className: this._metricClass(m),
          text: trans.__('Δ %1 vs baseline', m),
          title: trans.__(
            'Mean paired difference against the baseline [95 %% interval] (pairs)'
          ),
          attrs: { 'data-metric': m, 'data-field': 'delta' }
        })
      ]),
      h('th', { text: trans.__('Wall') }),
      h('th', { text: trans.__('Peak VRAM') })
    ]);
    const body = comparison.rows.map(row => this._renderRow(row, metrics));
    this._table.replaceChildren(h('thead', {}, [head]), h('tbody', {}, body));
    if (!comparison.rows.length) {
      this._table.append(
        h('caption', {
          className: 'jp-EvalSched-muted',
          text: trans.__('No runs to compare.')
        })
      );
    }

    // Chart
    this._chartHost.replaceChildren(this._renderChart(comparison));
  }

  private _metricClass(metric: string): string {
    return metric === this._metric
      ? 'jp-EvalSched-compareMetric jp-mod-selected'
      : 'jp-EvalSched-compareMetric';
  }

  private _renderRow(row: ICompareRow, metrics: string[]): HTMLElement {
    const trans = this._trans;
    const comparison = this._comparison!;
    const isBaseline = row.id === comparison.baseline;
    const name = this._openRun
      ? h('button', {
          className: 'jp-EvalSched-compareRunName',
          text: this._runLabel(row),
          title: trans.__('Open run %1', row.id),
          attrs: { type: 'button', 'data-testid': 'evalsched-compare-open' }
        })
      : h('span', {
          className: 'jp-EvalSched-compareRunName',
          text: this._runLabel(row)
        });
    if (this._openRun) {
      name.addEventListener('click', () => this._openRun?.(row.id));
    }
    const runCell = h('td', { attrs: { 'data-field': 'run' } }, [
      h('div', { className: 'jp-EvalSched-compareRun' }, [
        name,
        h('span', { className: 'jp-EvalSched-runId', text: row.id }),
        row.state
          ? h('span', {
              className: 'jp-EvalSched-state',
              text: row.state,
              attrs: { 'data-state': row.state, 'data-field': 'state' }
            })
          : null,
        isBaseline
          ? h('span', {
              className: 'jp-EvalSched-tag jp-EvalSched-baselineTag',
              text: trans.__('baseline'),
              attrs: { 'data-testid': 'evalsched-compare-baseline-tag' }
            })
          : null,
        row.error
          ? h('span', {
              className: 'jp-EvalSched-warnBadge',
              text: trans.__('⚠ unreadable'),
              title: row.error,
              attrs: { 'data-field': 'error' }
            })
          : null
      ])
    ]);
    const cells: HTMLElement[] = [runCell];
    for (const p of comparison.params) {
      cells.push(
        h('td', {
          className: 'jp-EvalSched-compareParam',
          text: paramText(row.params?.[p]),
          attrs: { 'data-field': 'param', 'data-param': p }
        })
      );
    }
    for (const m of metrics) {
      const stat = row.metrics?.[m];
      const mean = stat?.mean ?? null;
      const stderr = stat?.stderr ?? null;
      const meanText =
        mean === null
          ? '–'
          : stderr === null
            ? formatNumber(mean)
            : `${formatNumber(mean)} ± ${formatNumber(stderr)}`;
      cells.push(
        h('td', {
          className: this._metricClass(m),
          text: meanText,
          title: trans.__('%1 episodes', stat?.count ?? 0),
          attrs: {
            'data-metric': m,
            'data-field': 'mean',
            'data-value': mean === null ? '' : String(mean),
            'data-stderr': stderr === null ? '' : String(stderr),
            'data-count': String(stat?.count ?? 0)
          }
        })
      );
      const delta = row.delta?.[m];
      const dMean = delta?.mean ?? null;
      const ci = Array.isArray(delta?.ci95) ? delta!.ci95 : null;
      const paired = delta?.paired ?? 0;
      let deltaText: string;
      if (isBaseline) {
        deltaText = trans.__('baseline');
      } else if (dMean === null) {
        deltaText = trans.__('– (no pairs)');
      } else {
        deltaText = ci
          ? `${signed(dMean)} [${formatNumber(ci[0])}, ${formatNumber(ci[1])}] (${paired})`
          : `${signed(dMean)} (${paired})`;
      }
      const significant =
        !isBaseline && ci !== null && (ci[0] > 0 || ci[1] < 0);
      cells.push(
        h('td', {
          className:
            this._metricClass(m) +
            (significant ? ' jp-EvalSched-significant' : ''),
          text: deltaText,
          title: isBaseline
            ? trans.__('The runs are compared against this one')
            : trans.__(
                'Paired over %1 episodes; the 95 %% interval excludes 0: %2',
                paired,
                significant ? trans.__('yes') : trans.__('no')
              ),
          attrs: {
            'data-metric': m,
            'data-field': 'delta',
            'data-value': dMean === null ? '' : String(dMean),
            'data-ci-lo': ci ? String(ci[0]) : '',
            'data-ci-hi': ci ? String(ci[1]) : '',
            'data-paired': String(paired)
          }
        })
      );
    }
    cells.push(
      h('td', {
        text: formatWall(row.wall_s),
        attrs: {
          'data-field': 'wall_s',
          'data-value': row.wall_s === null ? '' : String(row.wall_s)
        }
      }),
      h('td', {
        text: row.peak_vram_mb === null ? '–' : formatMB(row.peak_vram_mb),
        attrs: {
          'data-field': 'peak_vram_mb',
          'data-value':
            row.peak_vram_mb === null ? '' : String(row.peak_vram_mb)
        }
      })
    );
    return h(
      'tr',
      {
        className: isBaseline ? 'jp-EvalSched-compareBaseline' : '',
        attrs: {
          'data-testid': 'evalsched-compare-row',
          'data-run-id': row.id,
          'data-baseline': String(isBaseline),
          'data-state': row.state ?? ''
        }
      },
      cells
    );
  }

  private _renderChart(comparison: IComparison): HTMLElement {
    return renderChart(
      comparison,
      this._metric,
      row => this._runLabel(row),
      this._trans
    );
  }

  private _model: EvalSchedModel;
  private _trans: TranslationBundle;
  private _openRun: ((id: string) => void) | null;
  private _baseline: string | null;
  private _metric: string | null = null;
  private _comparison: IComparison | null = null;
  private _request = 0;
  private _lastLoad = 0;
  private _stale = false;
  private _refreshTimer: ReturnType<typeof setTimeout> | null = null;
  private _title: HTMLElement;
  private _baselineSelect: HTMLSelectElement;
  private _metricSelect: HTMLSelectElement;
  private _message: HTMLElement;
  private _chartHost: HTMLElement;
  private _table: HTMLTableElement;
  private _note: HTMLElement;
}

/** The DOM id of the tab of a comparison. */
export function compareTabId(target: ICompareTarget): string {
  return `jupyter-evalsched-compare-${domSuffix(target)}`;
}

/** Create (not attach) the main-area tab of a comparison, and start reading it. */
export function createCompareTab(
  options: ICompareViewOptions
): MainAreaWidget<CompareView> {
  const content = new CompareView(options);
  const widget = new MainAreaWidget({ content });
  const trans = options.trans;
  const target = options.target;
  widget.id = compareTabId(target);
  let label: string;
  if (target.sweep) {
    label = trans.__(
      'Compare · %1',
      sweepNameOf(target.sweep, options.model.sweepRuns(target.sweep))
    );
  } else {
    label = trans._n(
      'Compare · %1 run',
      'Compare · %1 runs',
      (target.runs ?? []).length
    );
  }
  widget.title.label = label;
  widget.title.caption = target.sweep
    ? trans.__('Comparison of the runs of sweep %1', target.sweep)
    : trans.__('Comparison of runs %1', (target.runs ?? []).join(', '));
  widget.title.icon = evalschedIcon;
  widget.title.closable = true;
  void content.load();
  return widget;
}
