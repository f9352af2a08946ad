"""`qwen38 bench verify`: how fast start-up verification is, cold and warm.

Cold: N real files (``--cold-gb`` in total, pseudo-random bytes) are written and fsync'ed,
then, each time after dropping them from the page cache, the same run measures
``cat FILES > /dev/null`` (the read limit), our full verification (threads, one file
each), our verification on one thread, and ``sha256sum`` of one file (the single-thread
reference). Targets: ours >= 90 % of cat, and >= sha256sum's rate x cores used.

Dropping the cache: ``--drop fadvise`` (default) asks the kernel to evict just these
files (``posix_fadvise(DONTNEED)`` on clean, fsync'ed pages: it touches nobody else's
cache on a shared machine); ``--drop global`` writes 3 to /proc/sys/vm/drop_caches (root).
Residency is measured with ``fincore`` (util-linux) when available and printed.

Warm: a 15-file, 25 GB directory of sparse files (only stat matters on a warm restart;
sparse files take no disk), pinned as a hub artifact in a lock, is fully verified once by
`verify_profile`, then verified again as a restart would (lock, manifest against the
lock, stat cache, stat of every file, vLLM metadata, patch hook, status file). Timed in
process (median of 5) and in a new process (verify's imports included; the settings and
profile imports the launcher has already paid are timed apart).

First (``--first-gb``, default 20): the first `qwen38 serve` after `qwen38 prepare`. N files
of pseudo-random bytes are pinned as a user-supplied artifact and prepared by the real
command in a new process (``qwen38 prepare download KEY --from DIR``: copied into staging,
hashed, renamed into place, manifest written, and what it hashed left in the stat cache
under its CACHE_DIR). The first `verify_profile` is then timed twice, each after evicting
the files from the page cache: with a fresh stat cache (what every first start paid
before prepare left its hashes: every byte read again) and with the cache prepare left.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from core.artifact_lock import ArtifactLock, LockedArtifact, LockedFile, write_lock
from core.errors import BenchError
from core.hashing import available_cores
from core.identity import GeneratedIdentity
from core.manifest import read_manifest, write_manifest
from core.profiles import Profile
from core.settings import Settings
from core.stat_cache import RACY_WINDOW_NS, StatCache
from entrypoint.verify import DirReport, verify_directories, verify_profile

_BLOCK = 64 << 20


def _write_random_file(path: Path, size: int, seed: int) -> str:
    """Write ``size`` pseudo-random bytes (distinct per file and block); return their sha256."""
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=_BLOCK, dtype=np.uint8)
    digest = hashlib.sha256()
    with open(path, "wb") as handle:
        written = 0
        index = 0
        while written < size:
            n = min(_BLOCK, size - written)
            base[:16] = np.frombuffer(index.to_bytes(8, "little") + seed.to_bytes(8, "little"), dtype=np.uint8)
            chunk = memoryview(base)[:n]
            handle.write(chunk)
            digest.update(chunk)
            written += n
            index += 1
        handle.flush()
        os.fsync(handle.fileno())
    return digest.hexdigest()


def _zeros_sha256(size: int) -> str:
    digest = hashlib.sha256()
    block = bytes(_BLOCK)
    left = size
    while left:
        n = min(left, _BLOCK)
        digest.update(memoryview(block)[:n])
        left -= n
    return digest.hexdigest()


def drop_from_cache(files: list[Path], how: str) -> None:
    if how == "global":
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError as exc:
            raise BenchError(
                f"--drop global: cannot write /proc/sys/vm/drop_caches ({exc}); use --drop fadvise"
            ) from None
        return
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(files: list[Path]) -> int | None:
    """Bytes of ``files`` in the page cache (util-linux fincore), None if unknown."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return None
    return sum(int(line) for line in out.stdout.split())


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_seconds() -> float:
    """CPU time used so far by this process (all threads) and its waited-for children."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def cpu_pressure() -> float | None:
    """Share of the last 10 s some task waited for a CPU (Linux PSI), in percent."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(line.split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


