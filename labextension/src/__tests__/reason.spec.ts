import { holderLabel, reasonView, whyOf } from '../reason';

describe('reasonView', () => {
  it('shows a why: its code as the head, code:arg with an argument, detail as the text', () => {
    const view = reasonView({
      reason: 'waiting_vram: needs 16,000 MB',
      why: {
        code: 'waiting_vram',
        arg: null,
        detail: 'needs 16,000 MB, 8,000 MB free',
        holders: []
      }
    });
    expect(view).toEqual({
      structured: true,
      code: 'waiting_vram',
      arg: '',
      head: 'waiting_vram',
      text: 'needs 16,000 MB, 8,000 MB free',
      holders: []
    });
    const preempting = reasonView({
      why: { code: 'preempting', arg: 'r-9', detail: null, holders: [] }
    });
    expect(preempting?.head).toBe('preempting:r-9');
    expect(preempting?.arg).toBe('r-9');
    expect(preempting?.text).toBe('');
  });

  it('names the holders: a run by its name, a lease by its label, a kernel by its notebook, a user by name', () => {
    const view = reasonView({
      reason: 'waiting_vram',
      why: {
        code: 'waiting_vram',
        arg: null,
        detail: null,
        holders: [
          { kind: 'run', id: 'r-1', name: 'llama eval', gpu: 0, mb: 8000 },
          { kind: 'lease', id: 'l-1', name: 'my notebook', gpu: 0, mb: 4000 },
          {
            kind: 'kernel',
            id: 'k-123456789',
            name: 'work/analysis.ipynb',
            gpu: 1,
            mb: 2000
          },
          { kind: 'user', id: null, name: 'alice', gpu: null, mb: null },
          { kind: 'process', id: '4242', name: 'python', gpu: 0, mb: 100 },
          { kind: 'model', id: 'm-1', name: 'llama-7b', gpu: 0, mb: 14000 }
        ]
      }
    });
    expect(view?.holders.map(h => [h.kind, h.label])).toEqual([
      ['run', 'llama eval'],
      ['lease', 'my notebook'],
      ['kernel', 'analysis.ipynb'],
      ['user', 'alice'],
      ['process', 'python (pid 4242)'],
      ['model', 'llama-7b']
    ]);
    expect(view?.holders[0]).toMatchObject({ id: 'r-1', gpu: 0, mb: 8000 });
  });

  it('shows a reason without why as it is, not taken apart', () => {
    for (const reason of [
      'exit_code:1',
      'preempted_by:r-9: stopped after 2 of 6',
      'waiting_vram: needs 16000 MB'
    ]) {
      expect(reasonView({ reason, why: null })).toEqual({
        structured: false,
        code: '',
        arg: '',
        head: reason,
        text: '',
        holders: []
      });
      expect(reasonView({ reason })?.head).toBe(reason);
    }
  });

  it('is null with neither why nor reason', () => {
    expect(reasonView({})).toBeNull();
    expect(reasonView({ reason: null, why: null })).toBeNull();
    expect(reasonView({ reason: '' })).toBeNull();
  });
});

describe('whyOf', () => {
  it('drops what is not in the pinned shape', () => {
    expect(whyOf({ why: 'waiting_vram' })).toBeNull();
    expect(whyOf({ why: { arg: 'x' } })).toBeNull();
    expect(whyOf({ why: [] })).toBeNull();
    expect(
      whyOf({
        why: {
          code: 'waiting_gpu',
          holders: [
            null,
            'r-1',
            { kind: 'alien', id: 'x' },
            { kind: 'run', id: 'r-2', name: 7, gpu: '0', mb: 10 }
          ]
        }
      })
    ).toEqual({
      code: 'waiting_gpu',
      arg: null,
      detail: null,
      holders: [{ kind: 'run', id: 'r-2', name: null, gpu: null, mb: 10 }]
    });
  });
});

describe('holderLabel', () => {
  const holder = { id: null, name: null, gpu: null, mb: null };
  it('falls back to the id, then to the kind', () => {
    expect(holderLabel({ ...holder, kind: 'run', id: 'r-1' })).toBe('r-1');
    expect(holderLabel({ ...holder, kind: 'lease' })).toBe('lease');
    expect(
      holderLabel({ ...holder, kind: 'kernel', id: 'abcdef0123456' })
    ).toBe('kernel abcdef01');
    expect(holderLabel({ ...holder, kind: 'process', id: '77' })).toBe(
      'pid 77'
    );
    expect(holderLabel({ ...holder, kind: 'process' })).toBe('process');
  });
});
