"""mix.py's split of a tenant's turns from its co-holds, and its waits for the token, on a
made-up gem-schd log.

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


class Waits(unittest.TestCase):
    def test_each_wait_runs_from_the_first_waiting_request_to_the_grant(self):
        def waits(at, conn, client, repaying):
            return line(at, f"token request waits conn={conn} client={client} overuse_us=0 "
                            f"burst_us=5000 vt_us=0 repaying={str(repaying).lower()}")
        log = [
            # Before the window judged: left out, though granted inside it.
            waits(1.990, 1, "d", False),
            grant(2.001, "d", False),
            waits(3.000, 1, "d", False),
            # A second process of d waits too: the wait still runs from the first.
            waits(3.004, 2, "d", False),
            grant(3.012, "e", False),
            grant(3.015, "d", False),
            waits(3.020, 1, "d", True),
            grant(3.029, "d", True),
            # A request line without the field (an older gem-schd): not repaying.
            line(3.100, "token request waits conn=1 client=d overuse_us=0 burst_us=0 vt_us=0"),
            grant(3.1005, "d", False),
            # Still waiting at the end: not counted.
            waits(3.200, 1, "d", False),
        ]
        with tempfile.NamedTemporaryFile("w", suffix=".log") as f:
            f.writelines(log)
            f.flush()
            got = mix.turn_waits(f.name, 0, {"d": (START + 2.0, START + 13.5)})
        self.assertEqual(set(got), {"d"})
        d = got["d"]
        self.assertEqual(d["n"], 3)
        self.assertEqual(d["repaying"], 1)
        self.assertEqual(d["over_10ms"], 1)
        self.assertAlmostEqual(d["max_ms"], 15.0, places=1)
        self.assertAlmostEqual(d["p50_ms"], 9.0, places=1)


class OwnIdle(unittest.TestCase):
    def test_each_own_gap_is_placed_in_its_turn_by_its_last_grant(self):
        log = [
            grant(3.000, "a", False),
            line(3.005, "renew conn=1 client=a burst_us=5000"),
            grant(3.010, "b", False),
            grant(3.020, "a", False),
        ]
        with tempfile.NamedTemporaryFile("w", suffix=".log") as f:
            f.writelines(log)
            f.flush()
            grants, notice_after = mix.turn_grants(f.name, 0, ["a", "b"], START)
        self.assertEqual(len(grants["a"]), 2)
        for (t, q), want in zip(grants["a"], [3.0, 3.02]):
            self.assertAlmostEqual(t, want, places=5)
            self.assertEqual(q, 0.005)
        self.assertEqual(len(notice_after), 1)
        self.assertAlmostEqual(notice_after[0], 0.0, places=4)
        res = {
            # a: a gap 0.5 ms into its turn (0.2 ms), one 2 ms in (0.5 ms), one in its drain
            # 6 ms in (0.3 ms); then, in its next turn, a kernel to 180 ms past its grant and a
            # gap there (0.4 ms), with no grant in the 50 ms before.
            "a": {"busy": [[3.0001, 3.0005], [3.0007, 3.002], [3.0025, 3.006], [3.0063, 3.008],
                           [3.0201, 3.2], [3.2004, 3.201]]},
            # b's first kernel is a hand-over gap, not its own; then 0.1 ms of its own.
            "b": {"busy": [[3.0101, 3.012], [3.0121, 3.015]]},
        }
        got = mix.own_idle_in_turns(res, ["a", "b"], 3.0, 4.0, grants)
        self.assertAlmostEqual(got["a"]["first_ms"], 0.0002, places=6)
        self.assertAlmostEqual(got["a"]["in_quota"], 0.0005, places=6)
        self.assertAlmostEqual(got["a"]["past_quota"], 0.0003, places=6)
        self.assertAlmostEqual(got["a"]["without_grant"], 0.0004, places=6)
        self.assertAlmostEqual(got["b"]["in_quota"], 0.0001, places=6)
        self.assertEqual(got["b"]["first_ms"] + got["b"]["past_quota"], 0.0)
        own = mix.handovers(res, ["a", "b"], 3.0, 4.0)["idle_own_of"]
        for lbl in ("a", "b"):
            self.assertAlmostEqual(sum(got[lbl].values()), own[lbl], places=4)


class Engine(unittest.TestCase):
    def test_engine_time_above_the_wall_time_is_flagged(self):
        def busy(at, client, engine):
            return line(at, f"busy client={client} busy_us=100 held_us=5000 engine_us={engine} "
                            "fill=0.500 limit=500")
        log = [
            # a: 12 ms of engine time over 20 ms of reports; b: 2 s over 20 ms.
            busy(3.000, "a", 4000), busy(3.010, "a", 5000), busy(3.020, "a", 3000),
            busy(3.000, "b", 1000), busy(3.020, "b", 2_000_000),
            # Without engine time (a hook without CUPTI): no summary.
            line(3.005, "busy client=c busy_us=100 held_us=5000 fill=0.500 limit=500"),
        ]
        with tempfile.NamedTemporaryFile("w", suffix=".log") as f:
            f.writelines(log)
            f.flush()
            got = mix.fills(f.name, 0)
        self.assertEqual(got["a"]["engine"], {"reports": 3, "engine_s": 0.012, "span_s": 0.02,
                                              "largest_ms": 5.0, "above_wall": False})
        self.assertTrue(got["b"]["engine"]["above_wall"])
        self.assertNotIn("engine", got["c"])
        group = {"a": {"gpu": 0.2, "charged": 0.5}, "grants": got}
        self.assertEqual(mix.brief({"pair": group}),
                         ["pair: a 0.200 (0.500) | ENGINE TIME ABOVE WALL TIME: b"])


class Brief(unittest.TestCase):
    def test_a_line_per_group_of_tenants(self):
        holds = {"turns": {"n": 3}, "co_holds": {"n": 1}}
        table = {
            "_gpu": "GPU-x",
            "capped_elastic": {"gpt+decode": {
                "gpt": {"gpu": 0.25, "charged": 0.5, "steps_per_s": 21.5, "holds": holds,
                        "waits": {"n": 4, "max_ms": 12.25}},
                "decode": {"gpu": 0.3, "charged": 0.6, "lat_p99_ms": 2.5, "lat_max_ms": 11.4},
                "gpu_busy": 0.55, "gaps": {"switches_per_s": 200.0}}},
            "four": {"conv": {"gpu": 0.06, "charged": 0.1}, "gpu_busy": 0.88, "gaps": {}},
            "mps": {"error": "RuntimeError('no server')"},
            "targets": [{"row": "x"}],
        }
        self.assertEqual(mix.brief(table), [
            "capped_elastic gpt+decode: gpt 0.250 (0.500) 21.5/s co 1/4 wait max 12.2 ms"
            " | decode 0.300 (0.600) p99 2.50 max 11.4 ms | busy 0.550",
            "four: conv 0.060 (0.100) | busy 0.880",
            "mps: RuntimeError('no server')",
        ])


class RatesOnly(unittest.TestCase):
    def test_untraced_tenants_give_rates_and_no_targets(self):
        pair = {"gpt": {"gpu": 0.0, "min_5s": 0.0, "charged": 0.497, "steps_per_s": 23.6,
                        "request": 0.5, "limit": 0.5, "work": "gpt", "reading": "rates"},
                "decode": {"gpu": 0.0, "min_5s": 0.0, "charged": 0.6, "steps_per_s": 2500.0,
                           "lat_p99_ms": 2.5, "lat_max_ms": 11.4, "request": 0.5, "limit": 1.0,
                           "work": "decode", "reading": "rates"}}
        table = {"capped_elastic": {"gpt+decode": pair}}
        # Read as GPU time, the zeros would miss every floor.
        self.assertTrue(mix.targets(table))
        table["_reading"] = mix.RATES
        self.assertEqual(mix.targets(table), [])
        self.assertEqual(mix.brief(table), [
            "capped_elastic gpt+decode: gpt untraced (0.497) 23.6/s"
            " | decode untraced (0.600) p99 2.50 max 11.4 ms 2500/s",
        ])


if __name__ == "__main__":
    unittest.main()
