"""What the GPU check's test section covered, from pytest's JUnit XML: every gpu-marked case by
test and parameters (the kernel, its shape, the dtype), passed, failed or skipped (with why).

    python bench/gpu/covered.py gpu_tests.xml --out results.md

Appends a Markdown section to --out (and prints it): one line per test function with its
counts, then the cases themselves, so a GPU run leaves the list of what it checked. Exit
status 1 where a case failed or none ran.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def cases(path: str) -> list[tuple[str, str, str, str]]:
    """(module, test, parameters, outcome) of each test case in the report; outcome is
    'passed', 'failed', or 'skipped: reason'."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "")
        test, _, params = name.partition("[")
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped: " + (child.get("message") or "").strip()
        out.append((module, test, params.rstrip("]"), outcome))
    return out


def section(rows: list[tuple[str, str, str, str]]) -> str:
    by_test: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for module, test, params, outcome in rows:
        by_test[(module, test)].append((params, outcome))
    total = {k: sum(1 for r in rows if r[3].split(":")[0] == k) for k in ("passed", "failed", "skipped")}
    lines = ["#### Kernels covered (the gpu-marked tests)", "",
             f"{len(rows)} cases: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped.", "",
             "| module | test | passed | failed | skipped |", "|---|---|---|---|---|"]
    for (module, test), got in by_test.items():
        count = {k: sum(1 for _, o in got if o.split(":")[0] == k) for k in ("passed", "failed", "skipped")}
        lines.append(f"| {module} | {test} | {count['passed']} | {count['failed']} | {count['skipped']} |")
    lines += ["", "<details><summary>every case</summary>", "", "```"]
    for (module, test), got in by_test.items():
        for params, outcome in got:
            lines.append(f"{outcome[:60]:<8}  {module}::{test}[{params}]")
    lines += ["```", "", "</details>", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("xml")
    ap.add_argument("--out", default=None, help="append the section to this Markdown file")
    args = ap.parse_args()
    try:
        rows = cases(args.xml)
    except (OSError, ET.ParseError) as e:
        text = f"#### Kernels covered\n\nno test report ({e}): the test section did not finish\n"
        rows = []
    else:
        text = section(rows)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    passed = sum(1 for r in rows if r[3] == "passed")
    return 0 if passed and not any(r[3] == "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