def _verify_dir(directory: Path, cache_path: Path | None, *, full: bool, jobs: int | None):
    """verify's file checks for one directory: manifest, stat cache, stat, hash (cold runs)."""

    cache = StatCache.load(cache_path) if cache_path is not None else StatCache(None)
    manifest = read_manifest(directory)
    report = DirReport(slot="bench", dir=str(directory))
    problems = verify_directories([(directory, manifest, report)], cache, full=full, jobs=jobs)
    if problems:
        raise BenchError(f"bench directory failed verification: {problems[0]}")
    cache.save()
    return report


def bench_cold(root: Path, total: int, nfiles: int, jobs: int, drop: str, repeat: int = 3) -> dict:
    directory = root / "cold"
    directory.mkdir()
    size = total // nfiles
    files = [directory / f"model-{i + 1:05d}-of-{nfiles:05d}.safetensors" for i in range(nfiles)]
    print(f"cold: writing {nfiles} files x {size / 1e9:.2f} GB ...", flush=True)
    digests = {p.name: _write_random_file(p, size, seed=i) for i, p in enumerate(files)}
    write_manifest(directory, GeneratedIdentity(generator="bench-verify", generator_version="1"), files=digests)
    nbytes = size * nfiles
    result: dict = {"files": nfiles, "bytes": nbytes, "drop": drop, "jobs": jobs}

    def measure(name: str, fn) -> float:
        drop_from_cache(files, drop)
        resident = resident_bytes(files)
        pressure = cpu_pressure()
        cpu = _cpu_seconds()
        seconds = _timed(fn)
        cpu = _cpu_seconds() - cpu
        rate = nbytes / seconds / 1e9
        result.setdefault(name, []).append(
            {
                "seconds": round(seconds, 3),
                "gb_per_s": round(rate, 3),
                "cpu_seconds": round(cpu, 3),
                "resident_before": resident,
                "cpu_pressure_avg10_before": pressure,
            }
        )
        shown = "?" if resident is None else f"{resident / 1e6:.0f} MB"
        print(
            f"cold: {name:18} {seconds:7.2f} s  {rate:6.2f} GB/s  cpu {cpu:6.2f} s  "
            f"(page cache before: {shown}; CPU pressure {pressure}%)",
            flush=True,
        )
        return rate

    # Interleaved repeats: on a shared machine the neighbours' load drifts; the medians of
    # runs taken side by side compare like with like.
    cats, ours = [], []
    names = [str(p) for p in files]
    for _ in range(repeat):
        cats.append(measure("cat", lambda: subprocess.run(["cat", *names], stdout=subprocess.DEVNULL, check=True)))
        ours.append(measure("verify", lambda: _verify_dir(directory, None, full=True, jobs=jobs)))
    cat, ours_rate = statistics.median(cats), statistics.median(ours)
    measure("verify_1_thread", lambda: _verify_dir(directory, None, full=True, jobs=1))
    # sha256sum of one file: the single-thread reference rate.
    drop_from_cache(files, drop)
    seconds = _timed(lambda: subprocess.run(["sha256sum", str(files[0])], stdout=subprocess.DEVNULL, check=True))
    sha256sum = size / seconds / 1e9
    result["sha256sum_1_file"] = {"seconds": round(seconds, 3), "gb_per_s": round(sha256sum, 3)}
    print(f"cold: {'sha256sum (1 file)':18} {seconds:7.2f} s  {sha256sum:6.2f} GB/s", flush=True)

    cores_used = min(jobs, nfiles)
    result["targets"] = {
        "cat_median_gb_per_s": round(cat, 3),
        "verify_median_gb_per_s": round(ours_rate, 3),
        "verify_vs_cat": round(ours_rate / cat, 3),
        "verify_vs_cat_ok": ours_rate >= 0.9 * cat,
        "sha256sum_x_cores_gb_per_s": round(sha256sum * cores_used, 3),
        "verify_vs_sha256sum_x_cores_ok": ours_rate >= sha256sum * cores_used,
    }
    print(
        f"cold: median of {repeat}: cat {cat:.2f} GB/s, verify {ours_rate:.2f} GB/s = {ours_rate / cat:.0%} of cat "
        f"(target >= 90 %); sha256sum x {cores_used} cores = {sha256sum * cores_used:.2f} GB/s "
        f"(target: verify >= that)",
        flush=True,
    )
    shutil.rmtree(directory)
    return result


