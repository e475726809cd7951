/**
 * Pending reasons as data: what a run or lease row shows from the record's `why` (the code as the
 * head, the holders named), or the record's `reason` string as it is when the server sends no
 * `why` (a terminal reason such as `exit_code:1`, or an older server). Pure: runs in node.
 */
import { basename, IWhy, IWhyHolder } from './records';

/** A holder of `why`, named for a row. */
export interface IHolderView {
  kind: IWhyHolder['kind'];
  id: string | null;
  /** A run by its name, a lease by its label, a kernel by its notebook, a user by name. */
  label: string;
  gpu: number | null;
  mb: number | null;
}

/** How a row shows a reason. */
export interface IReasonView {
  /** True when it comes from `why`; false for a `reason` string shown as it is. */
  structured: boolean;
  /** `why.code` ('' for a bare reason string). */
  code: string;
  /** `why.arg` ('' when none). */
  arg: string;
  /** What is shown first: `code` or `code:arg`; the whole string of a bare reason. */
  head: string;
  /** `why.detail` ('' when none). */
  text: string;
  holders: IHolderView[];
}

const HOLDER_KINDS: ReadonlyArray<string> = [
  'run',
  'lease',
  'kernel',
  'process',
  'model',
  'user'
];

function text(value: unknown): string | null {
  return typeof value === 'string' && value ? value : null;
}

function whole(value: unknown): number | null {
  return typeof value === 'number' && Number.isFinite(value) ? value : null;
}

/**
 * The record's `why`, checked: null when absent, null, or not in the pinned shape (a code is
 * required; holders that are not objects of a known kind are dropped).
 */
export function whyOf(record: { why?: unknown }): IWhy | null {
  const why = record.why;
  if (!why || typeof why !== 'object' || Array.isArray(why)) {
    return null;
  }
  const w = why as { [key: string]: unknown };
  const code = text(w.code);
  if (!code) {
    return null;
  }
  const holders = (Array.isArray(w.holders) ? w.holders : [])
    .filter(
      (x): x is { [key: string]: unknown } =>
        !!x &&
        typeof x === 'object' &&
        HOLDER_KINDS.includes((x as { kind?: unknown }).kind as string)
    )
    .map(x => ({
      kind: x.kind as IWhyHolder['kind'],
      id: text(x.id),
      name: text(x.name),
      gpu: whole(x.gpu),
      mb: whole(x.mb)
    }));
  return { code, arg: text(w.arg), detail: text(w.detail), holders };
}

/** The name a row gives a holder. */
export function holderLabel(holder: IWhyHolder): string {
  const id = holder.id ?? '';
  const name = holder.name ?? '';
  switch (holder.kind) {
    case 'kernel':
      // A kernel is known by its notebook (the name is the notebook's path).
      return name ? basename(name) : id ? `kernel ${id.slice(0, 8)}` : 'kernel';
    case 'process':
      return name && id
        ? `${name} (pid ${id})`
        : name || (id ? `pid ${id}` : 'process');
    default:
      // A run by its name, a lease by its label, a model or a user by name; else the id.
      return name || id || holder.kind;
  }
}

/** How to show a record's reason; null when it has neither `why` nor `reason`. */
export function reasonView(record: {
  reason?: string | null;
  why?: unknown;
}): IReasonView | null {
  const why = whyOf(record);
  if (why) {
    const arg = why.arg ?? '';
    return {
      structured: true,
      code: why.code,
      arg,
      head: arg ? `${why.code}:${arg}` : why.code,
      text: why.detail ?? '',
      holders: why.holders.map(holder => ({
        kind: holder.kind,
        id: holder.id,
        label: holderLabel(holder),
        gpu: holder.gpu,
        mb: holder.mb
      }))
    };
  }
  if (record.reason) {
    // No `why`: the string as the server wrote it, not taken apart.
    return {
      structured: false,
      code: '',
      arg: '',
      head: record.reason,
      text: '',
      holders: []
    };
  }
  return null;
}
