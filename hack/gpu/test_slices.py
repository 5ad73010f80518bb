"""slices.py against a made-up GPU whose truth is known: two contexts time-sliced, the switch
records on a clock that is ahead by a shift that drifts, as on H200 hosts.

    python3 -m unittest hack/gpu/test_slices.py     # needs numpy
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import slices  # noqa: E402
from share_bench import union  # noqa: E402

MS = 1_000_000
US = 1_000


def timeline(seconds):
    """A busy context `long` (kernels back to back, each preempted once by the other context)
    beside `short`, which every 2.48 ms is switched in for 74 us and runs one 12 us kernel
    30 us into it. Returns, in ns on the kernels' clock: each context's kernel records and the
    intervals it held the engine."""
    rec = {"long": [], "short": []}
    held = {"long": [], "short": []}
    t, end = 0, seconds * 1000 * MS
    while t < end:
        held["long"].append((t, t + 2 * MS + 326 * US - 80 * US))
        s = t + 2 * MS + 326 * US
        held["short"].append((s, s + 74 * US))
        rec["short"].append((s + 30 * US, s + 42 * US))
        t = s + 74 * US + 80 * US
    # A kernel starts and ends only while its context holds the engine: each one here ends
    # 1 ms into every second slice of `long`, and the next starts there.
    k = held["long"][0][0] + 10 * US
    for s, _ in held["long"][2::2]:
        rec["long"].append((k, s + MS))
        k = s + MS
    return rec, held


def drifting(at0, per_s):
    return lambda t: at0 + per_s * t // (1000 * MS)


class OwnTime(unittest.TestCase):
    def run_with(self, shift):
        rec, held = timeline(6)
        res = {}
        for lbl in rec:
            switched = [(s + shift(s), e + shift(e)) for s, e in held[lbl]]
            merged = union(rec[lbl])
            res[lbl] = {"busy": [[s / 1e9, e / 1e9] for s, e in merged],
                        "held": [[s / 1e9, e / 1e9] for s, e in switched], "seconds": 6}
        return rec, held, res, slices.own_time(res)

    def test_the_shift_is_found_and_each_context_keeps_its_own_time(self):
        shift = drifting(1500 * US, 10 * US)
        rec, held, res, fit = self.run_with(shift)
        self.assertEqual(fit["outside"], 0.0)
        self.assertAlmostEqual(fit["shift_us"][0], 1500.0, delta=25)
        self.assertAlmostEqual(fit["shift_us"][1], 1560.0, delta=25)
        short = sum(e - s for s, e in res["short"]["busy"])
        self.assertAlmostEqual(short, sum(e - s for s, e in rec["short"]) / 1e9, places=6)
        true_long = sum(e - s for s, e in slices.intersect(
            [[s, e] for s, e in rec["long"]], [[s, e] for s, e in held["long"]])) / 1e9
        self.assertAlmostEqual(sum(e - s for s, e in res["long"]["busy"]), true_long, delta=0.01)
        both = slices.intersect(res["long"]["busy"], res["short"]["busy"])
        self.assertLess(sum(e - s for s, e in both), 1e-4)

    def test_without_the_shift_the_records_would_not_fit(self):
        # What the test above guards against: read on their own clocks, the short context's
        # kernels fall outside its slices and both contexts claim the same time.
        rec, held = timeline(2)
        shift = drifting(1500 * US, 10 * US)
        t = slices.Tenant([(s, e) for s, e in rec["short"]],
                          [(s + shift(s), e + shift(e)) for s, e in held["short"]])
        self.assertEqual(slices.outside(t.points, t.starts, t.ends, 0), len(t.points))

    def test_a_large_offset_is_found_too(self):
        _, _, _, fit = self.run_with(drifting(-900 * MS, -3 * US))
        self.assertEqual(fit["outside"], 0.0)
        self.assertAlmostEqual(fit["shift_us"][0], -900_000.0, delta=25)


if __name__ == "__main__":
    unittest.main()