# A fresh process, as a restarted container runs it. The launcher has loaded settings and
# profiles before it verifies, so their import is timed apart from verify's own cost.
_PROBE = """
import sys, time
t0 = time.perf_counter()
import core.profiles, core.settings
t1 = time.perf_counter()
from pathlib import Path
from bench.verify import warm_fixture
from entrypoint.verify import verify_profile
profile, settings, lock = warm_fixture(Path(sys.argv[1]))
r = verify_profile(profile, settings, lock_path=lock)
t2 = time.perf_counter()
assert r.dirs[0].hashed == 0, r
print(t1 - t0, t2 - t1)
"""


def one_slot_profile(name: str, description: str, directory: str, artifact: str):
    """A profile serving one pinned artifact from ``MODELS_DIR/directory``: what verify benches check."""

    return Profile.model_validate(
        {
            "name": name,
            "description": description,
            "platform": "cpu",
            "machine": "any",
            "served": {"base": "bench"},
            "models": {"target": {"dir": directory, "artifact": artifact}},
            "engine": {"max_model_len": 4096, "max_num_seqs": 1},
        }
    )


def warm_fixture(root: Path):
    """The warm bench's profile (one pinned-artifact slot), settings and lock path."""

    profile = one_slot_profile("bench-verify", "synthetic 15-file directory", "warm", "bench-synthetic")
    settings = Settings.model_construct(models_dir=root, cache_dir=root / "cache")
    return profile, settings, root / "artifacts.lock.toml"


def bench_warm(root: Path, total: int, nfiles: int, jobs: int) -> dict:
    """A restart of `verify_profile` itself: lock, manifest vs lock, stat cache, engine, status."""

    directory = root / "warm"
    directory.mkdir()
    size = total // nfiles
    print(f"warm: {nfiles} sparse files x {size / 1e9:.2f} GB, pinned in a lock ...", flush=True)
    names = [f"model-{i + 1:05d}-of-{nfiles:05d}.safetensors" for i in range(nfiles)]
    for name in names:
        with open(directory / name, "wb") as handle:
            handle.truncate(size)
    zeros = _zeros_sha256(size)
    artifact = LockedArtifact(
        key="bench-synthetic",
        source="hub",
        repo="bench/synthetic",
        revision="0" * 40,
        files=tuple(LockedFile(path=n, size=size, sha256=zeros) for n in names),
    )
    profile, settings, lock_path = warm_fixture(root)
    write_lock(ArtifactLock(artifacts={artifact.key: artifact}), lock_path)
    write_manifest(directory, artifact.identity(), files={n: zeros for n in names})
    # Let the files' last change leave the racy window, as any real model directory has.
    time.sleep(RACY_WINDOW_NS / 1e9 + 0.1)

    def run():
        return verify_profile(profile, settings, jobs=jobs, lock_path=lock_path)

    start = time.perf_counter()
    first = run()
    first_s = time.perf_counter() - start
    print(f"warm: first run (hashes {total / 1e9:.1f} GB of zeros) {first_s:6.2f} s", flush=True)
    if first.dirs[0].hashed != nfiles:
        raise BenchError(f"the first run hashed {first.dirs[0].hashed} of {nfiles} files")
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        report = run()
        runs.append(time.perf_counter() - start)
        if report.dirs[0].hashed:
            raise BenchError(f"warm run re-hashed {report.dirs[0].hashed} files; the stat cache did not hold")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    start = time.perf_counter()
    probe = subprocess.run([sys.executable, "-c", _PROBE, str(root)], capture_output=True, text=True, env=env)
    process_wall = time.perf_counter() - start
    if probe.returncode != 0:
        raise BenchError(f"warm probe process failed: {probe.stderr.strip().splitlines()[-1:]}")
    base_imports, in_probe = map(float, probe.stdout.strip().splitlines()[-1].split())
    first_s_value = first_s
    result = {
        "files": nfiles,
        "bytes": size * nfiles,
        "first_run_s": round(first_s_value, 3),
        "warm_in_process_median_s": round(statistics.median(runs), 4),
        "warm_in_process_max_s": round(max(runs), 4),
        "warm_new_process_settings_imports_s": round(base_imports, 4),
        "warm_new_process_verify_s": round(in_probe, 4),
        "warm_new_process_wall_s": round(process_wall, 3),
        "target_ok": max(runs) < 0.2 and in_probe < 0.2,
    }
    print(
        f"warm: restart verify {statistics.median(runs) * 1e3:.1f} ms median, {max(runs) * 1e3:.1f} ms max "
        f"(in process); new process: {in_probe * 1e3:.1f} ms for verify's imports + verification, after "
        f"{base_imports * 1e3:.0f} ms importing settings/profiles ({process_wall:.2f} s wall incl. interpreter "
        f"start); target < 200 ms",
        flush=True,
    )
    shutil.rmtree(directory)
    return result


