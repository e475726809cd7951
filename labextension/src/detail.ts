/**
 * The detail of one run: its record, the metrics of its summary, its error and the tail of its
 * logs. Shown inline (expanded row of the panel) and in a main-area tab.
 */
import { MainAreaWidget, showErrorMessage } from '@jupyterlab/apputils';
import { TranslationBundle } from '@jupyterlab/translation';
import { launchIcon, refreshIcon } from '@jupyterlab/ui-components';
import { IDisposable } from '@lumino/disposable';
import { Widget } from '@lumino/widgets';

import {
  EvalSchedError,
  IRunRecord,
  isTerminal,
  LogStream,
  runWarnings
} from './api';
import {
  attemptOf,
  executorOf,
  formatDuration,
  formatMB,
  formatNumber,
  formatTimestamp,
  h,
  historyOf,
  IBadgeLabels,
  isResumable,
  isSlurm,
  parseTime,
  preemptionsOf,
  retriesOf,
  retryAtOf,
  splitReason
} from './format';
import { attemptHistoryNodes } from './attemptHistory';
import { evalschedIcon } from './icon';
import { EvalSchedModel } from './model';
import { latestMetrics } from './records';
import { reasonView } from './reason';
import { readableReason } from './reasonLine';

/** Refresh the logs of a running run at most this often while they are shown (ms). */
const LOG_REFRESH_MS = 2000;

/**
 * Resume a run that ended without succeeding (`POST /evalsched/runs/{id}/resume`); a refusal
 * (409: it is not failed, aborted or cancelled; 404: unknown) shows the server's message.
 */
export async function resumeRun(
  model: EvalSchedModel,
  id: string,
  trans: TranslationBundle
): Promise<void> {
  try {
    await model.resume(id);
  } catch (reason) {
    await showErrorMessage(
      trans.__('Cannot resume %1', id),
      reason instanceof Error ? reason.message : String(reason)
    );
  }
}

/** The badge words of a run row, translated. */
export function badgeLabels(trans: TranslationBundle): IBadgeLabels {
  return {
    attempt: n => [
      trans.__('attempt %1', n),
      trans.__(
        'Attempt %1: the run was resumed or retried, skipping the episodes already done',
        n
      )
    ],
    preemptions: n => [
      trans.__('preempted ×%1', n),
      trans.__(
        'Preempted by higher-priority work (times: %1); it resumed where it stopped',
        n
      )
    ],
    retries: (used, allowed) => [
      trans.__('retry %1/%2', used, allowed),
      trans.__('Automatic retries: %1 of %2 made', used, allowed)
    ],
    detached: () => [
      trans.__('detached'),
      trans.__('Detached: the run does not die with the Jupyter server')
    ]
  };
}

export interface IRunDetailOptions {
  model: EvalSchedModel;
  id: string;
  trans: TranslationBundle;
  /** Lines of log to show. */
  logTail: number;
  /** Shows an "open in a tab" button when given. */
  onOpenInTab?: () => void;
}

