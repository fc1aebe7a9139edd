"""A stand-in ``sacct`` for tests without SLURM's accounting: it prints the records it was
given, each with the fields asked for (``-o``) in the order asked, as ``--parsable2`` does
(a field a record lacks is empty), and writes its arguments to a file."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

_SCRIPT = """\
import json, sys
args = sys.argv[1:]
with open({argv_log!r}, "w") as f:
    f.write(" ".join(args) + "\\n")
fields = args[args.index("-o") + 1].split(",")
for record in json.loads({records!r}):
    print("|".join(record.get(name, "") for name in fields))
"""


def install(bin_dir: Path, records: Sequence[Mapping[str, str]]) -> Path:
    """Write ``bin_dir/sacct`` printing ``records``; return the file it writes its arguments to
    (put ``bin_dir`` first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    argv_log = bin_dir / "sacct.argv"
    script = _SCRIPT.format(argv_log=str(argv_log), records=json.dumps(list(map(dict, records))))
    (bin_dir / "sacct").write_text(f"#!{sys.executable}\n{script}")
    (bin_dir / "sacct").chmod(0o755)
    return argv_log
