/**
 * A live lease's row in the panel's Leases list.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { ILeaseRecord, leaseHolder } from './api';
import { formatDuration, formatMB, h, parseTime, setName } from './format';
import { reasonView } from './reason';
import { renderReason } from './reasonLine';
import { IRowHost } from './rowHost';

/** `14,000 MB × 1 GPU`, `exclusive` marked. */
export function leaseSize(
  lease: ILeaseRecord,
  trans: TranslationBundle
): string {
  const gpus = lease.gpus ?? 1;
  const perGpu =
    lease.vram_mb > 0
      ? trans._n('%2 × %1 GPU', '%2 × %1 GPUs', gpus, formatMB(lease.vram_mb))
      : trans._n('%1 GPU', '%1 GPUs', gpus);
  return lease.exclusive_gpu ? trans.__('%1, exclusive', perGpu) : perGpu;
}

/**
 * One live lease in the Leases list: holder, state (and why it waits), size, GPUs, pid, notebook
 * and what its process uses, with a Release button.
 */
export class LeaseRow {
  constructor(
    readonly id: string,
    private _panel: IRowHost
  ) {
    const trans = _panel.trans;
    this.node = h('div', {
      className: 'jp-EvalSched-lease',
      attrs: { 'data-lease-id': id, 'data-testid': 'evalsched-lease-row' }
    });
    this._holder = h('span', {
      className: 'jp-EvalSched-leaseHolder',
      attrs: { 'data-testid': 'evalsched-lease-holder' }
    });
    this._state = h('span', { className: 'jp-EvalSched-state' });
    this._release = h('button', {
      className: 'jp-EvalSched-textButton jp-EvalSched-release',
      text: trans.__('Release'),
      title: trans.__(
        'Release this lease: its VRAM goes back to the scheduler'
      ),
      attrs: { type: 'button', 'data-testid': 'evalsched-lease-release' }
    });
    this._release.addEventListener('click', () => {
      const lease = this._lease;
      if (lease && lease.state !== 'ended') {
        void this._panel.confirmRelease(lease);
      }
    });
    this._meta = h('div', { className: 'jp-EvalSched-runMeta' });
    this._notebook = h('div', {
      className: 'jp-EvalSched-leaseNotebook',
      attrs: { 'data-testid': 'evalsched-lease-notebook' }
    });
    this._reason = h('div', {
      className: 'jp-EvalSched-reason',
      attrs: { 'data-testid': 'evalsched-reason' }
    });
    this._usage = h('div', { className: 'jp-EvalSched-leaseUsage' });
    this.node.append(
      h('div', { className: 'jp-EvalSched-runHead' }, [
        h('span', {
          className: 'jp-EvalSched-colorChip jp-EvalSched-seg-lease',
          title: trans.__('Its colour in the GPU bar')
        }),
        this._holder,
        h('span', { className: 'jp-EvalSched-headEnd' }, [
          this._state,
          this._release
        ])
      ]),
      this._meta,
      this._notebook,
      this._reason,
      this._usage
    );
  }

  readonly node: HTMLElement;

