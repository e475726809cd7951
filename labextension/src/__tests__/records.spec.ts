import {
  basename,
  compareKey,
  isTerminal,
  leaseHolder,
  runWarnings,
  sweepIdOf
} from '../records';

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
