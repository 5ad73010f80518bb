"""Each context's own time slices on the GPU, from CUPTI's compute-engine context-switch records
(hack/gpu/gputrace.cu), and the part of each tenant's records inside them: its GPU time where
the driver time-slices contexts.

The switch records come on another clock than the kernel records: on H200 hosts they read
0.1 to a few ms late, and the difference grows by 3-14 microseconds a second. A kernel starts
and ends only while its context holds the compute engine, so the records themselves give the
shift, the same for every process on the GPU: the shift that puts the most of all tenants'
record starts and ends inside their own slices, found over the whole run by correlation on a
20 us grid, then for each second to the microsecond; then a line through those seconds. `fit`
says how well it fits (`outside`: the share of record starts and ends still outside their
slices after the shift).
"""

import numpy as np

WINDOW_NS = 1_000_000_000
# The correlation's grid and reach over the whole run; then each second is searched to the
# microsecond within NEAR_NS of it.
BIN_NS = 20_000
REACH_NS = 5_000_000_000
NEAR_NS = 400_000
# A second whose best shifts span more than this says little (one long slice, say).
INFORMATIVE_NS = 300_000
# Record starts and ends looked at per second, at most.
POINTS_PER_WINDOW = 6000
FOREVER = 1 << 62
# How far past the timed run a tenant's slices are kept in its results.
MARGIN_NS = 5_000_000_000
# Held intervals reaching past this (ns from the run's start) are open-ended: the context held
# the engine before its first switch record or after its last.
OPEN_NS = 100_000 * 1_000_000_000


def held_intervals(switches, ctx):
    """The intervals context `ctx` held the compute engine, from its switch-in (1) and
    switch-out (2) records [(ts, op, ctx)], open-ended (from 0, to FOREVER) where its first
    record is a switch-out or its last a switch-in; None where `ctx` has no record."""
    mine = sorted((ts, op) for ts, op, c in switches if c == ctx)
    if not mine:
        return None
    held, since = [], (0 if mine[0][1] == 2 else None)
    for ts, op in mine:
        if op == 1 and since is None:
            since = ts
        elif op == 2 and since is not None:
            held.append((since, ts))
            since = None
    if since is not None:
        held.append((since, FOREVER))
    return held


