"""Faults the results layer must survive: a sweep killed (SIGKILL) inside a cell's encoder and inside the write of
its run directory, two sweeps writing one results root at once, and a results folder that cannot be written.

The sweeps run the CLI in subprocesses on conftest's tiny checkpoint. Their cells are identity runs through a
small plugin written beside the test (``compressor._target_=faultplug.Faulty``): it logs every encode and, when
``KVBENCH_FAULT`` names its cell, drops a marker file and blocks inside the encoder or inside the serialisation of
``summary.json`` (the last file of the staged run directory), where the test kills it.

Two sweeps at once are made to overlap, not left to luck: with ``KVBENCH_FAULT_MEET`` naming a folder, a sweep marks
each cell it reaches as it builds the cell's compressor (before the reuse check and the cell's lock), and its
encoder marks that it measures the cell, then holds it until the other sweep has reached the cell too and then up to
the plugin's ``JOIN_S`` seconds more for the other to join it inside the encoder. Under the per-cell lock the other
sweep waits at the lock and never joins: each cell is measured once while the other sweep provably wanted it.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from kvbench.store import results

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent

PLUGIN = '''
import os
import time
from dataclasses import dataclass

from compressors.exact.identity import Identity

ARRIVE_S = 120  # bounds the wait for the other sweep to reach the cell (it always does: both sweep the same cells)
JOIN_S = 4  # without the lock the other sweep, once at the cell, is in its encoder within a second


def _fault(where, tag):
    with open(os.environ["KVBENCH_FAULT_LOG"], "a") as f:
        f.write(f"{where} {tag} {os.getpid()}\\n")
    if os.environ.get("KVBENCH_FAULT") == f"{where}:{tag}":
        open(os.environ["KVBENCH_FAULT_MARK"], "w").close()
        time.sleep(3600)  # killed here


class _AtWrite:
    """A stats value that json.dumps(default=str) turns into text while summary.json is being written."""

    def __init__(self, tag):
        self.tag = tag

    def __str__(self):
        _fault("write", self.tag)
        return "written"


def _others(folder, what, tag):
    mine = f"{what}.{tag}.{os.getpid()}"
    return [p for p in os.listdir(folder) if p.startswith(f"{what}.{tag}.") and p != mine]


def _wait(until_s, done):
    deadline = time.monotonic() + until_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)
    return done()


def _meet(tag):
    """Hold the cell's measurement until the other sweep has reached the cell, then give it JOIN_S seconds to
    enter this encoder too; log whether it reached the cell and whether it joined."""
    folder = os.environ.get("KVBENCH_FAULT_MEET")
    if not folder:
        return
    open(os.path.join(folder, f"encode.{tag}.{os.getpid()}"), "w").close()
    arrived = _wait(ARRIVE_S, lambda: _others(folder, "arrive", tag))
    joined = _wait(JOIN_S, lambda: _others(folder, "encode", tag)) if arrived else False
    with open(os.environ["KVBENCH_FAULT_LOG"], "a") as f:
        f.write(f"meet {tag} {os.getpid()} arrived={int(bool(arrived))} joined={int(bool(joined))}\\n")


@dataclass
class Faulty(Identity):
    tag: int = 0

    name = "faulty"

    def __post_init__(self):
        # built for the cell before its reuse check and its lock: this sweep has reached the cell
        folder = os.environ.get("KVBENCH_FAULT_MEET")
        if folder:
            open(os.path.join(folder, f"arrive.{self.tag}.{os.getpid()}"), "w").close()

    def encode(self, kv, ctx):
        _fault("encode", self.tag)
        _meet(self.tag)
        return super().encode(kv, ctx)

    def stats(self):
        return {"probe": _AtWrite(self.tag)}
'''


def _sweep_args(ckpt: Path, corpus: Path, tags: str) -> list[str]:
    return ["-m", "kvbench", "run", "-m", "+compressor=identity", "compressor._target_=faultplug.Faulty",
            f"+compressor.tag={tags}", "model=hf", f"model.path={ckpt}", "dataset=text", f"dataset.path={corpus}",
            "dataset.seq_len=32", "dataset.eval_len=8", "dataset.n_sequences=1", "dataset.n_calib=0",
            "metrics.nll=false", "metrics.resume=true"]


class Sweeps:
    """Sweeps of ``Faulty`` cells on one results root, the encode log and the marker the plugin drops."""

    def __init__(self, tmp: Path, checkpoint: tuple[Path, Path]) -> None:
        self.tmp, (self.ckpt, self.corpus) = tmp, checkpoint
        (tmp / "plugin").mkdir()
        (tmp / "plugin" / "faultplug.py").write_text(textwrap.dedent(PLUGIN))
        self.results, self.log, self.mark = tmp / "results", tmp / "faults.log", tmp / "fault.mark"
        self.meet = tmp / "meet"
        self.env = {**os.environ, "KVBENCH_HOME": str(tmp / "home"), "KVBENCH_RESULTS": str(self.results),
                    "OMP_NUM_THREADS": "1", "KVBENCH_FAULT_LOG": str(self.log), "KVBENCH_FAULT_MARK": str(self.mark),
                    # this checkout's kvbench, not whichever one the interpreter has installed
                    "PYTHONPATH": os.pathsep.join([str(tmp / "plugin"), str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.env.pop("KVBENCH_FAULT", None)
        self.env.pop("KVBENCH_FAULT_MEET", None)

    def start(self, tags: str, fault: str | None = None, meet: bool = False) -> subprocess.Popen:
        """A sweep of the cells ``tags``; ``meet``: each of its measurements waits for another sweep (see the
        module docstring)."""
        if meet:
            self.meet.mkdir(exist_ok=True)
        env = {**self.env, **({"KVBENCH_FAULT": fault} if fault else {}),
               **({"KVBENCH_FAULT_MEET": str(self.meet)} if meet else {})}
        return subprocess.Popen([sys.executable, *_sweep_args(self.ckpt, self.corpus, tags)], env=env, cwd=self.tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def kill_at(self, tags: str, fault: str) -> str:
        """Run a sweep until the plugin blocks at ``fault``, SIGKILL it there; its output."""
        self.mark.unlink(missing_ok=True)
        p = self.start(tags, fault)
        try:
            p.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        while not self.mark.exists():  # the plugin's marker; a sweep that ends without reaching it is a failure
            try:
                out, _ = p.communicate(timeout=0.2)
                pytest.fail(f"the sweep exited ({p.returncode}) before reaching {fault}:\n{out[-3000:]}")
            except subprocess.TimeoutExpired:
                continue
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == -signal.SIGKILL, out[-3000:]
        return out

    def encodes(self) -> list[int]:
        """Tags encoded so far, one entry per encode call (a cell encodes its one sequence once)."""
        text = self.log.read_text() if self.log.exists() else ""
        return [int(line.split()[1]) for line in text.splitlines() if line.startswith("encode")]

    def meetings(self) -> list[tuple[int, int, bool, bool]]:
        """Per measurement that waited for the other sweep: (tag, pid, the other reached the cell meanwhile, the
        other measured it too)."""
        text = self.log.read_text() if self.log.exists() else ""
        out = []
        for line in text.splitlines():
            if line.startswith("meet "):
                _, tag, pid, arrived, joined = line.split()
                out.append((int(tag), int(pid), arrived == "arrived=1", joined == "joined=1"))
        return out

    def runs(self) -> dict[int, Path]:
        """Finished run directories by tag, as the results layer finds them; every one must be complete."""
        out = {}
        for s in results.summaries([self.results / "runs"]):
            d = Path(s["_dir"])
            assert results.read_summary(d / "summary.json") == {k: v for k, v in s.items() if k != "_dir"}
            assert s["lossless"] is True and s["kind"] == "run" and s["compressor_stats"]["probe"] == "written"
            assert json.loads((d / "config.json").read_text()) == s["config"]
            assert len(pd.read_parquet(d / "rows.parquet")) >= 2  # one row per layer x k/v at least
            tag = s["compressor_params"]["tag"]
            assert tag not in out, f"cell tag={tag} has two run directories: {out.get(tag)} and {d}"
            out[tag] = d
        return out

    def staged(self) -> list[Path]:
        return [p for p in (self.results / "runs").iterdir() if p.name.startswith(".") and p.name != ".locks"]


def _inodes(dirs: dict[int, Path]) -> dict[int, tuple[int, bytes]]:
    return {t: (d.stat().st_ino, (d / "summary.json").read_bytes()) for t, d in dirs.items()}


def test_killed_sweeps_resume_and_two_sweeps_at_once_measure_each_cell_once(tmp_path, tiny_checkpoint):
    """The per-cell lock is what this guards: with ``with FileLock(str(lock)):`` in
    ``kvbench.store.results.reuse_or_measure`` replaced by ``if True:``, both sweeps measure cells 3 and 4 together
    and the test fails with "both sweeps measured one cell at once: [(3, …, True, True), (3, …, True, True),
    (4, …), (4, …)]"."""
    sw = Sweeps(tmp_path, tiny_checkpoint)

    # SIGKILL inside cell 2's encoder: cell 1 is finished, cell 2 left nothing, not even a staging directory
    sw.kill_at("1,2,3", "encode:2")
    assert sorted(sw.runs()) == [1] and sw.staged() == []
    assert sw.encodes() == [1, 2]

    # SIGKILL while cell 3's run directory is being written (its table and config are staged, the summary is not)
    sw.kill_at("1,2,3", "write:3")
    first = sw.runs()
    assert sorted(first) == [1, 2], "a half-written run directory was taken as finished"
    staged = sw.staged()
    assert len(staged) == 1 and (staged[0] / "rows.parquet").exists() and not (staged[0] / "summary.json").exists()
    assert sw.encodes() == [1, 2, 2, 3]  # cell 1 was reused, not encoded again
    kept = _inodes(first)

    # two sweeps resume the same root at once, with a cell neither has run, each measurement held until the other
    # sweep has reached the cell: every cell ends up present once, cells 3 and 4 are measured once between the two
    # sweeps while the other sweep waited on them, and the finished cells are not touched
    a, b = sw.start("1,2,3,4", meet=True), sw.start("1,2,3,4", meet=True)
    outs = [p.communicate(timeout=300)[0] for p in (a, b)]
    meetings = sw.meetings()
    assert not any(joined for *_, joined in meetings), f"both sweeps measured one cell at once: {meetings}"
    assert all(arrived for _, _, arrived, _ in meetings), f"a sweep measured a cell the other never reached: {meetings}"
    assert sorted(m[0] for m in meetings) == [3, 4], meetings
    assert a.returncode == 0 and b.returncode == 0, "\n".join(o[-3000:] for o in outs)
    done = sw.runs()
    assert sorted(done) == [1, 2, 3, 4]
    assert {t: v for t, v in _inodes(done).items() if t in kept} == kept, "a finished cell was rewritten"
    later = sw.encodes()[4:]
    assert sorted(later) == [3, 4], f"cells measured after the kills: {later} (each of 3 and 4 exactly once)"
    assert sum(o.count("reusing finished run") for o in outs) == 2 * 4 - 2
    assert staged[0].name.startswith(f".{done[3].name}."), "the leftovers are the killed write of cell 3"

    # the report reads the four runs and lists the killed write's leftovers as skipped, never as a run
    from kvbench.report.collect import collect

    got = collect([sw.results / "runs"])
    assert len(got.table) == 4 and sorted(got.table["compressor_params.tag"]) == [1, 2, 3, 4]
    assert [Path(p).name for p, _ in got.skipped] == [staged[0].name]


