"""Install the benchmarks' external tools ahead of their first use: llama.cpp's server (it
compiles llama.cpp: about 8 minutes on 2 cores), lm-eval, genai-perf and AIPerf, each into its
own venv under ``.venv/tools/`` (``perf/lib/tools.ensure_tool``), one after the other.

``scripts/test.sh`` starts this in the background at the lowest CPU priority while the suite
runs, so that the build uses the CPU time the tests leave idle; a test that needs a tool before
its install has finished waits for it (the install holds the tool's lock), and one whose install
failed here tries again itself and reports its own error.

    python -m perf.install_tools
"""

from __future__ import annotations

import subprocess
import sys
import time

from perf import aiperf, genai_perf, lm_eval_run
from perf.lib import servers

INSTALLS = {
    "llama-cpp": servers.llama_cpp_python,
    "lm-eval": lm_eval_run.lm_eval_exe,
    "genai-perf": genai_perf.TOOL.install,
    "aiperf": aiperf.TOOL.install,
}


def main() -> int:
    failed = []
    for name, install in INSTALLS.items():
        t0 = time.monotonic()
        try:
            path = install()
        except (OSError, subprocess.CalledProcessError) as e:
            failed.append(name)
            print(f"[install-tools] {name}: failed ({e}); its first use will try again", flush=True)
            continue
        print(f"[install-tools] {name}: {path} ({time.monotonic() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