def intersect(a, b):
    """The intersection of two sorted lists of disjoint [start, end] intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, t = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if t > s:
            out.append([s, t])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def outside(points, starts, ends, shift):
    """How many of `points` + `shift` fall in no [starts[i], ends[i]] (sorted, disjoint)."""
    x = points + shift
    j = np.searchsorted(starts, x, side="right") - 1
    inside = (j >= 0) & (x <= ends[np.maximum(j, 0)])
    return len(x) - int(inside.sum())


class Tenant:
    """One tenant's record starts and ends and its closed slices (ns, numpy)."""

    def __init__(self, records, held):
        self.points = np.array(sorted(p for s, e in records for p in (s, e)), dtype=np.int64)
        closed = [(s, e) for s, e in held if -OPEN_NS < s and e < OPEN_NS]
        self.starts = np.array([s for s, _ in closed], dtype=np.int64)
        self.ends = np.array([e for _, e in closed], dtype=np.int64)

    def correlation(self, lo, n, size):
        """The correlation of this tenant's points with its slices on the grid from `lo`."""
        s = np.clip((self.starts - lo) // BIN_NS, 0, n)
        e = np.clip((self.ends - lo) // BIN_NS + 1, 0, n)
        edges = np.zeros(n + 1)
        np.add.at(edges, s, 1)
        np.add.at(edges, e, -1)
        held = (np.cumsum(edges)[:n] > 0).astype(float)
        at = np.zeros(n)
        p = self.points[::max(1, len(self.points) // (20 * POINTS_PER_WINDOW))]
        np.add.at(at, np.clip((p - lo) // BIN_NS, 0, n - 1), 1)
        # corr[k] = sum over t of at[t] * held[t + k], k modulo size
        return np.fft.irfft(np.conj(np.fft.rfft(at, size)) * np.fft.rfft(held, size), size)

    def window(self, lo, hi):
        """Its points in [lo, hi), at most POINTS_PER_WINDOW of them, evenly spread."""
        w = self.points[(self.points >= lo) & (self.points < hi)]
        return w[:: max(1, len(w) // POINTS_PER_WINDOW)]


def rough_shift(tenants):
    """The shift within +-REACH_NS that puts the most points inside their slices, to BIN_NS."""
    first = min(int(t.points[0]) for t in tenants)
    last = max(int(t.points[-1]) for t in tenants)
    lo = first - REACH_NS
    n = (last + REACH_NS - lo) // BIN_NS + 1
    size = 1 << int(np.ceil(np.log2(2 * n)))
    corr = sum(t.correlation(lo, n, size) for t in tenants)
    reach = REACH_NS // BIN_NS
    lags = np.concatenate([np.arange(0, reach + 1), np.arange(-reach, 0)])
    vals = np.concatenate([corr[: reach + 1], corr[size - reach:]])
    return int(lags[int(np.argmax(vals))]) * BIN_NS


def fit_shift(tenants):
    """The shift of the switch records' clock against the records' (ns, added to a record's
    time) as a line: (shift_at(t), details)."""
    tenants = [t for t in tenants if len(t.points) and len(t.starts)]
    if not tenants:
        return (lambda t: 0), {"windows": 0}
    around = rough_shift(tenants)
    tried = np.arange(around - NEAR_NS, around + NEAR_NS + 1, 1_000)
    first = min(int(t.points[0]) for t in tenants)
    last = max(int(t.points[-1]) for t in tenants)
    windows = []
    for lo in range(first, last + 1, WINDOW_NS):
        counts, points = np.zeros(len(tried)), 0
        for t in tenants:
            w = t.window(lo, lo + WINDOW_NS)
            counts += [outside(w, t.starts, t.ends, s) for s in tried]
            points += len(w)
        if points < 20:
            continue
        good = tried[counts == counts.min()]
        windows.append((lo + WINDOW_NS // 2, (int(good.min()) + int(good.max())) // 2,
                        int(good.max() - good.min())))
    useful = [w for w in windows if w[2] <= INFORMATIVE_NS]
    if len(useful) >= 3 and useful[-1][0] - useful[0][0] >= 2 * WINDOW_NS:
        ts = np.array([w[0] for w in useful], dtype=np.float64)
        weights = 1.0 / (np.array([w[2] for w in useful], dtype=np.float64) + 10_000)
        slope, at0 = np.polyfit(ts - ts[0], [w[1] for w in useful], 1, w=np.sqrt(weights))
        t0 = ts[0]
    else:
        slope, at0, t0 = 0.0, float(around), 0.0

    def shift_at(t):
        return int(at0 + slope * (t - t0))

    return shift_at, {"windows": len(windows), "informative": len(useful),
                      "shift_us": [round(shift_at(first) / 1e3, 1), round(shift_at(last) / 1e3, 1)]}


def to_ns(intervals):
    return [(int(round(s * 1e9)), int(round(e * 1e9))) for s, e in intervals]


def own_time(res):
    """For the tenants of one run (results by label, intervals in seconds from its start) that
    carry `held` (their slices on the switch records' clock): their `busy` records cut to their
    own slices, `held` moved onto the records' clock, `reading` "slices". Returns the fit, or
    None where no tenant carries slices."""
    sliced = {lbl: r for lbl, r in res.items() if r.get("held") and r.get("reading") != "slices"}
    if not sliced:
        return None
    records = {lbl: to_ns(r["busy"]) for lbl, r in sliced.items()}
    helds = {lbl: to_ns(r["held"]) for lbl, r in sliced.items()}
    tenants = {lbl: Tenant(records[lbl], helds[lbl]) for lbl in sliced}
    shift_at, fit = fit_shift(list(tenants.values()))
    out = total = 0
    for lbl, r in sliced.items():
        moved = [(s if s <= -OPEN_NS else s - shift_at(s), e if e >= OPEN_NS else e - shift_at(e))
                 for s, e in helds[lbl]]
        t = tenants[lbl]
        starts = np.array([s for s, _ in moved], dtype=np.int64)
        ends = np.array([e for _, e in moved], dtype=np.int64)
        out += outside(t.points, starts, ends, 0)
        total += len(t.points)
        own = intersect(records[lbl], moved)
        r["records_s"] = round(sum(e - s for s, e in records[lbl]) / 1e9, 4)
        # How long it held the engine in the timed run, busy or not.
        run_ns = int(r["seconds"] * 1e9)
        r["held_s"] = round(sum(e - s for s, e in intersect(moved, [(0, run_ns)])) / 1e9, 4)
        r["busy"] = [[round(s / 1e9, 7), round(e / 1e9, 7)] for s, e in own]
        r["reading"] = "slices"
        # Its slices on the records' clock, for what it held in each of its turns and co-holds
        # (mix.py); open ends cut to the run and a margin.
        lo, hi = -MARGIN_NS, run_ns + MARGIN_NS
        r["held"] = [[round(max(s, lo) / 1e9, 7), round(min(e, hi) / 1e9, 7)]
                     for s, e in moved if e > lo and s < hi]
    fit["outside"] = round(out / max(1, total), 5)
    for r in sliced.values():
        r["fit"] = fit
    return fit