def _refuse(monkeypatch, root: Path, where: str, code: int) -> None:
    """Make the OS refuse writes under ``root`` with ``code`` (EROFS: creating files or folders; ENOSPC: syncing
    data to disk, where a full disk reports it), as a read-only mount or a full disk would."""
    real_open, real_mkdir, real_fsync = os.open, os.mkdir, os.fsync
    inside = lambda path: str(path).startswith(str(root))

    def refused(path):
        raise OSError(code, os.strerror(code), str(path))

    if where == "create":
        monkeypatch.setattr(os, "open", lambda path, flags, *a, **k: refused(path) if inside(path) and flags & (
            os.O_WRONLY | os.O_RDWR | os.O_CREAT) else real_open(path, flags, *a, **k))
        monkeypatch.setattr(os, "mkdir", lambda path, *a, **k: refused(path) if inside(path) else real_mkdir(path, *a, **k))
    else:
        fds: set[int] = set()

        def tracking_open(path, flags, *a, **k):
            fd = real_open(path, flags, *a, **k)
            if inside(path):
                fds.add(fd)
            return fd

        monkeypatch.setattr(os, "open", tracking_open)
        monkeypatch.setattr(os, "fsync", lambda fd: refused(root) if fd in fds else real_fsync(fd))


@pytest.mark.parametrize("where,code,why", [("create", errno.EROFS, "it is on a read-only file system"),
                                            ("sync", errno.ENOSPC, "no space is left on its device")])
