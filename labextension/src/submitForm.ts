import { TranslationBundle } from '@jupyterlab/translation';

import { EvalSchedError } from './api';
import { h } from './format';
import { EvalSchedModel } from './model';

/**
 * A compact form to submit a run (entrypoint, episodes, params, VRAM, priority).
 */
export class SubmitForm {
  constructor(
    private _model: EvalSchedModel,
    private _trans: TranslationBundle
  ) {
    const trans = _trans;
    const field = (label: string, input: HTMLElement, hint?: string) =>
      h('label', { className: 'jp-EvalSched-field' }, [
        h('span', { className: 'jp-EvalSched-fieldLabel', text: label }),
        input,
        hint ? h('span', { className: 'jp-EvalSched-hint', text: hint }) : null
      ]);
    const input = (
      name: string,
      type: string,
      attrs: Record<string, string> = {}
    ) =>
      h('input', {
        className: 'jp-mod-styled jp-EvalSched-input',
        attrs: {
          name,
          type,
          'data-testid': `evalsched-submit-${name}`,
          ...attrs
        }
      });
    this._entrypoint = input('entrypoint', 'text', {
      placeholder: trans.__('pkg.module:function'),
      required: 'true',
      spellcheck: 'false'
    });
    this._nameInput = input('name', 'text', {
      placeholder: trans.__('derived from the entrypoint')
    });
    this._episodes = input('episodes', 'number', { min: '0', value: '1' });
    this._vram = input('vram', 'number', { min: '0', value: '0', step: '256' });
    this._gpus = input('gpus', 'number', { min: '1', value: '1' });
    this._priority = h('select', {
      className: 'jp-mod-styled jp-EvalSched-input',
      attrs: { name: 'priority', 'data-testid': 'evalsched-submit-priority' }
    });
    for (const p of ['high', 'normal', 'low']) {
      const option = h('option', { text: p, attrs: { value: p } });
      option.selected = p === 'normal';
      this._priority.append(option);
    }
    this._exclusive = h('input', {
      attrs: { type: 'checkbox', name: 'exclusive' }
    });
    this._params = h('textarea', {
      className: 'jp-mod-styled jp-EvalSched-input jp-EvalSched-params',
      attrs: {
        name: 'params',
        rows: '2',
        placeholder: trans.__('{"sleep_s": 0.5}'),
        spellcheck: 'false',
        'data-testid': 'evalsched-submit-params'
      }
    });
    this._message = h('div', {
      className: 'jp-EvalSched-formMessage',
      attrs: { role: 'status' }
    });
    const submit = h('button', {
      className: 'jp-EvalSched-button jp-mod-accept',
      text: trans.__('Submit'),
      attrs: { type: 'submit', 'data-testid': 'evalsched-submit' }
    });
    this._form = h('form', { className: 'jp-EvalSched-form' }, [
      field(trans.__('Entrypoint'), this._entrypoint),
      field(trans.__('Name'), this._nameInput),
      h('div', { className: 'jp-EvalSched-fieldRow' }, [
        field(trans.__('Episodes'), this._episodes),
        field(trans.__('Priority'), this._priority)
      ]),
      h('div', { className: 'jp-EvalSched-fieldRow' }, [
        field(trans.__('VRAM per GPU (MB)'), this._vram),
        field(trans.__('GPUs'), this._gpus)
      ]),
      h('label', { className: 'jp-EvalSched-check' }, [
        this._exclusive,
        trans.__('Exclusive GPU')
      ]),
      field(trans.__('Params (JSON object)'), this._params),
      h('div', { className: 'jp-EvalSched-formActions' }, [
        submit,
        this._message
      ])
    ]);
    this._form.addEventListener('submit', event => {
      event.preventDefault();
      void this._submit();
    });
    this.node = h(
      'details',
      { className: 'jp-EvalSched-section jp-EvalSched-submit' },
      [
        h('summary', {
          className: 'jp-EvalSched-sectionTitle',
          text: trans.__('Submit a run')
        }),
        this._form
      ]
    );
  }

  readonly node: HTMLDetailsElement;

  private async _submit(): Promise<void> {
    const trans = this._trans;
    const entrypoint = this._entrypoint.value.trim();
    if (!entrypoint) {
      this._say(trans.__('An entrypoint is required.'), true);
      return;
    }
    let params: unknown = {};
    const raw = this._params.value.trim();
    if (raw) {
      try {
        params = JSON.parse(raw);
      } catch {
        this._say(trans.__('Params must be a JSON object.'), true);
        return;
      }
      if (!params || typeof params !== 'object' || Array.isArray(params)) {
        this._say(trans.__('Params must be a JSON object.'), true);
        return;
      }
    }
    const spec: Record<string, unknown> = {
      entrypoint,
      episodes: Number(this._episodes.value || 1),
      params,
      scheduling: {
        marginal_vram_mb: Number(this._vram.value || 0),
        gpus: Number(this._gpus.value || 1),
        exclusive_gpu: this._exclusive.checked,
        priority: this._priority.value
      }
    };
    const name = this._nameInput.value.trim();
    if (name) {
      spec.name = name;
    }
    this._say(trans.__('Submitting…'), false);
    try {
      const record = await this._model.submit(spec);
      this._say(trans.__('Submitted %1 (%2).', record.id, record.state), false);
    } catch (reason) {
      if (reason instanceof EvalSchedError) {
        const details = reason.details;
        this._say(
          details.length
            ? `${reason.message}\n${details.join('\n')}`
            : reason.message,
          true
        );
      } else {
        this._say(
          reason instanceof Error ? reason.message : String(reason),
          true
        );
      }
    }
  }

  private _say(text: string, error: boolean): void {
    this._message.textContent = text;
    this._message.classList.toggle('jp-mod-error', error);
  }

  private _form: HTMLFormElement;
  private _entrypoint: HTMLInputElement;
  private _nameInput: HTMLInputElement;
  private _episodes: HTMLInputElement;
  private _vram: HTMLInputElement;
  private _gpus: HTMLInputElement;
  private _priority: HTMLSelectElement;
  private _exclusive: HTMLInputElement;
  private _params: HTMLTextAreaElement;
  private _message: HTMLElement;
}
