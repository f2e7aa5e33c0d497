"""Counts per mode, and the tests torch's FSDP2 passes and fsdp-rs does not,
each with its errors and the fsdp_rs frames of its traceback.

    python tools/upstream_fsdp2/report.py [OUT]   (default: upstream-out)
"""

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

_ERROR = re.compile(r"[A-Za-z_.]*(Error|Exception)\b")


def load(out: Path, mode: str) -> dict[str, tuple[str, str]]:
    results = {}
    for xml in sorted((out / mode).glob("*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            status, text = "PASS", ""
            for tag, name in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "SKIP")):
                node = case.find(tag)
                if node is not None:
                    status = name
                    text = f"{node.get('message') or ''}\n{node.text or ''}"
                    break
            results[f"{case.get('classname')}::{case.get('name')}"] = (status, text)
    return results


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "upstream-out")
    torch_, ours = load(out, "torch"), load(out, "fsdprs")
    for mode, res in (("torch", torch_), ("fsdprs", ours)):
        passed = sum(s == "PASS" for s, _ in res.values())
        print(f"{mode}: {passed} passed of {len(res)}")
    for test, (status, _) in torch_.items():
        ours_status, text = ours.get(test, ("MISSING", ""))
        if status != "PASS" or ours_status == "PASS":
            continue
        print(f"{ours_status} {test}")
        lines = [line.strip().lstrip("E").strip() for line in text.splitlines()]
        errors = dict.fromkeys(line for line in lines if _ERROR.match(line))
        frames = dict.fromkeys(line for line in lines if "fsdp_rs" in line and "File" in line)
        for line in list(errors)[:4]:
            print("   error:", line[:300])
        for line in list(frames)[-3:]:
            print("   at:", line[:300])


if __name__ == "__main__":
    main()