def test_an_unwritable_results_folder_fails_before_any_work(tiny_cfg, tmp_path, monkeypatch, capsys, where, code, why):
    """Through the CLI's cell entry point: a clear error naming the folder, exit status 2, and nothing measured
    (no model loaded, no trace captured, no run directory)."""
    from kvbench.cli import cell

    cfg = tiny_cfg("+compressor=identity", "metrics.nll=false")
    root = tmp_path / "results"
    measured = []
    monkeypatch.setattr("kvbench.measure.run.measure", lambda *a, **k: measured.append(a) or pytest.fail("measured"))
    _refuse(monkeypatch, root, where, code)
    with pytest.raises(SystemExit) as exit_:
        cell("run", cfg)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and measured == []
    assert f"results folder {root / 'runs'} cannot take a run: {why}" in err, err
    assert "nothing was measured" in err and "paths.results=DIR" in err
    assert not (tmp_path / "home").exists()  # no trace, no converted model: the check came first
    assert not list(root.rglob("*.json"))


def test_the_write_check_leaves_nothing_and_a_finished_cell_needs_no_write(tmp_path, monkeypatch):
    """The probe file is removed; a cell already finished is reused from a folder that has since become
    unwritable (reading needs no write)."""
    results.check_writable(tmp_path)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == []
    cfg = {"compressor": {"name": "x"}, "paths": {"results": str(tmp_path)}}
    first = results.reuse_or_measure("run", cfg, "x", None, lambda: ({"lossless": True}, [{"layer": 0}]))
    _refuse(monkeypatch, tmp_path, "create", errno.EROFS)
    again = results.reuse_or_measure("run", cfg, "x", None, lambda: pytest.fail("measured again"))
    assert again.reused and again.path == first.path
    with pytest.raises(results.ResultsNotWritable, match="read-only file system"):
        results.reuse_or_measure("run", cfg, "x", None, lambda: pytest.fail("measured"), resume=False)
