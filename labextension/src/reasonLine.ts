/**
 * The reason line of a run or lease row: from `why`, its code as the head, readable words for the
 * codes of preemption and retries, the server's sentence and the holders by name; without `why`,
 * the `reason` string as the server wrote it.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { formatMB, h, shortenIds, shortId } from './format';
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
    // A run or lease by its name and a short id (the whole id in the tooltip): a whole id
    // would make the reason several lines long in the panel's width.
    const short =
      holder.id && (holder.kind === 'run' || holder.kind === 'lease')
        ? shortId(holder.id)
        : '';
    const label = holder.label === holder.id && short ? short : holder.label;
    children.push(
      h(
        'span',
        {
          className: 'jp-EvalSched-reasonHolder',
          title: holderTitle(holder, trans),
          attrs: {
            'data-kind': holder.kind,
            'data-holder-id': holder.id ?? ''
          }
        },
        [
          label,
          short && label !== short
            ? h('span', {
                className: 'jp-EvalSched-shortId',
                text: ` (${short})`
              })
            : null
        ]
      )
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

/**
 * A sentence of a reason with the ids in it shortened (`shortId`), each with its whole id as a
 * tooltip.
 */
function withShortIds(
  text: string,
  className: string,
  attrs: Record<string, string> = {}
): HTMLElement {
  return h(
    'span',
    { className, attrs },
    shortenIds(text).map(part =>
      typeof part === 'string'
        ? part
        : h('span', {
            className: 'jp-EvalSched-shortId',
            text: part.short,
            title: part.id,
            attrs: { 'data-id': part.id }
          })
    )
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
      withShortIds(view.head, 'jp-EvalSched-reasonText', {
        'data-raw': 'true'
      }),
      retry ?? ''
    );
    el.title = view.head;
    return;
  }
  const readable = readableReason(view.code, view.arg, view.text, trans);
  el.replaceChildren(
    withShortIds(view.head, 'jp-EvalSched-reasonCode'),
    retry ?? '',
    readable
      ? withShortIds(readable, 'jp-EvalSched-reasonText', {
          'data-readable': 'true'
        })
      : view.text
        ? withShortIds(view.text, 'jp-EvalSched-reasonText')
        : '',
    view.holders.length ? holdersNode(view.holders, trans) : ''
  );
  el.title = view.text ? `${view.head}: ${view.text}` : view.head;
}
