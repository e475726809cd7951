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
  sweepPointLabel
} from './format';
import { sweepNameOf } from './sweeps';
import { evalschedIcon } from './icon';
import { EvalSchedModel } from './model';

/** Re-read a comparison at most this often while its runs change (ms). */
const REFRESH_THROTTLE_MS = 2000;
/** Colour slots of the chart's lines (CSS classes jp-EvalSched-series-0 … 7). */
const SERIES_SLOTS = 8;
/** Categories labelled on the x axis at most (the others are ticks only). */
const MAX_CATEGORY_LABELS = 12;
/** How far apart series are drawn, and at most (px). */
const DODGE_PX = 3;
const MAX_DODGE_PX = 12;

const SVG_NS = 'http://www.w3.org/2000/svg';

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

function svg<K extends keyof SVGElementTagNameMap>(
  tag: K,
  attrs: Record<string, string | number> = {},
  children: (Node | string | null)[] = []
): SVGElementTagNameMap[K] {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) {
    el.setAttribute(k, String(v));
  }
  for (const child of children) {
    if (child !== null) {
      el.append(child);
    }
  }
  return el;
}

/** About `count` round tick values covering [lo, hi]. */
export function niceTicks(lo: number, hi: number, count = 5): number[] {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) {
    return [];
  }
  if (hi < lo) {
    [lo, hi] = [hi, lo];
  }
  const span = hi - lo || Math.abs(hi) || 1;
  const raw = span / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step =
    [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw) ?? 10 * mag;
  const ticks: number[] = [];
  const start = Math.ceil(lo / step - 1e-9) * step;
  for (let v = start; v <= hi + step * 1e-9; v += step) {
    ticks.push(Number(v.toPrecision(12)));
    if (ticks.length > 50) {
      break;
    }
  }
  return ticks;
}

/** One plotted point of the chart. */
export interface IChartPoint {
  id: string;
  label: string;
  /** The x value: the first differing parameter's value (a number, or a category index). */
  x: number;
  xText: string;
  y: number;
  stderr: number | null;
  series: number;
  baseline: boolean;
}

/** The chart's data: points, series labels, the x axis (numeric or categories). */
export interface IChartData {
  xParam: string | null;
  numeric: boolean;
  categories: string[];
  series: string[];
  points: IChartPoint[];
}

/**
 * The chart of a comparison for one metric: x is the first differing parameter (numeric when
 * every value is a number, else categories in the order met; the runs themselves when no
 * parameter differs), one series per combination of the other differing parameters. Runs
 * without a mean for the metric are left out.
 */