  update(lease: ILeaseRecord): void {
    if (lease === this._lease) {
      return; // records are replaced, never mutated
    }
    this._lease = lease;
    const trans = this._panel.trans;
    const node = this.node;
    const holder = leaseHolder(lease);
    // The reason as data (`why`) when the server sends it, else its string as it is.
    const reason = reasonView(lease);
    node.dataset.state = lease.state;
    node.dataset.reasonCode = reason?.code ?? '';
    node.dataset.holder = holder;
    node.dataset.vramMb = String(lease.vram_mb);
    node.dataset.devices = (lease.devices ?? []).join(',');
    setName(this._holder, holder, trans.__('%1 (lease %2)', holder, lease.id));
    this._state.textContent = lease.state;
    this._state.dataset.state = lease.state;

    const parts: HTMLElement[] = [
      h('span', {
        className: 'jp-EvalSched-vram',
        text: leaseSize(lease, trans),
        attrs: { 'data-field': 'size' }
      })
    ];
    if (lease.exclusive_gpu) {
      parts.push(
        h('span', {
          className: 'jp-EvalSched-tag',
          text: trans.__('exclusive')
        })
      );
    }
    if (lease.devices && lease.devices.length) {
      parts.push(
        h('span', {
          text: `GPU ${lease.devices.join(',')}`,
          title: lease.cuda_visible_devices
            ? `CUDA_VISIBLE_DEVICES=${lease.cuda_visible_devices}`
            : undefined,
          attrs: { 'data-field': 'devices' }
        })
      );
    }
    if (lease.pid !== null && lease.pid !== undefined) {
      parts.push(
        h('span', {
          text: trans.__('pid %1', lease.pid),
          title: trans.__('The lease ends when this process exits'),
          attrs: { 'data-field': 'pid' }
        })
      );
    }
    if (
      lease.priority &&
      lease.priority !== 'high' &&
      lease.state === 'queued'
    ) {
      parts.push(
        h('span', {
          className: 'jp-EvalSched-priority',
          text: lease.priority,
          attrs: { 'data-priority': lease.priority }
        })
      );
    }
    parts.push(
      h('span', {
        className: 'jp-EvalSched-runId',
        text: lease.id,
        title: lease.id
      })
    );
    this._time = h('span', { className: 'jp-EvalSched-time' });
    parts.push(this._time);
    this._meta.replaceChildren(...parts);

    this._notebook.hidden = !lease.session_path;
    if (lease.session_path) {
      this._notebook.textContent = lease.session_path;
      this._notebook.title = lease.kernel_id
        ? trans.__(
            'Notebook %1 (kernel %2)',
            lease.session_path,
            lease.kernel_id
          )
        : trans.__('Notebook %1', lease.session_path);
    }

    this._reason.hidden = lease.state !== 'queued' || !reason;
    if (reason) {
      renderReason(this._reason, reason, trans);
    }

    const observed = Object.entries(lease.observed_mb ?? {}).filter(
      ([, mb]) => mb > 0
    );
    const over = Math.max(0, lease.over_lease_mb ?? 0);
    this._usage.hidden = observed.length === 0 && over === 0;
    this._usage.replaceChildren(
      observed.length
        ? h('span', {
            text: trans.__(
              'uses %1',
              observed
                .map(([gpu, mb]) => trans.__('%1 on GPU %2', formatMB(mb), gpu))
                .join(', ')
            )
          })
        : '',
      over > 0
        ? h('span', {
            className: 'jp-EvalSched-warnBadge',
            text: trans.__('⚠ %1 over its lease', formatMB(over)),
            title: trans.__(
              'Its process uses %1 more than it leased: the excess counts as unmanaged VRAM',
              formatMB(over)
            ),
            attrs: { 'data-testid': 'evalsched-lease-over' }
          })
        : ''
    );
    this.tick(Date.now());
  }

  /** Refresh the time shown on the row: how long it has been held or has waited. */
  tick(now: number): void {
    const lease = this._lease;
    if (!lease || !this._time) {
      return;
    }
    const trans = this._panel.trans;
    const granted = parseTime(lease.granted_at);
    const requested = parseTime(lease.requested_at);
    let text = '';
    if (lease.state === 'granted' && granted !== null) {
      text = trans.__('held %1', formatDuration(now - granted));
      if (lease.ttl_s) {
        text +=
          ' · ' +
          trans.__(
            'ends in %1',
            formatDuration(granted + lease.ttl_s * 1000 - now)
          );
      }
    } else if (lease.state === 'queued' && requested !== null) {
      text = trans.__('waiting %1', formatDuration(now - requested));
    }
    if (this._time.textContent !== text) {
      this._time.textContent = text;
    }
  }

  dispose(): void {
    this.node.remove();
  }

  private _lease: ILeaseRecord | null = null;
  private _holder: HTMLElement;
  private _state: HTMLElement;
  private _release: HTMLButtonElement;
  private _meta: HTMLElement;
  private _notebook: HTMLElement;
  private _reason: HTMLElement;
  private _usage: HTMLElement;
  private _time: HTMLElement | null = null;
}
