"""The exec-per-job baseline of `locketd-bench python`: a class whose handler is
`command = [PYTHON, "bench/python/noop_job.py"]` starts this script once per job.
It does nothing, so what it costs is Python's own start-up."""
