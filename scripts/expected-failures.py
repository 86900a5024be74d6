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
summary.txt prints them). A kind followed by `,may-pass` (`by-design,may-pass`)
marks a spec that fails only under conditions the run does not control,
and the reason says which. LABEL prefixes every line (default
"conformance STAGE1").

Exit status 1 when a spec failed that LIST does not expect for STAGE1, or
when a spec LIST expects to fail passed (the entry is stale: remove it, or
narrow its stage1s), unless its entry is may-pass: such a pass is printed,
without failing.
"""
import json
import re
import sys
import xml.etree.ElementTree as ET


KINDS = ("by-design", "environment", "pending")
MAY_PASS = "may-pass"


class Entry:
    """One line of LIST: a spec a stage1 is expected to fail."""

    def __init__(self, kind, reason, may_pass, where):
        self.kind, self.reason, self.may_pass, self.where = kind, reason, may_pass, where


def parse_kind(field):
    """Returns (kind, may_pass) of LIST's kind field, or None when it is bad."""
    words = [w.strip() for w in field.split(",")]
    if words[0] not in KINDS or any(w != MAY_PASS for w in words[1:]) or len(words) > 2:
        return None
    return words[0], len(words) == 2


def load(path, stage1):
    expected = {}
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(" | ")]
        kind = parse_kind(parts[1]) if len(parts) == 4 else None
        if kind is None or not parts[2] or not parts[3]:
            sys.exit(f"{path}:{n}: want `stage1s | {'|'.join(KINDS)}[,{MAY_PASS}] | spec | reason`")
        stage1s, _, spec, reason = parts
        if stage1s == "*" or stage1 in stage1s.split(","):
            expected[spec] = Entry(kind[0], reason, kind[1], f"{path}:{n}")
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
        names = sorted(n for n, r in got.items() if r == "failed" and n in expected and expected[n].kind == kind)
        if names:
            print(f"{label}: {len(names)} expected failures ({kind}):")
            for n in names:
                print(f"    {n}\n      — {expected[n].reason}")
    passed = sorted(n for n in expected if got.get(n) == "passed")
    stale = [n for n in passed if not expected[n].may_pass]
    for n in passed:
        if expected[n].may_pass:
            print(f"{label}: listed as {expected[n].kind},{MAY_PASS} and passed this time: {n}")
    for n in sorted(n for n in expected if n not in got):
        print(f"{label}: listed but not run (renamed, or outside this run's focus): {n}")
    if unexpected:
        print(f"{label}: {len(unexpected)} unexpected failures:")
        for n in unexpected:
            print(f"    {n}")
    if stale:
        print(f"{label}: {len(stale)} specs listed as expected failures passed: remove their entries from {path}, "
              f"narrow their stage1s, or mark them {MAY_PASS} when they fail only sometimes:")
        for n in stale:
            print(f"    {n}\n      — {expected[n].where}: {expected[n].kind}")
    return 1 if unexpected or stale else 0


if __name__ == "__main__":
    sys.exit(main())
