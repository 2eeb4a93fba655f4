"""``make test-sanitize``: the C extensions under AddressSanitizer, UndefinedBehaviorSanitizer
and LeakSanitizer.

1. Every extension is built with ``-fsanitize=address,undefined -fno-omit-frame-pointer``
   into ``build/sanitize`` beside a copy of the package (``scripts/build_extensions.py``);
   the in-place build under ``src/`` is left as it is.
2. The tests of the scope named by the first argument (``all``, the default: the unit layer,
   ``make test-fast``'s tests, and the disk, Redis and Mooncake tier tests; ``ci``, what
   ``.ci/run`` runs: the folders whose tests call every extension, without the slow ones)
   run with that folder first on ``PYTHONPATH``, the ASan runtime preloaded (and libstdc++,
   whose ``__cxa_throw`` ASan intercepts: C++ libraries such as matplotlib's throw at import),
   ``PYTHONMALLOC=malloc`` (so that every ``PyMem`` buffer of the extensions is a malloc
   block ASan guards), each process writing its reports under ``build/sanitize/reports``.
3. Fails on any ASan or UBSan report (the first stops its process: ``halt_on_error``), and
   on any leak that is not suppressed below. A leak with a frame in an extension is never
   suppressed. The suppressions name CPython's and third-party libraries' allocations that
   live until the process exits, each with why; LeakSanitizer's own suppressions match a
   frame anywhere in a stack, so these are applied here instead, to stacks without a frame
   of ours.

The objects an extension creates through CPython's API are allocated by CPython, whose
library here is built without frame pointers: the fast unwinder stops in it, and such a
leak would read as CPython's. Those are what ``tests/native/test_native_refcounts.py``
checks (allocated blocks and objects flat over hundreds of thousands of calls).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "sanitize"
REPORTS = BUILD / "reports"
FLAGS = "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all -g -O1"

# (why, pattern): a leak none of whose frames is ours, and one of whose frames matches, is
# suppressed. Every entry is an allocation that lives for the process and is not freed at exit.
SUPPRESSED = [
    ("numpy registers its ufunc loops, promoters, casts and dtypes at import and never frees them",
     r"site-packages/numpy/"),
    ("torch's operator registry, dispatch tables and Python bindings live for the process",
     r"site-packages/torch/"),
    ("pyo3 (Rust) extensions create their types and module objects once and never free them",
     r"site-packages/(tokenizers|pydantic_core|openai_harmony|safetensors|orjson|dynamo)/"),
    ("pybind11 extensions (matplotlib) keep their types, interned strings and exceptions",
     r"site-packages/(matplotlib|contourpy|kiwisolver)/"),
    ("pyzmq and libzmq: contexts and sockets' globals of the process",
     r"site-packages/(zmq|pyzmq\.libs)/"),
    ("msgspec and crc32c keep their module state and type caches until the process ends",
     r"site-packages/(msgspec|crc32c)/"),
    ("mooncake's transfer engine and its libraries hold their globals until exit",
     r"site-packages/(mooncake|mooncake_transfer_engine)"),
    (OTHER_PROGRAM := "programs the tests start that are not Python (sh, tr, redis-server, "
     "mooncake_master) inherit the preloaded runtime, which reports what they leave at exit", None),
    (CPYTHON_ONLY := "CPython's own allocations, every frame of which is CPython's or the C "
     "library's under it (libpython is built without frame pointers, so the unwinder stops in "
     "it): module objects, interned strings and caches the interpreter leaves at exit, the "
     "getaddrinfo result of a daemon thread still resolving when the process ends (an "
     "extension's objects are counted by tests/native/test_native_refcounts.py)", None),
]  # fmt: skip
OURS = re.compile(r"/kvoffload/[^ ]*_[a-z]+(\.cpython[^ ]*\.so|\.c:\d+)")
REPORT = re.compile(r"^(?:==\d+==ERROR: AddressSanitizer|.*runtime error:|AddressSanitizer: CHECK).*$", re.M)
# a frame in the sanitizer's runtime, or in CPython's sources or library
CPYTHON_FRAME = re.compile(
    r" in \S+ (\.\./)*src/libsanitizer/| in \S+ (\S*/)?(Objects|Modules|Python|Include|Parser)/"
    r"|\(\S*libpython3[^)]*\)$| in \S+ \.\./sysdeps/|\(\S*libc\.so[^)]*\)$"
)
# a frame of a Python process: the interpreter, its library, an extension
PYTHON_FRAME = re.compile(
    r"(Objects|Modules|Python|Include|Parser)/\S+\.[ch]:\d|libpython3|python3|site-packages|kvoffload"
)


def frames(body: str) -> list[str]:
    return [line for line in body.splitlines() if re.match(r"\s+#\d+ ", line)]


def build() -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_extensions.py"), "--into", str(BUILD),
         "--with-package", f"--cflags={FLAGS}", "--ldflags=-fsanitize=address,undefined"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def runtime(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True)
    return path.stdout.strip()


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(BUILD), *filter(None, [env.get("PYTHONPATH")])]),
        LD_PRELOAD=" ".join([runtime("libasan.so"), runtime("libstdc++.so")]),
        PYTHONMALLOC="malloc",
        ASAN_OPTIONS=f"detect_leaks=1:halt_on_error=1:abort_on_error=0:log_path={REPORTS}/asan",
        LSAN_OPTIONS="exitcode=0:report_objects=0",  # leaks are judged below, not by exit codes
        UBSAN_OPTIONS=f"halt_on_error=1:print_stacktrace=1:log_path={REPORTS}/ubsan",
    )
    return env


RUNS = {
    "all": [
        # the unit layer (make test-fast), without the folders other work owns in flux
        ["-m", "not slow and not vllm and not redis and not mooncake and not s3",
         "--ignore=tests/integrations/sglang", "--ignore=tests/tiers/s3"],
        # the tier tests the unit layer leaves out: real redis-server and mooncake_master, slow ones
        ["-m", "(slow or redis or mooncake) and not vllm", "tests/tiers/fs", "tests/tiers/redis",
         "tests/tiers/mooncake"],
    ],
    # .ci/run's bounded form: the folders whose tests call every extension (block states and
    # policies, decode-step passes, row copier, index parser, disk index and run reads, RESP
    # batches and job queues), their fuzzing and native tests, without the slow ones
    "ci": [
        ["-m", "not slow and not vllm and not mooncake and not s3", "tests/native", "tests/fuzz",
         "tests/policies", "tests/core", "tests/scheduler", "tests/transfer", "tests/index",
         "tests/tiers/fs", "tests/tiers/redis"],
    ],
}  # fmt: skip


def leaks(text: str) -> list[str]:
    return re.split(r"\n(?=(?:Direct|Indirect) leak of)", text)[1:]


def judge() -> list[str]:
    """The reports that fail the run; a summary of the suppressed leaks is printed."""
    failures, suppressed = [], {why: 0 for why, _ in SUPPRESSED}
    for path in sorted(REPORTS.glob("*")):
        text = path.read_text(errors="replace")
        errors = REPORT.findall(text)
        if errors:
            failures.append(f"{path.name}: {errors[0]}\n{text[:6000]}")
        for leak in leaks(text):
            body = leak.split("\n\n")[0]
            if OURS.search(body):
                failures.append(f"{path.name}: a leak in an extension\n{body}")
                continue
            why = next((why for why, pattern in SUPPRESSED if pattern and re.search(pattern, body)), None)
            if why is None and all(CPYTHON_FRAME.search(line) for line in frames(body)):
                why = CPYTHON_ONLY
            if why is None and not any(PYTHON_FRAME.search(line) for line in frames(body)):
                why = OTHER_PROGRAM
            if why is None:
                failures.append(f"{path.name}: a leak no suppression names\n{body}")
            else:
                suppressed[why] += 1
    for why, count in suppressed.items():
        if count:
            print(f"suppressed {count} leak reports: {why}")
    return failures


def main() -> int:
    scope = sys.argv[1] if len(sys.argv) > 1 else "all"
    if scope not in RUNS:
        print(f"test_sanitize.py: unknown scope {scope!r}; one of {sorted(RUNS)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    build()
    shutil.rmtree(REPORTS, ignore_errors=True)
    REPORTS.mkdir(parents=True)
    env = environment()
    code = 0
    for args in RUNS[scope]:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        print("+", " ".join(command), flush=True)
        code = subprocess.run(command, cwd=ROOT, env=env).returncode or code
    failures = judge()
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"make test-sanitize ({scope}): {len(failures)} reports failed, tests exit {code}, "
          f"{time.monotonic() - started:.0f} s", flush=True)  # fmt: skip
    return 1 if failures or code else 0


if __name__ == "__main__":
    sys.exit(main())
