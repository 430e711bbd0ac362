"""py-spy on every serving process of a system while one load point runs, summarised
as text: where each process spends its samples, self and inclusive, idle excluded.

Processes are found under the system's own process tree: Ray Serve replicas
(`ray::ServeReplica:<app>:<Deployment>`), vLLM engine cores and workers, and a
`vllm serve` server itself. Sampling costs CPU, so profile in a run of its own
(`python -m bench compare --profile`), never in the run whose figures are reported.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

_WANTED = re.compile(r"^(ray::ServeReplica:[^. ]+|VLLM::\w+|.*vllm\.entrypoints\.openai\.api_server)")


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        found[int(entry)] = (ppid, cmdline.strip())
    return found


def process_tree(roots: list[int]) -> dict[int, str]:
    """pid -> command line of these live roots and every process below them."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    tree, stack = {}, [pid for pid in roots if pid in procs]
    while stack:
        pid = stack.pop()
        if pid not in tree:
            tree[pid] = procs[pid][1]
            stack.extend(children.get(pid, []))
    return tree


def serving_processes(roots: list[int]) -> dict[str, int]:
    """A readable name -> pid for each serving process below these roots."""
    named = {}
    for pid, cmdline in process_tree(roots).items():
        m = _WANTED.match(cmdline)
        if m:
            name = m.group(1).removeprefix("ray::ServeReplica:").replace(":", "-")
            name = "vllm-api_server" if "api_server" in name else name
            while name in named:
                name += "+"
            named[name] = pid
    return named


class Profiler:
    def __init__(self, out_dir: Path, tag: str):
        self.out_dir, self.tag = out_dir, tag
        self.running: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, roots: list[int], label: str) -> None:
        py_spy = str(Path(sys.executable).parent / "py-spy")
        for name, pid in serving_processes(roots).items():
            raw = self.out_dir / f".pyspy-{self.tag}-{label}-{name}.txt"
            proc = subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    "100",
                    "--format",
                    "raw",
                    "--output",
                    str(raw),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                # py-spy writes its output on SIGINT, which background jobs ignore.
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
            self.running.append((f"{label}_{name}", proc, raw))

    def stop(self) -> list[Path]:
        written = []
        for label, proc, raw in self.running:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            if raw.exists():
                out = self.out_dir / f"profile_{self.tag}_{label}.txt"
                out.write_text(summarise(raw.read_text()))
                raw.unlink()
                written.append(out)
        self.running = []
        return written


def summarise(collapsed: str, top: int = 25) -> str:
    """Self and inclusive shares per function from py-spy's collapsed stacks."""
    own, incl, total = Counter(), Counter(), 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            incl[frame] += n
    lines = [f"samples (100 Hz, active only): {total}", "", "self %  function"]
    lines += [f"{100 * n / max(total, 1):5.1f}  {f}" for f, n in own.most_common(top)]
    lines += ["", "inclusive %  function"]
    lines += [f"{100 * n / max(total, 1):5.1f}  {f}" for f, n in incl.most_common(top * 2)]
    return "\n".join(lines) + "\n"
