"""`betelgeuse bench`: prefill/decode throughput of the out-of-core engine against physical ceilings
measured in the same run (disk, host->device, expert compute), inside a memory cgroup and a VRAM budget.

  cli.py       the subcommand: create/reuse the synth benchmark model, options, run, write results
  harness.py   the plan of cases and passes, the time budget, per-pass records
  procs.py     the store child process, the cgroup, the peak memory / VRAM monitor
  vram_peak.py the monitor's VRAM sampler: a child process polling NVML (no thread in the bench process)
  threads.py   a census of a process's threads (wakeups, CPU) between two moments: the decode's `threads`
  ceilings.py  disk / host->device / compute ceilings and a pass's bound
  report.py    bench.json, bench.md (the reference report's table), bench.png
"""
