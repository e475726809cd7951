import {
  assignColors,
  COLOR_SLOTS,
  deviceGeometry,
  otherUsers,
  unmanagedGroups
} from '../ledgerGeometry';
import { colorSlot } from '../format';
import { IUnmanagedProcess } from '../records';
import { device } from './fixtures';

function proc(fields: Partial<IUnmanagedProcess> & { pid: number }) {
  return {
    gpu: 0,
    used_mb: 0,
    name: '',
    kernel_id: null,
    session_path: null,
    lease_id: null,
    user: null,
    ...fields
  };
}

const lease = {
  pid: 10,
  label: 'nb',
  kernel_id: null,
  session_path: null,
  observed_mb: 0,
  over_lease_mb: 0
};

describe('deviceGeometry', () => {
  it('divides a bar into baseline, runs, leases, unmanaged, free and reserved', () => {
    const g = deviceGeometry(
      device({
        total_mb: 24000,
        baseline_mb: 2000,
        usable_mb: 21000,
        allocated_mb: 12000,
        free_mb: 6000,
        unmanaged_mb: 3000,
        runs: [{ id: 'r1', marginal_vram_mb: 8000 }],
        leases: [{ ...lease, id: 'l1', vram_mb: 4000, over_lease_mb: 1000 }],
        unmanaged_processes: [
          proc({ pid: 1, used_mb: 1500, session_path: 'a/x.ipynb' }),
          proc({ pid: 2, used_mb: 500 })
        ]
      })
    );
    expect(g.allocated).toBe(12000);
    expect(g.exclusiveExtra).toBe(0);
    expect(g.overSum).toBe(1000);
    expect(g.groups.map(x => [x.kind, x.holder, x.mb])).toEqual([
      ['kernel', 'x.ipynb', 1500],
      ['process', 'pid 2', 500]
    ]);
    expect(g.unmanaged).toBe(3000);
    expect(g.unmanagedRest).toBe(0);
    expect(g.kernelMb).toBe(1500);
    expect(g.otherMb).toBe(500);
    expect(g.scale).toBe(24000);
    // 24000 - 2000 - 12000 - 3000 - 6000
    expect(g.reserved).toBe(1000);
  });

  it("gives an exclusive holder the whole usable memory, and the server's rest to unmanaged", () => {
    const g = deviceGeometry(
      device({
        allocated_mb: 24000,
        free_mb: 0,
        unmanaged_mb: 700,
        exclusive: 'r1',
        runs: [{ id: 'r1', marginal_vram_mb: 10000 }]
      })
    );
    expect(g.exclusiveExtra).toBe(14000);
    expect(g.unmanagedRest).toBe(700);
    expect(g.scale).toBe(24700);
  });

  it('counts a process within a lease on this GPU as the lease’s', () => {
    const g = deviceGeometry(
      device({
        leases: [{ ...lease, id: 'l1', vram_mb: 4000 }],
        unmanaged_processes: [
          proc({ pid: 10, used_mb: 3000, lease_id: 'l1' }),
          proc({ pid: 11, used_mb: 900, lease_id: 'l-elsewhere' })
        ]
      })
    );
    expect(g.groups.map(x => [x.holder, x.mb, x.leaseIds])).toEqual([
      ['pid 11', 900, ['l-elsewhere']]
    ]);
  });

  it('never draws a negative segment', () => {
    const g = deviceGeometry(
      device({ total_mb: 0, usable_mb: -5, free_mb: -1, baseline_mb: -3 })
    );
    expect(g.baseline).toBe(0);
    expect(g.free).toBe(0);
    expect(g.scale).toBe(1);
  });
});

describe('unmanagedGroups', () => {
  it('groups by notebook, then kernel, else pid: notebooks first, then the largest', () => {
    const groups = unmanagedGroups([
      proc({ pid: 1, used_mb: 100 }),
      proc({ pid: 2, used_mb: 300, name: 'python' }),
      proc({ pid: 3, used_mb: 50, session_path: 'w/a.ipynb', kernel_id: 'k1' }),
      proc({ pid: 4, used_mb: 60, session_path: 'w/a.ipynb', kernel_id: 'k1' }),
      proc({ pid: 5, used_mb: 10, kernel_id: 'abcdef0123' }),
      proc({ pid: 6, used_mb: 0 })
    ]);
    expect(groups.map(g => [g.kind, g.holder, g.mb, g.pids])).toEqual([
      ['kernel', 'a.ipynb', 110, [3, 4]],
      ['kernel', 'kernel abcdef01', 10, [5]],
      ['process', 'pid 2', 300, [2]],
      ['process', 'pid 1', 100, [1]]
    ]);
    expect(groups[2].names).toEqual(['python']);
  });
});

