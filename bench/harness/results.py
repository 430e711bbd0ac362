"""What every saved result carries, and the one way results are saved.

Every experiment's JSON starts with the same provenance record: the commit it
ran at, the command that made it, when, and the machine as detected where it
ran (CPUs, memory, GPUs by name, platform), so a figure can be told apart from
a figure of another machine or another commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"
PROG = "python -m bench"
PROVENANCE_KEYS = ("commit", "command", "started", "machine")


def git_commit() -> str:
    """HEAD, with "-dirty" when tracked files differ from it; "unknown" outside a checkout."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_names() -> list[str]:
    """The GPUs of this machine by name: nvidia-smi's list where it is installed, else what a
    fresh Python process sees through torch.cuda (a subprocess, so that this process does not
    initialise CUDA before an experiment forks); [] for none."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            )
            if out.returncode == 0:
                return [line.strip() for line in out.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired):
            pass
    probe = (
        "import torch\nif torch.cuda.is_available():\n"
        "    print('\\n'.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))"
    )
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def detect_machine() -> dict:
    """The machine this process runs on, as detected now."""
    cpus = os.cpu_count() or 1
    memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    gpus = gpu_names()
    machine = {
        "cpus": cpus,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": memory_gib,
        "gpus": gpus,
        "platform": platform.platform(),
        "arch": platform.machine(),
        "python": platform.python_version(),
    }
    machine["description"] = describe(machine)
    return machine


def describe(machine: dict) -> str:
    """ "2-CPU x86_64 machine with 24 GiB, no GPU"; GPUs by name and count where there are any."""
    gpus = machine["gpus"]
    if gpus:
        counted = {name: gpus.count(name) for name in dict.fromkeys(gpus)}
        gpu_text = " + ".join(f"{n}× {name}" if n > 1 else name for name, n in counted.items())
    else:
        gpu_text = "no GPU"
    return f"{machine['cpus']}-CPU {machine['arch']} machine with {machine['memory_gib']:.0f} GiB, {gpu_text}"


def label(machine: dict | str) -> str:
    """A short label for plot titles: "2 CPUs, no GPU", "16 CPUs, NVIDIA H200" (a result saved
    before the machine was a record has a description string instead: that)."""
    if isinstance(machine, str):
        return machine
    return f"{machine['cpus']} CPUs, " + (", ".join(dict.fromkeys(machine["gpus"])) or "no GPU")


def command_line(experiment: str, argv: list[str]) -> str:
    """The command a user types to run `experiment` with these arguments again."""
    return " ".join([PROG, experiment, *map(shlex.quote, argv)])


def provenance(command: str) -> dict:
    """The record every results file starts with."""
    return {
        "commit": git_commit(),
        "command": command,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": detect_machine(),
    }


def save(run: dict, path: Path, markdown: str | None = None) -> Path:
    """Writes run as JSON to path (and markdown beside it as .md); the run must carry provenance()."""
    missing = [key for key in PROVENANCE_KEYS if key not in run]
    if missing:
        raise ValueError(f"results without provenance: {missing} missing")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=1) + "\n")
    if markdown is not None:
        path.with_suffix(".md").write_text(markdown)
    return path


def parser(experiment: str, doc: str | None) -> argparse.ArgumentParser:
    """An experiment's argument parser, named as it is run: `python -m bench <experiment>`."""
    return argparse.ArgumentParser(
        prog=f"{PROG} {experiment}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
