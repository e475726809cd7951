/**
 * A run's row in the panel's lists: name, state, badges, reason, progress, latest metrics, and
 * its detail inline.
 */
import {
  caretDownIcon,
  caretRightIcon,
  closeIcon
} from '@jupyterlab/ui-components';

import {
  IRunRecord,
  isTerminal,
  ISummary,
  runWarnings,
  sweepIdOf
} from './api';
import { RunDetailView } from './detail';
import { ProgressBar } from './dom';
import {
  attemptOf,
  executorOf,
  formatAgo,
  formatDuration,
  formatMB,
  formatNumber,
  formatTimestamp,
  h,
  isResumable,
  isSlurm,
  parseTime,
  preemptionsOf,
  retryAtOf,
  retryInSeconds,
  runBadges,
  setName,
  slurmLabel,
  splitReason,
  sweepPointLabel
} from './format';
import { COLOR_SLOTS } from './ledgerGeometry';
import { latestMetrics } from './records';
import { reasonView } from './reason';
import { renderReason } from './reasonLine';
import { IRowHost } from './rowHost';
import { Section } from './sweeps';

/** Metrics shown on a row at most (all are in the detail). */
const MAX_ROW_METRICS = 4;

/**
 * One run in one of the lists. Keeps its element (and its open detail) across updates.
 */
export class RunRow {
  constructor(
    readonly id: string,
    private _panel: IRowHost
  ) {
    const trans = _panel.trans;
    this.logTail = _panel.logTail;
    this.node = h('div', {
      className: 'jp-EvalSched-run',
      attrs: { 'data-run-id': id, 'data-testid': 'evalsched-run' }
    });
    this._chip = h('span', { className: 'jp-EvalSched-colorChip' });
    this._position = h('span', {
      className: 'jp-EvalSched-position',
      attrs: { 'data-testid': 'evalsched-position' }
    });
    this._state = h('span', { className: 'jp-EvalSched-state' });
    this._warn = h('span', {
      className: 'jp-EvalSched-warnBadge',
      attrs: { 'data-testid': 'evalsched-warning' }
    });
    this._warn.hidden = true;
    this._name = h('button', {
      className: 'jp-EvalSched-runName',
      attrs: { type: 'button', 'data-testid': 'evalsched-run-name' }
    });
    this._name.addEventListener('click', () => this.toggle());
    this._select = h('input', {
      className: 'jp-EvalSched-select',
      title: trans.__('Select for a comparison'),
      attrs: {
        type: 'checkbox',
        'data-testid': 'evalsched-select',
        'aria-label': trans.__('Select %1 for a comparison', id)
      }
    });
    this._select.hidden = !_panel.canCompare;
    this._select.addEventListener('change', () => {
      this._panel.setSelected(this.id, this._select.checked);
    });
    this._caret = h('button', {
      className: 'jp-EvalSched-iconButton jp-EvalSched-toggle',
      title: trans.__('Show details and logs'),
      attrs: {
        type: 'button',
        'data-testid': 'evalsched-details',
        'aria-expanded': 'false'
      }
    });
    this._caret.append(caretRightIcon.element({ tag: 'span' }));
    this._caret.addEventListener('click', () => this.toggle());
    this._cancel = h('button', {
      className: 'jp-EvalSched-iconButton jp-EvalSched-cancel',
      title: trans.__('Cancel this run'),
      attrs: { type: 'button', 'data-testid': 'evalsched-cancel' }
    });
    this._cancel.append(closeIcon.element({ tag: 'span' }));
    this._cancel.addEventListener('click', () => {
      const record = this._record;
      if (record && !isTerminal(record.state)) {
        void this._panel.confirmCancel(record);
      }
    });
    this._resume = h('button', {
      className: 'jp-EvalSched-textButton jp-EvalSched-resume',
      text: trans.__('Resume'),
      title: trans.__(
        'Resume this run: queued again under the same id, skipping the episodes already done'
      ),
      attrs: { type: 'button', 'data-testid': 'evalsched-resume' }
    });
    this._resume.hidden = true;
    this._resume.addEventListener('click', () => {
      const record = this._record;
      if (record && isResumable(record.state) && !this._resume.disabled) {
        this._resume.disabled = true;
        void this._panel.resume(record).finally(() => {
          this._resume.disabled = false;
        });
      }
    });
    this._meta = h('div', { className: 'jp-EvalSched-runMeta' });
    this._reason = h('div', {
      className: 'jp-EvalSched-reason',
      attrs: { 'data-testid': 'evalsched-reason' }
    });
    this._bar = new ProgressBar('evalsched-progress');
    this._progress = this._bar.node;
    this._metrics = h('div', {
      className: 'jp-EvalSched-rowMetrics',
      attrs: { 'data-testid': 'evalsched-metrics' }
    });
    this._detailHost = h('div', { className: 'jp-EvalSched-detailHost' });
    this._detailHost.hidden = true;
    this.node.append(
      h('div', { className: 'jp-EvalSched-runHead' }, [
        this._caret,
        this._select,
        this._chip,
        this._position,
        this._name,
        h('span', { className: 'jp-EvalSched-headEnd' }, [
          this._state,
          this._cancel
        ])
      ]),
      this._meta,
      this._reason,
      this._progress,
      this._metrics,
      this._detailHost
    );
  }

