import { chartData, niceTicks } from '../compareChart';
import { ICompareRow } from '../records';

function row(
  id: string,
  params: { [param: string]: unknown },
  mean: number | null
): ICompareRow {
  return {
    id,
    name: `run ${id}`,
    state: 'succeeded',
    params,
    metrics: { acc: { mean, stderr: 0.01, count: 4 } },
    delta: {},
    wall_s: 1,
    peak_vram_mb: null,
    error: null
  };
}

describe('niceTicks', () => {
  it('steps by 1, 2, 2.5 or 5 times a power of ten', () => {
    expect(niceTicks(0, 1)).toEqual([0, 0.2, 0.4, 0.6, 0.8, 1]);
    expect(niceTicks(10, 0, 4)).toEqual([0, 2.5, 5, 7.5, 10]);
    expect(niceTicks(NaN, 1)).toEqual([]);
  });
});

describe('chartData', () => {
  it('puts the first differing parameter on x and a series per combination of the others', () => {
    const data = chartData(
      {
        params: ['skill', 'label'],
        metrics: ['acc'],
        metrics_dropped: 0,
        baseline: 'a',
        rows: [
          row('a', { skill: 0.3, label: 'x' }, 0.5),
          row('b', { skill: 0.6, label: 'x' }, 0.6),
          row('c', { skill: 0.3, label: 'y' }, 0.4),
          row('d', { skill: 0.9, label: 'y' }, null)
        ]
      },
      'acc'
    );
    expect(data.xParam).toBe('skill');
    expect(data.numeric).toBe(true);
    expect(data.series).toEqual(['label=x', 'label=y']);
    // A run without a mean is not plotted.
    expect(
      data.points.map(p => [p.id, p.x, p.y, p.series, p.baseline])
    ).toEqual([
      ['a', 0.3, 0.5, 0, true],
      ['b', 0.6, 0.6, 0, false],
      ['c', 0.3, 0.4, 1, false]
    ]);
  });

  it('uses categories for values that are not all numbers, and the runs when nothing differs', () => {
    const categorical = chartData(
      {
        params: ['model'],
        metrics: ['acc'],
        metrics_dropped: 0,
        baseline: null,
        rows: [row('a', { model: 'small' }, 1), row('b', { model: 'big' }, 2)]
      },
      'acc'
    );
    expect(categorical.numeric).toBe(false);
    expect(categorical.categories).toEqual(['small', 'big']);
    const runs = chartData(
      {
        params: [],
        metrics: ['acc'],
        metrics_dropped: 0,
        baseline: null,
        rows: [row('a', {}, 1)]
      },
      'acc'
    );
    expect(runs.xParam).toBeNull();
    expect(runs.categories).toEqual(['run a']);
  });
});
