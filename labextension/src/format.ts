/**
 * Small formatting helpers shared by the panel and the run detail view.
 */

/** Parse the contract's ISO 8601 timestamps (microseconds, `+00:00`) into epoch ms. */
export function parseTime(value: string | null | undefined): number | null {
  if (!value) {
    return null;
  }
  // Trim microseconds to milliseconds: not every engine parses six fractional digits.
  const normalized = value.replace(/(\.\d{3})\d+/, '$1');
  const ms = Date.parse(normalized);
  return Number.isNaN(ms) ? null : ms;
}

/** `75 s` → `1:15`, `3725 s` → `1:02:05`. */
export function formatDuration(ms: number | null): string {
  if (ms === null || !Number.isFinite(ms)) {
    return '–';
  }
  const total = Math.max(0, Math.floor(ms / 1000));
  const h = Math.floor(total / 3600);
  const m = Math.floor((total % 3600) / 60);
  const s = total % 60;
  const pad = (n: number) => String(n).padStart(2, '0');
  return h > 0 ? `${h}:${pad(m)}:${pad(s)}` : `${m}:${pad(s)}`;
}

/** `2 min ago`, `just now`, … */
export function formatAgo(ms: number | null, now = Date.now()): string {
  if (ms === null) {
    return '';
  }
  const seconds = Math.round((now - ms) / 1000);
  if (seconds < 10) {
    return 'just now';
  }
  if (seconds < 60) {
    return `${seconds} s ago`;
  }
  const minutes = Math.round(seconds / 60);
  if (minutes < 60) {
    return `${minutes} min ago`;
  }
  const hours = Math.round(minutes / 60);
  if (hours < 48) {
    return `${hours} h ago`;
  }
  return new Date(ms).toLocaleDateString();
}

/**
 * MB with a thousands separator. Always MB: the contract (and every declaration a user writes)
 * counts in MB, so 16000 shows as "16,000 MB", never as a rounded "15.6 GB".
 */
export function formatMB(mb: number | null | undefined, unit = true): string {
  if (mb === null || mb === undefined || !Number.isFinite(mb)) {
    return '–';
  }
  const n = Math.round(mb).toLocaleString('en-US');
  return unit ? `${n} MB` : n;
}

/** A timestamp: the time alone when it is today, else date and time. */
export function formatTimestamp(
  value: string | null | undefined,
  now = new Date()
): string | null {
  const ms = parseTime(value);
  if (ms === null) {
    return null;
  }
  const date = new Date(ms);
  const sameDay = date.toDateString() === now.toDateString();
  return sameDay
    ? date.toLocaleTimeString()
    : `${date.toLocaleDateString()} ${date.toLocaleTimeString()}`;
}

/** A metric value with about four significant digits. */
export function formatNumber(value: number | null | undefined): string {
  if (value === null || value === undefined || !Number.isFinite(value)) {
    return '–';
  }
  if (Number.isInteger(value) && Math.abs(value) < 1e9) {
    return String(value);
  }
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) {
    return value.toExponential(2);
  }
  return String(Number(value.toPrecision(4)));
}

/** A stable palette slot for a run id (its colour in the ledger bar and its row). */
export function colorSlot(id: string, slots = 8): number {
  let hash = 0;
  for (let i = 0; i < id.length; i++) {
    hash = (hash * 31 + id.charCodeAt(i)) | 0;
  }
  return Math.abs(hash) % slots;
}

/** A run's, lease's or sweep's id as the server makes them: `[lease-|sweep-]<time>-<6 hex>`. */
const LONG_ID = /\b(?:lease-|sweep-)?\d{8}T\d{6}(?:\.\d{6})?-([0-9a-f]{6})\b/g;

/**
 * A short form of an id (its random tail, `3eda47`), to name a run or lease in a line of text;
 * the whole id goes in a tooltip. An id of another shape is kept whole.
 */
export function shortId(id: string): string {
  LONG_ID.lastIndex = 0;
  const m = LONG_ID.exec(id);
  return m && m[0] === id ? m[1] : id;
}

/**
 * `text` with every long id in it shortened (`shortId`), as parts: strings, and the ids as
 * `{ id, short }` (the caller shows the short form with the whole id in a tooltip).
 */
export function shortenIds(
  text: string
): (string | { id: string; short: string })[] {
  const parts: (string | { id: string; short: string })[] = [];
  let at = 0;
  LONG_ID.lastIndex = 0;
  for (let m = LONG_ID.exec(text); m; m = LONG_ID.exec(text)) {
    if (m.index > at) {
      parts.push(text.slice(at, m.index));
    }
    parts.push({ id: m[0], short: m[1] });
    at = m.index + m[0].length;
  }
  if (at < text.length) {
    parts.push(text.slice(at));
  }
  return parts;
}

