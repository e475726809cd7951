/**
 * The Resources section's content: one VRAM bar per GPU (shared models, runs, leases and what
 * their holders use beyond them, the VRAM of other processes per holder, free) with its legend,
 * and the CPU slots. Rebuilt only when something it shows changed.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { ILedger, ILedgerDevice, ILedgerLease, leaseHolder } from './api';
import { colorSlot, formatMB, h, shortId } from './format';
import {
  COLOR_SLOTS,
  deviceGeometry,
  IOtherUser,
  IUnmanagedGroup
} from './ledgerGeometry';

/** A bar segment is labelled with its holder when it is at least this share of the bar. */
const LABEL_MIN_SHARE = 0.12;
/** Unmanaged holders of one kind named in a GPU's legend at most (the rest are summed). */
const MAX_LEGEND_HOLDERS = 3;

export interface ILedgerViewOptions {
  trans: TranslationBundle;
  /** The name of a run, when the panel knows it. */
  runName: (id: string) => string | undefined;
  /** The colour slot the panel gave a run. */
  colorOf: (id: string) => number | undefined;
  /** What the colours are now (part of what the view shows). */
  colorKey: () => unknown;
  /**
   * This server's user on a host shared through a host ledger (`host_ledger.user` of
   * `GET /evalsched/status`), null without one: other users' processes are shown by user name.
   */
  me?: () => string | null;
}

export class LedgerView {
  constructor(options: ILedgerViewOptions) {
    this._trans = options.trans;
    this._runName = options.runName;
    this._colorOf = options.colorOf;
    this._colorKey = options.colorKey;
    this._me = options.me ?? (() => null);
    this.gpus = h('div', {
      className: 'jp-EvalSched-gpus',
      attrs: { 'data-testid': 'evalsched-ledger' }
    });
    this.cpu = h('div', { className: 'jp-EvalSched-cpu' });
  }

  /** The GPU bars. */
  readonly gpus: HTMLElement;
  /** The CPU slots. */
  readonly cpu: HTMLElement;

  render(ledger: ILedger | null): void {
    const trans = this._trans;
    // Rebuild only when something shown changed (progress events re-render the panel often).
    const key = JSON.stringify([
      ledger,
      this._colorKey(),
      this._me(),
      (ledger?.devices ?? []).flatMap(d =>
        (d.runs ?? []).map(r => this._runName(r.id))
      )
    ]);
    if (key === this._ledgerKey) {
      return;
    }
    this._ledgerKey = key;
    this.gpus.replaceChildren();
    this.cpu.replaceChildren();
    if (!ledger) {
      this.gpus.append(
        h('div', {
          className: 'jp-EvalSched-empty',
          text: trans.__('Loading…')
        })
      );
      return;
    }
    if (!ledger.devices.length) {
      this.gpus.append(
        h('div', {
          className: 'jp-EvalSched-empty',
          text: trans.__('No GPU on this host: runs use CPU slots.')
        })
      );
    }
    for (const device of ledger.devices) {
      this.gpus.append(this._renderDevice(device));
    }
    const cpu = ledger.cpu_slots;
    if (cpu) {
      const pct =
        cpu.total > 0 ? Math.min(100, (100 * cpu.allocated) / cpu.total) : 0;
      const fill = h('div', { className: 'jp-EvalSched-cpuFill' });
      fill.style.width = `${pct}%`;
      this.cpu.dataset.total = String(cpu.total);
      this.cpu.dataset.allocated = String(cpu.allocated);
      this.cpu.append(
        h('div', { className: 'jp-EvalSched-gpuHead' }, [
          h('span', {
            className: 'jp-EvalSched-gpuName',
            text: trans.__('CPU slots')
          }),
          h('span', {
            className: 'jp-EvalSched-gpuNums',
            text: trans.__('%1 / %2 in use', cpu.allocated, cpu.total)
          })
        ]),
        h('div', { className: 'jp-EvalSched-cpuBar' }, [fill])
      );
    }
  }

