"""Rehearse a config at its real depth and topology, width shrunk, on gloo ranks on this machine.

    python tools/rehearse.py --config opus100_1000L --markdown rehearsal.md --json rehearsal.json
    python tools/rehearse.py --config tiny_cpu --stages 4 --world 4

Runs the config's pipeline stages x the data-parallel size of its SLURM launcher (or --world)
as plain processes, with d=16 and synthetic data, and checks: the first updates equal one
process's; SIGUSR1 saves and the same topology resumes exactly; another stage count resumes
at the step; the checkpoint converts to an export that translates. Prints one table with the
start-up time, time per update, peak memory per rank, save/resume times and checkpoint size.
Exit codes: 0 all checks passed, 1 a check failed, 2 bad input. Details: docs/rehearsal.md.
"""

from megatron_branchnorm.commands.rehearse import main

if __name__ == "__main__":
    raise SystemExit(main())
