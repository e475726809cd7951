/**
 * How each earlier attempt of a run ended (its record's `history`), as the run detail lists them.
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { formatDuration, h, IAttemptEnd, parseTime } from './format';

/** A heading and one line per earlier attempt, oldest first; nothing without history. */
export function attemptHistoryNodes(
  history: ReadonlyArray<IAttemptEnd>,
  trans: TranslationBundle
): HTMLElement[] {
  if (!history.length) {
    return [];
  }
  const nodes: HTMLElement[] = [
    h('span', {
      className: 'jp-EvalSched-subhead',
      text: trans.__('Earlier attempts')
    })
  ];
  for (const entry of history) {
    const from = parseTime(entry.started_at);
    const to = parseTime(entry.finished_at);
    const ran = from !== null && to !== null ? formatDuration(to - from) : null;
    nodes.push(
      h(
        'div',
        {
          className: 'jp-EvalSched-attemptEnd',
          title: entry.reason ?? undefined,
          attrs: {
            'data-testid': 'evalsched-history-entry',
            'data-attempt': String(entry.attempt),
            'data-state': entry.state,
            'data-episodes-done':
              entry.episodes_done === null ? '' : String(entry.episodes_done)
          }
        },
        [
          h('span', {
            className: 'jp-EvalSched-attemptNumber',
            text: trans.__('attempt %1', entry.attempt)
          }),
          h('span', {
            className: 'jp-EvalSched-state',
            text: entry.state,
            attrs: { 'data-state': entry.state }
          }),
          // How it ended, as the server wrote it (history carries no `why`).
          entry.reason
            ? h('span', {
                className: 'jp-EvalSched-reasonText',
                text: entry.reason,
                attrs: { 'data-raw': 'true' }
              })
            : null,
          entry.episodes_done !== null
            ? h('span', {
                className: 'jp-EvalSched-attemptEpisodes',
                text: trans._n(
                  '%1 episode done',
                  '%1 episodes done',
                  entry.episodes_done
                )
              })
            : null,
          ran
            ? h('span', {
                className: 'jp-EvalSched-muted',
                text: trans.__('ran %1', ran)
              })
            : null
        ]
      )
    );
  }
  return nodes;
}
