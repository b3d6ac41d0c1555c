"""attnforge.benchmarks: timing scripts for the kernels against the copy bandwidth and torch SDPA
peers (`python -m attnforge.benchmarks.decode`, `attnforge bench decode`). Each writes a JSON record
with --out (_record); `attnforge bench report` renders docs/benchmarks.md from those records."""