  private _renderDevice(device: ILedgerDevice): HTMLElement {
    const trans = this._trans;
    const {
      baseline,
      usable,
      free,
      runs,
      leases,
      allocated,
      exclusiveExtra,
      overSum,
      others,
      groups,
      reported,
      unmanagedRest,
      kernelMb,
      otherMb,
      scale,
      reserved
    } = deviceGeometry(device, this._me());
    const pct = (mb: number) => `${(100 * mb) / scale}%`;

    const bar = h('div', {
      className: 'jp-EvalSched-bar',
      attrs: {
        role: 'img',
        'aria-label': trans.__(
          'GPU %1: %2 allocated, %3 free of %4 usable',
          device.index,
          formatMB(device.allocated_mb),
          formatMB(free),
          formatMB(usable)
        )
      }
    });
    const seg = (
      kind: string,
      mb: number,
      title: string,
      attrs: Record<string, string> = {},
      label?: string
    ) => {
      if (mb <= 0) {
        return;
      }
      const el = h('div', {
        className: `jp-EvalSched-seg jp-EvalSched-seg-${kind}`,
        title,
        attrs: { 'data-kind': kind, 'data-mb': String(mb), ...attrs }
      });
      el.style.width = pct(mb);
      if (label && mb / scale >= LABEL_MIN_SHARE) {
        el.append(
          h('span', { className: 'jp-EvalSched-segLabel', text: label })
        );
      }
      bar.append(el);
      return el;
    };
    seg(
      'baseline',
      baseline,
      trans.__('Shared models (baseline): %1', formatMB(baseline))
    );
    for (const run of runs) {
      const name = this._runName(run.id);
      let mb = Math.max(0, run.marginal_vram_mb);
      if (device.exclusive === run.id) {
        mb += exclusiveExtra;
      }
      const el = seg(
        'run',
        mb,
        this._runTitle(run.id, mb, device.exclusive === run.id),
        { 'data-run-id': run.id },
        name || shortId(run.id)
      );
      el?.classList.add(this._runColor(run.id));
    }
    for (const lease of leases) {
      let mb = Math.max(0, lease.vram_mb);
      const exclusive = device.exclusive === lease.id;
      if (exclusive) {
        mb += exclusiveExtra;
      }
      const holder = leaseHolder(lease);
      seg(
        'lease',
        mb,
        this._leaseTitle(lease, mb, exclusive),
        {
          'data-lease-id': lease.id,
          'data-holder': holder
        },
        holder
      );
      const over = Math.max(0, lease.over_lease_mb ?? 0);
      seg(
        'over',
        over,
        trans.__(
          '%1 uses %2 more than its lease %3 (%4 in all on this GPU): the excess counts as unmanaged',
          holder,
          formatMB(over),
          lease.id,
          formatMB(lease.observed_mb ?? mb + over)
        ),
        { 'data-over-lease-id': lease.id, 'data-holder': holder }
      );
    }
    if (!runs.length && !leases.length && allocated > 0) {
      seg('run', allocated, trans.__('Allocated: %1', formatMB(allocated)));
    }
    // Other users of a shared host: their grants, one segment each, by user name only.
    for (const other of others) {
      seg(
        'user',
        other.mb,
        this._userTitle(other),
        {
          'data-user': other.user,
          'data-user-runs': String(other.runs),
          'data-user-leases': String(other.leases)
        },
        other.user
      );
    }
    for (const group of groups) {
      if (group.kind === 'user') {
        // Another user's processes outside their grants: by user name only.
        seg(
          'userProcess',
          group.mb,
          this._userOutsideTitle(group.holder, group.mb),
          { 'data-user': group.holder, 'data-unmanaged': 'true' },
          group.holder
        );
        continue;
      }
      const attrs: Record<string, string> = {
        'data-holder': group.holder,
        'data-holder-kind': group.kind,
        'data-pids': group.pids.join(',')
      };
      if (group.sessionPath) {
        attrs['data-session-path'] = group.sessionPath;
      }
      if (group.kernelIds.length) {
        attrs['data-kernel-id'] = group.kernelIds.join(',');
      }
      seg(
        group.kind === 'kernel' ? 'kernel' : 'unmanaged',
        group.mb,
        this._groupTitle(group),
        { ...attrs, 'data-unmanaged': 'true' },
        group.holder
      );
    }
    seg(
      'unmanaged',
      unmanagedRest,
      trans.__(
        'Not managed by the scheduler (other processes): %1',
        formatMB(unmanagedRest)
      ),
      { 'data-unmanaged': 'true' }
    );
    seg('free', free, trans.__('Free: %1', formatMB(free)));
    seg(
      'reserved',
      reserved,
      trans.__('Reserved or otherwise unusable: %1', formatMB(reserved))
    );

    // The legend: what each colour is.
    const legend = h('div', { className: 'jp-EvalSched-legend' }, [
      baseline > 0
        ? legendItem(
            'baseline',
            trans.__('shared models %1', formatMB(baseline))
          )
        : null,
      ...runs.map(run => {
        const mb =
          Math.max(0, run.marginal_vram_mb) +
          (device.exclusive === run.id ? exclusiveExtra : 0);
        return legendItem(
          'run',
          trans.__(
            '%1 %2',
            this._runName(run.id) || shortId(run.id),
            formatMB(mb)
          ),
          { 'data-legend-run-id': run.id },
          this._runTitle(run.id, mb, device.exclusive === run.id),
          this._runColor(run.id)
        );
      }),
      ...leases.map(lease =>
        legendItem(
          'lease',
          trans.__(
            'lease: %1 %2',
            leaseHolder(lease),
            formatMB(
              lease.vram_mb +
                (device.exclusive === lease.id ? exclusiveExtra : 0)
            )
          ),
          { 'data-legend-lease-id': lease.id },
          this._leaseTitle(lease, lease.vram_mb, device.exclusive === lease.id)
        )
      ),
      ...others
        .filter(o => o.mb > 0)
        .map(o =>
          legendItem('user', this._userTitle(o), { 'data-user': o.user })
        ),
      ...groups
        .filter(g => g.kind === 'user')
        .map(g =>
          legendItem(
            'userProcess',
            this._userOutsideTitle(g.holder, g.mb),
            { 'data-user': g.holder },
            trans.__(
              'Processes of user %1 holding VRAM outside the grants of the host ledger',
              g.holder
            )
          )
        ),
      overSum > 0
        ? legendItem(
            'over',
            trans.__('over lease %1', formatMB(overSum)),
            {},
            trans.__(
              'What lease holders use beyond their leases (counted as unmanaged)'
            )
          )
        : null,
      ...this._unmanagedLegend(
        groups.filter(g => g.kind === 'kernel'),
        'kernel',
        kernelMb
      ),
      ...this._unmanagedLegend(
        groups.filter(g => g.kind === 'process'),
        'unmanaged',
        otherMb
      ),
      device.exclusive
        ? h('span', {
            className: 'jp-EvalSched-tag',
            text: trans.__('exclusive'),
            title: trans.__('Held exclusively by %1', device.exclusive)
          })
        : null,
      h('span', {
        className: 'jp-EvalSched-legendFree',
        text: trans.__('%1 free', formatMB(free)),
        attrs: { 'data-kind': 'free' }
      })
    ]);

    return h(
      'div',
      {
        className: 'jp-EvalSched-gpu',
        attrs: {
          'data-index': String(device.index),
          'data-total-mb': String(device.total_mb),
          'data-usable-mb': String(device.usable_mb),
          'data-baseline-mb': String(device.baseline_mb),
          'data-allocated-mb': String(device.allocated_mb),
          'data-free-mb': String(device.free_mb),
          'data-unmanaged-mb': String(reported),
          'data-runs': runs.map(r => r.id).join(','),
          'data-leases': leases.map(l => l.id).join(','),
          'data-testid': 'evalsched-gpu'
        }
      },
      [
        h('div', { className: 'jp-EvalSched-gpuHead' }, [
          h('span', {
            className: 'jp-EvalSched-gpuName',
            text: `GPU ${device.index}`,
            title: device.name
          }),
          h('span', {
            className: 'jp-EvalSched-gpuModel',
            text: device.name,
            title: device.name
          }),
          h('span', {
            className: 'jp-EvalSched-gpuNums',
            text: trans.__(
              '%1 / %2',
              formatMB(device.allocated_mb, false),
              formatMB(usable)
            )
          })
        ]),
        bar,
        legend
      ]
    );
  }

