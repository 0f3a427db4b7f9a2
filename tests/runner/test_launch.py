"""runner/launch.py: the checkout it names is the one that holds the package and slurm/."""

from __future__ import annotations

from pathlib import Path

import megatron_branchnorm
from megatron_branchnorm.runner.launch import CHECKOUT


def test_checkout_holds_the_package_and_the_launchers():
    """A module moved one folder deeper once pointed CHECKOUT at the package itself: sbatch
    then could not open slurm/opus100_1000L.sh (the multi-node rehearsal failed)."""
    assert CHECKOUT / "megatron_branchnorm" == Path(megatron_branchnorm.__file__).resolve().parent
    assert (CHECKOUT / "slurm" / "opus100_1000L.sh").is_file()