  readonly node: HTMLElement;
  logTail: number;
  section: Section = 'queued';
  position = 0;

  /** Check (or uncheck) its selection box. */
  setSelected(selected: boolean): void {
    if (this._select.checked !== selected) {
      this._select.checked = selected;
    }
    this.node.classList.toggle('jp-mod-selected', selected);
  }

  update(record: IRunRecord, section: Section, position: number): void {
    const trans = this._panel.trans;
    const summary = this._panel.model.getSummary(record.id);
    const slot =
      section === 'running' ? this._panel.colorOf(record.id) : undefined;
    if (
      record === this._record &&
      summary === this._summary &&
      section === this.section &&
      position === this.position &&
      slot === this._slot
    ) {
      return; // records are replaced, never mutated: nothing changed
    }
    this._summary = summary;
    this._slot = slot;
    this._record = record;
    this.section = section;
    this.position = position;
    const node = this.node;
    node.dataset.state = record.state;
    node.dataset.section = section;
    node.dataset.priority = record.priority;
    // The reason as data (`why`) when the server sends it, else its string as it is.
    const reason = reasonView(record);
    node.dataset.reasonCode = reason?.code ?? '';
    node.dataset.reasonArg = reason?.arg ?? '';
    node.dataset.attempt = String(attemptOf(record));
    node.dataset.preemptions = String(preemptionsOf(record));
    node.dataset.progressDone = String(record.progress?.done ?? 0);
    node.dataset.progressTotal = String(record.progress?.total ?? 0);
    node.dataset.executor = executorOf(record);

    // Colour chip: matches the run's segment in the ledger bar.
    for (let i = 0; i < COLOR_SLOTS; i++) {
      this._chip.classList.remove(`jp-EvalSched-c${i}`);
    }
    this._chip.hidden = slot === undefined;
    if (slot !== undefined) {
      this._chip.classList.add(`jp-EvalSched-c${slot}`);
      this._chip.title = this._panel.trans.__('Its colour in the GPU bar');
    }

    // A sweep's run is told apart from its siblings by its point (its sweep's row has the name).
    const sweepId = sweepIdOf(record);
    if (sweepId) {
      const point = sweepPointLabel(record);
      node.dataset.sweepId = sweepId;
      node.dataset.point = point;
      setName(
        this._name,
        point || record.name || record.id,
        trans.__(
          '%1 (%2) — show details and logs',
          point ? `${record.name || record.id} [${point}]` : record.name,
          record.id
        )
      );
    } else {
      delete node.dataset.sweepId;
      delete node.dataset.point;
      setName(
        this._name,
        record.name || record.id,
        trans.__(
          '%1 (%2) — show details and logs',
          record.name || record.id,
          record.id
        )
      );
    }
    // A running run a cancel has signalled is ending: said on its badge, and not cancelled again
    // from here (its reason line says when it is killed).
    const cancelling =
      record.state === 'running' && reason?.code === 'cancelling';
    this._state.textContent = cancelling
      ? trans.__('cancelling')
      : record.state;
    this._state.dataset.state = cancelling ? 'cancelling' : record.state;
    this._cancel.hidden = isTerminal(record.state) || cancelling;
    this._resume.hidden = !isResumable(record.state);

    // Warnings (over_vram, …): a badge with the first code; the full texts as its tooltip.
    const warnings = runWarnings(record);
    const codes = [...new Set(warnings.map(w => splitReason(w).code))];
    this._warn.hidden = warnings.length === 0;
    node.dataset.warnings = codes.join(',');
    if (warnings.length) {
      this._warn.textContent =
        codes.length > 1
          ? `⚠ ${codes[0]} +${codes.length - 1}`
          : `⚠ ${codes[0]}`;
      this._warn.title = warnings.join('\n');
      this._warn.setAttribute(
        'aria-label',
        trans.__('Warnings: %1', warnings.join('; '))
      );
    }

    // Meta line: position, id, priority, resources.
    this._position.hidden = section !== 'queued';
    this._position.textContent = `#${position + 1}`;
    this._position.title = trans.__(
      'Position %1 in the admission order',
      position + 1
    );
    const parts: (HTMLElement | string)[] = [];
    if (!this._warn.hidden) {
      parts.push(this._warn);
    }
    parts.push(
      h('span', {
        className: 'jp-EvalSched-runId',
        text: record.id,
        title: record.id
      })
    );
    if (record.priority && record.priority !== 'normal') {
      parts.push(
        h('span', {
          className: 'jp-EvalSched-priority',
          text: record.priority,
          attrs: { 'data-priority': record.priority }
        })
      );
    }
    // Attempt, preemptions, automatic retries, detached: only what sets the run apart.
    for (const badge of runBadges(record, this._panel.badgeLabels)) {
      parts.push(
        h('span', {
          className: `jp-EvalSched-badge jp-EvalSched-badge-${badge.kind}`,
          text: badge.text,
          title: badge.title,
          attrs: { 'data-testid': `evalsched-${badge.kind}` }
        })
      );
    }
    if (isSlurm(record)) {
      // Not on this host's GPUs: the SLURM job and its state instead of VRAM and devices.
      const job =
        record.slurm_job_id === null || record.slurm_job_id === undefined
          ? ''
          : String(record.slurm_job_id);
      const slurmState =
        typeof record.slurm_state === 'string' ? record.slurm_state : '';
      parts.push(
        h('span', {
          className: 'jp-EvalSched-slurm',
          text: slurmLabel(record),
          title: job
            ? trans.__(
                'Runs under SLURM as job %1 (%2)',
                job,
                slurmState || trans.__('state unknown')
              )
            : trans.__('Runs under SLURM; sbatch has not answered yet'),
          attrs: { 'data-slurm-job-id': job, 'data-slurm-state': slurmState }
        })
      );
    } else if (record.marginal_vram_mb > 0) {
      const where =
        record.devices && record.devices.length
          ? ` · GPU ${record.devices.join(',')}`
          : '';
      parts.push(
        h('span', {
          className: 'jp-EvalSched-vram',
          text: `${formatMB(record.marginal_vram_mb)}${where}`
        })
      );
    } else if (section !== 'finished') {
      parts.push(
        h('span', { className: 'jp-EvalSched-vram', text: trans.__('CPU') })
      );
    }
    this._time = h('span', { className: 'jp-EvalSched-time' });
    parts.push(this._time);
    // Resume on the meta line, not beside the name: the name keeps the head's width.
    parts.push(this._resume);
    this._meta.replaceChildren(...parts);

    // Reason: the pending reason of a queued run, the end reason of a finished one; of a running
    // run only that it is being preempted or cancelled (or, without `why`, whatever reason it
    // carries).
    this._reason.hidden =
      !reason ||
      (section === 'running' &&
        reason.structured &&
        reason.code !== 'preempting' &&
        reason.code !== 'cancelling');
    this._retry = null;
    if (reason) {
      // A run in back-off counts down to its `retry_at`.
      const retryAt = record.state === 'queued' ? retryAtOf(record) : null;
      if (retryAt) {
        this._retry = h('span', {
          className: 'jp-EvalSched-retryAt',
          title: trans.__('Retry at %1', formatTimestamp(retryAt) ?? retryAt),
          attrs: {
            'data-testid': 'evalsched-retry-at',
            'data-retry-at': retryAt
          }
        });
      }
      renderReason(this._reason, reason, trans, this._retry);
    }

    // Progress: running runs.
    const done = record.progress?.done ?? 0;
    const total = record.progress?.total ?? 0;
    this._progress.hidden = section !== 'running';
    this._bar.set(
      done,
      total,
      total > 0 ? `${done} / ${total}` : trans.__('starting…')
    );

    // Latest metrics (mean of each): from the record, else from the summary.
    const metrics = latestMetrics(record, summary);
    const names = Object.keys(metrics).sort();
    this._metrics.hidden = names.length === 0 || section === 'queued';
    this._metrics.replaceChildren(
      ...names.slice(0, MAX_ROW_METRICS).map(name => {
        const m = metrics[name] ?? {};
        return h(
          'span',
          {
            className: 'jp-EvalSched-metric',
            title: `${name}: mean ${formatNumber(m.mean)}, std ${formatNumber(m.std)}, min ${formatNumber(m.min)}, max ${formatNumber(m.max)}, n ${m.count ?? 0}`,
            attrs: { 'data-metric': name, 'data-value': String(m.mean ?? '') }
          },
          [
            h('span', { className: 'jp-EvalSched-metricName', text: name }),
            formatNumber(m.mean)
          ]
        );
      }),
      ...(names.length > MAX_ROW_METRICS
        ? [
            h('span', {
              className: 'jp-EvalSched-muted',
              text: `+${names.length - MAX_ROW_METRICS}`
            })
          ]
        : [])
    );
    if (summary?.error && section === 'finished') {
      this._metrics.hidden = false;
      this._metrics.append(
        h('span', {
          className: 'jp-EvalSched-errorLine',
          text: `${summary.error.type}: ${summary.error.message}`,
          title: `${summary.error.type}: ${summary.error.message}`
        })
      );
    }
    this.tick(Date.now());
  }

