/**
 * A shared model's row in the panel's Shared models list: name, state, its OpenAI endpoint (with
 * a Copy button) and its figures: requests, tokens/s and mean batch size.
 */
import { Clipboard } from '@jupyterlab/apputils';
import { TranslationBundle } from '@jupyterlab/translation';

import { IModelInfo } from './api';
import { h } from './format';
import { formatBatch, formatRate, modelEndpoint } from './modelFigures';

export class ModelRow {
  constructor(
    readonly name: string,
    private _trans: TranslationBundle,
    private _baseUrl: string
  ) {
    const trans = _trans;
    this.node = h('div', {
      className: 'jp-EvalSched-model',
      attrs: { 'data-model': name, 'data-testid': 'evalsched-model-row' }
    });
    this._state = h('span', {
      className: 'jp-EvalSched-state',
      attrs: { 'data-testid': 'evalsched-model-state' }
    });
    this._endpoint = h('code', {
      className: 'jp-EvalSched-endpoint',
      attrs: { 'data-testid': 'evalsched-model-endpoint' }
    });
    const copy = h('button', {
      className: 'jp-EvalSched-textButton',
      text: trans.__('Copy'),
      title: trans.__('Copy the OpenAI base URL'),
      attrs: { type: 'button', 'data-testid': 'evalsched-model-copy' }
    });
    copy.addEventListener('click', () => {
      Clipboard.copyToSystem(this._endpoint.textContent ?? '');
    });
    this._figures = h('div', {
      className: 'jp-EvalSched-runMeta',
      attrs: { 'data-testid': 'evalsched-model-figures' }
    });
    this._error = h('div', { className: 'jp-EvalSched-errorLine' });
    this.node.append(
      h('div', { className: 'jp-EvalSched-runHead' }, [
        h('span', { className: 'jp-EvalSched-modelName', text: name }),
        h('span', { className: 'jp-EvalSched-headEnd' }, [this._state])
      ]),
      h('div', { className: 'jp-EvalSched-modelEndpoint' }, [
        this._endpoint,
        copy
      ]),
      this._figures,
      this._error
    );
  }

  readonly node: HTMLElement;

  update(model: IModelInfo): void {
    if (model === this._model) {
      return; // lists are replaced, never mutated
    }
    this._model = model;
    const trans = this._trans;
    const node = this.node;
    node.dataset.state = model.state;
    node.dataset.requests = String(model.requests ?? 0);
    this._state.textContent = model.state.replace('_', ' ');
    this._state.dataset.state = model.state;
    const endpoint = modelEndpoint(model, this._baseUrl);
    this._endpoint.textContent = endpoint;
    this._endpoint.title = trans.__(
      'OpenAI base URL; the model id is %1, the API key the server’s token',
      model.name
    );
    const requests = model.requests ?? 0;
    const field = (key: string, text: string, title: string) =>
      h('span', { text, title, attrs: { 'data-field': key } });
    this._figures.replaceChildren(
      field(
        'requests',
        trans._n('%1 request', '%1 requests', requests),
        trans.__('Requests answered (API requests and ctx.model calls)')
      ),
      field(
        'tokens_per_s',
        trans.__('%1 tok/s', formatRate(model.tokens_per_s)),
        trans.__(
          'Prompt and generated tokens per second over the last minute (%1 since the load)',
          formatRate(model.tokens_per_s_since_load)
        )
      ),
      field(
        'mean_batch_size',
        trans.__('batch %1', formatBatch(model.mean_batch_size)),
        trans.__('Inputs per batch on average (%1 batches)', model.batches ?? 0)
      )
    );
    const error = model.error as { type?: string; message?: string } | null;
    this._error.hidden = model.state !== 'failed' || !error;
    if (error) {
      const text = `${error.type ?? ''}: ${error.message ?? ''}`;
      this._error.textContent = text;
      this._error.title = text;
    }
  }

  dispose(): void {
    this.node.remove();
  }

  private _model: IModelInfo | null = null;
  private _state: HTMLElement;
  private _endpoint: HTMLElement;
  private _figures: HTMLElement;
  private _error: HTMLElement;
}
