/** Records for the unit tests: the fields a test sets, the rest as a fresh queued run has them. */
import { ILedgerDevice, IRunRecord } from '../records';

export function run(fields: Partial<IRunRecord> & { id: string }): IRunRecord {
  return {
    name: fields.id,
    state: 'queued',
    reason: null,
    priority: 'normal',
    submitted_at: '2030-01-01T00:00:00.000000+00:00',
    started_at: null,
    finished_at: null,
    pid: null,
    exit_code: null,
    marginal_vram_mb: 0,
    ...fields
  } as IRunRecord;
}

export function device(fields: Partial<ILedgerDevice> = {}): ILedgerDevice {
  return {
    index: 0,
    name: 'Virtual GPU',
    total_mb: 24000,
    baseline_mb: 0,
    usable_mb: 24000,
    allocated_mb: 0,
    free_mb: 24000,
    unmanaged_mb: 0,
    exclusive: null,
    runs: [],
    leases: [],
    unmanaged_processes: [],
    ...fields
  };
}