  /**
   * Legend items of unmanaged holders of one colour: one per holder (notebook or pid), the
   * smallest folded into one item beyond a few; `total` also counts VRAM the server does not
   * itemise.
   */
  private _unmanagedLegend(
    groups: IUnmanagedGroup[],
    kind: 'kernel' | 'unmanaged',
    total: number
  ): HTMLElement[] {
    const trans = this._trans;
    if (total <= 0) {
      return [];
    }
    const what =
      kind === 'kernel'
        ? trans.__(
            'A notebook kernel holding VRAM without a lease (not managed by the scheduler)'
          )
        : trans.__('A process holding VRAM that the scheduler does not manage');
    const shown =
      groups.length > MAX_LEGEND_HOLDERS + 1
        ? groups.slice(0, MAX_LEGEND_HOLDERS)
        : groups;
    const items = shown.map(g =>
      legendItem(
        kind,
        kind === 'kernel'
          ? trans.__('notebook: %1 %2', g.holder, formatMB(g.mb))
          : trans.__('process: %1 %2', g.holder, formatMB(g.mb)),
        { 'data-holder': g.holder },
        `${what}\n${this._groupTitle(g)}`
      )
    );
    const rest = total - shown.reduce((a, g) => a + g.mb, 0);
    if (rest > 0) {
      const more = groups.length - shown.length;
      items.push(
        legendItem(
          kind,
          more > 0
            ? kind === 'kernel'
              ? trans._n(
                  '%1 more notebook %2',
                  '%1 more notebooks %2',
                  more,
                  formatMB(rest)
                )
              : trans._n(
                  '%1 more process %2',
                  '%1 more processes %2',
                  more,
                  formatMB(rest)
                )
            : trans.__('other processes %1', formatMB(rest)),
          {},
          what
        )
      );
    }
    return items;
  }

