"""The ``data`` section of tools/benchmark.py: the data path at real size.

For each N of ``--data-pairs`` it writes (once, cached in the work directory) a synthetic
corpus of OPUS-100's shape with N training pairs (data/synthetic_corpus.py), runs
``tools/preprocess_data.py --format opus100 --langs <its 20 languages> --vocab-size 64000
--workers 2`` of the checkout under test and reports the wall time and the peak memory: per
phase from the tool's ``--stats FILE`` where it has that flag, and for the whole run from
sampling ``/proc`` (the summed RSS of the tool and its workers, every 0.1 s) in every case, as
a cross-check. For each N of ``--data-train-pairs`` it then starts training as users do
(``deepspeed --num_gpus R --module megatron_branchnorm.train``) on that DATA_DIR with a tiny
model, at 2 data-parallel ranks x 1 stage and at 4 stages x 1, and reports per rank the time
from the rank's process start to the first training update done (the first ``metrics.jsonl``
record; the updates are collective, so every rank is there at about the same time), the time
to the rank's ``rank R (stage S): ...`` line (its data is ready), and its peak RSS, up to the
first update and over the whole run (3 updates). A least-squares line of preprocessing time
and peak memory against N gives the projection to OPUS-100's 55M pairs.

    python tools/benchmark.py --sections data --workdir /tmp/mbn_bench_data --json data.json
    python tools/benchmark.py --sections data --checkout /tmp/bench_before ...  # another tree

``--checkout DIR`` runs DIR's tools/preprocess_data.py and train (``PYTHONPATH=DIR``, cwd DIR),
so an earlier revision is measured by this harness (``git worktree add DIR REV``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from megatron_branchnorm.formats.records import metrics_path, read_metrics
from megatron_branchnorm.runner.launch import deepspeed_command
from megatron_branchnorm.runner.ranks import remove_shm_leftovers

OPUS100_PAIRS = 55_000_000
"""Training pairs of OPUS-100 (the projection's target)."""
DEFAULT_PAIRS = (250_000, 1_000_000, 4_000_000)
QUICK_PAIRS = (20_000, 60_000)
DEFAULT_TRAIN_PAIRS = (1_000_000,)
TRAIN_LAYOUTS = ((2, 1), (4, 4))
"""(ranks, pipeline stages) of the training start-up runs: 2 data-parallel, 4 stages."""
PHASES = ("read_clean", "spm_sample", "spm_train", "encode_write", "finish")
TRAIN_STEPS = 3
_RANK_LINE = re.compile(r"rank (\d+) \(stage \d+\):")


class TreeSampler:
    """Samples the RSS of a process and all its descendants every ``interval`` seconds in a
    thread. ``peak_mb``: the peak of their sum; ``group`` (a function of a process, returning a
    key or None, asked once per process) also keeps the peak per key, a process without a key
    counting for its nearest ancestor's. :meth:`mark` freezes the peaks so far in ``marked``."""

    def __init__(self, pid: int, interval: float = 0.1, group=None) -> None:
        self.root = psutil.Process(pid)
        self.interval = interval
        self.group = group
        self.peak_mb = 0.0
        self.peaks: dict[str, float] = {}
        self.marked: dict[str, float] | None = None
        self.own_marked: dict[str, float] = {}
        self.own_peaks: dict[str, float] = {}
        """Peak per key of the processes ``group`` named alone (without their children)."""
        self.children: dict[str, set[str]] = {}
        """Names of the child processes counted for each key."""
        self.created: dict[str, float] = {}
        """Start time (epoch seconds) of the first process ``group`` gave each key."""
        self.samples = 0
        self._keys: dict[int, str | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> None:
        self.marked = {"total": self.peak_mb, **self.peaks}
        self.own_marked = dict(self.own_peaks)

    def _key(self, proc: psutil.Process) -> str | None:
        if proc.pid not in self._keys:
            key = None
            try:
                key = self.group(proc) if self.group else None
                if key is not None:
                    self.created.setdefault(key, proc.create_time())
                elif proc.ppid() in self._keys:
                    key = self._keys[proc.ppid()]
                    if key is not None:
                        self.children.setdefault(key, set()).add(proc.name())
            except psutil.Error:
                pass
            self._keys[proc.pid] = key
        return self._keys[proc.pid]

    def sample(self) -> None:
        """One sample (the thread calls this every ``interval``)."""
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        total, per, own = 0, {}, {}
        for proc in procs:  # parents come before their children
            try:
                rss = proc.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            key = self._key(proc)
            if key is not None:
                per[key] = per.get(key, 0) + rss
                if self.created.get(key) == proc.create_time():
                    own[key] = own.get(key, 0) + rss
        self.samples += 1
        self.peak_mb = max(self.peak_mb, total / 2**20)
        for key, rss in per.items():
            self.peaks[key] = max(self.peaks.get(key, 0.0), rss / 2**20)
        for key, rss in own.items():
            self.own_peaks[key] = max(self.own_peaks.get(key, 0.0), rss / 2**20)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)
        self.sample()


def checkout_env(checkout: Path) -> dict[str, str]:
    """The environment that runs ``checkout``'s package (PYTHONPATH first)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def check_checkout(checkout: Path) -> None:
    """Raise unless ``checkout``'s megatron_branchnorm is the one its processes import."""
    out = subprocess.run(
        [sys.executable, "-c", "import megatron_branchnorm as m; print(m.__file__)"],
        env=checkout_env(checkout), cwd=checkout, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(out).resolve().is_relative_to(checkout.resolve()):
        raise RuntimeError(f"--checkout {checkout}: its processes import {out} instead")


def has_stats_flag(checkout: Path) -> bool:
    """Whether ``checkout``'s preprocess_data.py takes ``--stats FILE``."""
    res = subprocess.run(
        [sys.executable, str(checkout / "tools" / "preprocess_data.py"), "--help"],
        env=checkout_env(checkout), cwd=checkout, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return "--stats" in res.stdout


def ensure_corpus(work: Path, pairs: int, seed: int = 1) -> tuple[Path, list[str], float | None]:
    """The cached corpus of ``pairs`` training pairs (written now if missing), its languages
    and the seconds it took to write (None when cached)."""
    from megatron_branchnorm.data.synthetic_corpus import language_codes, write_opus100_like

    corpus = work / f"opus_like_{pairs}_s{seed}"
    took = None
    if not (corpus / "synthetic_corpus.json").exists():
        t0 = time.perf_counter()
        write_opus100_like(corpus, pairs, seed=seed, overwrite=True)
        took = time.perf_counter() - t0
    return corpus, language_codes(20), took


def run_preprocess(
    checkout: Path,
    corpus: Path,
    langs: list[str],
    out: Path,
    vocab_size: int,
    workers: int,
    stats: bool,
    timeout: float,
    log_path: Path,
) -> dict:
    """Run ``checkout``'s tools/preprocess_data.py on ``corpus``; wall time, sampled peak RSS
    of its process tree, when each of its first output lines came (a rough phase split for a
    tool without ``--stats``) and, with ``stats``, its ``--stats`` figures."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable, str(checkout / "tools" / "preprocess_data.py"), "--format", "opus100",
        "--input", str(corpus), "--langs", ",".join(langs), "--output", str(out),
        "--vocab-size", str(vocab_size), "--workers", str(workers), "--no-progress",
    ]  # fmt: skip
    stats_file = out.parent / f"{out.name}.stats.json"
    stats_file.unlink(missing_ok=True)
    if stats:
        cmd += ["--stats", str(stats_file)]
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=checkout_env(checkout), cwd=checkout, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
    )  # fmt: skip

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with TreeSampler(proc.pid) as sampler:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"preprocess_data.py timed out after {timeout:.0f} s") from None
    wall = time.perf_counter() - t0
    reader.join(timeout=5)
    log_path.write_text("".join(f"[{t:7.1f} s] {x}\n" for t, x in lines))
    if rc:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"preprocess_data.py exited {rc}: {tail}")
    res: dict = {
        "wall_s": wall,
        "sampled_peak_rss_mb": sampler.peak_mb,
        "samples": sampler.samples,
        "output_lines_s": [[round(t, 1), x[:100]] for t, x in lines[:20]],
    }
    if stats and stats_file.exists():
        res["stats"] = json.loads(stats_file.read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    res["vocab_size"] = int(manifest["vocab_size"])
    res["data_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return res


def _rank_of(proc: psutil.Process) -> str | None:
    """``rank<R>`` for a training rank (a process with RANK in its environment running
    megatron_branchnorm.train), else None."""
    cmd = proc.cmdline()
    if "-m" not in cmd or cmd[cmd.index("-m") + 1 :][:1] != ["megatron_branchnorm.train"]:
        return None
    rank = proc.environ().get("RANK")
    return f"rank{rank}" if rank is not None else None


def run_train(
    checkout: Path,
    data_dir: Path,
    vocab_size: int,
    ranks: int,
    stages: int,
    save_dir: Path,
    timeout: float,
) -> dict:
    """Train a tiny model for :data:`TRAIN_STEPS` updates on ``data_dir`` with the deepspeed
    launcher; per rank: seconds from its process start to its ``rank R (stage S)`` line and to
    the first update done, and its peak RSS (MiB) up to the first update and over the run."""
    shutil.rmtree(save_dir, ignore_errors=True)
    save_dir.mkdir(parents=True)
    args = [
        "--config", "tiny_cpu", f"data.dataset={data_dir}", f"model.vocab_size={vocab_size}",
        f"pipeline.stages={stages}", "train.micro_batches=4", f"train.max_steps={TRAIN_STEPS}",
        "train.log_interval=1", "train.save_interval=0", "train.eval_interval=100000",
        "data.max_tokens=512", "data.max_length=64", f"train.save_dir={save_dir}",
    ]  # fmt: skip
    cmd, env = deepspeed_command(ranks, args)
    env.update({k: v for k, v in checkout_env(checkout).items() if k == "PYTHONPATH"})
    env["OMP_NUM_THREADS"] = "1"
    metrics = metrics_path(save_dir)
    ready: dict[str, float] = {}
    lines: list[str] = []
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, env=env, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, errors="replace",
    )  # fmt: skip

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            m = _RANK_LINE.search(line)
            if m and f"rank{m.group(1)}" not in ready:
                ready[f"rank{m.group(1)}"] = time.time()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    first = None
    with TreeSampler(proc.pid, group=_rank_of) as sampler:
        while proc.poll() is None:
            if first is None and metrics.exists() and metrics.stat().st_size:
                first = time.time()
                sampler.mark()
            if time.time() - t0 > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise RuntimeError(f"training timed out after {timeout:.0f} s")
            time.sleep(0.05)
    reader.join(timeout=5)
    (save_dir / "launcher.log").write_text("".join(lines))
    # DeepSpeed's CPU backend leaves a shared-memory all-reduce buffer per rank in /dev/shm
    # (~66 MB each), named after the port: remove this run's.
    remove_shm_leftovers(int(cmd[cmd.index("--master_port") + 1]))
    if proc.returncode or first is None:
        tail = [x.strip() for x in lines[-4:]]
        raise RuntimeError(f"training exited {proc.returncode} before an update: {tail}")
    records = read_metrics(save_dir)
    marked = sampler.marked or {}
    per_rank = {}
    for key in sorted(sampler.peaks, key=lambda k: int(k[4:])):
        start = sampler.created.get(key, t0)
        per_rank[key] = {
            "process_start_s": start - t0,
            "data_ready_s": ready[key] - start if key in ready else None,
            "first_update_s": first - start,
            "peak_rss_mb_first_update": sampler.own_marked.get(key),
            "peak_rss_mb": sampler.own_peaks.get(key),
            "peak_rss_mb_with_children": sampler.peaks[key],
            "peak_rss_mb_with_children_first_update": marked.get(key),
            "child_processes": sorted(sampler.children.get(key, ())),
        }
    return {
        "ranks": ranks,
        "stages": stages,
        "launch_to_first_update_s": first - t0,
        "wall_s": time.time() - t0,
        "updates": len([r for r in records if "tokens_per_sec" in r]),
        "peak_rss_mb_all_ranks": sampler.peak_mb,
        "per_rank": per_rank,
    }


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of y against x; None with fewer than 2 distinct x."""
    if len(set(xs)) < 2:
        return None
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return slope, my - slope * mx


def projection(rows: dict[str, dict], target: int = OPUS100_PAIRS) -> dict:
    """Linear fits of preprocessing wall time and peak memory against N, and their values at
    ``target`` pairs."""
    ok = {int(n): r for n, r in rows.items() if "wall_s" in r}
    out: dict = {"target_pairs": target}
    xs = list(ok)
    for name, key in (("wall_s", "wall_s"), ("peak_rss_mb", "sampled_peak_rss_mb")):
        fit = linear_fit(xs, [ok[n][key] for n in xs])
        if fit:
            slope, icpt = fit
            out[name] = {
                "per_million": slope * 1e6,
                "intercept": icpt,
                "at_target": icpt + slope * target,
            }
    return out


def train_projection(train: dict[str, dict], target: int = OPUS100_PAIRS) -> dict:
    """Per layout, a linear fit of the largest rank process's peak RSS against N (from the
    runs' names, ``N/layout``) and its value at ``target`` pairs."""
    points: dict[str, list[tuple[int, float]]] = {}
    for name, t in train.items():
        if "error" not in t:
            n, layout = name.split("/", 1)
            peak = max((r["peak_rss_mb"] or 0.0 for r in t["per_rank"].values()), default=0.0)
            points.setdefault(layout, []).append((int(n), peak))
    out = {}
    for layout, pts in points.items():
        fit = linear_fit([float(n) for n, _ in pts], [p for _, p in pts])
        if fit:
            slope, icpt = fit
            out[layout] = {
                "per_million": slope * 1e6, "intercept": icpt, "at_target": icpt + slope * target
            }  # fmt: skip
    return out


def measure(
    work: Path,
    checkout: Path,
    pairs: list[int],
    train_pairs: list[int],
    vocab_size: int = 64000,
    workers: int = 2,
    timeout: float = 3600.0,
    log=print,
) -> dict:
    """The whole section (module docstring); a failed run is kept as ``{"error": ...}``."""
    checkout = checkout.resolve()
    check_checkout(checkout)
    stats = has_stats_flag(checkout)
    log(f"data: checkout {checkout}; preprocess_data.py --stats: {'yes' if stats else 'no'}")
    res: dict = {
        "checkout": str(checkout),
        "stats_flag": stats,
        "vocab_size": vocab_size,
        "workers": workers,
        "preprocess": {},
        "train": {},
    }
    for n in sorted(set(pairs) | set(train_pairs)):
        log(f"data: {n:,} pairs (load {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
        corpus, langs, took = ensure_corpus(work, n)
        if took is not None:
            log(f"data: wrote the {n:,}-pair corpus in {took:.1f} s")
        data_dir = work / f"data_{n}"
        try:
            row = run_preprocess(
                checkout, corpus, langs, data_dir, vocab_size, workers, stats, timeout,
                work / f"preprocess_{n}.log",
            )  # fmt: skip
            row["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
            log(
                f"data: preprocess {n:,} pairs: {row['wall_s']:.0f} s, "
                f"peak {row['sampled_peak_rss_mb']:,.0f} MB"
            )
        except Exception as exc:  # noqa: BLE001 - keep the other sizes' figures
            row = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"data: preprocess {n:,} failed: {exc}")
        if n in pairs:
            res["preprocess"][str(n)] = row
        if n in train_pairs and "error" not in row:
            for ranks, stages in TRAIN_LAYOUTS:
                name = f"{n}/{ranks // stages}dp_x_{stages}stage"
                try:
                    t = run_train(
                        checkout, data_dir, row["vocab_size"], ranks, stages,
                        work / f"train_{n}_{ranks}r{stages}s", timeout,
                    )  # fmt: skip
                    peaks = [r["peak_rss_mb"] or 0 for r in t["per_rank"].values()]
                    log(
                        f"data: train {name}: first update {t['launch_to_first_update_s']:.1f} s "
                        f"after launch, peak RSS per rank {max(peaks, default=0):,.0f} MB"
                    )
                except Exception as exc:  # noqa: BLE001
                    t = {"error": f"{type(exc).__name__}: {exc}"}
                    log(f"data: train {name} failed: {exc}")
                res["train"][name] = t
        shutil.rmtree(data_dir, ignore_errors=True)
    res["projection"] = projection(res["preprocess"])
    res["train_projection"] = train_projection(res["train"])
    return res


def format_table(res: dict) -> str:
    """The section's tables: preprocessing per N (and per phase with --stats), training
    start-up per rank, the projection to 55M pairs."""
    out = [
        f"checkout {res['checkout']}; tools/preprocess_data.py --vocab-size {res['vocab_size']} "
        f"--workers {res['workers']}; --stats: {'yes' if res['stats_flag'] else 'no'}",
        "",
        f"{'pairs':>10} {'wall s':>8} {'peak MB':>9} {'MB/1M':>7} {'load after':>16}  phases "
        "(s / peak MB)",
    ]
    for n, r in res["preprocess"].items():
        if "error" in r:
            out.append(f"{int(n):>10,} {r['error']}")
            continue
        phases = r.get("stats", {}).get("phases", {})
        text = ", ".join(
            f"{p} {phases[p]['seconds']:.0f} / {phases[p]['peak_rss_mb']:,.0f}"
            for p in PHASES
            if p in phases
        )
        lines = r.get("output_lines_s", [])
        if not text and len({round(t) for t, _ in lines}) > 1:  # no --stats: the tool's lines
            text = "lines at " + ", ".join(
                f"{t:.0f} s '{(x.split() or [''])[0]}'" for t, x in lines
            )
        if "stats" in r:
            text += f"; tool's own peak {r['stats'].get('peak_rss_mb', 0):,.0f} MB"
        out.append(
            f"{int(n):>10,} {r['wall_s']:>8.1f} {r['sampled_peak_rss_mb']:>9,.0f} "
            f"{r['sampled_peak_rss_mb'] / int(n) * 1e6:>7,.0f} {r['load_after']:>16}  "
            f"{text or '-'}"
        )
    proj = res.get("projection", {})
    if "wall_s" in proj:
        w, m = proj["wall_s"], proj["peak_rss_mb"]
        out.append(
            f"linear fit: {w['per_million']:.1f} s and {m['per_million']:,.0f} MB per 1M pairs "
            f"(+ {w['intercept']:.0f} s, {m['intercept']:,.0f} MB); at "
            f"{proj['target_pairs'] / 1e6:.0f}M pairs: {w['at_target'] / 60:,.0f} min, "
            f"{m['at_target'] / 1024:,.1f} GB"
        )
    if res["train"]:
        out += [
            "",
            "per rank: start = its process start after the launch; ready = its 'rank R (stage "
            "S)' line; 1st upd = first update done, from its start; MB = the rank process's RSS "
            "(@1st: peak up to the first update); +children = with the processes it started "
            "(on a CPU: the compiler building DeepSpeed's shm-comm op)",
            f"{'run':<26} {'rank':>5} {'start s':>8} {'ready s':>8} {'1st upd s':>9} "
            f"{'MB@1st':>8} {'peak MB':>8} {'+children':>10}  children",
        ]
        for name, t in res["train"].items():
            if "error" in t:
                out.append(f"{name:<26} {t['error']}")
                continue
            for rank, r in t["per_rank"].items():
                ready = f"{r['data_ready_s']:.1f}" if r["data_ready_s"] is not None else "-"
                at_first = r["peak_rss_mb_first_update"] or 0.0
                out.append(
                    f"{name:<26} {rank[4:]:>5} {r['process_start_s']:>8.1f} {ready:>8} "
                    f"{r['first_update_s']:>9.1f} {at_first:>8,.0f} {r['peak_rss_mb'] or 0:>8,.0f} "
                    f"{r['peak_rss_mb_with_children']:>10,.0f}  "
                    f"{','.join(r['child_processes']) or '-'}"
                )
            out.append(
                f"{name:<26} {'all':>5} launch to first update {t['launch_to_first_update_s']:.1f} s,"
                f" sum of ranks' peak {t['peak_rss_mb_all_ranks']:,.0f} MB (launcher included)"
            )
    for layout, f in res.get("train_projection", {}).items():
        out.append(
            f"linear fit, largest rank's peak at {layout}: {f['per_million']:,.0f} MB per 1M pairs "
            f"(+ {f['intercept']:,.0f} MB); at {proj.get('target_pairs', OPUS100_PAIRS) / 1e6:.0f}M"
            f" pairs: {f['at_target'] / 1024:,.1f} GB per rank"
        )
    return "\n".join(out)
