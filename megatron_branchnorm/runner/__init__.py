"""The runner, plumbing shared by the front doors: starting ranks and tool processes (``launch``),
logged steps of a workflow (``steps``), what the CPU can do (``hardware``) and plots of a run's
metrics (``plotting``). docs/design.md §9 has the map."""
