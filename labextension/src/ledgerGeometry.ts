/**
 * The geometry of a GPU's ledger bar: how much of it each holder takes (shared models, runs,
 * leases and what their processes use beyond them, the VRAM of other processes per holder, free,
 * reserved), and the runs' colour slots. Pure: runs in node.
 */
import {
  basename,
  ILedger,
  ILedgerDevice,
  ILedgerLease,
  ILedgerRun,
  IUnmanagedProcess
} from './records';
import { colorSlot } from './format';

/** Colour slots of runs (CSS classes jp-EvalSched-c0 … c7). */
export const COLOR_SLOTS = 8;

/**
 * VRAM of processes without a lease, by holder: one notebook (kernel), one process, or (on a host
 * shared through a host ledger) another user's processes outside their grants, by user name.
 */
export interface IUnmanagedGroup {
  kind: 'kernel' | 'process' | 'user';
  holder: string;
  mb: number;
  pids: number[];
  names: string[];
  sessionPath: string | null;
  kernelIds: string[];
  /** Leases (on other GPUs) of its processes. */
  leaseIds: string[];
}

/**
 * Whether a process belongs to another user of a host shared through a host ledger: it carries
 * a `user` that is not `me` (this server's user, from `GET /evalsched/status`'s
 * `host_ledger.user`). Unknown `me` (no host ledger, or not yet read): nobody is another user.
 */
export function isOtherUsers(
  p: IUnmanagedProcess,
  me: string | null | undefined
): p is IUnmanagedProcess & { user: string } {
  return !!me && typeof p.user === 'string' && !!p.user && p.user !== me;
}

/**
 * Group a device's unmanaged processes by who holds them: another user's processes by that
 * user's name (nothing else of them is shown), a notebook kernel's processes by its notebook
 * (the basename of session_path; by kernel id when there is no path), every other process by
 * its pid. Notebooks first, then the largest holders.
 */
export function unmanagedGroups(
  processes: ReadonlyArray<IUnmanagedProcess>,
  me: string | null = null
): IUnmanagedGroup[] {
  const groups = new Map<string, IUnmanagedGroup>();
  for (const p of processes) {
    const used = Math.max(0, Number(p.used_mb) || 0);
    const other = isOtherUsers(p, me);
    const kernel = !other && !!(p.session_path || p.kernel_id);
    const key = other
      ? `user:${p.user}`
      : p.session_path
        ? `notebook:${p.session_path}`
        : p.kernel_id
          ? `kernel:${p.kernel_id}`
          : `pid:${p.pid}`;
    let group = groups.get(key);
    if (!group) {
      group = {
        kind: other ? 'user' : kernel ? 'kernel' : 'process',
        holder: other
          ? (p.user as string)
          : p.session_path
            ? basename(p.session_path)
            : p.kernel_id
              ? `kernel ${p.kernel_id.slice(0, 8)}`
              : `pid ${p.pid}`,
        mb: 0,
        pids: [],
        names: [],
        sessionPath: p.session_path || null,
        kernelIds: [],
        leaseIds: []
      };
      groups.set(key, group);
    }
    group.mb += used;
    if (!group.pids.includes(p.pid)) {
      group.pids.push(p.pid);
    }
    if (!other && p.name && !group.names.includes(p.name)) {
      group.names.push(p.name);
    }
    if (p.kernel_id && !group.kernelIds.includes(p.kernel_id)) {
      group.kernelIds.push(p.kernel_id);
    }
    if (p.lease_id && !group.leaseIds.includes(p.lease_id)) {
      group.leaseIds.push(p.lease_id);
    }
  }
  const rank = { kernel: 0, process: 1, user: 2 };
  return [...groups.values()]
    .filter(g => g.mb > 0)
    .sort(
      (a, b) =>
        rank[a.kind] - rank[b.kind] ||
        b.mb - a.mb ||
        (a.holder < b.holder ? -1 : a.holder > b.holder ? 1 : 0)
    );
}

/** What another user of a shared host holds on a GPU, by user name only. */
export interface IOtherUser {
  user: string;
  /** Their grants (runs and leases) on this GPU. */
  mb: number;
  runs: number;
  leases: number;
  /** Their servers' shared models. */
  models: number;
  /** What their processes outside any grant use here (also in `groups`, kind `user`). */
  outsideMb: number;
}

/**
 * The other users' holdings on a device (a server that is a tenant of a host ledger): their
 * grants from `users`, and what their processes outside any grant use, per user, largest first.
 * Empty without a host ledger (no `users`, no process of another user).
 */
export function otherUsers(
  device: ILedgerDevice,
  me: string | null = null
): IOtherUser[] {
  const per = new Map<string, IOtherUser>();
  const entry = (user: string) => {
    let e = per.get(user);
    if (!e) {
      e = { user, mb: 0, runs: 0, leases: 0, models: 0, outsideMb: 0 };
      per.set(user, e);
    }
    return e;
  };
  for (const u of Array.isArray(device.users) ? device.users : []) {
    if (!u || typeof u.user !== 'string' || u.user === me) {
      continue;
    }
    const e = entry(u.user);
    e.mb += Math.max(0, Number(u.allocated_mb) || 0);
    e.runs += Math.max(0, Number(u.runs) || 0);
    e.leases += Math.max(0, Number(u.leases) || 0);
    e.models += Math.max(0, Number(u.models) || 0);
  }
  for (const p of Array.isArray(device.unmanaged_processes)
    ? device.unmanaged_processes
    : []) {
    if (isOtherUsers(p, me)) {
      entry(p.user).outsideMb += Math.max(0, Number(p.used_mb) || 0);
    }
  }
  return [...per.values()]
    .filter(e => e.mb > 0 || e.outsideMb > 0)
    .sort(
      (a, b) =>
        b.mb + b.outsideMb - (a.mb + a.outsideMb) ||
        (a.user < b.user ? -1 : a.user > b.user ? 1 : 0)
    );
}

