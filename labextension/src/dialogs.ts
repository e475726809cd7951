/**
 * The confirmation dialogs of the panel's destructive actions: cancel a run, cancel a sweep's
 * unfinished runs, release a lease.
 */
import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import { TranslationBundle } from '@jupyterlab/translation';

import { EvalSchedError, ILeaseRecord, IRunRecord, leaseHolder } from './api';
import { leaseSize } from './leaseRow';
import { EvalSchedModel } from './model';

/** Ask for confirmation, then cancel a sweep's unfinished runs. */
export async function confirmCancelSweep(
  model: EvalSchedModel,
  trans: TranslationBundle,
  id: string,
  name: string,
  unfinished: number
): Promise<void> {
  const result = await showDialog({
    title: trans.__('Cancel sweep?'),
    body: trans._n(
      'Cancel the %1 unfinished run of “%2” (%3)? Its finished runs stay as they are.',
      'Cancel the %1 unfinished runs of “%2” (%3)? Its finished runs stay as they are.',
      unfinished,
      name,
      id
    ),
    buttons: [
      Dialog.cancelButton({ label: trans.__('Keep it') }),
      Dialog.warnButton({
        label: trans.__('Cancel sweep'),
        ariaLabel: trans.__('Cancel sweep')
      })
    ]
  });
  if (!result.button.accept) {
    return;
  }
  try {
    await model.cancelSweep(id);
  } catch (reason) {
    await showErrorMessage(
      trans.__('Cannot cancel sweep %1', id),
      reason instanceof Error ? reason.message : String(reason)
    );
  }
}

/** Ask for confirmation, then cancel. */
export async function confirmCancel(
  model: EvalSchedModel,
  trans: TranslationBundle,
  record: IRunRecord
): Promise<void> {
  const running = record.state === 'running';
  const result = await showDialog({
    title: trans.__('Cancel run?'),
    body: running
      ? trans.__(
          'Cancel “%1” (%2)? Its process group is signalled; the episodes done so far stay in its summary.',
          record.name,
          record.id
        )
      : trans.__('Remove “%1” (%2) from the queue?', record.name, record.id),
    buttons: [
      Dialog.cancelButton({ label: trans.__('Keep it') }),
      Dialog.warnButton({
        label: trans.__('Cancel run'),
        ariaLabel: trans.__('Cancel run')
      })
    ]
  });
  if (!result.button.accept) {
    return;
  }
  try {
    await model.cancel(record.id);
  } catch (reason) {
    const message =
      reason instanceof EvalSchedError && reason.status === 409
        ? trans.__('The run already finished.')
        : reason instanceof Error
          ? reason.message
          : String(reason);
    await showErrorMessage(trans.__('Cannot cancel %1', record.id), message);
  }
}

/** Ask for confirmation, then release a lease (DELETE /evalsched/leases/{id}). */
export async function confirmRelease(
  model: EvalSchedModel,
  trans: TranslationBundle,
  lease: ILeaseRecord
): Promise<void> {
  const holder = leaseHolder(lease);
  const size = leaseSize(lease, trans);
  const result = await showDialog({
    title: trans.__('Release lease?'),
    body:
      lease.state === 'granted'
        ? trans.__(
            'Release the %1 that “%2” holds (%3)? Its process keeps running, but the scheduler no longer keeps that VRAM for it: queued runs may take it.',
            size,
            holder,
            lease.id
          )
        : trans.__(
            'Withdraw the request of “%1” (%2) for %3?',
            holder,
            lease.id,
            size
          ),
    buttons: [
      Dialog.cancelButton({ label: trans.__('Keep it') }),
      Dialog.warnButton({
        label: trans.__('Release'),
        ariaLabel: trans.__('Release lease')
      })
    ]
  });
  if (!result.button.accept) {
    return;
  }
  try {
    await model.release(lease.id);
  } catch (reason) {
    if (reason instanceof EvalSchedError && reason.status === 404) {
      // It ended meanwhile (or is unknown to this server): show what is.
      void model.refresh();
      return;
    }
    await showErrorMessage(
      trans.__('Cannot release %1', lease.id),
      reason instanceof Error ? reason.message : String(reason)
    );
  }
}