export class RunDetailView implements IDisposable {
  constructor(options: IRunDetailOptions) {
    this._model = options.model;
    this._id = options.id;
    this._trans = options.trans;
    this.logTail = options.logTail;
    const trans = this._trans;

    this.node = h('div', {
      className: 'jp-EvalSched-detail',
      attrs: { 'data-run-id': this._id, 'data-testid': 'evalsched-detail' }
    });
    this._info = h('dl', { className: 'jp-EvalSched-kv' });
    this._metrics = h('div', { className: 'jp-EvalSched-metricsTable' });
    this._error = h('div', { className: 'jp-EvalSched-runError' });
    this._warnings = h('div', {
      className: 'jp-EvalSched-warnings',
      attrs: { 'data-testid': 'evalsched-detail-warnings' }
    });
    this._history = h('div', {
      className: 'jp-EvalSched-history',
      attrs: { 'data-testid': 'evalsched-history' }
    });
    // In a tab (no run row beside it) the detail has the run's actions itself.
    this._actions = h('div', { className: 'jp-EvalSched-detailActions' });
    this._actions.hidden = true;
    if (!options.onOpenInTab) {
      const resume = h('button', {
        className: 'jp-EvalSched-textButton jp-EvalSched-resume',
        text: trans.__('Resume'),
        title: trans.__(
          'Resume this run: queued again under the same id, skipping the episodes already done'
        ),
        attrs: { type: 'button', 'data-testid': 'evalsched-resume' }
      });
      resume.addEventListener('click', () => {
        const record = this._model.getRun(this._id);
        if (record && isResumable(record.state) && !resume.disabled) {
          resume.disabled = true;
          void resumeRun(this._model, this._id, trans).finally(() => {
            resume.disabled = false;
          });
        }
      });
      this._resume = resume;
      this._actions.append(resume);
    }

    this._streamButtons = (['stdout', 'stderr'] as LogStream[]).map(stream => {
      const button = h('button', {
        className: 'jp-EvalSched-chip',
        text: stream,
        attrs: { 'data-stream': stream, type: 'button' }
      });
      button.addEventListener('click', () => {
        this._stream = stream;
        this._syncStreamButtons();
        void this.refreshLogs();
      });
      return button;
    });
    const reload = h('button', {
      className: 'jp-EvalSched-iconButton',
      title: trans.__('Reload the logs'),
      attrs: { type: 'button', 'data-testid': 'evalsched-logs-reload' }
    });
    reload.append(refreshIcon.element({ tag: 'span' }));
    reload.addEventListener('click', () => void this.refreshLogs());
    const toolbar = h('div', { className: 'jp-EvalSched-logsToolbar' }, [
      h('span', { className: 'jp-EvalSched-subhead', text: trans.__('Logs') }),
      ...this._streamButtons,
      h('span', { className: 'jp-EvalSched-spacer' }),
      reload
    ]);
    if (options.onOpenInTab) {
      const open = h('button', {
        className: 'jp-EvalSched-iconButton',
        title: trans.__('Open in a tab'),
        attrs: { type: 'button', 'data-testid': 'evalsched-open-tab' }
      });
      open.append(launchIcon.element({ tag: 'span' }));
      open.addEventListener('click', options.onOpenInTab);
      toolbar.append(open);
    }
    this._log = h('pre', {
      className: 'jp-EvalSched-log',
      attrs: { 'data-testid': 'evalsched-log', tabindex: '0' }
    });
    this._logNote = h('div', { className: 'jp-EvalSched-logNote' });
    this.node.append(
      this._actions,
      this._info,
      this._warnings,
      this._history,
      this._metrics,
      this._error,
      h('div', { className: 'jp-EvalSched-logs' }, [
        toolbar,
        this._log,
        this._logNote
      ])
    );
    this._syncStreamButtons();

    this._model.runChanged.connect(this._onRunChanged, this);
    this._model.summaryChanged.connect(this._onSummaryChanged, this);
    this.render();
  }

  readonly node: HTMLElement;
  logTail: number;

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  /** Load the summary and the logs (when first shown, and on demand). */
  async load(): Promise<void> {
    await Promise.all([
      this._model
        .fetchSummary(this._id)
        .catch(reason => this._showFetchError(reason)),
      this.refreshLogs()
    ]);
  }

  async refreshLogs(): Promise<void> {
    const stream = this._stream;
    const seq = ++this._logSeq;
    this._lastLogFetch = Date.now();
    this.node.dataset.logsLoading = 'true';
    try {
      const text = await this._model.api.getLogs(
        this._id,
        stream,
        this.logTail
      );
      if (seq !== this._logSeq || this._isDisposed) {
        return;
      }
      const atBottom =
        this._log.scrollHeight - this._log.scrollTop - this._log.clientHeight <
        8;
      this._log.textContent = text;
      this._log.dataset.empty = text ? 'false' : 'true';
      this._logNote.textContent = text
        ? this._trans.__('last %1 lines of %2', this.logTail, stream)
        : this._trans.__('%1 is empty', stream);
      if (atBottom || this._log.dataset.scrolled !== 'true') {
        this._log.scrollTop = this._log.scrollHeight;
        this._log.dataset.scrolled = 'true';
      }
    } catch (reason) {
      if (seq !== this._logSeq || this._isDisposed) {
        return;
      }
      this._log.textContent = '';
      this._log.dataset.empty = 'true';
      this._logNote.textContent =
        reason instanceof Error ? reason.message : String(reason);
    } finally {
      if (seq === this._logSeq) {
        delete this.node.dataset.logsLoading;
      }
    }
  }