/**
 * Show a name in `el` (a row's name button or holder): wrapped at word boundaries over at most
 * two lines, then cut with an ellipsis (style: .jp-EvalSched-nameText); `title` carries the whole.
 */
export function setName(el: HTMLElement, name: string, title: string): void {
  const current = el.firstElementChild;
  if (
    current instanceof HTMLElement &&
    current.classList.contains('jp-EvalSched-nameText')
  ) {
    if (current.textContent !== name) {
      current.textContent = name;
    }
  } else {
    el.replaceChildren(
      h('span', { className: 'jp-EvalSched-nameText', text: name })
    );
  }
  el.title = title;
}

/** Split a `reason` into its code and the human sentence after `: `. */
export function splitReason(reason: string | null | undefined): {
  code: string;
  text: string;
} {
  if (!reason) {
    return { code: '', text: '' };
  }
  const at = reason.indexOf(': ');
  if (at < 0) {
    return { code: reason, text: '' };
  }
  return { code: reason.slice(0, at), text: reason.slice(at + 2) };
}

/** Create an element with classes, attributes and text. */
export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  props: {
    className?: string;
    text?: string;
    title?: string;
    attrs?: Record<string, string>;
  } = {},
  children: (Node | string | null | undefined | false)[] = []
): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  if (props.className) {
    el.className = props.className;
  }
  if (props.text !== undefined) {
    el.textContent = props.text;
  }
  if (props.title !== undefined) {
    el.title = props.title;
  }
  if (props.attrs) {
    for (const [k, v] of Object.entries(props.attrs)) {
      el.setAttribute(k, v);
    }
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) {
      continue;
    }
    el.append(child);
  }
  return el;
}

/** The SLURM fields of a run record (absent on local runs and on older servers). */
export interface ISlurmFields {
  executor?: unknown;
  slurm_job_id?: unknown;
  slurm_state?: unknown;
  [key: string]: unknown;
}

/** Where a run executes: `slurm`, or `local` (also when the server does not say). */
export function executorOf(record: ISlurmFields): string {
  return typeof record.executor === 'string' && record.executor
    ? record.executor
    : 'local';
}

/** Whether a run executes under SLURM (not on this host's GPUs: it is never in the ledger). */
export function isSlurm(record: ISlurmFields): boolean {
  return executorOf(record) === 'slurm';
}

/**
 * The compact badge text of a SLURM run: `SLURM 123 · RUNNING`; `SLURM · PENDING` or `SLURM`
 * while sbatch has not answered (no job id yet).
 */
export function slurmLabel(record: ISlurmFields): string {
  const job =
    record.slurm_job_id === null || record.slurm_job_id === undefined
      ? ''
      : String(record.slurm_job_id);
  const state =
    typeof record.slurm_state === 'string' ? record.slurm_state : '';
  return [job ? `SLURM ${job}` : 'SLURM', state].filter(Boolean).join(' · ');
}

/** The retry and preemption fields of a run record (all absent on older servers). */
export interface IAttemptFields {
  attempt?: unknown;
  preemptions?: unknown;
  preemptible?: unknown;
  retries?: unknown;
  retries_used?: unknown;
  retry_at?: unknown;
  detach?: unknown;
  history?: unknown;
  [key: string]: unknown;
}

/** How one earlier attempt of a run ended (an entry of its `history`). */
export interface IAttemptEnd {
  attempt: number;
  state: string;
  reason: string | null;
  started_at: string | null;
  finished_at: string | null;
  episodes_done: number | null;
}

function wholeNumber(value: unknown): number | null {
  return typeof value === 'number' && Number.isFinite(value) && value >= 0
    ? Math.floor(value)
    : null;
}

/** The attempt a run is on: 1 for the first (also when the server does not say). */
export function attemptOf(record: IAttemptFields): number {
  return Math.max(1, wholeNumber(record.attempt) ?? 1);
}

/** How many times a run was preempted (0 when the server does not say). */
export function preemptionsOf(record: IAttemptFields): number {
  return wholeNumber(record.preemptions) ?? 0;
}

/** Automatic retries: allowed, and made so far (0 and 0 when the server does not say). */
export function retriesOf(record: IAttemptFields): {
  allowed: number;
  used: number;
} {
  return {
    allowed: wholeNumber(record.retries) ?? 0,
    used: wholeNumber(record.retries_used) ?? 0
  };
}

/** When a run in back-off is retried (`retry_at`), or null. */
export function retryAtOf(record: IAttemptFields): string | null {
  return typeof record.retry_at === 'string' && record.retry_at
    ? record.retry_at
    : null;
}

