#!/usr/bin/env python3
"""Compares a suite's report with the specs a stage1 is expected to fail.

    expected-failures.py LIST STAGE1 REPORT [LABEL]

REPORT is a junit XML report (critest) or a ginkgo JSON report
(report.json of the node e2e suite). LIST has one spec per line:
`stage1s | kind | spec | reason`, where stage1s is a comma-separated list or
`*`, kind is `by-design`, `environment` (this kind of machine cannot
give what the spec checks, whatever the runtime) or `pending`, and spec is the spec's full name as
the suite reports it (critest: without the leading `[It]`; node e2e: the
container texts and the spec's text joined by spaces, as the kit's
summary.txt prints them). LABEL prefixes every line (default "conformance
STAGE1"). Exit status 1 when a spec failed that LIST does not expect for
STAGE1; specs LIST expects that passed are printed, without failing.
"""
import json
import re
import sys
import xml.etree.ElementTree as ET


KINDS = ("by-design", "environment", "pending")


def load(path, stage1):
    expected = {}
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ")]
        if len(parts) != 4 or parts[1] not in KINDS or not parts[3]:
            sys.exit(f"{path}:{n}: want `stage1s | {'|'.join(KINDS)} | spec | reason`")
        stage1s, kind, spec, reason = parts
        if stage1s == "*" or stage1 in stage1s.split(","):
            expected[spec] = (kind, reason)
    return expected


def junit_results(path):
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = re.sub(r"^\[[A-Za-z]+\] ", "", tc.get("name", ""))
        st = tc.get("status", "")
        if tc.find("skipped") is not None or st == "skipped":
            out[name] = "skipped"
        elif tc.find("failure") is not None or tc.find("error") is not None or st in ("failed", "panicked"):
            out[name] = "failed"
        else:
            out[name] = "passed"
    return out


def ginkgo_results(path):
    rep = json.load(open(path, encoding="utf-8"))
    out = {}
    for suite in rep if isinstance(rep, list) else [rep]:
        for s in suite.get("SpecReports") or []:
            if s.get("LeafNodeType") != "It":
                if s.get("State") not in ("passed", "skipped"):
                    # A failed BeforeSuite or AfterSuite fails the run.
                    out["suite node " + s.get("LeafNodeType", "")] = "failed"
                continue
            name = " ".join((s.get("ContainerHierarchyTexts") or []) + [s.get("LeafNodeText") or ""]).strip()
            state = s.get("State")
            if state == "passed":
                out[name] = "passed"
            elif state in ("skipped", "pending"):
                out[name] = "skipped"
            else:
                out[name] = "failed"
    return out


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    path, stage1, report = sys.argv[1:4]
    label = sys.argv[4] if len(sys.argv) > 4 else f"conformance {stage1}"
    expected = load(path, stage1)
    got = ginkgo_results(report) if report.endswith(".json") else junit_results(report)
    unexpected = sorted(n for n, r in got.items() if r == "failed" and n not in expected)
    for kind in KINDS:
        names = sorted(n for n, r in got.items() if r == "failed" and expected.get(n, ("",))[0] == kind)
        if names:
            print(f"{label}: {len(names)} expected failures ({kind}):")
            for n in names:
                print(f"    {n}\n      — {expected[n][1]}")
    for n in sorted(n for n in expected if got.get(n) == "passed"):
        print(f"{label}: listed as {expected[n][0]} but passed this time (remove it if it always does): {n}")
    for n in sorted(n for n in expected if n not in got):
        print(f"{label}: listed but not run (renamed, or outside this run's focus): {n}")
    if unexpected:
        print(f"{label}: {len(unexpected)} unexpected failures:")
        for n in unexpected:
            print(f"    {n}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
