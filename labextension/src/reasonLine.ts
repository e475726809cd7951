/**
 * The reason line of a run or lease row: from `why`, its code as the head, readable words for the
 * codes of preemption and retries, the server's sentence and the holders by name; without `why`,
 * the `reason` string as the server wrote it.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { formatMB, h } from './format';
import { IHolderView, IReasonView } from './reason';

/**
 * Readable text of the reason codes of preemption and retries (`preempted_by:<id>`,
 * `preempting:<id>`, `retrying`), with the server's sentence when it sent one; '' for other codes
 * (their sentence alone says it).
 */
export function readableReason(
  code: string,
  arg: string,
  text: string,
  trans: TranslationBundle
): string {
  const by = arg || trans.__('a higher lane');
  switch (code) {
    case 'preempted_by':
      return text
        ? trans.__('preempted by %1 — %2', by, text)
        : trans.__(
            'preempted by %1: queued again, it resumes where it stopped when there is room',
            by
          );
    case 'preempting':
      return text
        ? trans.__('being preempted for %1 — %2', by, text)
        : trans.__(
            'being preempted for %1: it stops at its next episode boundary',
            by
          );
    case 'retrying':
      return text
        ? trans.__('automatic retry — %1', text)
        : trans.__('waiting out the back-off before an automatic retry');
    default:
      return '';
  }
}

/** The tooltip of a holder: what it is, where, how much. */
function holderTitle(holder: IHolderView, trans: TranslationBundle): string {
  const what = holder.id
    ? trans.__('%1 %2', holder.kind, holder.id)
    : holder.kind;
  const where =
    holder.gpu !== null ? trans.__('%1 on GPU %2', what, holder.gpu) : what;
  return holder.mb !== null
    ? trans.__('%1: %2', where, formatMB(holder.mb))
    : where;
}

/** Who holds the room back: `held by a, b`. */
function holdersNode(
  holders: IHolderView[],
  trans: TranslationBundle
): HTMLElement {
  const children: (HTMLElement | string)[] = [trans.__('held by') + ' '];
  holders.forEach((holder, i) => {
    if (i > 0) {
      children.push(', ');
    }
    children.push(
      h('span', {
        className: 'jp-EvalSched-reasonHolder',
        text: holder.label,
        title: holderTitle(holder, trans),
        attrs: {
          'data-kind': holder.kind,
          'data-holder-id': holder.id ?? ''
        }
      })
    );
  });
  return h(
    'span',
    {
      className: 'jp-EvalSched-reasonHolders',
      attrs: { 'data-testid': 'evalsched-reason-holders' }
    },
    children
  );
}

/** Fill a row's reason element (`retry`: the retry countdown, placed after the head). */
export function renderReason(
  el: HTMLElement,
  view: IReasonView,
  trans: TranslationBundle,
  retry: HTMLElement | null = null
): void {
  el.dataset.structured = String(view.structured);
  if (!view.structured) {
    el.replaceChildren(
      h('span', {
        className: 'jp-EvalSched-reasonText',
        text: view.head,
        attrs: { 'data-raw': 'true' }
      }),
      retry ?? ''
    );
    el.title = view.head;
    return;
  }
  const readable = readableReason(view.code, view.arg, view.text, trans);
  el.replaceChildren(
    h('span', { className: 'jp-EvalSched-reasonCode', text: view.head }),
    retry ?? '',
    readable
      ? h('span', {
          className: 'jp-EvalSched-reasonText',
          text: readable,
          attrs: { 'data-readable': 'true' }
        })
      : view.text
        ? h('span', { className: 'jp-EvalSched-reasonText', text: view.text })
        : '',
    view.holders.length ? holdersNode(view.holders, trans) : ''
  );
  el.title = view.text ? `${view.head}: ${view.text}` : view.head;
}