/** How each earlier attempt ended, oldest first ([] when the server sends no history). */
export function historyOf(record: IAttemptFields): IAttemptEnd[] {
  const history = record.history;
  if (!Array.isArray(history)) {
    return [];
  }
  const text = (v: unknown) => (typeof v === 'string' && v ? v : null);
  return history
    .filter(
      (e): e is { [key: string]: unknown } =>
        !!e && typeof e === 'object' && !Array.isArray(e)
    )
    .map((e, i) => ({
      attempt: Math.max(1, wholeNumber(e.attempt) ?? i + 1),
      state: typeof e.state === 'string' ? e.state : '',
      reason: text(e.reason),
      started_at: text(e.started_at),
      finished_at: text(e.finished_at),
      episodes_done: wholeNumber(e.episodes_done)
    }))
    .sort((a, b) => a.attempt - b.attempt);
}

/** A badge of a run row: what sets this attempt apart from a plain first run. */
export interface IRunBadge {
  kind: 'attempt' | 'preemptions' | 'retries' | 'detached';
  text: string;
  title: string;
}

/** The words of the badges (the panel passes translated ones). */
export interface IBadgeLabels {
  attempt(attempt: number): [text: string, title: string];
  preemptions(preemptions: number): [text: string, title: string];
  retries(used: number, allowed: number): [text: string, title: string];
  detached(): [text: string, title: string];
}

export const BADGE_LABELS: IBadgeLabels = {
  attempt: n => [
    `attempt ${n}`,
    `Attempt ${n}: the run was resumed or retried, skipping the episodes already done`
  ],
  preemptions: n => [
    `preempted ×${n}`,
    `Preempted by higher-priority work (times: ${n}); it resumed where it stopped`
  ],
  retries: (used, allowed) => [
    `retry ${used}/${allowed}`,
    `Automatic retries: ${used} of ${allowed} made`
  ],
  detached: () => [
    'detached',
    'Detached: the run does not die with the Jupyter server'
  ]
};

/**
 * The badges of a run row: `attempt N` (N > 1), `preempted ×N` (N > 0), `retry k/n` (n > 0
 * automatic retries allowed, k made) and `detached`. None for a plain run or an older server.
 */
export function runBadges(
  record: IAttemptFields,
  labels: IBadgeLabels = BADGE_LABELS
): IRunBadge[] {
  const badges: IRunBadge[] = [];
  const badge = (kind: IRunBadge['kind'], [text, title]: [string, string]) =>
    badges.push({ kind, text, title });
  const attempt = attemptOf(record);
  if (attempt > 1) {
    badge('attempt', labels.attempt(attempt));
  }
  const preemptions = preemptionsOf(record);
  if (preemptions > 0) {
    badge('preemptions', labels.preemptions(preemptions));
  }
  const { allowed, used } = retriesOf(record);
  if (allowed > 0) {
    badge('retries', labels.retries(used, allowed));
  }
  if (record.detach === true) {
    badge('detached', labels.detached());
  }
  return badges;
}

/** Seconds until a run in back-off is retried (0 once due), or null without a `retry_at`. */
export function retryInSeconds(
  retryAt: string | null | undefined,
  now = Date.now()
): number | null {
  const at = parseTime(retryAt);
  return at === null ? null : Math.max(0, Math.ceil((at - now) / 1000));
}

/** The run states that Resume applies to (a run that ended without succeeding). */
export function isResumable(state: string): boolean {
  return state === 'failed' || state === 'aborted' || state === 'cancelled';
}

/** The point of a sweep's run (`sweep_point`), or null (not a sweep's run; older servers). */
export function sweepPointOf(record: {
  sweep_point?: unknown;
}): { [param: string]: unknown } | null {
  const point = record.sweep_point;
  return point && typeof point === 'object' && !Array.isArray(point)
    ? (point as { [param: string]: unknown })
    : null;
}

/** A parameter value as the server writes it in a run name: strings bare, the rest as JSON. */
export function paramText(value: unknown): string {
  if (typeof value === 'string') {
    return value;
  }
  const text = JSON.stringify(value);
  return text === undefined ? String(value) : text;
}

/**
 * Where the point starts in a sweep run's name (`<base> [<point>]`): the last ` [<first param>=`,
 * else the last ` [`; -1 when there is none.
 */
function pointStart(name: string, point: { [param: string]: unknown }): number {
  const first = Object.keys(point)[0];
  const at = first === undefined ? -1 : name.lastIndexOf(` [${first}=`);
  return at >= 0 ? at : name.lastIndexOf(' [');
}

/**
 * How a sweep's run is told apart from its siblings: `temperature=0.2, k=1` (the server's text in
 * its name when it is there, else made from `sweep_point`).
 */
export function sweepPointLabel(record: {
  name?: string;
  sweep_point?: unknown;
}): string {
  const point = sweepPointOf(record);
  const name = record.name ?? '';
  if (!point) {
    return name;
  }
  const at = pointStart(name, point);
  if (at >= 0 && name.endsWith(']')) {
    return name.slice(at + 2, -1);
  }
  return Object.entries(point)
    .map(([k, v]) => `${k}=${paramText(v)}`)
    .join(', ');
}
