import {
  countStates,
  groupRuns,
  IRunSource,
  queuedNotShown,
  sectionOf,
  sweepNameOf,
  sweepSection,
  sweepState
} from '../sweeps';
import { IRunRecord } from '../records';
import { run } from './fixtures';

describe('sections', () => {
  it('lists a run by its state', () => {
    expect(sectionOf('queued')).toBe('queued');
    expect(sectionOf('running')).toBe('running');
    for (const state of ['succeeded', 'failed', 'cancelled', 'aborted']) {
      expect(sectionOf(state)).toBe('finished');
    }
  });

  it('lists a sweep where its liveliest run is', () => {
    expect(sweepSection({ running: 1, queued: 3, succeeded: 2 })).toBe(
      'running'
    );
    expect(sweepSection({ queued: 3, failed: 1 })).toBe('queued');
    expect(sweepSection({ succeeded: 4 })).toBe('finished');
  });

  it('gives a sweep the worst state of its runs', () => {
    expect(sweepState({ running: 1, failed: 1 })).toBe('running');
    expect(sweepState({ queued: 1, failed: 1 })).toBe('queued');
    expect(sweepState({ succeeded: 3, cancelled: 1, aborted: 1 })).toBe(
      'aborted'
    );
    expect(sweepState({ succeeded: 3, failed: 1, aborted: 1 })).toBe('failed');
    expect(sweepState({ succeeded: 3, cancelled: 1 })).toBe('cancelled');
    expect(sweepState({ succeeded: 3 })).toBe('succeeded');
    expect(sweepState({})).toBe('succeeded');
  });

  it('counts runs per state', () => {
    expect(
      countStates([
        run({ id: 'a', state: 'running' }),
        run({ id: 'b' }),
        run({ id: 'c' })
      ])
    ).toEqual({ running: 1, queued: 2 });
  });
});

describe('sweepNameOf', () => {
  it("is the runs' sweep_name, else the sweep's id", () => {
    expect(
      sweepNameOf('s-1', [{ sweep_name: null }, { sweep_name: 'temp sweep' }])
    ).toBe('temp sweep');
    // Not recovered from the run names any more.
    expect(sweepNameOf('s-1', [{ name: 'temp sweep [t=0.1]' } as object])).toBe(
      's-1'
    );
    expect(sweepNameOf('s-1', [])).toBe('s-1');
  });
});

describe('groupRuns', () => {
  function source(records: IRunRecord[]): IRunSource {
    const by = (state: string) => records.filter(r => r.state === state);
    return {
      running: by('running'),
      queued: by('queued'),
      finished: records.filter(
        r => r.state !== 'running' && r.state !== 'queued'
      ),
      getRun: id => records.find(r => r.id === id),
      sweepRuns: id => records.filter(r => r.sweep_id === id)
    };
  }

  it('makes one entry per sweep, listed where its liveliest run is', () => {
    const records = [
      run({ id: 'a', state: 'running' }),
      run({ id: 's1-1', state: 'running', sweep_id: 's1', sweep_name: 'S' }),
      run({ id: 's1-2', sweep_id: 's1', sweep_name: 'S' }),
      run({ id: 'b' }),
      run({ id: 's2-1', state: 'succeeded', sweep_id: 's2' }),
      run({ id: 'c', state: 'failed' })
    ];
    const { items, covered } = groupRuns(source(records), 200);
    const ids = (section: 'running' | 'queued' | 'finished') =>
      items[section].map(item =>
        item.kind === 'run' ? item.record.id : `sweep:${item.id}`
      );
    expect(ids('running')).toEqual(['a', 'sweep:s1']);
    expect(ids('queued')).toEqual(['b']);
    expect(ids('finished')).toEqual(['sweep:s2', 'c']);
    const sweep = items.running[1];
    expect(sweep.kind === 'sweep' && sweep.counts).toEqual({
      running: 1,
      queued: 1
    });
    expect([...covered].sort()).toEqual(
      ['a', 'b', 'c', 's1-1', 's1-2', 's2-1'].sort()
    );
  });

  it('shows at most maxQueued queued entries; the rest is not covered', () => {
    const records = ['q1', 'q2', 'q3'].map(id => run({ id }));
    const { items, covered } = groupRuns(source(records), 2);
    expect(items.queued.map(i => i.kind === 'run' && i.position)).toEqual([
      0, 1
    ]);
    expect(covered.has('q3')).toBe(false);
  });

  it('prefers the fresher record the model holds', () => {
    const stale = run({ id: 'a', state: 'queued' });
    const fresh = run({ id: 'a', state: 'running' });
    const src: IRunSource = {
      running: [],
      queued: [stale],
      finished: [],
      getRun: () => fresh,
      sweepRuns: () => []
    };
    expect(groupRuns(src, 200).items.running).toEqual([
      { kind: 'run', record: fresh, position: 0 }
    ]);
  });
});

describe('queuedNotShown', () => {
  function source(queued: IRunRecord[], sweeps: IRunRecord[] = []): IRunSource {
    return {
      running: [],
      queued,
      finished: [],
      getRun: id => [...queued, ...sweeps].find(r => r.id === id),
      sweepRuns: id => [...queued, ...sweeps].filter(r => r.sweep_id === id)
    };
  }

  it('counts the head not shown and the queue beyond the head', () => {
    const head = ['q1', 'q2', 'q3'].map(id => run({ id }));
    const grouping = groupRuns(source(head), 2);
    // One of the head is not shown; 7 more are queued beyond the head of 3 read.
    expect(queuedNotShown(head, 10, grouping)).toBe(8);
    // A whole queue read (an older server: the total is the list).
    expect(queuedNotShown(head, 3, grouping)).toBe(1);
  });

  it("does not count twice a sweep's runs beyond the head that its entry shows", () => {
    const head = [run({ id: 's-1', sweep_id: 's' }), run({ id: 'q1' })];
    // The sweep's read knows two more queued runs, beyond the head, and one that ended.
    const beyond = [
      run({ id: 's-2', sweep_id: 's' }),
      run({ id: 's-3', sweep_id: 's' }),
      run({ id: 's-4', sweep_id: 's', state: 'succeeded' })
    ];
    const grouping = groupRuns(source(head, beyond), 200);
    // 10 queued: the 2 of the head and the sweep's 2 beyond it are shown; 6 are not.
    expect(queuedNotShown(head, 10, grouping)).toBe(6);
  });
});
