"""What the benchmarks share: the machine and commit a result was measured on (``machine``),
the one results envelope and where results live (``results``), and reading a server's
Prometheus metrics (``metrics``). ``perf/cli.py`` (``triton-disagg bench``) runs every benchmark
through them."""