/** How a GPU's bar is divided, in MB (every figure ≥ 0). */
export interface IDeviceGeometry {
  baseline: number;
  usable: number;
  free: number;
  runs: ILedgerRun[];
  leases: ILedgerLease[];
  /** Runs and leases, or the server's allocated_mb when larger (an exclusive holder). */
  allocated: number;
  /** What an exclusive holder takes beyond what it declared. */
  exclusiveExtra: number;
  /** What lease holders use beyond their leases. */
  overSum: number;
  /** Other users of a shared host: their grants and processes, by user name. */
  others: IOtherUser[];
  /** Their grants on this GPU, all together. */
  othersMb: number;
  /** Processes outside the scheduler, per holder (other users' by user name). */
  groups: IUnmanagedGroup[];
  /** The server's unmanaged_mb. */
  reported: number;
  /** Unmanaged VRAM the server does not itemise (an older server). */
  unmanagedRest: number;
  unmanaged: number;
  /** Unmanaged VRAM of notebook kernels, of other users' processes, and of every other process. */
  kernelMb: number;
  userMb: number;
  otherMb: number;
  /** The bar's full width. */
  scale: number;
  /** Reserved or otherwise unusable. */
  reserved: number;
}

/**
 * `me`: this server's user on a host shared through a host ledger (`host_ledger.user` of
 * `GET /evalsched/status`); null without one.
 */
export function deviceGeometry(
  device: ILedgerDevice,
  me: string | null = null
): IDeviceGeometry {
  const baseline = Math.max(0, device.baseline_mb);
  const usable = Math.max(0, device.usable_mb);
  const free = Math.max(0, device.free_mb);
  const runs = device.runs ?? [];
  const leases = Array.isArray(device.leases) ? device.leases : [];
  const runsSum = runs.reduce((a, r) => a + Math.max(0, r.marginal_vram_mb), 0);
  const leaseSum = leases.reduce((a, l) => a + Math.max(0, l.vram_mb), 0);
  // A ledger that lists `models` counts the loaded shared models (baseline_mb) in allocated_mb,
  // not off usable_mb: they are drawn as the baseline segment, once.
  const modelsHeld = Array.isArray(device.models);
  // An exclusive holder allocates the whole usable memory, more than it declared.
  const allocated = Math.max(
    0,
    device.allocated_mb - (modelsHeld ? baseline : 0),
    runsSum + leaseSum
  );
  const exclusiveExtra = Math.max(0, allocated - runsSum - leaseSum);
  // Unmanaged VRAM, per holder: what leases' processes use beyond their lease (drawn beside
  // each lease), processes without a lease grouped by notebook (kernels) or by pid, and any
  // rest the server does not itemise (an older server).
  const overSum = leases.reduce(
    (a, l) => a + Math.max(0, l.over_lease_mb ?? 0),
    0
  );
  // A process within a lease on this GPU is the lease's (its excess is drawn beside it); one
  // whose lease is on other GPUs holds what it uses here outside of any lease.
  const leased = new Set(leases.map(l => l.id));
  const groups = unmanagedGroups(
    (Array.isArray(device.unmanaged_processes)
      ? device.unmanaged_processes
      : []
    ).filter(p => !p.lease_id || !leased.has(p.lease_id)),
    me
  );
  // Other users' grants: not in allocated_mb (this user's own), taken off free_mb.
  const others = otherUsers(device, me);
  const othersMb = others.reduce((a, u) => a + u.mb, 0);
  const groupSum = groups.reduce((a, g) => a + g.mb, 0);
  const reported = Math.max(0, device.unmanaged_mb ?? 0);
  const unmanagedRest = Math.max(0, reported - overSum - groupSum);
  const unmanaged = Math.max(reported, overSum + groupSum);
  const scale = Math.max(
    device.total_mb,
    (modelsHeld ? 0 : baseline) + usable,
    baseline + allocated + othersMb + unmanaged + free,
    1
  );
  const sumOf = (kind: IUnmanagedGroup['kind']) =>
    groups.filter(g => g.kind === kind).reduce((a, g) => a + g.mb, 0);
  const kernelMb = sumOf('kernel');
  const userMb = sumOf('user');
  return {
    baseline,
    usable,
    free,
    runs,
    leases,
    allocated,
    exclusiveExtra,
    overSum,
    others,
    othersMb,
    groups,
    reported,
    unmanagedRest,
    unmanaged,
    kernelMb,
    userMb,
    otherMb: unmanaged - overSum - kernelMb - userMb,
    scale,
    reserved: scale - baseline - allocated - othersMb - unmanaged - free
  };
}

/**
 * The colour slot of every run holding memory on the ledger: its id's hash (`colorSlot`), the
 * rule of the notebook widget too (`color_slot` in widget.py), so a run has one colour in both.
 * Two runs may share a colour: their segments are labelled and listed in the legend by name.
 * Updates `colors`.
 */
export function assignColors(
  colors: Map<string, number>,
  ledger: ILedger | null,
  slots = COLOR_SLOTS
): void {
  colors.clear();
  for (const device of ledger?.devices ?? []) {
    for (const run of device.runs ?? []) {
      colors.set(run.id, colorSlot(run.id, slots));
    }
  }
}
