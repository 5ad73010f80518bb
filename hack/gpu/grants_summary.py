"""Per hooked process: grants, quota, wait and reported overuse (drain) from bench.log (debug);
the turn is a grant plus the overuse reported with the next request (the drain past it)."""
import re, sys, collections
pat = re.compile(r"\[gemhook (\d+) [^\]]*\] device \d+: granted (\d+) µs after waiting (\d+) µs \(reported overuse (\d+) µs\)")
d = collections.defaultdict(lambda: {"q": [], "w": [], "o": []})
idle = collections.Counter()
for line in open(sys.argv[1], errors="replace"):
    m = pat.search(line)
    if m:
        p = d[m.group(1)]
        p["q"].append(int(m.group(2))); p["w"].append(int(m.group(3))); p["o"].append(int(m.group(4)))
    elif "idle, released" in line:
        idle[re.search(r"\[gemhook (\d+)", line).group(1)] += 1
def pct(v, q):
    v = sorted(v); return v[min(len(v) - 1, int(q * len(v)))] if v else None
for pid, p in d.items():
    if len(p["q"]) < 20:
        continue
    print(pid, "grants", len(p["q"]), "idle releases", idle[pid],
          "quota p50/p90", pct(p["q"], .5), pct(p["q"], .9),
          "wait p50/p99/max", pct(p["w"], .5), pct(p["w"], .99), max(p["w"]),
          "overuse p50/p90/max", pct(p["o"], .5), pct(p["o"], .9), max(p["o"]),
          "turn p50/p90/p99", *(pct([q + o for q, o in zip(p["q"], p["o"][1:])], x) for x in (.5, .9, .99)))