  /** Render the record and the summary from the model. */
  render(): void {
    const trans = this._trans;
    const record = this._model.getRun(this._id);
    const summary = this._model.getSummary(this._id);
    this._info.replaceChildren();
    this._warnings.replaceChildren();
    this._history.replaceChildren();
    this._actions.hidden =
      !this._resume || !record || !isResumable(record.state);
    if (!record) {
      this._info.append(
        h('dt', { text: trans.__('Run') }),
        h('dd', { text: this._id })
      );
      return;
    }
    const started = parseTime(record.started_at);
    const finished = parseTime(record.finished_at);
    // Readable words for a reason given as data (`why`); a bare reason string is shown as it is.
    const reason = reasonView(record);
    const readable =
      reason?.structured && !reason.text
        ? readableReason(reason.code, reason.arg, '', trans)
        : '';
    const attempt = attemptOf(record);
    const history = historyOf(record);
    const preemptions = preemptionsOf(record);
    const retries = retriesOf(record);
    const retryAt = retryAtOf(record);
    const rows: [string, string | null, string?][] = [
      [trans.__('Run id'), record.id],
      [trans.__('Name'), record.name],
      [trans.__('State'), record.state],
      [
        trans.__('Reason'),
        record.reason
          ? readable
            ? `${record.reason} (${readable})`
            : record.reason
          : null,
        'reason'
      ],
      [
        trans.__('Held back by'),
        reason?.holders.length
          ? reason.holders.map(holder => holder.label).join(', ')
          : null,
        'holders'
      ],
      [
        trans.__('Attempt'),
        attempt > 1 || history.length ? String(attempt) : null,
        'attempt'
      ],
      [
        trans.__('Preempted'),
        preemptions > 0 ? trans._n('%1 time', '%1 times', preemptions) : null,
        'preemptions'
      ],
      [
        trans.__('Preemptible'),
        record.preemptible === true
          ? trans.__('yes: a higher lane may stop it at an episode boundary')
          : null,
        'preemptible'
      ],
      [
        trans.__('Automatic retries'),
        retries.allowed > 0
          ? trans.__('%1 of %2 made', retries.used, retries.allowed)
          : null,
        'retries'
      ],
      [
        trans.__('Retry at'),
        retryAt ? formatTimestamp(retryAt) : null,
        'retry_at'
      ],
      [
        trans.__('Detached'),
        record.detach === true
          ? trans.__('yes: it does not die with the server')
          : null,
        'detach'
      ],
      [
        trans.__('Start'),
        record.start === 'warm'
          ? trans.__('warm: %1', record.start_detail ?? '')
          : record.start === 'cold'
            ? trans.__('cold: %1', record.start_detail ?? '')
            : null,
        'start'
      ],
      [trans.__('Priority'), record.priority],
      [trans.__('Submitted'), formatTimestamp(record.submitted_at)],
      [trans.__('Started'), formatTimestamp(record.started_at)],
      [trans.__('Finished'), formatTimestamp(record.finished_at)],
      [
        trans.__('Duration'),
        started !== null
          ? formatDuration((finished ?? Date.now()) - started)
          : null
      ],
      [
        trans.__('Episodes'),
        record.progress
          ? `${record.progress.done} / ${record.progress.total}`
          : null
      ],
      [trans.__('Executor'), executorOf(record), 'executor'],
      [
        trans.__('SLURM job'),
        isSlurm(record) &&
        record.slurm_job_id !== null &&
        record.slurm_job_id !== undefined
          ? String(record.slurm_job_id)
          : isSlurm(record) && !isTerminal(record.state)
            ? trans.__('not submitted yet')
            : null,
        'slurm_job_id'
      ],
      [
        trans.__('SLURM state'),
        isSlurm(record) &&
        typeof record.slurm_state === 'string' &&
        record.slurm_state
          ? record.slurm_state
          : null,
        'slurm_state'
      ],
      [
        trans.__('GPUs'),
        record.devices && record.devices.length
          ? record.devices.join(', ')
          : null
      ],
      [
        trans.__('VRAM (declared)'),
        record.marginal_vram_mb ? formatMB(record.marginal_vram_mb) : null
      ],
      [
        trans.__('VRAM from'),
        typeof record.marginal_vram_source === 'string' &&
        record.marginal_vram_source &&
        record.marginal_vram_source !== 'declared'
          ? record.marginal_vram_source
          : null,
        'marginal_vram_source'
      ],
      [
        trans.__('Host memory limit'),
        typeof record.memory_mb === 'number'
          ? formatMB(record.memory_mb)
          : null,
        'memory_mb'
      ],
      [trans.__('Peak VRAM'), peakVram(record), 'observed_vram'],
      [
        trans.__('Peak host memory'),
        typeof record.observed?.peak_rss_mb === 'number'
          ? formatMB(record.observed.peak_rss_mb)
          : null,
        'observed_rss'
      ],
      [
        trans.__('Observed by'),
        record.observed && typeof record.observed.source === 'string'
          ? record.observed.source === 'virtual'
            ? trans.__('virtual GPUs')
            : record.observed.source === 'nvml'
              ? trans.__('NVML')
              : record.observed.source
          : null,
        'observed_source'
      ],
      [
        trans.__('PID'),
        record.pid !== null && record.pid !== undefined
          ? String(record.pid)
          : null
      ],
      [
        trans.__('Exit code'),
        // (A 0 of a run that failed says nothing: the runner exits 0 after writing the eval's
        // failure; the reason tells it.)
        record.exit_code !== null &&
        record.exit_code !== undefined &&
        !(
          record.exit_code === 0 &&
          !['succeeded', 'queued', 'running'].includes(record.state)
        )
          ? String(record.exit_code)
          : null
      ],
      [
        trans.__('Depends on'),
        record.depends_on && record.depends_on.length
          ? record.depends_on.join(', ')
          : null
      ]
    ];
    for (const [label, value, field] of rows) {
      if (value === null || value === '') {
        continue;
      }
      const attrs = field ? { 'data-field': field } : undefined;
      this._info.append(
        h('dt', { text: label, attrs }),
        h('dd', { text: value, title: value, attrs })
      );
    }

    for (const warning of runWarnings(record)) {
      const { code, text } = splitReason(warning);
      this._warnings.append(
        h(
          'div',
          {
            className: 'jp-EvalSched-warning',
            title: warning,
            attrs: { 'data-code': code }
          },
          [
            h('span', {
              className: 'jp-EvalSched-reasonCode',
              text: `⚠ ${code}`
            }),
            text
          ]
        )
      );
    }

    // How each earlier attempt ended: one line each, oldest first.
    this._history.append(...attemptHistoryNodes(history, trans));

    this._metrics.replaceChildren();
    const metrics = latestMetrics(record, summary);
    const names = Object.keys(metrics).sort();
    if (names.length) {
      const head = h('tr', {}, [
        h('th', { text: trans.__('metric') }),
        h('th', { text: trans.__('mean') }),
        h('th', { text: trans.__('std') }),
        h('th', { text: trans.__('min') }),
        h('th', { text: trans.__('max') }),
        h('th', { text: trans.__('n') })
      ]);
      const body = names.map(name => {
        const m = metrics[name] ?? {};
        return h('tr', { attrs: { 'data-metric': name } }, [
          h('td', { text: name, title: name }),
          h('td', { text: formatNumber(m.mean) }),
          h('td', { text: formatNumber(m.std) }),
          h('td', { text: formatNumber(m.min) }),
          h('td', { text: formatNumber(m.max) }),
          h('td', {
            text: `${m.count ?? ''}${m.skipped ? ` (+${m.skipped} skipped)` : ''}`
          })
        ]);
      });
      this._metrics.append(
        h('table', {}, [h('thead', {}, [head]), h('tbody', {}, body)])
      );
    } else if (summary === null) {
      this._metrics.append(
        h('div', {
          className: 'jp-EvalSched-muted',
          text: trans.__('No summary yet.')
        })
      );
    }

    this._error.replaceChildren();
    const error = summary?.error;
    if (error) {
      this._error.append(
        h('div', {
          className: 'jp-EvalSched-runErrorTitle',
          text: `${error.type}: ${error.message}`
        })
      );
      if (error.traceback) {
        this._error.append(
          h('pre', {
            className: 'jp-EvalSched-traceback',
            text: error.traceback
          })
        );
      }
    }
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._model.runChanged.disconnect(this._onRunChanged, this);
    this._model.summaryChanged.disconnect(this._onSummaryChanged, this);
    if (this._logTimer !== null) {
      clearTimeout(this._logTimer);
    }
    this.node.remove();
  }

