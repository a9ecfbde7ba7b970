"""Red-team holes in what a run hands to CI (issue 23, item 6): control characters in a
record must not make the JUnit XML unparseable."""
import xml.etree.ElementTree as ET

import pytest

from ep_harness.reports.ci_outputs import junit_xml
from tests.test_reports import record

HOSTILE = "boom \x1b[31mred\x1b[0m \x00nul \x07bell \x08 \x0b\x0c \x1f \ud800 \ufffe end"


@pytest.mark.parametrize("status", ["unexpected", "error", "vacuous", "interrupted"])
def test_control_characters_in_a_record_leave_the_junit_xml_parseable(tmp_path, status):
    recs = [record("c\x01/rank-invariance", case="c\x02", status=status, held=False, mismatched=3, total=8,
                   reason=HOSTILE, rerun="ep-harness verify --check c\x03"), record("fine")]
    path = tmp_path / "junit.xml"
    path.write_text(junit_xml(recs, "run\x04"), encoding="utf-8")  # a lone surrogate would not even encode
    suite = ET.parse(path).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["c\\x01/rank-invariance", "fine"]
    [outcome] = [child for child in cases[0]]
    message = outcome.get("message")
    # every illegal character is shown, escaped, and the legal text around it is kept
    assert "\\x1b[31mred" in message and "\\x00nul" in message and "\\ud800" in message and message.endswith(" end")
    assert "\\x0b\\x0c" in message and "\\ufffe" in message


def test_tabs_and_newlines_stay_as_they_are():
    text = junit_xml([record("a", status="error", reason="line one\n\tline two", held=None, mismatched=None)], "r")
    error = ET.fromstring(text).find("testsuite/testcase/error")
    assert error.get("message") == "line one\n\tline two" and error.text.startswith("line one\n\tline two\nRerun:")
