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