  private _onRunChanged(_: EvalSchedModel, record: IRunRecord): void {
    if (record.id !== this._id) {
      return;
    }
    this.render();
    // Follow the logs of a live run while it is shown, and read them once more when it ends.
    if (
      this.node.isConnected &&
      (record.state === 'running' || isTerminal(record.state))
    ) {
      this._scheduleLogRefresh();
    }
  }

  private _onSummaryChanged(_: EvalSchedModel, id: string): void {
    if (id === this._id) {
      this.render();
    }
  }

  private _scheduleLogRefresh(): void {
    if (this._logTimer !== null) {
      return;
    }
    const wait = Math.max(0, this._lastLogFetch + LOG_REFRESH_MS - Date.now());
    this._logTimer = setTimeout(() => {
      this._logTimer = null;
      if (this.node.isConnected && !this._isDisposed) {
        void this.refreshLogs();
      }
    }, wait);
  }

  private _showFetchError(reason: unknown): void {
    const message =
      reason instanceof EvalSchedError && reason.status === 404
        ? this._trans.__('This run no longer exists.')
        : reason instanceof Error
          ? reason.message
          : String(reason);
    this._metrics.replaceChildren(
      h('div', { className: 'jp-EvalSched-muted', text: message })
    );
  }

  private _syncStreamButtons(): void {
    for (const button of this._streamButtons) {
      const active = button.dataset.stream === this._stream;
      button.classList.toggle('jp-mod-active', active);
      button.setAttribute('aria-pressed', String(active));
    }
  }

