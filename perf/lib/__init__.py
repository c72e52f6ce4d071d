"""What the benchmarks share; each module of ``perf/`` is a thin ``main(argv)`` over these.

- ``servers``: our deployments (aggregated, or disaggregated with the cores split between the
  roles) and llama.cpp's server as a baseline;
- ``loadgen``: prompts and held-out text, open-loop replay against a server (the arrival
  processes and statistics it uses are ``backend/planner/workload.py``'s and ``stats.py``'s);
- ``results``: where results live and the one envelope a run is recorded in (``report``: the
  report written from the envelopes);
- ``tools``: external tools' venvs (genai-perf, AIPerf, lm-eval, llama.cpp), perf_analyzer, and
  the driver genai-perf and AIPerf share;
- ``machine``: the machine and the commit a result was measured on;
- ``progress``: a one-line progress display for long runs.

``perf/cli.py`` (``triton-disagg bench``) runs every benchmark and records it."""
