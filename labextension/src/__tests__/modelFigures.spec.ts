import {
  formatBatch,
  formatRate,
  modelEndpoint,
  modelsOf,
  sameModels
} from '../modelFigures';

describe('modelFigures', () => {
  it('writes tokens per second and batch sizes short', () => {
    expect(formatRate(0)).toBe('0');
    expect(formatRate(null)).toBe('0');
    expect(formatRate(8.26)).toBe('8.3');
    expect(formatRate(1234.56)).toBe('1235');
    expect(formatBatch(2.5)).toBe('2.5');
    expect(formatBatch(10)).toBe('10');
    expect(formatBatch(3.14159)).toBe('3.14');
    expect(formatBatch(undefined)).toBe('0');
  });

  it('takes the server’s endpoint, else the page’s server', () => {
    const served = 'http://127.0.0.1:8888/evalsched/v1';
    expect(modelEndpoint({ endpoint: served }, 'http://x/')).toBe(served);
    expect(modelEndpoint({ endpoint: null }, 'http://x:1/user/a/')).toBe(
      'http://x:1/user/a/evalsched/v1'
    );
    expect(modelEndpoint({ endpoint: null }, 'http://x:1/user/a')).toBe(
      'http://x:1/user/a/evalsched/v1'
    );
  });

  it('reads a model list, and compares two', () => {
    expect(modelsOf(null)).toBeNull();
    expect(modelsOf({ models: 'x' })).toBeNull();
    const list = modelsOf({
      models: [{ name: 'm', state: 'loaded' }, null, 3]
    });
    expect(list?.map(m => m.name)).toEqual(['m']);
    expect(
      sameModels(
        list ?? [],
        modelsOf({ models: [{ name: 'm', state: 'loaded' }] }) ?? []
      )
    ).toBe(true);
    expect(sameModels(list ?? [], [])).toBe(false);
  });
});
