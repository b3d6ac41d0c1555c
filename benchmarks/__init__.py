"""attnforge.benchmarks: timing scripts for the kernels against the copy bandwidth and
torch SDPA peers (`python -m attnforge.benchmarks.decode`, `attnforge bench decode`)."""
