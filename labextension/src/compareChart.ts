/**
 * The chart of a comparison, drawn as inline SVG: the selected metric's mean (± standard error
 * bars) against the first differing parameter, one line per combination of the others.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { ICompareRow, IComparison } from './api';
import { formatNumber, h, paramText } from './format';

/** Colour slots of the chart's lines (CSS classes jp-EvalSched-series-0 … 7). */
const SERIES_SLOTS = 8;
/** Categories labelled on the x axis at most (the others are ticks only). */
const MAX_CATEGORY_LABELS = 12;
/** How far apart series are drawn, and at most (px). */
const DODGE_PX = 3;
const MAX_DODGE_PX = 12;

const SVG_NS = 'http://www.w3.org/2000/svg';

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

export function renderChart(
  comparison: IComparison,
  metric: string | null,
  runLabel: (row: ICompareRow) => string,
  trans: TranslationBundle
): HTMLElement {
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
  const data = chartData(comparison, metric, runLabel);
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
