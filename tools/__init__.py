"""Developer tools: tuning sweeps, profilers, kernel-variant benchmarks, the packing and eval-backend benchmarks,
`induction_probe`. Not part of the installed package; run from the repository root as `python -m tools.<name>`
(they import `mtrain`, installed or on the path)."""
