#!/usr/bin/env python3
"""Compares a critest junit report with the specs a stage1 is expected to fail.

    conformance-check.py LIST STAGE1 JUNIT

LIST has one spec per line: `stage1s | kind | spec | reason`, where stage1s
is a comma-separated list or `*`, kind is `by-design` or `pending`, and spec
is the spec's full name as critest reports it (without the leading `[It]`).
Exit status 1 when a spec failed that LIST does not expect for STAGE1; specs
LIST expects that passed are printed, without failing.
"""
import re
import sys
import xml.etree.ElementTree as ET


def load(path, stage1):
    expected = {}
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ")]
        if len(parts) != 4 or parts[1] not in ("by-design", "pending") or not parts[3]:
            sys.exit(f"{path}:{n}: want `stage1s | by-design|pending | spec | reason`")
        stage1s, kind, spec, reason = parts
        if stage1s == "*" or stage1 in stage1s.split(","):
            expected[spec] = (kind, reason)
    return expected


def results(junit):
    out = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        name = re.sub(r"^\[[A-Za-z]+\] ", "", tc.get("name", ""))
        st = tc.get("status", "")
        if tc.find("skipped") is not None or st == "skipped":
            out[name] = "skipped"
        elif tc.find("failure") is not None or tc.find("error") is not None or st in ("failed", "panicked"):
            out[name] = "failed"
        else:
            out[name] = "passed"
    return out


def main():
    path, stage1, junit = sys.argv[1:4]
    expected = load(path, stage1)
    got = results(junit)
    unexpected = sorted(n for n, r in got.items() if r == "failed" and n not in expected)
    for kind in ("by-design", "pending"):
        names = sorted(n for n, r in got.items() if r == "failed" and expected.get(n, ("",))[0] == kind)
        if names:
            print(f"conformance {stage1}: {len(names)} expected failures ({kind}):")
            for n in names:
                print(f"    {n}\n      — {expected[n][1]}")
    for n in sorted(n for n in expected if got.get(n) == "passed"):
        print(f"conformance {stage1}: listed as {expected[n][0]} but passed this time (remove it if it always does): {n}")
    for n in sorted(n for n in expected if n not in got):
        print(f"conformance {stage1}: listed but not run (renamed?): {n}")
    if unexpected:
        print(f"conformance {stage1}: {len(unexpected)} unexpected failures:")
        for n in unexpected:
            print(f"    {n}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
