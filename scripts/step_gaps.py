#!/usr/bin/env python3
"""The decode loop's host time between steps, from a decode server's side port: the mean
of pdserve_decode_step_gap_seconds, its parts (pdserve_decode_step_gap_part_seconds), the
share below 100 us (issue 19's target) and the mean batch, as one line.

    python3 scripts/step_gaps.py PORT "64 sessions" ["extra text for the line"]
"""
import sys
import urllib.request


def main():
    port, label = sys.argv[1], sys.argv[2]
    extra = sys.argv[3] if len(sys.argv) > 3 else ""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    def series(name, *labels):
        for line in text.splitlines():
            if line.startswith(name + "{") and all(l in line for l in labels):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    n = series("pdserve_decode_step_gap_seconds_count")
    mean = series("pdserve_decode_step_gap_seconds_sum") / max(n, 1) * 1e6
    under = series("pdserve_decode_step_gap_seconds_bucket", 'le="0.0001"') / max(n, 1) * 100

    def part_us(p):
        return series("pdserve_decode_step_gap_part_seconds_sum", 'part="%s"' % p) / max(n, 1) * 1e6

    parts = ", ".join(f"{p} {part_us(p):.1f}" for p in ("sample", "admit", "other"))
    batch = series("pdserve_decode_batch_size_sum") / max(series("pdserve_decode_batch_size_count"), 1)
    print(f"decode loop host time between steps, {label}: mean {mean:.1f} us ({parts}), "
          f"{under:.1f}% below 100 us over {n:.0f} gaps, mean batch {batch:.1f}{extra}")


if __name__ == "__main__":
    main()