describe('other users of a shared host (a host ledger)', () => {
  // alice's server: her run and notebook; bob and carol hold grants, and processes outside them.
  const shared = () =>
    device({
      total_mb: 48000,
      usable_mb: 48000,
      allocated_mb: 5000,
      unmanaged_mb: 3500,
      free_mb: 48000 - 5000 - 3500 - 17000,
      runs: [{ id: 'r1', marginal_vram_mb: 5000 }],
      users: [
        { user: 'bob', allocated_mb: 14000, runs: 2, leases: 1, models: 0 },
        { user: 'carol', allocated_mb: 3000, runs: 1, leases: 0, models: 1 }
      ],
      unmanaged_processes: [
        proc({
          pid: 1,
          used_mb: 1000,
          session_path: 'w/x.ipynb',
          user: 'alice'
        }),
        proc({ pid: 50, used_mb: 1500, user: 'bob' }),
        proc({ pid: 51, used_mb: 500, user: 'bob' }),
        proc({ pid: 60, used_mb: 500, user: 'carol' })
      ]
    });

  it("gives each other user's grants and processes their own share, by user name", () => {
    const g = deviceGeometry(shared(), 'alice');
    expect(
      g.others.map(o => [o.user, o.mb, o.runs, o.leases, o.outsideMb])
    ).toEqual([
      ['bob', 14000, 2, 1, 2000],
      ['carol', 3000, 1, 0, 500]
    ]);
    expect(g.othersMb).toBe(17000);
    expect(g.groups.map(x => [x.kind, x.holder, x.mb])).toEqual([
      ['kernel', 'x.ipynb', 1000],
      ['user', 'bob', 2000],
      ['user', 'carol', 500]
    ]);
    // Nothing of another user's process but its user and size: no command.
    expect(g.groups[1].names).toEqual([]);
    expect(g.kernelMb).toBe(1000);
    expect(g.userMb).toBe(2500);
    expect(g.otherMb).toBe(0);
    expect(g.allocated).toBe(5000);
    expect(g.free).toBe(22500);
    // The bar adds up: nothing of theirs is lumped into reserved.
    expect(g.scale).toBe(48000);
    expect(g.reserved).toBe(0);
  });

  it("shows other users' grants before this server's user is known, their processes by pid", () => {
    const g = deviceGeometry(shared(), null);
    expect(g.others.map(o => [o.user, o.mb, o.outsideMb])).toEqual([
      ['bob', 14000, 0],
      ['carol', 3000, 0]
    ]);
    expect(g.groups.map(x => [x.kind, x.holder])).toEqual([
      ['kernel', 'x.ipynb'],
      ['process', 'pid 50'],
      ['process', 'pid 51'],
      ['process', 'pid 60']
    ]);
    expect(g.reserved).toBe(0);
  });

  it('never counts this user as another, even when the ledger lists them', () => {
    const d = shared();
    d.users = [
      ...(d.users ?? []),
      { user: 'alice', allocated_mb: 9, runs: 1, leases: 0, models: 0 }
    ];
    expect(otherUsers(d, 'alice').map(o => o.user)).toEqual(['bob', 'carol']);
  });

  it('draws a ledger without a host ledger as before (no users, or none)', () => {
    const plain = {
      total_mb: 24000,
      usable_mb: 22000,
      allocated_mb: 8000,
      unmanaged_mb: 700,
      free_mb: 13300,
      runs: [{ id: 'r1', marginal_vram_mb: 8000 }],
      unmanaged_processes: [proc({ pid: 7, used_mb: 700 })]
    };
    const before = deviceGeometry(device(plain));
    expect(before.others).toEqual([]);
    expect(before.othersMb).toBe(0);
    expect(before.reserved).toBe(2000);
    expect(deviceGeometry(device({ ...plain, users: [] }), 'alice')).toEqual(
      before
    );
  });
});

describe('assignColors', () => {
  it('gives each run on the ledger the slot of its id, whatever else is there', () => {
    const colors = new Map<string, number>();
    const ledger = (ids: string[]) => ({
      devices: [device({ runs: ids.map(id => ({ id, marginal_vram_mb: 1 })) })],
      cpu_slots: { total: 4, allocated: 0 }
    });
    const ids = Array.from({ length: COLOR_SLOTS }, (_, i) => `r${i}`);
    assignColors(colors, ledger(ids));
    for (const id of ids) {
      expect(colors.get(id)).toBe(colorSlot(id, COLOR_SLOTS));
    }
    assignColors(colors, ledger(['r3', 'new']));
    expect(colors.get('r3')).toBe(colorSlot('r3', COLOR_SLOTS));
    expect(colors.has('r0')).toBe(false);
    assignColors(colors, null);
    expect(colors.size).toBe(0);
  });
});
