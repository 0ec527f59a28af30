"""bench/run.py end to end with tiny counts: real servers, real load, the full report.

No timing assertions: only that every workload ran against every server without errors
and the report has its rows. Without picows (the `bench` extra) the load generator uses
aiohttp and the picows baseline is left out, so this runs on a `.[dev]` install too.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
HAS_PICOWS = importlib.util.find_spec("picows") is not None
RPC_MESSAGES = 200  # the paged /v1/rpc session: small, so filling it takes well under 1 s


def run_quick(out: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(BENCH / "run.py"), "--quick", "--out", str(out)]
    command += ["--clients", "2", "--seconds", "0.5", "--idle", "200", "--repeat", "1"]
    command += ["--resume", "1000:2,10000:1", "--rpc-messages", str(RPC_MESSAGES)]
    command += ["--rpc-pages", "20", "--voice", "3:3", "--voice-seconds", "0.5"]
    return subprocess.run(command, capture_output=True, text=True, timeout=150, check=False)


def table_rows(report: str, heading: str) -> list[list[str]]:
    """The cells of each data row of the table(s) under `## heading`."""
    section = report.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    # Drop each table's header row and the separator row under it.
    return [
        row
        for index, row in enumerate(cells)
        if not set("".join(row)) <= set("-:")
        and not (index + 1 < len(cells) and set("".join(cells[index + 1])) <= set("-:"))
    ]


# Twice a quick run reported errors on a server (once on a quiet machine). One cause was
# found and fixed (an RPC send that overtook earlier ones still being archived dropped the
# session's backlog: the rpc_pages fill never settled, engine test
# `..._being_archived_waits_behind_them`); the report now names the workload with errors.
# Rerun at most twice until clean CI runs show no other cause.
@pytest.mark.flaky(reruns=2)
def test_quick_run_reports_every_workload_for_every_server(tmp_path: Path) -> None:
    out = tmp_path / "latest.md"
    finished = run_quick(out)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = out.read_text()
    assert report.strip() == finished.stdout.strip()  # printed and written alike

    results = {(row[0], row[1]): row[2:] for row in table_rows(report, "Results")}
    expected = [
        ("stream, 2 clients, 1 client process", "frames/s"),
        ("stream, 2 clients, 1 client process", "turns/s"),
        ("latency, 200 msg/s over 32 connections", "msg/s achieved"),
        ("latency, 200 msg/s over 32 connections", "send → first chunk p99, ms"),
        ("latency, 200 msg/s over 32 connections", "send → done p999, ms"),
        ("idle, 200 connections", "server RSS per connection, KiB"),
    ]
    assert set(expected) <= set(results)
    for portico, aiohttp, picows, *ratios in results.values():
        assert "—" not in (portico, aiohttp)
        # A ratio is left out only when the bare figure is zero: RSS may not grow at all
        # for a few hundred connections when the allocator reuses freed pages.
        assert ratios[0] != "—" or float(aiohttp.split()[0].replace(",", "")) == 0
        assert (picows != "—") is HAS_PICOWS

    diagnostics = {row[0]: row for row in table_rows(report, "Is the client the bottleneck?")}
    servers = {"portico", "aiohttp", "picows"} if HAS_PICOWS else {"portico", "aiohttp"}
    assert set(diagnostics) == servers
    # No errors. The count sums every workload's; the report names them, and the
    # progress log says what each step saw.
    assert all(row[-1] == "0" for row in diagnostics.values()), (
        report.split("## Is the client the bottleneck?", 1)[1],
        finished.stderr[-3000:],
    )

    # /v1/session: stream beside /ws, and resumes of both backlogs, all without errors.
    sessions = table_rows(report, "Resumable sessions (/v1/session, Portico only)")
    by_first = {row[0]: row for row in sessions}
    frames = by_first["frames/s"]
    assert "—" not in frames
    assert float(frames[3]) > 0  # /v1/session ÷ /ws
    for backlog in ("1,000", "10,000"):
        resume = by_first[backlog]
        assert resume[1] == str(2 if backlog == "1,000" else 1)  # resumes timed
        assert "n/a" not in resume  # every figure measured
        assert resume[-1] == "0"  # no errors

    # /v1/rpc: latency beside /ws on the same server, and pages of the filled session.
    rpc = {row[0]: row for row in table_rows(report, "RPC (/v1/rpc, Portico only)")}
    for figure in ("send → first chunk p99, ms", "send → turn end p99, ms"):
        assert "—" not in rpc[figure], rpc[figure]
        assert "n/a" not in rpc[figure], rpc[figure]
    for figure in ("send → reply p99, ms", "send → turn running p99, ms"):
        assert rpc[figure][1] not in ("—", "n/a"), rpc[figure]
    assert float(rpc["turns timed"][1]) > 0
    assert rpc["errors"][1:3] == ["0", "0"], rpc["errors"]  # /v1/rpc and /ws, same server
    (pages,) = [row for name, row in rpc.items() if name.endswith(" messages")]
    # The fill stops at its target or just past it (a turn adds two messages).
    assert int(pages[0].split()[0].replace(",", "")) >= RPC_MESSAGES, pages
    assert pages[3] == "20"  # pages timed
    assert "n/a" not in pages[4]
    assert pages[-1] == "0"  # no errors

    targets = {row[0]: row[1] for row in table_rows(report, "Targets")}
    assert any("0.80 × bare aiohttp" in target for target in targets)
    session_targets = [t for t in targets if "/v1/session" in t or "resume of 1,000" in t]
    assert len(session_targets) == 2
    assert all(targets[t] != "not measured" for t in session_targets)
    rpc_targets = [t for t in targets if "rpc send → first live chunk" in t or "50-message" in t]
    assert len(rpc_targets) == 2
    assert all(targets[t] not in ("not measured", "n/a") for t in rpc_targets), targets
    assert "PORTICO_RATE_LIMIT_MESSAGES" in report  # the lifted limits are disclosed

    # voice: 3 real-time callers on every server (the echo through Portico's scripted
    # duplex runtime and through the bare servers), then one step of 3 for Portico and
    # for the bare echoes (aiohttp, whose ceiling the targets compare, and picows, the
    # machine's floor, where installed).
    voice = table_rows(report, "Voice (/ws calls, issue 15)")
    relay = {row[0]: row[1:] for row in voice if not row[0][0].isdigit()}
    for figure in ("echo p50, ms", "echo p99, ms"):
        assert "—" not in relay[figure][:2], relay
        assert "n/a" not in relay[figure], relay
    assert relay["errors"][:2] == ["0", "0"], relay
    assert relay["frames lost"][:2] == ["0", "0"], relay
    steps = {row[1]: row for row in voice if row[0] == "3"}
    assert set(steps) == servers
    assert all(float(step[2].replace(",", "")) > 0 for step in steps.values())  # frames/s
    assert any("voice relay p99" in target for target in targets)
    (against_bare,) = [t for t in targets if "Portico ÷ the bare aiohttp echo" in t]
    assert targets[against_bare] != "not measured", targets


def test_the_grpc_workload_runs_both_runtimes_and_reports_its_rows(tmp_path: Path) -> None:
    """bench/run_grpc.py: the scripted runtime and an SDK agent behind runtime: grpc."""
    out = tmp_path / "grpc.md"
    command = [sys.executable, str(BENCH / "run_grpc.py"), "--quick", "--out", str(out)]
    command += ["--clients", "2", "--seconds", "0.3", "--repeat", "1"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=100, check=False)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = out.read_text()
    assert report.strip() == finished.stdout.strip()
    heading = "Bring your own agent: `runtime: grpc` (bench/run_grpc.py)"
    rows = {row[0]: row[1:] for row in table_rows(report, heading)}
    turns = "/ws stream, turns/s (50 chunks' text each)"
    for name in (turns, "/ws stream, frames/s", "first chunk p99 at 200/s, ms"):
        scripted, grpc, _ = rows[name]
        assert min(float(scripted), float(grpc)) > 0, rows
    _, bare, _ = rows["bare grpc.aio write -> first chunk at 200/s, p50 / p99 ms"]
    assert min(float(figure) for figure in bare.split(" / ")) > 0, rows
    assert "Errors: 0." in report