def bench_first(root: Path, total: int, nfiles: int, jobs: int, drop: str) -> dict:
    """The first verify after prepare: with a fresh stat cache, and with the one prepare left."""

    source = root / "first-source"
    source.mkdir()
    size = total // nfiles
    names = [f"model-{i + 1:05d}-of-{nfiles:05d}.safetensors" for i in range(nfiles)]
    print(f"first: writing {nfiles} files x {size / 1e9:.2f} GB to prepare from ...", flush=True)
    digests = {name: _write_random_file(source / name, size, seed=1000 + i) for i, name in enumerate(names)}
    key = "bench-first"
    lock_path = root / "first.lock.toml"
    files = tuple(LockedFile(path=name, size=size, sha256=digests[name]) for name in names)
    write_lock(ArtifactLock(artifacts={key: LockedArtifact(key=key, source="local", files=files)}), lock_path)
    models, prepared_cache = root / "first-models", root / "first-cache-prepared"

    # The real command, in a new process, as the compose prepare service runs it.
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), MODELS_DIR=str(models),
               CACHE_DIR=str(prepared_cache))
    for knob in ("PROFILE", "PROFILES_DIR", "LOG_LEVEL"):
        env.pop(knob, None)
    command = [sys.executable, "-m", "entrypoint.cli", "prepare", "download", key, "--from", str(source),
               "--lock", str(lock_path)]
    start = time.perf_counter()
    prepared = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
    prepare_s = time.perf_counter() - start
    if prepared.returncode != 0:
        raise BenchError(f"`qwen38 prepare download` failed: {prepared.stderr.strip().splitlines()[-1:]}")
    left = [line for line in prepared.stdout.splitlines() if "stat cache" in line]
    print(f"first: prepare download (copy, sha256, rename, manifest) {prepare_s:6.1f} s; {' '.join(left)}", flush=True)
    shutil.rmtree(source)

    profile = one_slot_profile("bench-first", "synthetic directory, prepared by `qwen38 prepare download`", key, key)
    paths = [models / key / name for name in names]

    def first_verify(cache_dir: Path) -> dict:
        drop_from_cache(paths, drop)
        resident = resident_bytes(paths)
        settings = Settings.model_construct(models_dir=models, cache_dir=cache_dir)
        start = time.perf_counter()
        report = verify_profile(profile, settings, jobs=jobs, lock_path=lock_path)
        seconds = time.perf_counter() - start
        d = report.dirs[0]
        return {"seconds": round(seconds, 3), "hashed_files": d.hashed, "hashed_bytes": d.hashed_bytes,
                "trusted_files": d.trusted, "resident_before": resident}

    before = first_verify(root / "first-cache-fresh")
    print(f"first: verify, fresh stat cache      {before['seconds']:7.2f} s  ({before['hashed_files']} files, "
          f"{before['hashed_bytes'] / 1e9:.1f} GB hashed)", flush=True)
    after = first_verify(prepared_cache)
    print(f"first: verify, the cache prepare left {after['seconds']:7.2f} s  ({after['hashed_files']} files hashed, "
          f"{after['trusted_files']} trusted)", flush=True)
    if after["hashed_files"]:
        raise BenchError(f"verify hashed {after['hashed_files']} files prepare had hashed: the stat cache did not hold")
    shutil.rmtree(models)
    return {
        "files": nfiles,
        "bytes": size * nfiles,
        "drop": drop,
        "command": " ".join(["qwen38", *command[3:]]),
        "prepare_s": round(prepare_s, 3),
        "first_verify_fresh_cache": before,
        "first_verify_after_prepare": after,
        "saved_s": round(before["seconds"] - after["seconds"], 3),
    }


def describe_machine() -> dict:
    """The CPU, usable cores, Python, kernel and load average the figures were taken with."""
    import platform

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": available_cores(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }

