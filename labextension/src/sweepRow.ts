/**
 * A sweep's row in the panel's lists.
 */
import {
  caretDownIcon,
  caretRightIcon,
  closeIcon
} from '@jupyterlab/ui-components';

import { IRunRecord, isTerminal, StateCounts } from './api';
import { ProgressBar, reconcile } from './dom';
import { formatAgo, formatDuration, h, parseTime, setName } from './format';
import { IRowHost } from './rowHost';
import { Section, STATE_ORDER, sweepNameOf, sweepState } from './sweeps';

/**
 * One sweep in one of the lists: its name, runs per state, the episodes done over all its runs,
 * Compare and Cancel sweep; expanded, its runs as ordinary run rows labelled with their points.
 */
export class SweepRow {
  constructor(
    readonly id: string,
    private _panel: IRowHost
  ) {
    const trans = _panel.trans;
    this.node = h('div', {
      className: 'jp-EvalSched-sweep',
      attrs: {
        'data-sweep-id': id,
        'data-testid': 'evalsched-sweep',
        'data-expanded': 'false'
      }
    });
    this._caret = h('button', {
      className: 'jp-EvalSched-iconButton jp-EvalSched-toggle',
      title: trans.__('Show the runs of this sweep'),
      attrs: {
        type: 'button',
        'data-testid': 'evalsched-sweep-toggle',
        'aria-expanded': 'false'
      }
    });
    this._caret.append(caretRightIcon.element({ tag: 'span' }));
    this._caret.addEventListener('click', () => this.toggle());
    this._name = h('button', {
      className: 'jp-EvalSched-runName',
      attrs: { type: 'button', 'data-testid': 'evalsched-sweep-name' }
    });
    this._name.addEventListener('click', () => this.toggle());
    this._state = h('span', { className: 'jp-EvalSched-state' });
    this._compare = h('button', {
      className: 'jp-EvalSched-textButton jp-EvalSched-compareButton',
      text: trans.__('Compare'),
      title: trans.__('Compare the runs of this sweep side by side'),
      attrs: { type: 'button', 'data-testid': 'evalsched-sweep-compare' }
    });
    this._compare.hidden = !_panel.canCompare;
    this._compare.addEventListener('click', () =>
      this._panel.openCompare({ sweep: this.id })
    );
    this._cancel = h('button', {
      className: 'jp-EvalSched-iconButton jp-EvalSched-cancel',
      title: trans.__('Cancel the unfinished runs of this sweep'),
      attrs: { type: 'button', 'data-testid': 'evalsched-sweep-cancel' }
    });
    this._cancel.append(closeIcon.element({ tag: 'span' }));
    this._cancel.addEventListener('click', () => {
      const unfinished = this._unfinished();
      if (unfinished > 0) {
        void this._panel.confirmCancelSweep(this.id, this._label, unfinished);
      }
    });
    this._counts = h('div', {
      className: 'jp-EvalSched-sweepCounts',
      attrs: { 'data-testid': 'evalsched-sweep-counts' }
    });
    this._meta = h('div', { className: 'jp-EvalSched-runMeta' });
    this._time = h('span', { className: 'jp-EvalSched-time' });
    this._bar = new ProgressBar('evalsched-sweep-progress');
    this._progress = this._bar.node;
    this._runs = h('div', {
      className: 'jp-EvalSched-list jp-EvalSched-sweepRuns',
      attrs: { 'data-testid': 'evalsched-sweep-runs' }
    });
    this._more = h('div', { className: 'jp-EvalSched-more' });
    this._runsHost = h('div', { className: 'jp-EvalSched-sweepRunsHost' }, [
      this._runs,
      this._more
    ]);
    this._runsHost.hidden = true;
    this._sweepTag = h('span', {
      className: 'jp-EvalSched-sweepTag',
      text: trans.__('sweep'),
      title: trans.__('One submission, one run per point')
    });
    this.node.append(
      h('div', { className: 'jp-EvalSched-runHead' }, [
        this._caret,
        this._name,
        h('span', { className: 'jp-EvalSched-headEnd' }, [
          this._state,
          this._cancel
        ])
      ]),
      this._meta,
      h('div', { className: 'jp-EvalSched-sweepLine' }, [
        this._counts,
        h('span', { className: 'jp-EvalSched-spacer' }),
        this._compare
      ]),
      this._progress,
      this._runsHost
    );
  }

  readonly node: HTMLElement;

  get expanded(): boolean {
    return this._expanded;
  }

