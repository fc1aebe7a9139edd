"""Browser tier: ``nvrx-report --format html`` as headless Chromium draws it.

The page of the standard job (2 nodes x 2 ranks, faults, a hang, a killed process:
``tests/unit/test_report_fixtures.py``) is screenshot and its rendered DOM dumped.
The screenshot (decoded here with zlib and struct) must not be blank and must show
4 lanes of the training colour; the DOM must hold 4 rank lanes, and following a
fault's link must open its traceback block (the page's few lines of script).

Chromium is installed by ``scripts/install_chromium.sh`` when the test runs as root
with apt-get (as CI does); elsewhere, without a Chromium on PATH, the tests skip
and say why.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import zlib
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from test_report_fixtures import JOB, write_standard_job  # noqa: E402

from nvrx.report.cli import main  # noqa: E402
from nvrx.report.html_timeline import COLOURS, FAULT_COLOUR  # noqa: E402

INSTALL = REPO / "scripts" / "install_chromium.sh"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
#: Tall enough for the first screen (the answer, the summary) and the timeline under it.
WINDOW = (1400, 1400)
RUN_TIMEOUT_S = 90.0
#: The install waits up to 20 min for another install's lock (scripts/install_chromium.sh).
INSTALL_TIMEOUT_S = 1500.0

# The first test's set-up may install Chromium: more than the tier's 300 s default.
pytestmark = [pytest.mark.browser, pytest.mark.timeout(INSTALL_TIMEOUT_S + 4 * RUN_TIMEOUT_S)]


def _hex(colour: str) -> bytes:
    return bytes.fromhex(colour.removeprefix("#"))


def _find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def chromium() -> str:
    """A headless Chromium: found on PATH, or installed when root with apt-get, else skip."""
    found = _find_browser()
    if found is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(
            "no headless Chromium on PATH (chromium, chromium-browser, google-chrome) and not "
            "root with apt-get to install it: run scripts/install_chromium.sh as root, or "
            "apt-get install chromium"
        )
    code, _, err = _group(["bash", str(INSTALL)], INSTALL_TIMEOUT_S)
    if code == 2:
        pytest.skip(f"cannot install Chromium here: {err.strip()}")
    assert code == 0, f"{INSTALL} exited {code}: {err.strip()}"
    found = _find_browser()
    assert found is not None, f"{INSTALL} succeeded, yet no chromium on PATH"
    return found


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("html")
    write_standard_job(base / JOB)
    out = base / "report.html"
    assert main([str(base / JOB), "--format", "html", "-o", str(out), "--no-sacct"]) == 0
    return out


def _group(cmd: list[str], timeout: float, leftovers: bool = False) -> tuple[int, str, str]:
    """Run ``cmd`` in its own process group: (exit code, stdout, stderr). On a timeout the
    whole group is killed and the test fails; with ``leftovers``, whatever the command left
    running in its group when it exited is killed too."""
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout:.0f} s")
    finally:
        if leftovers or proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def _run(chromium: str, profile: Path, *args: str) -> str:
    """Run headless Chromium (its own profile, so that parallel runs do not share one);
    its stdout. Its whole process group is killed after it, or on a timeout; its shared
    memory files go to the temporary directory, not /dev/shm, where a killed one stays."""
    cmd = [
        chromium, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
        "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}", *args,
    ]  # fmt: skip
    code, out, err = _group(cmd, RUN_TIMEOUT_S, leftovers=True)
    assert code == 0, f"{' '.join(cmd)} exited {code}: {err[-2000:]}"
    return out


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB or RGBA, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks = 8, []
    width = height = bpp = 0
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + size]
        pos += 12 + size
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            chunks.append(body)
    raw = zlib.decompress(b"".join(chunks))
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        rgb = bytes(line) if bpp == 3 else b"".join(line[i : i + 3] for i in range(0, stride, 4))
        rows.append(rgb)
    return width, height, rows


def _count(row: bytes, colour: bytes) -> int:
    return sum(1 for i in range(0, len(row), 3) if row[i : i + 3] == colour)


def _bands(rows: list[bytes], colour: bytes, min_pixels: int) -> list[tuple[int, int]]:
    """Runs of consecutive rows with at least ``min_pixels`` pixels of ``colour``: (first, last)."""
    bands: list[tuple[int, int]] = []
    for y, row in enumerate(rows):
        if row.count(colour) and _count(row, colour) >= min_pixels:
            if bands and bands[-1][1] == y - 1:
                bands[-1] = (bands[-1][0], y)
            else:
                bands.append((y, y))
    return bands


def test_browser_screenshot_shows_the_lanes(chromium: str, page: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    width, height = WINDOW
    _run(
        chromium, tmp_path / "profile", f"--screenshot={shot}", f"--window-size={width},{height}",
        page.as_uri(),
    )  # fmt: skip
    w, h, rows = decode_png(shot.read_bytes())
    assert (w, h) == WINDOW
    pixels = Counter(row[i : i + 3] for row in rows for i in range(0, len(row), 3))
    white = pixels[b"\xff\xff\xff"]
    assert len(pixels) >= 20, f"only {len(pixels)} colours: a blank page?"
    assert white < 0.95 * w * h, f"{white} of {w * h} pixels white: a blank page?"
    # 4 rank lanes: 4 bands of rows, each wide in the training colour (the legend's swatch is small)
    training = _hex(COLOURS["training"][0])
    lanes = [(a, b) for a, b in _bands(rows, training, 200) if b - a + 1 >= 10]
    assert len(lanes) == 4, f"training-coloured lanes at rows {lanes}"
    top, bottom = lanes[0][0], lanes[-1][1]
    lane_rows = rows[top : bottom + 1]
    for kind in ("restart", "dead"):  # 3 restarts on every lane; rank 1's killed process
        colour = _hex(COLOURS[kind][0])
        assert sum(_count(r, colour) for r in lane_rows) >= 20, f"no {kind} period drawn"
    # the first lane restarts 3 times: 3 runs of the restart colour along its middle row
    middle = rows[(lanes[0][0] + lanes[0][1]) // 2]
    restart = _hex(COLOURS["restart"][0])
    marks = "".join("1" if middle[i : i + 3] == restart else "0" for i in range(0, len(middle), 3))
    runs = re.findall("1+", marks)
    assert len(runs) == 3, f"{len(runs)} restart periods on rank 0's lane"
    assert sum(_count(r, _hex(FAULT_COLOUR)) for r in lane_rows) >= 4 * 20, "fault marks missing"


class _Dom(HTMLParser):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.lanes: list[str] = []
        self.details: dict[str, bool] = {}  # id -> open
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "g" and (found.get("class") or "").split() == ["lane"]:
            self.lanes.append(found.get("data-rank") or "?")
        if tag == "details" and found.get("id"):
            self.details[str(found["id"])] = "open" in found


def test_browser_dom_has_the_lanes_and_a_fault_link_opens_its_traceback(
    chromium: str, page: Path, tmp_path: Path
) -> None:
    dom = _Dom(_run(chromium, tmp_path / "profile", "--dump-dom", page.as_uri()))
    assert dom.lanes == ["0", "1", "2", "3"]
    faults = sorted(k for k in dom.details if k.startswith("fault-"))
    assert faults == [f"fault-{i}" for i in range(4)] and not any(dom.details.values())
    # followed to #fault-1, the page's script opens that block (and only it)
    opened = _Dom(_run(chromium, tmp_path / "profile2", "--dump-dom", page.as_uri() + "#fault-1"))
    assert [k for k, is_open in opened.details.items() if is_open] == ["fault-1"]
