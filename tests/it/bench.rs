//! The benchmark harness (`locketd-bench`), run on a tiny N: it runs, it prints figures.
