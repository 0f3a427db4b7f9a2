"""Plan GPU memory and pipeline bubble for a config before launching it; builds no model.

Front door: `python tools/plan_memory.py --help` gives the usage; the code is
megatron_branchnorm/commands/plan.py.
"""

from megatron_branchnorm.commands.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
