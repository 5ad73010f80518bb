"""mix.py's split of a tenant's turns from its co-holds, on a made-up gem-schd log.

    python3 -m unittest hack/gpu/test_mix.py
"""

import datetime
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mix  # noqa: E402

START = 1_800_000_000.0


def line(at, text):
    stamp = datetime.datetime.fromtimestamp(START + at, datetime.timezone.utc)
    return f"{stamp.strftime('%Y-%m-%dT%H:%M:%S.%f')}Z DEBUG gem_schd::daemon: {text}\n"


def grant(at, client, co):
    return line(at, f"grant client={client} quota_us=5000 usage_us=0 vt_us=0 conns=1 "
                    f"shared={str(co).lower()} co={str(co).lower()}")


class Holds(unittest.TestCase):
    def test_turns_and_co_holds_are_split_and_measured(self):
        log = [
            grant(3.000, "a", False),
            grant(3.002, "b", True),
            line(3.005, "renew conn=1 client=a burst_us=5000"),
            line(3.006, "release conn=1 client=a used_us=6000"),
            line(3.022, "release conn=2 client=b used_us=20000"),
            grant(3.030, "b", False),
            line(3.035, "release conn=2 client=b used_us=5000"),
            # A release with no grant before it (a reconnection's) ends no hold.
            line(3.040, "release conn=3 client=a used_us=0"),
            # Outside the window judged: left out.
            grant(13.9, "b", False),
            line(14.2, "release conn=2 client=b used_us=5000"),
        ]
        with tempfile.NamedTemporaryFile("w", suffix=".log") as f:
            f.writelines(log)
            f.flush()
            spans = mix.holds(f.name, 0)
        self.assertEqual([co for _, _, co in spans["b"]], [True, False, False])
        b = {"busy": [[3.002, 3.010], [3.031, 3.033]], "held": [[3.001, 3.012], [3.030, 3.036]]}
        mine = [(s - START, e - START, co) for s, e, co in spans["b"]]
        got = mix.hold_figures(b, mine, 2.0, 13.5)
        self.assertEqual(got["co_holds"]["n"], 1)
        self.assertAlmostEqual(got["co_holds"]["wall_s"], 0.020, places=4)
        self.assertAlmostEqual(got["co_holds"]["gpu_s"], 0.008, places=4)
        self.assertAlmostEqual(got["co_holds"]["held_s"], 0.010, places=4)
        self.assertEqual(got["turns"]["n"], 1)
        self.assertAlmostEqual(got["turns"]["wall_s"], 0.005, places=4)
        self.assertAlmostEqual(got["turns"]["gpu_s"], 0.002, places=4)
        self.assertAlmostEqual(got["turns"]["held_s"], 0.005, places=4)
        self.assertEqual([co for _, _, co in spans["a"]], [False])


if __name__ == "__main__":
    unittest.main()
