/**
 * What the panel's rows (runs, sweeps, leases) ask of the panel that holds them. The rows are
 * separate components; this keeps them from importing the panel (and each other's wiring).
 */
import { TranslationBundle } from '@jupyterlab/translation';

import { ICompareTarget, ILeaseRecord, IRunRecord } from './api';
import { IBadgeLabels } from './format';
import { EvalSchedModel } from './model';

export interface IRowHost {
  readonly model: EvalSchedModel;
  readonly trans: TranslationBundle;
  /** The badge words of run rows, translated. */
  readonly badgeLabels: IBadgeLabels;
  /** Lines of log shown in a run's detail. */
  readonly logTail: number;
  /** Whether a comparison can be opened (the panel was given a way to). */
  readonly canCompare: boolean;
  /** The colour slot of a run holding GPU memory. */
  colorOf(id: string): number | undefined;
  /** Select (or unselect) a run for a comparison. */
  setSelected(id: string, selected: boolean): void;
  openInTab(id: string): void;
  openCompare(target: ICompareTarget): void;
  confirmCancel(record: IRunRecord): Promise<void>;
  confirmCancelSweep(
    id: string,
    name: string,
    unfinished: number
  ): Promise<void>;
  resume(record: IRunRecord): Promise<void>;
  confirmRelease(lease: ILeaseRecord): Promise<void>;
  /** Re-render (a sweep row expanded or collapsed). */
  update(): void;
}
