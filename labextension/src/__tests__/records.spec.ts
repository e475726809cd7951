import {
  basename,
  latestMetrics,
  compareKey,
  isTerminal,
  leaseHolder,
  runWarnings,
  sweepIdOf
} from '../records';
import { run } from './fixtures';

describe('records', () => {
  it('names a lease holder by label, notebook, pid, else id', () => {
    expect(leaseHolder({ id: 'l', label: 'mine', pid: 1 })).toBe('mine');
    expect(leaseHolder({ id: 'l', session_path: 'w/a.ipynb' })).toBe('a.ipynb');
    expect(leaseHolder({ id: 'l', pid: 7 })).toBe('pid 7');
    expect(leaseHolder({ id: 'l' })).toBe('l');
    expect(basename('a/b/')).toBe('b');
  });

  it('reads the optional fields of older servers', () => {
    expect(isTerminal('failed')).toBe(true);
    expect(isTerminal('running')).toBe(false);
    expect(sweepIdOf({ sweep_id: 's' })).toBe('s');
    expect(sweepIdOf({ sweep_id: '' })).toBeNull();
    expect(runWarnings({ warnings: ['over_vram: x', 3] })).toEqual([
      'over_vram: x'
    ]);
    expect(runWarnings({})).toEqual([]);
    expect(compareKey({ sweep: 's' })).toBe('sweep:s');
    expect(compareKey({ runs: ['a', 'b'] })).toBe('runs:a,b');
  });
});

describe('latestMetrics', () => {
  const metrics = { acc: { mean: 0.5 } };
  it('takes the record’s metrics, else the summary’s, else whichever saw more episodes', () => {
    expect(latestMetrics(run({ id: 'a', metrics }), null)).toEqual(metrics);
    expect(latestMetrics(run({ id: 'a' }), { metrics })).toEqual(metrics);
    expect(latestMetrics(undefined, undefined)).toEqual({});
    const newer = { acc: { mean: 0.7 } };
    const record = run({ id: 'a', metrics, progress: { done: 3, total: 4 } });
    expect(latestMetrics(record, { metrics: newer, episodes_done: 4 })).toBe(
      newer
    );
    expect(latestMetrics(record, { metrics: newer, episodes_done: 2 })).toBe(
      metrics
    );
  });
});