  /** Refresh the time shown on the row. */
  tick(now: number): void {
    const record = this._record;
    if (!record || !this._time) {
      return;
    }
    const trans = this._panel.trans;
    const started = parseTime(record.started_at);
    const finished = parseTime(record.finished_at);
    const submitted = parseTime(record.submitted_at);
    let text = '';
    if (record.state === 'running' && started !== null) {
      text = trans.__('elapsed %1', formatDuration(now - started));
    } else if (record.state === 'queued' && submitted !== null) {
      text = trans.__('waiting %1', formatDuration(now - submitted));
    } else if (isTerminal(record.state)) {
      const ran =
        started !== null && finished !== null
          ? formatDuration(finished - started)
          : null;
      const ago = formatAgo(finished ?? submitted, now);
      text = ran ? trans.__('ran %1 · %2', ran, ago) : ago;
    }
    if (this._time.textContent !== text) {
      this._time.textContent = text;
    }
    if (this._retry) {
      const seconds = retryInSeconds(this._retry.dataset.retryAt, now);
      const when =
        seconds === null
          ? ''
          : seconds > 0
            ? this._panel.trans.__(
                'retry in %1',
                formatDuration(seconds * 1000)
              )
            : this._panel.trans.__('retrying now');
      if (this._retry.textContent !== when) {
        this._retry.textContent = when;
      }
    }
  }

