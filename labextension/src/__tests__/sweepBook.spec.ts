import { bySubmission, SweepBook } from '../sweepBook';
import { run } from './fixtures';

describe('SweepBook', () => {
  it('asks for a read when a run is news to its sweep', () => {
    const book = new SweepBook();
    expect(book.note('s', 'a')).toBe(true); // never read
    expect(book.note('s', 'a')).toBe(false); // already noted
    book.apply(
      { id: 's', runs: [run({ id: 'a' }), run({ id: 'b' })], counts: {} },
      1000
    );
    expect(book.note('s', 'b')).toBe(false); // in the last read
    expect(book.note('s', 'c')).toBe(true); // not in it
  });

  it("lists a sweep's runs in submission order, the caller's records first", () => {
    const book = new SweepBook();
    book.apply({
      id: 's',
      runs: [
        run({ id: 'b', seq: 2 }),
        run({ id: 'a', seq: 1, state: 'queued' })
      ],
      counts: {}
    });
    const fresh = run({ id: 'a', seq: 1, state: 'running' });
    const runs = book.runs('s', id => (id === 'a' ? fresh : undefined));
    expect(runs.map(r => [r.id, r.state])).toEqual([
      ['a', 'running'],
      ['b', 'queued']
    ]);
    expect(book.runs('unknown', () => undefined)).toEqual([]);
  });

  it('forgets unlisted sweeps on a resync and says which are due for a read', () => {
    const book = new SweepBook();
    book.apply({ id: 'old', runs: [run({ id: 'x' })], counts: {} }, 0);
    book.apply({ id: 'new', runs: [run({ id: 'y' })], counts: {} }, 25_000);
    book.note('gone', 'z');
    expect(book.resync(new Set(['old', 'new']), 30_000, 40_000)).toEqual([
      'old'
    ]);
    expect(book.has('gone')).toBe(false);
    book.unknown('new', 40_000);
    expect(book.runs('new', () => undefined)).toEqual([]);
    expect(book.resync(new Set(['new']), 30_000, 60_000)).toEqual([]);
  });

  it('orders by seq, then submission time, then id', () => {
    const runs = [
      run({ id: 'c', submitted_at: '2030-01-02' }),
      run({ id: 'b', seq: 5 }),
      run({ id: 'a', submitted_at: '2030-01-02' }),
      run({ id: 'd', submitted_at: '2030-01-01' })
    ];
    expect(runs.sort(bySubmission).map(r => r.id)).toEqual([
      'b',
      'd',
      'a',
      'c'
    ]);
  });
});
