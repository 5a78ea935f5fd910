"""With FSDP8_TEST_LOG=FILE, every test's outcome and time, and a failure's report, are
appended to FILE as each test ends: a run cut short by a time limit (the device machine's
call) still tells what failed and why, which pytest's end-of-run summary would not."""

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("FSDP8_TEST_LOG")
    # Under pytest-xdist the controller hears every worker's reports: write there only.
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or (report.when != "call" and not report.failed):
        return
    with open(path, "a") as f:
        f.write(f"{report.outcome.upper()} {report.nodeid} [{report.when}] {report.duration:.1f}s\n")
        if report.failed:
            f.write(report.longreprtext + "\n\n")