  /** Show or hide the inline detail (record, metrics, logs). */
  toggle(open?: boolean): void {
    const show = open ?? this._detailHost.hidden;
    this._detailHost.hidden = !show;
    this.node.classList.toggle('jp-mod-expanded', show);
    this._caret.setAttribute('aria-expanded', String(show));
    this._caret.replaceChildren(
      (show ? caretDownIcon : caretRightIcon).element({ tag: 'span' })
    );
    if (show && !this._detail) {
      this._detail = new RunDetailView({
        model: this._panel.model,
        id: this.id,
        trans: this._panel.trans,
        logTail: this.logTail,
        onOpenInTab: () => this._panel.openInTab(this.id)
      });
      this._detailHost.append(this._detail.node);
    }
    if (show && this._detail) {
      this._detail.logTail = this.logTail;
      void this._detail.load();
    }
    if (!show && this._detail) {
      this._detail.dispose();
      this._detail = null;
    }
  }

  dispose(): void {
    this._detail?.dispose();
    this._detail = null;
    this.node.remove();
  }

  private _record: IRunRecord | null = null;
  private _summary: ISummary | null | undefined = undefined;
  private _slot: number | undefined = undefined;
  private _chip: HTMLElement;
  private _position: HTMLElement;
  private _state: HTMLElement;
  private _warn: HTMLElement;
  private _name: HTMLButtonElement;
  private _select: HTMLInputElement;
  private _caret: HTMLButtonElement;
  private _cancel: HTMLButtonElement;
  private _resume: HTMLButtonElement;
  private _meta: HTMLElement;
  private _time: HTMLElement | null = null;
  private _retry: HTMLElement | null = null;
  private _reason: HTMLElement;
  private _progress: HTMLElement;
  private _bar: ProgressBar;
  private _metrics: HTMLElement;
  private _detailHost: HTMLElement;
  private _detail: RunDetailView | null = null;
}
