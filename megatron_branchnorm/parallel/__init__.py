"""The parallel layout: how the model's layers are cut into pipeline stages (``partition``,
pure), what a layout costs in memory and time before anything runs (``planner``, pure), and the
DeepSpeed PipelineModule that runs the cut (``pipeline``, the only module here that imports
DeepSpeed). docs/design.md §9 has the map."""
