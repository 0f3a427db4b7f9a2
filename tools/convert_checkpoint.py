"""Convert a DeepSpeed pipeline checkpoint into an export directory for inference.

Front door: `python tools/convert_checkpoint.py --help` gives the usage; the code is
megatron_branchnorm/commands/convert.py.
"""

from megatron_branchnorm.commands.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
