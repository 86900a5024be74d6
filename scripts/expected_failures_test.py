#!/usr/bin/env python3
"""Tests of expected-failures.py on small reports and lists: which runs
it fails, and what it says. Run by `make test` and `make unit`:

    python3 -B -m unittest discover -s scripts -p '*_test.py'
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected-failures.py")

FLAKY = "[k8s.io] Container runtime should support execSync with timeout [Conformance]"
HOST_PID = "[k8s.io] Security Context NamespaceOption runtime should support HostPID"
MOUNTS = "[k8s.io] Container Mount Readonly runtime should support recursive readonly mounts"
OTHER = "[k8s.io] Image Manager runtime should support pulling an image"

LIST = f"""# a comment, then a blank line

fly | by-design,may-pass | {FLAKY} | passes on a host that runs no sleep
kvm | by-design | {HOST_PID} | a VM has its own PID namespace
* | pending | {MOUNTS} | not done yet
"""


def junit(results):
    """A critest junit report: spec name -> passed, failed or skipped."""
    cases = []
    for name, r in results.items():
        body = {"passed": "", "failed": "<failure>boom</failure>", "skipped": "<skipped/>"}[r]
        cases.append(f'<testcase name="[It] {name}" status="{r}">{body}</testcase>')
    return f'<?xml version="1.0"?><testsuites><testsuite>{"".join(cases)}</testsuite></testsuites>'


def ginkgo(results, suite_node=None):
    """A ginkgo JSON report: spec name (container texts and the leaf's
    text) -> state; suite_node adds a BeforeSuite in that state."""
    specs = []
    for name, state in results.items():
        container, leaf = name.rsplit(" ", 1)
        specs.append({"LeafNodeType": "It", "ContainerHierarchyTexts": [container], "LeafNodeText": leaf, "State": state})
    if suite_node:
        specs.append({"LeafNodeType": "BeforeSuite", "State": suite_node})
    return json.dumps([{"SpecReports": specs}])


class ExpectedFailures(unittest.TestCase):
    def setUp(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        self.dir = d.name
        self.list = self.write("expected-failures.txt", LIST)

    def write(self, name, text):
        path = os.path.join(self.dir, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def run_script(self, stage1, report, name="junit.xml", listpath=None):
        path = self.write(name, report)
        p = subprocess.run([sys.executable, SCRIPT, listpath or self.list, stage1, path],
                           capture_output=True, text=True, timeout=60)
        return p.returncode, p.stdout + p.stderr

    def test_expected_failures_pass_the_run(self):
        rc, out = self.run_script("kvm", junit({HOST_PID: "failed", MOUNTS: "failed", OTHER: "passed"}))
        self.assertEqual(rc, 0, out)
        self.assertIn("conformance kvm: 1 expected failures (by-design):", out)
        self.assertIn("conformance kvm: 1 expected failures (pending):", out)
        self.assertIn("a VM has its own PID namespace", out)

    def test_unexpected_failure_fails_the_run(self):
        rc, out = self.run_script("kvm", junit({HOST_PID: "failed", MOUNTS: "failed", OTHER: "failed"}))
        self.assertEqual(rc, 1, out)
        self.assertIn("conformance kvm: 1 unexpected failures:", out)
        self.assertIn(OTHER, out)

    def test_listed_spec_that_passed_fails_the_run(self):
        rc, out = self.run_script("kvm", junit({HOST_PID: "passed", MOUNTS: "failed"}))
        self.assertEqual(rc, 1, out)
        self.assertIn("1 specs listed as expected failures passed", out)
        self.assertIn(f"remove their entries from {self.list}", out)
        self.assertIn(HOST_PID, out)
        self.assertIn(f"{self.list}:4: by-design", out)
        self.assertNotIn("unexpected failures", out)

    def test_entry_for_every_stage1_that_passed_fails_the_run(self):
        rc, out = self.run_script("nspawn", junit({MOUNTS: "passed"}))
        self.assertEqual(rc, 1, out)
        self.assertIn(f"{self.list}:5: pending", out)

    def test_may_pass_entry_that_passed_is_printed_only(self):
        rc, out = self.run_script("fly", junit({FLAKY: "passed", MOUNTS: "failed"}))
        self.assertEqual(rc, 0, out)
        self.assertIn(f"conformance fly: listed as by-design,may-pass and passed this time: {FLAKY}", out)
        rc, out = self.run_script("fly", junit({FLAKY: "failed", MOUNTS: "failed"}))
        self.assertEqual(rc, 0, out)
        self.assertIn("conformance fly: 1 expected failures (by-design):", out)

    def test_entry_of_another_stage1_does_not_apply(self):
        rc, out = self.run_script("nspawn", junit({HOST_PID: "passed", FLAKY: "failed", MOUNTS: "failed"}))
        self.assertEqual(rc, 1, out)
        self.assertIn("1 unexpected failures:", out)
        self.assertIn(FLAKY, out)
        self.assertNotIn("listed as expected failures passed", out)

    def test_listed_spec_skipped_or_not_run(self):
        rc, out = self.run_script("kvm", junit({HOST_PID: "skipped"}))
        self.assertEqual(rc, 0, out)
        self.assertIn(f"listed but not run (renamed, or outside this run's focus): {MOUNTS}", out)

    def test_ginkgo_report(self):
        report = ginkgo({HOST_PID: "passed", MOUNTS: "failed", OTHER: "passed"})
        rc, out = self.run_script("kvm", report, name="report.json")
        self.assertEqual(rc, 1, out)
        self.assertIn(f"{self.list}:4: by-design", out)
        rc, out = self.run_script("kvm/default", report, name="report.json")
        self.assertEqual(rc, 0, out)
        rc, out = self.run_script("kvm/default", ginkgo({MOUNTS: "failed"}, suite_node="failed"), name="report.json")
        self.assertEqual(rc, 1, out)
        self.assertIn("suite node BeforeSuite", out)

    def test_bad_list_lines(self):
        for line in (f"kvm | flaky | {HOST_PID} | why",
                     f"kvm | by-design,flaky | {HOST_PID} | why",
                     f"kvm | by-design,may-pass,may-pass | {HOST_PID} | why",
                     f"kvm | by-design | {HOST_PID} | ",
                     f"kvm | by-design | {HOST_PID}"):
            with self.subTest(line=line):
                bad = self.write("bad.txt", "# header\n" + line + "\n")
                rc, out = self.run_script("kvm", junit({HOST_PID: "failed"}), listpath=bad)
                self.assertNotEqual(rc, 0, out)
                self.assertIn(f"{bad}:2: want", out)

    def test_the_lists_parse(self):
        root = os.path.dirname(os.path.dirname(SCRIPT))
        for name in ("test/conformance/expected-failures.txt", "test/node-e2e/expected-failures.txt"):
            for stage1 in ("nspawn", "fly", "kvm", "kvm/default"):
                with self.subTest(list=name, stage1=stage1):
                    rc, out = self.run_script(stage1, junit({OTHER: "passed"}), listpath=os.path.join(root, name))
                    self.assertEqual(rc, 0, out)


if __name__ == "__main__":
    unittest.main()