  /** Another user's grants: "bob: 14,000 MB (2 runs, 1 lease)", by user name only. */
  private _userTitle(other: IOtherUser): string {
    const trans = this._trans;
    const what = [
      other.runs > 0 ? trans._n('%1 run', '%1 runs', other.runs) : null,
      other.leases > 0 ? trans._n('%1 lease', '%1 leases', other.leases) : null,
      other.models > 0 ? trans._n('%1 model', '%1 models', other.models) : null
    ].filter(x => x !== null);
    return what.length
      ? trans.__('%1: %2 (%3)', other.user, formatMB(other.mb), what.join(', '))
      : trans.__('%1: %2', other.user, formatMB(other.mb));
  }

  /** Another user's processes outside their grants. */
  private _userOutsideTitle(user: string, mb: number): string {
    return this._trans.__('%1: %2 outside the scheduler', user, formatMB(mb));
  }

  /** A run's colour class: the slot of its id, as in its row and the notebook widget. */
  private _runColor(id: string): string {
    return `jp-EvalSched-c${this._colorOf(id) ?? colorSlot(id, COLOR_SLOTS)}`;
  }

  /** The tooltip of a run's segment and legend item: name, id, MB. */
  private _runTitle(id: string, mb: number, exclusive: boolean): string {
    const name = this._runName(id);
    const label = name ? `${name} (${id})` : id;
    return exclusive
      ? this._trans.__('%1: %2, exclusive', label, formatMB(mb))
      : this._trans.__('%1: %2', label, formatMB(mb));
  }

  /** The tooltip of a lease's segment: id, holder, MB, notebook, pid. */
  private _leaseTitle(
    lease: ILedgerLease,
    mb: number,
    exclusive: boolean
  ): string {
    const trans = this._trans;
    const lines = [
      exclusive
        ? trans.__(
            'Lease %1 held by %2: %3, exclusive',
            lease.id,
            leaseHolder(lease),
            formatMB(mb)
          )
        : trans.__(
            'Lease %1 held by %2: %3',
            lease.id,
            leaseHolder(lease),
            formatMB(mb)
          )
    ];
    if (lease.session_path) {
      lines.push(trans.__('Notebook: %1', lease.session_path));
    }
    if (lease.kernel_id) {
      lines.push(trans.__('Kernel: %1', lease.kernel_id));
    }
    if (lease.pid !== null && lease.pid !== undefined) {
      lines.push(trans.__('Process: pid %1', lease.pid));
    }
    if (lease.observed_mb) {
      lines.push(trans.__('Uses now: %1', formatMB(lease.observed_mb)));
    }
    return lines.join('\n');
  }

  /** The tooltip of an unmanaged holder's segment. */
  private _groupTitle(group: IUnmanagedGroup): string {
    const trans = this._trans;
    const lines = [
      trans.__(
        '%1: %2, not managed by the scheduler',
        group.holder,
        formatMB(group.mb)
      )
    ];
    if (group.sessionPath) {
      lines.push(trans.__('Notebook: %1', group.sessionPath));
    }
    if (group.kernelIds.length) {
      lines.push(trans.__('Kernel: %1', group.kernelIds.join(', ')));
    }
    if (group.kind === 'kernel' || group.pids.length > 1) {
      lines.push(trans.__('Processes: pid %1', group.pids.join(', ')));
    }
    if (group.names.length) {
      lines.push(trans.__('Command: %1', group.names.join(', ')));
    }
    if (group.leaseIds.length) {
      lines.push(
        trans.__(
          'Its lease %1 is on other GPUs: what it uses here is outside of it',
          group.leaseIds.join(', ')
        )
      );
    }
    return lines.join('\n');
  }

  private _trans: TranslationBundle;
  private _runName: (id: string) => string | undefined;
  private _colorOf: (id: string) => number | undefined;
  private _colorKey: () => unknown;
  private _me: () => string | null;
  private _ledgerKey = '';
}

function legendItem(
  kind: string,
  text: string,
  attrs: Record<string, string> = {},
  title?: string,
  swatchClass = ''
): HTMLElement {
  return h(
    'span',
    {
      className: 'jp-EvalSched-legendItem',
      title,
      attrs: { 'data-kind': kind, ...attrs }
    },
    [
      h('span', {
        className:
          `jp-EvalSched-swatch jp-EvalSched-seg-${kind} ${swatchClass}`.trim()
      }),
      text
    ]
  );
}