  private _model: EvalSchedModel;
  private _id: string;
  private _trans: TranslationBundle;
  private _info: HTMLElement;
  private _metrics: HTMLElement;
  private _error: HTMLElement;
  private _warnings: HTMLElement;
  private _history: HTMLElement;
  private _actions: HTMLElement;
  private _resume: HTMLButtonElement | null = null;
  private _log: HTMLElement;
  private _logNote: HTMLElement;
  private _streamButtons: HTMLButtonElement[];
  private _stream: LogStream = 'stdout';
  private _logSeq = 0;
  private _lastLogFetch = 0;
  private _logTimer: ReturnType<typeof setTimeout> | null = null;
  private _isDisposed = false;
}

/** `GPU 0: 10,000 MB, GPU 1: 9,500 MB`: the observed VRAM peaks of a run, or null. */
function peakVram(record: IRunRecord): string | null {
  const peaks = record.observed?.peak_vram_mb;
  if (!peaks || typeof peaks !== 'object') {
    return null;
  }
  const entries = Object.entries(peaks)
    .filter(([, mb]) => typeof mb === 'number')
    .sort(([a], [b]) => Number(a) - Number(b));
  if (!entries.length) {
    return null;
  }
  return entries.map(([gpu, mb]) => `GPU ${gpu}: ${formatMB(mb)}`).join(', ');
}

/** A run's detail as a main-area widget. */
export class RunDetailWidget extends Widget {
  constructor(options: Omit<IRunDetailOptions, 'onOpenInTab'>) {
    const view = new RunDetailView(options);
    super({ node: view.node });
    this._view = view;
    this.runId = options.id;
    this.addClass('jp-EvalSched-detailWidget');
  }

  /** The id of the run shown. */
  readonly runId: string;

  get view(): RunDetailView {
    return this._view;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._view.dispose();
    super.dispose();
  }

  private _view: RunDetailView;
}

/** Create (not attach) the main-area tab of a run. */
export function createRunDetailTab(
  options: Omit<IRunDetailOptions, 'onOpenInTab'>
): MainAreaWidget<RunDetailWidget> {
  const content = new RunDetailWidget(options);
  const widget = new MainAreaWidget({ content });
  const record = options.model.getRun(options.id);
  widget.id = `jupyter-evalsched-run-${options.id}`;
  widget.title.label = record ? `${record.name} · ${options.id}` : options.id;
  widget.title.caption = options.trans.__('Evaluation run %1', options.id);
  widget.title.icon = evalschedIcon;
  widget.title.closable = true;
  void content.view.load();
  return widget;
}
