/**
 * The panel model's queue with a head read (`queueLimit`): what it lists, how it counts the runs
 * beyond the head from events, and which runs missing from a read it reads again. No server:
 * the queue views and events are fed to it.
 */
import { EvalSchedModel } from '../model';
import { IQueueView, IRunRecord } from '../records';
import { run } from './fixtures';

type Internals = {
  _applyQueue(view: IQueueView): boolean;
  _upsert(record: IRunRecord, place: boolean): boolean;
  _queueSummaryFetch(id: string, delay: number): void;
};

function view(queued: IRunRecord[], total?: number): IQueueView {
  const v: IQueueView = {
    primary: null,
    queued,
    running: [],
    ledger: null as unknown as IQueueView['ledger'],
    leases: []
  };
  if (total !== undefined) {
    v.queued_total = total;
  }
  return v;
}

const ids = (records: ReadonlyArray<IRunRecord>) => records.map(r => r.id);

describe('a model reading the head of the queue', () => {
  let model: EvalSchedModel;
  let internals: Internals;
  let reread: string[];

  beforeEach(() => {
    model = new EvalSchedModel({} as never, { queueLimit: 3 });
    internals = model as unknown as Internals;
    reread = [];
    internals._queueSummaryFetch = (id: string) => {
      reread.push(id);
    };
  });

  afterEach(() => model.dispose());

  it('lists the head and counts the rest', () => {
    internals._applyQueue(
      view([run({ id: 'a' }), run({ id: 'b' }), run({ id: 'c' })], 7)
    );
    expect(ids(model.queued)).toEqual(['a', 'b', 'c']);
    expect(model.queuedTotal).toBe(7);
  });

  it('neither counts nor lists a queued run beyond the head that an event tells of', () => {
    internals._applyQueue(
      view([run({ id: 'a' }), run({ id: 'b' }), run({ id: 'c' })], 7)
    );
    // An admission pass tells the reasons of runs beyond the head: not new to the queue.
    internals._upsert(run({ id: 'x', reason: 'waiting_vram' }), true);
    expect(ids(model.queued)).toEqual(['a', 'b', 'c']);
    expect(model.queuedTotal).toBe(7);
    // A listed run that starts leaves the list and the count.
    internals._upsert(run({ id: 'a', state: 'running' }), true);
    expect(ids(model.queued)).toEqual(['b', 'c']);
    expect(model.queuedTotal).toBe(6);
    expect(ids(model.running)).toEqual(['a']);
  });

  it('reads again a run that left the head, not one pushed beyond it', () => {
    internals._applyQueue(
      view([run({ id: 'b' }), run({ id: 'c' }), run({ id: 'd' })], 6)
    );
    // A newcomer ahead: d, last, may be beyond the head now.
    internals._applyQueue(
      view([run({ id: 'n1' }), run({ id: 'b' }), run({ id: 'c' })], 7)
    );
    expect(reread).toEqual([]);
    // b is missing, and one newcomer cannot push the second of the head out: it left the queue.
    internals._applyQueue(
      view([run({ id: 'n1' }), run({ id: 'c' }), run({ id: 'e' })], 6)
    );
    expect(reread).toEqual(['b']);
  });

  it('counts and lists a newcomer while the whole queue is listed, up to the limit', () => {
    internals._applyQueue(view([run({ id: 'a' })], 1));
    internals._upsert(run({ id: 'n1' }), true);
    internals._upsert(run({ id: 'n2' }), true);
    expect(ids(model.queued)).toEqual(['a', 'n1', 'n2']);
    expect(model.queuedTotal).toBe(3);
    internals._upsert(run({ id: 'n3' }), true); // counted, beyond the limit: not listed
    expect(ids(model.queued)).toEqual(['a', 'n1', 'n2']);
    expect(model.queuedTotal).toBe(4);
  });

  it("takes an older server's whole list as the count", () => {
    internals._applyQueue(view([run({ id: 'a' }), run({ id: 'b' })]));
    expect(model.queuedTotal).toBe(2);
    internals._upsert(run({ id: 'a', state: 'cancelled' }), true);
    expect(model.queuedTotal).toBe(1);
  });
});
