import { readFileSync } from 'fs';
import { join } from 'path';

import {
  attemptOf,
  colorSlot,
  formatAgo,
  formatDuration,
  formatMB,
  formatNumber,
  historyOf,
  isResumable,
  parseTime,
  retryInSeconds,
  runBadges,
  shortenIds,
  shortId,
  slurmLabel,
  splitReason,
  sweepPointLabel
} from '../format';

describe('formatting', () => {
  it('formats durations', () => {
    expect(formatDuration(75_000)).toBe('1:15');
    expect(formatDuration(3_725_000)).toBe('1:02:05');
    expect(formatDuration(-5)).toBe('0:00');
    expect(formatDuration(null)).toBe('–');
  });

  it('says how long ago', () => {
    const now = 1_000_000_000;
    expect(formatAgo(now - 5_000, now)).toBe('just now');
    expect(formatAgo(now - 30_000, now)).toBe('30 s ago');
    expect(formatAgo(now - 120_000, now)).toBe('2 min ago');
    expect(formatAgo(now - 3 * 3600_000, now)).toBe('3 h ago');
    expect(formatAgo(null, now)).toBe('');
  });

  it('counts in MB, never in rounded GB', () => {
    expect(formatMB(16000)).toBe('16,000 MB');
    expect(formatMB(16000, false)).toBe('16,000');
    expect(formatMB(undefined)).toBe('–');
  });

  it('gives numbers about four significant digits', () => {
    expect(formatNumber(3)).toBe('3');
    expect(formatNumber(0.123456)).toBe('0.1235');
    expect(formatNumber(0.0001234)).toBe('1.23e-4');
    expect(formatNumber(NaN)).toBe('–');
  });

  it('parses the contract’s timestamps (microseconds)', () => {
    expect(parseTime('2030-01-01T00:00:01.123456+00:00')).toBe(
      Date.parse('2030-01-01T00:00:01.123Z')
    );
    expect(parseTime('nope')).toBeNull();
    expect(parseTime(null)).toBeNull();
  });

  it('splits a warning into its code and sentence', () => {
    expect(splitReason('over_vram: used 9,000 MB')).toEqual({
      code: 'over_vram',
      text: 'used 9,000 MB'
    });
    expect(splitReason('over_vram')).toEqual({ code: 'over_vram', text: '' });
    expect(splitReason(null)).toEqual({ code: '', text: '' });
  });
});

describe('run badges and attempts', () => {
  it('badges only what sets a run apart', () => {
    expect(runBadges({})).toEqual([]);
    expect(
      runBadges({
        attempt: 3,
        preemptions: 2,
        retries: 3,
        retries_used: 1,
        detach: true
      }).map(b => [b.kind, b.text])
    ).toEqual([
      ['attempt', 'attempt 3'],
      ['preemptions', 'preempted ×2'],
      ['retries', 'retry 1/3'],
      ['detached', 'detached']
    ]);
    expect(runBadges({ attempt: 'x', preemptions: -1, detach: 'yes' })).toEqual(
      []
    );
    expect(attemptOf({})).toBe(1);
  });

  it('reads the history oldest first, dropping junk', () => {
    expect(
      historyOf({
        history: [
          { attempt: 2, state: 'preempted', reason: 'preempted_by:r-9' },
          {
            attempt: 1,
            state: 'failed',
            reason: 'exit_code:3',
            episodes_done: 2
          },
          'junk'
        ]
      }).map(e => [e.attempt, e.state, e.reason, e.episodes_done])
    ).toEqual([
      [1, 'failed', 'exit_code:3', 2],
      [2, 'preempted', 'preempted_by:r-9', null]
    ]);
    expect(historyOf({ history: 'nope' })).toEqual([]);
  });

  it('resumes what ended without succeeding; counts down to a retry', () => {
    expect(
      ['failed', 'aborted', 'cancelled', 'succeeded', 'queued'].map(isResumable)
    ).toEqual([true, true, true, false, false]);
    const now = Date.parse('2030-01-01T00:00:00Z');
    expect(retryInSeconds('2030-01-01T00:00:10.000000+00:00', now)).toBe(10);
    expect(retryInSeconds('2029-12-31T23:59:00+00:00', now)).toBe(0);
    expect(retryInSeconds(null, now)).toBeNull();
  });
});

describe('SLURM and sweep points', () => {
  it('labels a SLURM run', () => {
    expect(slurmLabel({ slurm_job_id: 123, slurm_state: 'RUNNING' })).toBe(
      'SLURM 123 · RUNNING'
    );
    expect(slurmLabel({ slurm_state: 'PENDING' })).toBe('SLURM · PENDING');
    expect(slurmLabel({})).toBe('SLURM');
  });

  it("tells a sweep's run apart by its point", () => {
    expect(
      sweepPointLabel({
        name: 'toy [skill=0.3, label=a]',
        sweep_point: { skill: 0.3, label: 'a' }
      })
    ).toBe('skill=0.3, label=a');
    expect(
      sweepPointLabel({ name: 'renamed', sweep_point: { skill: 0.3 } })
    ).toBe('skill=0.3');
    expect(sweepPointLabel({ name: 'plain' })).toBe('plain');
  });
});

describe('run colours', () => {
  // The same fixture as tests/test_widget.py: a run has one colour in the widget and the panel.
  const fixture = JSON.parse(
    readFileSync(join(__dirname, 'fixtures', 'run-colors.json'), 'utf-8')
  ) as {
    palette: string[];
    cases: { id: string; slot: number; color: string }[];
  };

  it('gives each id the slot the notebook widget gives it', () => {
    for (const c of fixture.cases) {
      expect([c.id, colorSlot(c.id, fixture.palette.length)]).toEqual([
        c.id,
        c.slot
      ]);
    }
  });

  it('draws the slots in the palette of the widget', () => {
    const css = readFileSync(
      join(__dirname, '..', '..', 'style', 'base.css'),
      'utf-8'
    );
    const panel = /\.jp-EvalSched \{([^}]*)\}/.exec(css)![1];
    const palette: string[] = [];
    const re = /--jp-evalsched-c\d: (#[0-9a-f]{6});/g;
    for (let m = re.exec(panel); m; m = re.exec(panel)) {
      palette.push(m[1]);
    }
    expect(palette).toEqual(fixture.palette);
    for (const c of fixture.cases) {
      expect(fixture.palette[c.slot]).toBe(c.color);
    }
  });
});

describe('short ids', () => {
  it('shortens the ids the server makes to their random tail, and only those', () => {
    expect(shortId('20261203T063806.448589-41dfab')).toBe('41dfab');
    expect(shortId('lease-20261203T063805.937217-3eda47')).toBe('3eda47');
    expect(shortId('sweep-20261203T063922-210694')).toBe('210694');
    expect(shortId('k-1')).toBe('k-1');
    expect(shortId('my-run-abcdef')).toBe('my-run-abcdef');
  });

  it('finds the ids in a sentence', () => {
    const lease = 'lease-20261203T063805.937217-3eda47';
    expect(shortenIds(`lease ${lease} (notes) holds 6000 MB`)).toEqual([
      'lease ',
      { id: lease, short: '3eda47' },
      ' (notes) holds 6000 MB'
    ]);
    expect(shortenIds('needs 20000 MB')).toEqual(['needs 20000 MB']);
  });
});