export function chartData(
  comparison: IComparison,
  metric: string,
  runLabel: (row: ICompareRow) => string = row => row.name ?? row.id
): IChartData {
  const rows = comparison.rows.filter(row => {
    const mean = row.metrics?.[metric]?.mean;
    return typeof mean === 'number' && Number.isFinite(mean);
  });
  const [xParam, ...others] = comparison.params;
  const numeric =
    xParam !== undefined &&
    rows.length > 0 &&
    rows.every(row => {
      const v = row.params?.[xParam];
      return typeof v === 'number' && Number.isFinite(v);
    });
  const categories: string[] = [];
  const series: string[] = [];
  const points = rows.map(row => {
    let x: number;
    let xText: string;
    if (xParam === undefined) {
      xText = runLabel(row);
      categories.push(xText);
      x = categories.length - 1;
    } else if (numeric) {
      x = row.params[xParam] as number;
      xText = paramText(x);
    } else {
      xText = paramText(row.params?.[xParam]);
      let at = categories.indexOf(xText);
      if (at < 0) {
        categories.push(xText);
        at = categories.length - 1;
      }
      x = at;
    }
    const seriesLabel = others.length
      ? others.map(p => `${p}=${paramText(row.params?.[p])}`).join(', ')
      : metric;
    let s = series.indexOf(seriesLabel);
    if (s < 0) {
      series.push(seriesLabel);
      s = series.length - 1;
    }
    const stat = row.metrics[metric];
    return {
      id: row.id,
      label: runLabel(row),
      x,
      xText,
      y: stat.mean as number,
      stderr:
        typeof stat.stderr === 'number' && Number.isFinite(stat.stderr)
          ? stat.stderr
          : null,
      series: s,
      baseline: row.id === comparison.baseline
    };
  });
  return {
    xParam: xParam ?? null,
    numeric,
    categories,
    series,
    points
  };
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
          text: `${this._runLabel(row)} (${row.id})`,
          attrs: { value: row.id }
        })
      )
    );
    this._baselineSelect.value = comparison.baseline ?? '';
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
    const trans = this._trans;
    const metric = this._metric;
    const host = h('div', { className: 'jp-EvalSched-chartHost' });
    if (!metric) {
      host.append(
        h('div', {
          className: 'jp-EvalSched-muted',
          text: trans.__('No metric to chart.')
        })
      );
      return host;
    }
    const data = chartData(comparison, metric, row => this._runLabel(row));
    const W = 640;
    const H = 300;
    const M = { left: 60, right: 20, top: 16, bottom: 48 };
    const plotW = W - M.left - M.right;
    const plotH = H - M.top - M.bottom;
    const chart = svg('svg', {
      class: 'jp-EvalSched-chart',
      viewBox: `0 0 ${W} ${H}`,
      width: W,
      height: H,
      role: 'img',
      'aria-label': trans.__(
        '%1 against %2',
        metric,
        data.xParam ?? trans.__('run')
      ),
      'data-testid': 'evalsched-compare-chart',
      'data-metric': metric,
      'data-x-param': data.xParam ?? '',
      'data-x-kind': data.numeric ? 'numeric' : 'categorical',
      'data-series': String(data.series.length)
    });
    host.append(chart);
    if (!data.points.length) {
      chart.append(
        svg(
          'text',
          {
            x: W / 2,
            y: H / 2,
            'text-anchor': 'middle',
            class: 'jp-EvalSched-chartEmpty'
          },
          [trans.__('No values of %1 yet', metric)]
        )
      );
      return host;
    }

    // Scales
    let yLo = Infinity;
    let yHi = -Infinity;
    for (const p of data.points) {
      const e = p.stderr ?? 0;
      yLo = Math.min(yLo, p.y - e);
      yHi = Math.max(yHi, p.y + e);
    }
    if (yHi - yLo < 1e-12) {
      const pad = Math.abs(yHi) * 0.1 || 0.5;
      yLo -= pad;
      yHi += pad;
    } else {
      const pad = (yHi - yLo) * 0.08;
      yLo -= pad;
      yHi += pad;
    }
    const yTicks = niceTicks(yLo, yHi, 5);
    const yScale = (v: number) =>
      M.top + plotH - ((v - yLo) / (yHi - yLo)) * plotH;

    let xScale: (v: number) => number;
    let xTicks: { v: number; text: string }[];
    if (data.numeric) {
      let xLo = Math.min(...data.points.map(p => p.x));
      let xHi = Math.max(...data.points.map(p => p.x));
      if (xHi - xLo < 1e-12) {
        const pad = Math.abs(xHi) * 0.1 || 0.5;
        xLo -= pad;
        xHi += pad;
      } else {
        const pad = (xHi - xLo) * 0.06;
        xLo -= pad;
        xHi += pad;
      }
      xScale = v => M.left + ((v - xLo) / (xHi - xLo)) * plotW;
      xTicks = niceTicks(xLo, xHi, 6).map(v => ({ v, text: formatNumber(v) }));
    } else {
      const n = data.categories.length;
      const step = plotW / Math.max(1, n);
      xScale = v => M.left + step * (v + 0.5);
      // Every category is a tick; beyond a dozen, every k-th is labelled.
      const every = Math.ceil(n / MAX_CATEGORY_LABELS);
      xTicks = data.categories.map((text, v) => ({
        v,
        text: v % every === 0 ? text : ''
      }));
    }
    // Series side by side (a few pixels apart) so that equal values do not hide each other.
    const dodge = (series: number) =>
      data.series.length > 1
        ? Math.max(
            -MAX_DODGE_PX,
            Math.min(
              MAX_DODGE_PX,
              (series - (data.series.length - 1) / 2) * DODGE_PX
            )
          )
        : 0;

    // Axes and grid
    const axes = svg('g', { class: 'jp-EvalSched-chartAxes' });
    for (const t of yTicks) {
      const y = yScale(t);
      axes.append(
        svg('line', {
          x1: M.left,
          x2: M.left + plotW,
          y1: y,
          y2: y,
          class: 'jp-EvalSched-chartGrid'
        }),
        svg(
          'text',
          {
            x: M.left - 6,
            y: y + 4,
            'text-anchor': 'end',
            class: 'jp-EvalSched-chartTick'
          },
          [formatNumber(t)]
        )
      );
    }
    for (const t of xTicks) {
      const x = xScale(t.v);
      const text = t.text.length > 14 ? `${t.text.slice(0, 13)}…` : t.text;
      if (!text) {
        axes.append(
          svg('line', {
            x1: x,
            x2: x,
            y1: M.top + plotH,
            y2: M.top + plotH + 3,
            class: 'jp-EvalSched-chartAxis'
          })
        );
        continue;
      }
      axes.append(
        svg('line', {
          x1: x,
          x2: x,
          y1: M.top + plotH,
          y2: M.top + plotH + 4,
          class: 'jp-EvalSched-chartAxis'
        }),
        svg(
          'text',
          {
            x,
            y: M.top + plotH + 16,
            'text-anchor': 'middle',
            class: 'jp-EvalSched-chartTick'
          },
          [svg('title', {}, [t.text]), text]
        )
      );
    }
    axes.append(
      svg('line', {
        x1: M.left,
        x2: M.left + plotW,
        y1: M.top + plotH,
        y2: M.top + plotH,
        class: 'jp-EvalSched-chartAxis'
      }),
      svg('line', {
        x1: M.left,
        x2: M.left,
        y1: M.top,
        y2: M.top + plotH,
        class: 'jp-EvalSched-chartAxis'
      }),
      svg(
        'text',
        {
          x: M.left + plotW / 2,
          y: H - 10,
          'text-anchor': 'middle',
          class: 'jp-EvalSched-chartLabel'
        },
        [data.xParam ?? trans.__('run')]
      ),
      svg(
        'text',
        {
          x: 14,
          y: M.top + plotH / 2,
          'text-anchor': 'middle',
          transform: `rotate(-90 14 ${M.top + plotH / 2})`,
          class: 'jp-EvalSched-chartLabel'
        },
        [metric]
      )
    );
    chart.append(axes);

    // One line per series, points with their error bars
    data.series.forEach((label, s) => {
      const slot = `jp-EvalSched-series-${s % SERIES_SLOTS}`;
      const points = data.points
        .filter(p => p.series === s)
        .sort((a, b) => a.x - b.x);
      const group = svg('g', {
        class: `jp-EvalSched-chartSeries ${slot}`,
        'data-series': label
      });
      const offset = dodge(s);
      if (points.length > 1) {
        group.append(
          svg('polyline', {
            points: points
              .map(
                p =>
                  `${(xScale(p.x) + offset).toFixed(1)},${yScale(p.y).toFixed(1)}`
              )
              .join(' '),
            class: 'jp-EvalSched-chartLine'
          })
        );
      }
      for (const p of points) {
        const cx = xScale(p.x) + offset;
        const cy = yScale(p.y);
        if (p.stderr !== null && p.stderr > 0) {
          const top = yScale(p.y + p.stderr);
          const bottom = yScale(p.y - p.stderr);
          group.append(
            svg('line', {
              x1: cx,
              x2: cx,
              y1: top,
              y2: bottom,
              class: 'jp-EvalSched-chartErr'
            }),
            svg('line', {
              x1: cx - 4,
              x2: cx + 4,
              y1: top,
              y2: top,
              class: 'jp-EvalSched-chartErr'
            }),
            svg('line', {
              x1: cx - 4,
              x2: cx + 4,
              y1: bottom,
              y2: bottom,
              class: 'jp-EvalSched-chartErr'
            })
          );
        }
        group.append(
          svg(
            'circle',
            {
              cx: cx.toFixed(1),
              cy: cy.toFixed(1),
              r: p.baseline ? 5 : 4,
              class: p.baseline
                ? 'jp-EvalSched-chartPoint jp-mod-baseline'
                : 'jp-EvalSched-chartPoint',
              'data-testid': 'evalsched-compare-point',
              'data-run-id': p.id,
              'data-x': p.xText,
              'data-y': String(p.y),
              'data-series': label
            },
            [
              svg('title', {}, [
                p.stderr !== null
                  ? `${p.label}: ${formatNumber(p.y)} ± ${formatNumber(p.stderr)}`
                  : `${p.label}: ${formatNumber(p.y)}`
              ])
            ]
          )
        );
      }
      chart.append(group);
    });

    // Legend (HTML: it wraps)
    const legend = h(
      'div',
      {
        className: 'jp-EvalSched-chartLegend',
        attrs: { 'data-testid': 'evalsched-compare-legend' }
      },
      data.series.map((label, s) =>
        h(
          'span',
          {
            className: 'jp-EvalSched-legendItem',
            attrs: { 'data-series': label }
          },
          [
            h('span', {
              className: `jp-EvalSched-swatch jp-EvalSched-seriesSwatch jp-EvalSched-series-${s % SERIES_SLOTS}`
            }),
            label
          ]
        )
      )
    );
    host.append(legend);
    return host;
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