  update(
    members: IRunRecord[],
    counts: StateCounts,
    section: Section,
    position: number
  ): void {
    const same =
      members.length === this._members.length &&
      members.every((r, i) => r === this._members[i]);
    if (same && section === this._section && position === this._position) {
      return; // records are replaced, never mutated: nothing changed
    }
    this._members = members;
    this._section = section;
    this._position = position;
    const trans = this._panel.trans;
    const node = this.node;
    this._label = sweepNameOf(this.id, members);
    const state = sweepState(counts);
    node.dataset.section = section;
    node.dataset.state = state;
    node.dataset.runs = String(members.length);
    const shownCounts: StateCounts = {};
    for (const s of STATE_ORDER) {
      node.setAttribute(`data-count-${s}`, String(counts[s] ?? 0));
      if (counts[s]) {
        shownCounts[s] = counts[s];
      }
    }
    for (const [s, n] of Object.entries(counts)) {
      if (!STATE_ORDER.includes(s)) {
        shownCounts[s] = n;
      }
    }
    node.dataset.counts = JSON.stringify(shownCounts);
    setName(
      this._name,
      this._label,
      trans.__('Sweep %1 (%2) — show its runs', this._label, this.id)
    );
    this._state.textContent = state;
    this._state.dataset.state = state;
    this._cancel.hidden = this._unfinished() === 0;

    this._counts.replaceChildren(
      ...Object.entries(shownCounts).map(([s, n]) =>
        h('span', {
          className: 'jp-EvalSched-sweepCount',
          text: `${n} ${s}`,
          attrs: { 'data-state': s, 'data-count': String(n) }
        })
      )
    );
    this._meta.replaceChildren(
      this._sweepTag,
      h('span', {
        className: 'jp-EvalSched-runId',
        text: this.id,
        title: this.id
      }),
      h('span', {
        text: trans._n('%1 run', '%1 runs', members.length)
      }),
      this._time
    );

    // Progress: episodes done over all its runs.
    let done = 0;
    let total = 0;
    for (const r of members) {
      done += r.progress?.done ?? 0;
      total += r.progress?.total ?? 0;
    }
    node.dataset.progressDone = String(done);
    node.dataset.progressTotal = String(total);
    this._bar.set(
      done,
      total,
      total > 0
        ? trans.__('%1 / %2 episodes', done, total)
        : trans.__('starting…')
    );
    this.tick(Date.now());
  }

  /** Its runs' rows (shown while it is expanded); `more` runs are not shown. */
  setRuns(rows: HTMLElement[], more: number): void {
    reconcile(this._runs, rows);
    this._more.hidden = more <= 0;
    this._more.textContent =
      more > 0 ? this._panel.trans.__('… and %1 more runs', more) : '';
  }

  /** Expand (or collapse) it: its runs as run rows. */
  toggle(open?: boolean): void {
    const show = open ?? !this._expanded;
    if (show === this._expanded) {
      return;
    }
    this._expanded = show;
    this._runsHost.hidden = !show;
    this.node.dataset.expanded = String(show);
    this.node.classList.toggle('jp-mod-expanded', show);
    this._caret.setAttribute('aria-expanded', String(show));
    this._caret.replaceChildren(
      (show ? caretDownIcon : caretRightIcon).element({ tag: 'span' })
    );
    this._panel.update();
  }

  /** Draw attention to it for a moment (after a notification's Open). */
  highlight(): void {
    this.node.classList.add('jp-mod-highlight');
    if (this._highlightTimer !== null) {
      clearTimeout(this._highlightTimer);
    }
    this._highlightTimer = setTimeout(() => {
      this._highlightTimer = null;
      this.node.classList.remove('jp-mod-highlight');
    }, 2000);
  }

  /** How long it has run (while active), or when it finished. */
  tick(now: number): void {
    const trans = this._panel.trans;
    let started: number | null = null;
    let finished: number | null = null;
    for (const r of this._members) {
      const s = parseTime(r.started_at);
      const f = parseTime(r.finished_at);
      if (s !== null && (started === null || s < started)) {
        started = s;
      }
      if (f !== null && (finished === null || f > finished)) {
        finished = f;
      }
    }
    let text = '';
    if (this._section !== 'finished') {
      text =
        started !== null
          ? trans.__('elapsed %1', formatDuration(now - started))
          : '';
    } else {
      text = formatAgo(finished, now);
    }
    if (this._time.textContent !== text) {
      this._time.textContent = text;
    }
  }

  dispose(): void {
    if (this._highlightTimer !== null) {
      clearTimeout(this._highlightTimer);
    }
    this.node.remove();
  }

  private _unfinished(): number {
    return this._members.filter(r => !isTerminal(r.state)).length;
  }

  private _members: IRunRecord[] = [];
  private _section: Section | null = null;
  private _position = -1;
  private _expanded = false;
  private _label = '';
  private _highlightTimer: ReturnType<typeof setTimeout> | null = null;
  private _caret: HTMLButtonElement;
  private _name: HTMLButtonElement;
  private _state: HTMLElement;
  private _sweepTag: HTMLElement;
  private _compare: HTMLButtonElement;
  private _cancel: HTMLButtonElement;
  private _counts: HTMLElement;
  private _meta: HTMLElement;
  private _time: HTMLElement;
  private _progress: HTMLElement;
  private _bar: ProgressBar;
  private _runs: HTMLElement;
  private _more: HTMLElement;
  private _runsHost: HTMLElement;
}
